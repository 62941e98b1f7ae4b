"""A tier agent started with a shell's low open-file limit still holds and serves more replicas
than it: `hintfs agent` raises its soft limit to the hard one at start, and keeps fds open only
for the replicas read lately (half the limit; tests/unit/test_replica_fds.py)."""
from __future__ import annotations

import resource

import pytest

from tests.helpers.agent_process import AgentProcess


def test_an_agent_started_with_a_low_soft_limit_holds_more_replicas_than_that(tmp_path):
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1024:
        pytest.skip("the hard open-file limit here is under 1,024")
    store = tmp_path / "store"
    (store / "ckpt").mkdir(parents=True)
    n = 300
    for k in range(n):
        (store / "ckpt" / f"{k}.bin").write_bytes(b"%d" % k)
    agent = AgentProcess(tmp_path, store)
    c = agent.start(soft_open_files=128)
    try:
        for k in range(n):                      # EMFILE after ~100 with the limit it was given
            c.replicate(f"ckpt/{k}.bin", 600)
        assert len(c.status()["replicas"]) == n
        for k in range(n):
            assert c.read(f"ckpt/{k}.bin", 0, 10, replica_only=True) == b"%d" % k
        fds = c.status()["replica_fds"]
        assert fds["opened"] >= n and fds["open"] <= fds["max"], fds
        agent.kill()                            # and a restart adopts them all
        c = agent.start(soft_open_files=128)
        assert len(c.status()["replicas"]) == n
        for k in range(n):
            assert c.read(f"ckpt/{k}.bin", 0, 10, replica_only=True) == b"%d" % k
        assert "half for replicas read lately" in agent.log.read_text()
    finally:
        agent.stop()

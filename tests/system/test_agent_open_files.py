"""A tier agent started with a shell's low open-file limit still holds more replicas than it:
each replica keeps one fd, and `hintfs agent` raises its soft limit to the hard one at start."""
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
        assert c.read(f"ckpt/{n - 1}.bin", 0, 10, replica_only=True) == b"%d" % (n - 1)
        agent.kill()                            # and a restart adopts them all, one fd each
        c = agent.start(soft_open_files=128)
        assert len(c.status()["replicas"]) == n
        assert "open files: one per replica" in agent.log.read_text()
    finally:
        agent.stop()

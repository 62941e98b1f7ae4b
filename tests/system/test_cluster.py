"""The cluster harness (tests/helpers/cluster.py): hosts as network namespaces on one bridge.

A tiny cluster (one storage host, one training host) is started by the harness as its own
process; a training host reaches the agent through the bridge and reads a hinted file through
its mount from the agent's replica; then the harness is SIGKILLed (no teardown runs) and the
cleanup command must leave no namespace, link, mount, process or folder of the run behind.
Skipped, with the reason, where the machine cannot make namespaces, veths, a bridge or tbf."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.cluster import alive, cleanup, leftovers, missing_features
from tests.helpers.mounts import have_fuse
from tests.helpers.procs import REPO, wait_for

pytestmark = pytest.mark.skipif(not have_fuse(), reason="needs root and /dev/fuse")

# Run on the training host (its network and mount namespaces): the agent answers through the
# bridge, a hint makes its replica, and the read through the mount is served by it.
ON_TRAINING_HOST = textwrap.dedent("""
    import json, sys
    from hintfs import client
    from hintfs.agent.client import AgentClient
    location, token, mnt = sys.argv[1:4]
    agent = AgentClient(location, token=token, timeout_s=10)
    assert agent.ping()
    client.set_replication_hints(mnt, "t", {"hello.bin": 1}, ttl_s=60, deadline_s=30)
    client.wait_for_replicas(mnt, "t", timeout_s=30)
    with open(mnt + "/hello.bin", "rb") as f:
        data = f.read()
    load = agent.status().load      # (the bytes sent and those compressed ranges saved: a byte ramp compresses)
    print(json.dumps({"len": len(data), "ok": data == bytes(range(256)) * 64,
                      "served": load.bytes_served + load.bytes_saved}))
""")


def _empty(left: dict) -> bool:
    return not any(left.values())


def test_a_tiny_cluster_works_and_nothing_is_left_after_a_sigkill(tmp_path):
    why = missing_features()
    if why:
        pytest.skip(why)
    desc = tmp_path / "cluster.json"
    err = open(tmp_path / "harness.err", "w")
    harness = subprocess.Popen([sys.executable, "-m", "tests.helpers.cluster", "up", "--storage", "1",
                                "--training", "1", "--hold", "--describe", str(desc)],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    prefix = None
    try:
        assert wait_for(lambda: desc.exists() or harness.poll() is not None, timeout=60), "harness not up"
        assert desc.exists(), (tmp_path / "harness.err").read_text()
        d = json.loads(desc.read_text())
        prefix = d["prefix"]
        host, agent = d["training"][0], d["storage"][0]
        assert host["ip"] != agent["ip"] and agent["location"].startswith(f"grpc://{agent['ip']}:")
        with open(os.path.join(d["store"], "hello.bin"), "wb") as f:
            f.write(bytes(range(256)) * 64)

        on_host = ["nsenter", "-t", str(host["pid"]), "-m", "-n", f"--wd={REPO}", "--"]
        r = subprocess.run(on_host + [sys.executable, "-c", ON_TRAINING_HOST, agent["location"], d["token"],
                                      host["mnt"]], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["ok"] and got["len"] == 16384 and got["served"] >= 16384, got
        # the training host has its own mount table: the mount is not seen from this one
        assert not os.path.ismount(host["mnt"])

        before = leftovers(prefix)
        assert len(before["namespaces"]) == 2 and len(before["links"]) == 3      # 2 veths and the bridge
        assert len(before["processes"]) >= 2 and host["mnt"] in before["mounts"], before

        harness.send_signal(signal.SIGKILL)     # no teardown runs
        harness.wait(10)
        assert not _empty(leftovers(prefix))
        r = subprocess.run([sys.executable, "-m", "tests.helpers.cluster", "cleanup", "--prefix", prefix],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        left = leftovers(prefix)
        assert _empty(left), left
        pids = [p["pid"] for p in before["processes"]]
        # gone (a zombie waits for init to reap it: it runs nothing and holds nothing)
        assert wait_for(lambda: not any(alive(p) for p in pids), timeout=5)
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait(10)
        err.close()
        if prefix is not None:
            cleanup(prefix, force=True)

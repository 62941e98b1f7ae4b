"""Replication hints through real mounts and real agent processes (issue 3)."""
import hashlib
import json
import os
import signal
import subprocess
import threading

import pytest

from hintfs import client
from hintfs.agent.client import AgentClient
from tests.conftest import DAEMON_DATA_PATH, HINTFS, REPO, needs_fuse, wait_for
from tests.helpers.ports import free_port

pytestmark = needs_fuse


def _ckpt(store, mib=8):
    d = store / "ckpt"
    d.mkdir(exist_ok=True)
    (d / ".metadata").write_bytes(os.urandom(3000))
    (d / "shard0.distcp").write_bytes(os.urandom(mib << 20))
    return d


def test_hint_replicates_and_reads_come_from_replicas(mount_factory, tmp_path):
    # (the daemon's replica reads: with passthrough the kernel reads a local replica, below)
    m = mount_factory(extra=f'\n[agent]\ndata_dir = "{tmp_path / "rep"}"\n' + DAEMON_DATA_PATH)
    _ckpt(m.store)
    client.set_replication_hints(str(m.mnt), "restart", {"ckpt/.metadata": 256, "ckpt/shard0.distcp": 64},
                                 ttl_s=3, deadline_s=30)
    status = client.wait_for_replicas(str(m.mnt), "restart", timeout_s=30)
    shard = status["files"]["ckpt/shard0.distcp"]
    assert status["ready"] and (shard["target"], shard["ready"], len(shard["at"])) == (1, 1, 1)
    assert shard["at"][0].startswith("grpc+unix://")         # where the replica is: the mount's own agent
    data = (m.mnt / "ckpt" / "shard0.distcp").read_bytes()
    assert data == (m.store / "ckpt" / "shard0.distcp").read_bytes()
    counters = m.stats()["counters"]
    assert counters.get("replica_reads", 0) >= 2 and counters.get("replicas_made") == 2
    # The document reads back; the job is listed.
    assert json.loads((m.mnt / ".hintfs" / "hints" / "restart").read_text())["ttl_s"] == 3
    assert "restart.status" in os.listdir(m.mnt / ".hintfs" / "hints")
    # At the TTL the replicas are reclaimed and reads go to the store again.
    assert wait_for(lambda: client.replica_status(str(m.mnt), "restart") == {}, timeout=10)
    assert hashlib.sha256((m.mnt / "ckpt" / ".metadata").read_bytes()).digest() == \
        hashlib.sha256((m.store / "ckpt" / ".metadata").read_bytes()).digest()


def test_a_replica_on_this_host_is_read_by_the_kernel_and_never_stale(mount_factory, tmp_path):
    m = mount_factory(extra=f'\n[agent]\ndata_dir = "{tmp_path / "rep"}"\n')
    if m.stats()["passthrough"]["state"] != "on":
        pytest.skip(f"FUSE passthrough not available here: {m.stats()['passthrough']['state']}")
    _ckpt(m.store)
    client.set_replication_hints(str(m.mnt), "restart", {"ckpt/shard0.distcp": 64}, ttl_s=60, deadline_s=30)
    assert client.wait_for_replicas(str(m.mnt), "restart", timeout_s=30)["ready"]
    shard = m.mnt / "ckpt" / "shard0.distcp"
    old = (m.store / "ckpt" / "shard0.distcp").read_bytes()
    assert shard.read_bytes() == old
    s = m.stats()
    assert s["counters"].get("passthrough_replica_opens", 0) >= 1 and s["counters"].get("replica_reads", 0) == 0
    # The store file replaced while the replica-backed file is open: a new open reads the new
    # bytes (the replica is of the old version), the open one keeps reading the old ones.
    with open(shard, "rb") as before:
        tmp = m.store / "ckpt" / "new.tmp"
        tmp.write_bytes(b"new version" * 1000)
        os.rename(tmp, m.store / "ckpt" / "shard0.distcp")
        assert shard.read_bytes() == b"new version" * 1000
        assert before.read() == old
    assert shard.read_bytes() == b"new version" * 1000


def test_a_replica_of_an_older_version_is_never_read(mount_factory, tmp_path):
    # The daemon's replica reads (passthrough off): the agent is asked for the version the file
    # was opened at, and refuses a replica of another one (the reads then go to the store).
    m = mount_factory(extra=f'\n[agent]\ndata_dir = "{tmp_path / "rep"}"\n' + DAEMON_DATA_PATH)
    _ckpt(m.store)
    client.set_replication_hints(str(m.mnt), "restart", {"ckpt/shard0.distcp": 64}, ttl_s=60, deadline_s=30)
    assert client.wait_for_replicas(str(m.mnt), "restart", timeout_s=30)["ready"]
    tmp = m.store / "ckpt" / "new.tmp"
    tmp.write_bytes(b"second version" * 5000)
    os.rename(tmp, m.store / "ckpt" / "shard0.distcp")
    assert (m.mnt / "ckpt" / "shard0.distcp").read_bytes() == b"second version" * 5000


BAD_HINTS = [
    ("{not json", "invalid JSON"),
    ({"files": {"../etc/passwd": 3}}, "contains '..'"),
    ({"files": {"sub/../../x": 3}}, "contains '..'"),
    ({"files": {"/abs": 3}}, "not absolute"),
    ({"files": {".hintfs/stats": 3}}, "inside .hintfs"),
    ({"files": {".": 3}}, "store root"),
    ({"files": {"a": 10 ** 400}}, "expected_readers"),
    ({"files": {"a": 1}, "ttl_s": 1e308}, "ttl_s"),
    ("[" * 100000 + "]" * 100000, "nested deeper"),
    ({"files": {"a": 0}}, "expected_readers"),
    ({"files": {"a": 1}, "ttl": 5}, "unknown key"),
    ({"files": {}}, "files"),
    ({"files": {f"f{i}": 1 for i in range(5)}}, "max_hint_files"),
]


def test_bad_hints_are_refused_whole(mount_factory, tmp_path):
    # One mount for all the documents (a mount per case cost ~2 s each): each its own job.
    m = mount_factory(extra=f'\n[agent]\ndata_dir = "{tmp_path / "rep"}"\n[replicas]\nmax_hint_files = 4\n')
    for i, (doc, reason) in enumerate(BAD_HINTS):
        job = f"job{i}"
        path = m.mnt / ".hintfs" / "hints" / job
        with pytest.raises(OSError) as exc:
            with open(path, "w") as f:
                f.write(doc if isinstance(doc, str) else json.dumps(doc))
        assert exc.value.errno == 22, reason
        assert reason in (m.mnt / ".hintfs" / "hints" / f"{job}.error").read_text()
        assert client.replica_status(str(m.mnt), job) == {}     # nothing applied
        if isinstance(doc, dict):   # the client helper raises with the mount's reason
            with pytest.raises(ValueError, match=reason):
                client._write_control(str(m.mnt / ".hintfs" / "hints" / f"{job}b"), doc)


@pytest.fixture
def agents(tmp_path):
    token = tmp_path / "token"
    token.write_text("tok")
    token.chmod(0o600)
    store = tmp_path / "m" / "store"
    store.mkdir(parents=True)
    procs = []
    locs = [f"grpc://127.0.0.1:{free_port()}" for _ in range(3)]
    for i, loc in enumerate(locs):
        cfg = tmp_path / f"agent{i}.toml"
        # each agent copies from the others (tree fan-out): they are its trusted [agents] locations
        cfg.write_text(f'[store]\nuri = "file://{store}"\n[agent]\nlocation = "{loc}"\n'
                       f'data_dir = "{tmp_path / f"rep{i}"}"\ntoken_file = "{token}"\n'
                       f'budget_bytes = {40 << 20 if i < 2 else 1 << 20}\n'
                       f'[agents]\nlocations = {json.dumps([x for x in locs if x != loc])}\ntoken_file = "{token}"\n'
                       f'[logging]\nfile = "{tmp_path / f"agent{i}.log"}"\n')
        procs.append(subprocess.Popen(HINTFS + ["agent", str(cfg)], cwd=REPO))
    try:    # (agents that never answer are stopped too: a failed wait must not leave them running)
        for loc in locs:
            assert wait_for(lambda: _pings(loc), timeout=60)
        yield store, locs, procs, token
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=20)


def _pings(loc):
    try:
        return AgentClient(loc, token="tok", timeout_s=1).ping()
    except OSError:
        return False


def test_external_agents_failover_budget_and_single_flight(mount_factory, tmp_path, agents):
    store, locs, procs, token = agents
    _ckpt(store, mib=16)
    extra = (f'\n[agents]\nlocations = {json.dumps(locs)}\ntoken_file = "{token}"\n'
             f'[replicas]\nsafe_readers_per_replica = 8\nhedge_after_ms = 2000\nread_timeout_s = 5\n')
    m = mount_factory(extra=extra)
    client.set_replication_hints(str(m.mnt), "storm", {"ckpt/.metadata": 512, "ckpt/shard0.distcp": 512},
                                 ttl_s=120, deadline_s=30)
    with pytest.raises(TimeoutError) as exc:
        client.wait_for_replicas(str(m.mnt), "storm", timeout_s=30)
    # The third agent's budget (1 MiB) cannot hold the 16 MiB shard: fewer replicas, reported.
    files = exc.value.status["files"]
    meta = files["ckpt/.metadata"]
    assert (meta["target"], meta["ready"], sorted(meta["at"])) == (3, 3, sorted(locs))
    assert set(exc.value.status["asked"]) <= set(locs)      # (no reads yet: maybe none asked)
    assert files["ckpt/shard0.distcp"]["target"] == 3 and files["ckpt/shard0.distcp"]["ready"] == 2
    assert "ENOSPC" in files["ckpt/shard0.distcp"]["error"]

    # Eight readers on this host at once: the agents serve the shard about once (single-flight
    # in the mount plus the kernel page cache), not eight times.
    before_each = [AgentClient(loc, token="tok").status()["load"]["bytes_served"] for loc in locs]
    before = sum(before_each)
    expected = (store / "ckpt" / "shard0.distcp").read_bytes()
    results = []
    threads = [threading.Thread(target=lambda: results.append((m.mnt / "ckpt" / "shard0.distcp").read_bytes()))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == expected for r in results)
    after_each = [AgentClient(loc, token="tok").status()["load"]["bytes_served"] for loc in locs]
    served = sum(after_each) - before
    assert served <= 1.5 * len(expected)
    # Each 4 MiB block came in pieces from both replicas (`replicas.stripe_bytes`): each of the
    # two agents that hold the shard served a share of it, neither all of it.
    shares = sorted(a - b for a, b in zip(after_each, before_each))[-2:]
    assert all(0.25 * len(expected) <= x <= 0.75 * len(expected) for x in shares), shares
    assert m.stats()["counters"].get("replica_striped_blocks", 0) >= 4

    # Kill the agents holding replicas: reads continue from another replica or the store.
    for p in procs[:2]:
        p.send_signal(signal.SIGKILL)
        p.wait()
    subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=False)
    fd = os.open(m.mnt / "ckpt" / "shard0.distcp", os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert (m.mnt / "ckpt" / "shard0.distcp").read_bytes() == expected
    counters = m.stats()["counters"]
    assert counters.get("replica_failovers", 0) + counters.get("replica_store_fallbacks", 0) + \
        counters.get("replica_block_hits", 0) >= 1


def test_wrong_token_is_refused_and_logged(mount_factory, tmp_path, agents):
    store, locs, procs, token = agents
    _ckpt(store, mib=1)
    bad = tmp_path / "bad_token"
    bad.write_text("nope")
    bad.chmod(0o600)
    m = mount_factory(extra=f'\n[agents]\nlocations = {json.dumps(locs[:1])}\ntoken_file = "{bad}"\n')
    client.set_replication_hints(str(m.mnt), "j", {"ckpt/.metadata": 8}, deadline_s=10)
    with pytest.raises(TimeoutError) as exc:
        client.wait_for_replicas(str(m.mnt), "j", timeout_s=20)
    assert "token" in exc.value.status["files"]["ckpt/.metadata"]["error"]
    assert wait_for(lambda: "without a valid token" in (tmp_path / "agent0.log").read_text(), timeout=5)
    assert (m.mnt / "ckpt" / ".metadata").read_bytes() == (store / "ckpt" / ".metadata").read_bytes()


def test_hints_cli(mount_factory, tmp_path):
    m = mount_factory(extra=f'\n[agent]\ndata_dir = "{tmp_path / "rep"}"\n')
    _ckpt(m.store, mib=1)
    (tmp_path / "files.json").write_text(json.dumps({"ckpt/.metadata": 4}))
    r = subprocess.run(HINTFS + ["hints", "set", str(m.mnt), "cli", "--file", str(tmp_path / "files.json")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(HINTFS + ["hints", "wait", str(m.mnt), "cli", "--timeout", "30"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "have their replicas" in r.stdout, r.stderr
    (tmp_path / "bad.json").write_text(json.dumps({"../x": 4}))
    r = subprocess.run(HINTFS + ["hints", "set", str(m.mnt), "bad", "--file", str(tmp_path / "bad.json")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1 and "contains '..'" in r.stderr and "Traceback" not in r.stderr


def test_two_hosts_hinting_one_file_each_hold_its_replicas(mount_factory, tmp_path, agents):
    # Two hosts' mounts hint the same file; one host's hint is removed (or expires): the agents
    # keep the replicas for the other (before, the first to end dropped them under the other).
    store, locs, procs, token = agents
    _ckpt(store, mib=1)
    extra = f'\n[agents]\nlocations = {json.dumps(locs[:2])}\ntoken_file = "{token}"\n'
    a = mount_factory(extra=extra)
    b = mount_factory(extra=extra, store_uri=f"file://{store}", name="b")
    for m in (a, b):
        client.set_replication_hints(str(m.mnt), "restart", {"ckpt/shard0.distcp": 64}, ttl_s=300, deadline_s=30)
        assert client.wait_for_replicas(str(m.mnt), "restart", timeout_s=30)["ready"]

    def held() -> list[int]:
        return [AgentClient(loc, token="tok").status()["replicas"].get("ckpt/shard0.distcp", {}).get("holders", 0)
                for loc in locs[:2]]
    assert held() == [2, 2]                               # a replica on each agent, claimed by both
    os.unlink(a.mnt / ".hintfs" / "hints" / "restart")   # host A's job ends
    assert wait_for(lambda: held() == [1, 1], timeout=20), held()   # B's claims keep the replicas
    assert (b.mnt / "ckpt" / "shard0.distcp").read_bytes() == (store / "ckpt" / "shard0.distcp").read_bytes()
    assert b.stats()["counters"].get("replica_reads", 0) + b.stats()["counters"].get("passthrough_replica_opens", 0) >= 1
    os.unlink(b.mnt / ".hintfs" / "hints" / "restart")   # the last claim: the replica goes
    assert wait_for(lambda: all("ckpt/shard0.distcp" not in AgentClient(loc, token="tok").status()["replicas"]
                                for loc in locs[:2]), timeout=20)

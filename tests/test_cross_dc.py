"""Cross-DC eval (issue 5, first part): journal, predictive replication in an agent, local routing."""
import json
import os
import time

import pytest

from fusefs.agent import start_in_process
from fusefs.agentclient import AgentClient
from fusefs.follower import Follower
from fusefs.journal import encode_record, record_name
from fusefs.localstore import LocalStore
from mountconfig import parse_config
from tests.conftest import needs_fuse, wait_for


def _agent(tmp_path, store, **follow):
    cfg = parse_config({"store": {"uri": f"file://{store}"},
                        "agent": {"data_dir": str(tmp_path / "tier")},
                        "follow": {"poll_interval_s": 3600, **follow}})   # rounds driven by the test
    return start_in_process(cfg, LocalStore(str(store)))


def _journal(store, path):
    st = os.stat(store / path)
    (store / ".hintfs-journal").mkdir(exist_ok=True)
    (store / ".hintfs-journal" / record_name()).write_bytes(encode_record(path, st.st_size, st.st_mtime_ns))


def test_marker_is_copied_last_and_keep_last(tmp_path):
    store = tmp_path / "store"
    ck1 = store / "ckpt" / "job" / "step_1"
    ck1.mkdir(parents=True)
    server, loc = _agent(tmp_path, store, prefixes=["ckpt"], keep_last=1)
    f = server.follower
    try:
        (ck1 / "__0_0.distcp").write_bytes(b"a" * 100_000)
        _journal(store, "ckpt/job/step_1/__0_0.distcp")
        (ck1 / ".metadata").write_bytes(b"meta")
        _journal(store, "ckpt/job/step_1/.metadata")
        (ck1 / "__1_0.distcp").write_bytes(b"b" * 50_000)   # closed after the marker was journaled
        f.step()
        # The marker waits for every other file of its folder, then completes the checkpoint.
        assert f.status()["complete"] == ["ckpt/job/step_1"]
        c = AgentClient(loc)
        assert set(c.status()["replicas"]) == {"ckpt/job/step_1/__0_0.distcp", "ckpt/job/step_1/__1_0.distcp",
                                              "ckpt/job/step_1/.metadata"}
        assert c.read("ckpt/job/step_1/__1_0.distcp", 0, 10, replica_only=True) == b"b" * 10
        # A newer checkpoint completes; keep_last=1 drops the older one.
        ck2 = store / "ckpt" / "job" / "step_2"
        ck2.mkdir()
        (ck2 / "__0_0.distcp").write_bytes(b"c" * 1000)
        (ck2 / ".metadata").write_bytes(b"meta2")
        _journal(store, "ckpt/job/step_2/__0_0.distcp")
        _journal(store, "ckpt/job/step_2/.metadata")
        f.step()
        assert f.status()["complete"] == ["ckpt/job/step_2"]
        assert set(c.status()["replicas"]) == {"ckpt/job/step_2/__0_0.distcp", "ckpt/job/step_2/.metadata"}
    finally:
        server.shutdown()


def test_listing_fallback_without_journal(tmp_path):
    store = tmp_path / "store"
    ck = store / "ckpt" / "j" / "s1"
    ck.mkdir(parents=True)
    (ck / "x.distcp").write_bytes(b"x" * 10)
    (ck / ".metadata").write_bytes(b"m")
    server, loc = _agent(tmp_path, store, prefixes=["ckpt"])
    try:
        server.follower.step()
        assert server.follower.status()["complete"] == ["ckpt/j/s1"]
        assert AgentClient(loc).has("ckpt/j/s1/x.distcp", 10, os.stat(ck / "x.distcp").st_mtime_ns)
    finally:
        server.shutdown()


@needs_fuse
def test_training_mount_journal_to_eval_mount_local_reads(mount_factory, tmp_path):
    train = mount_factory(name="train", extra='\n[journal]\nenabled = true\n')
    store = train.store
    cfg = parse_config({"store": {"uri": f"file://{store}"}, "agent": {"data_dir": str(tmp_path / "tier")},
                        "follow": {"prefixes": ["ckpt"], "poll_interval_s": 0.1}})
    server, loc = start_in_process(cfg, LocalStore(str(store)))
    try:
        ck = train.mnt / "ckpt" / "run" / "step_10"
        ck.mkdir(parents=True)
        payload = {f"__{i}_0.distcp": os.urandom(300_000) for i in range(3)}
        for name, data in payload.items():
            (ck / name).write_bytes(data)
        (ck / ".metadata").write_bytes(b"metadata")            # the commit marker, written last
        assert ".hintfs-journal" not in os.listdir(train.mnt)   # the journal is hidden
        assert len(os.listdir(store / ".hintfs-journal")) == 4
        c = AgentClient(loc)
        assert wait_for(lambda: c.status().get("follow", {}).get("complete") == ["ckpt/run/step_10"], timeout=20)

        # The eval host's mount routes the prefix to its local tier and reads from it.
        ev = mount_factory(name="eval", store_uri=f"file://{store}",
                           extra=f'\n[[routes]]\nprefix = "ckpt"\nlocal_agent = "{loc}"\n')
        for name, data in payload.items():
            assert (ev.mnt / "ckpt" / "run" / "step_10" / name).read_bytes() == data
        counters = ev.stats()["counters"]
        assert counters.get("route_local", 0) >= 3 and counters.get("replica_reads", 0) >= 3
        assert counters.get("route_remote", 0) == 0

        # A file the tier lacks is read through, and the tier is asked to fetch it.
        (store / "ckpt" / "late.bin").write_bytes(b"late" * 1000)
        assert (ev.mnt / "ckpt" / "late.bin").read_bytes() == b"late" * 1000
        assert ev.stats()["counters"].get("route_remote", 0) == 1
        st = os.stat(store / "ckpt" / "late.bin")
        assert wait_for(lambda: c.has("ckpt/late.bin", st.st_size, st.st_mtime_ns), timeout=10)
    finally:
        server.shutdown()


def test_anomaly_signal_takes_the_link_first(tmp_path):
    import threading
    store = tmp_path / "store"
    (store / "ckpt" / "big" / "s1").mkdir(parents=True)
    (store / "ckpt" / "urgent" / "s1").mkdir(parents=True)
    (store / "ckpt" / "big" / "s1" / "w.distcp").write_bytes(os.urandom(6 << 20))
    (store / "ckpt" / "urgent" / "s1" / "w.distcp").write_bytes(os.urandom(1 << 20))
    cfg = parse_config({"store": {"uri": f"file://{store}"},
                        "agent": {"data_dir": str(tmp_path / "tier"), "link_bytes_s": 4 << 20,
                                  "link_chunk_bytes": 256 << 10}})
    server, loc = start_in_process(cfg, LocalStore(str(store)))
    done = {}

    def copy(name, priority):
        AgentClient(loc).replicate(f"ckpt/{name}/s1/w.distcp", 600, None, priority=priority, job=f"ckpt/{name}")
        done[name] = time.monotonic()

    try:
        t0 = time.monotonic()
        big = threading.Thread(target=copy, args=("big", "eval"))
        big.start()
        time.sleep(0.3)                                   # the big copy holds the link
        assert AgentClient(loc).signal("ckpt/urgent", severity=3.0)["applied"]
        urgent = threading.Thread(target=copy, args=("urgent", "eval"))
        urgent.start()
        urgent.join(30)
        big.join(30)
        # 1 MiB at 4 MiB/s takes ~0.25 s once it has the link; the 6 MiB copy ~1.5 s in all.
        assert done["urgent"] < done["big"]
        assert done["urgent"] - t0 < 1.2
        by_class = AgentClient(loc).status()["link_bytes_by_class"]
        assert by_class.get("anomaly", 0) + by_class.get("done", 0) >= 1 << 20
    finally:
        server.shutdown()


@needs_fuse
def test_signals_control_file(mount_factory, tmp_path):
    from fusefs import client
    cfg = parse_config({"store": {"uri": f"file://{tmp_path}"}, "agent": {"data_dir": str(tmp_path / "tier"),
                                                                        "link_bytes_s": 1 << 30}})
    server, loc = start_in_process(cfg, LocalStore(str(tmp_path)))
    try:
        m = mount_factory(extra=f'\n[[routes]]\nprefix = "ckpt"\nlocal_agent = "{loc}"\n')
        client.signal_anomaly(str(m.mnt), "eval7", "ckpt/run7", "loss_spike", 2.5)
        assert wait_for(lambda: json.loads((m.mnt / ".hintfs" / "signals" / "eval7").read_text())["forwarded"])
        assert server.link.sched._signals == {"ckpt/run7": 2.5}
        with pytest.raises(ValueError, match="kind"):
            client.signal_anomaly(str(m.mnt), "eval7", "ckpt/run7", "bogus", 1)
        client.signal_anomaly(str(m.mnt), "eval7", "ckpt/run7", "clear")
        assert wait_for(lambda: server.link.sched._signals == {})
    finally:
        server.shutdown()

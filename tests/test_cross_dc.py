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

"""Cross-DC eval (issue 5, first part): journal, predictive replication in an agent, local routing."""
import json
import os
import time

import pytest

from hintfs.agent.server import start_in_process
from hintfs.common.clock import SYSTEM_CLOCK, FakeClock
from hintfs.agent.client import AgentClient
from hintfs.common.journal import BUCKET_NS, TIMED, bucket_of, encode_record, record_key, record_name
from hintfs.stores.local import LocalStore
from mountconfig import parse_config
from tests.conftest import needs_fuse, wait_for


def _start(cfg, store, clock=SYSTEM_CLOCK):
    """The in-process agent of `cfg`'s slices over `store`."""
    return start_in_process(store, cfg.agent, peers=cfg.agents, follow=cfg.follow, transform_load=cfg.transform_load,
                            clock=clock)


def _agent(tmp_path, store, **follow):
    cfg = parse_config({"store": {"uri": f"file://{store}"},
                        "agent": {"data_dir": str(tmp_path / "tier")},
                        "follow": {"poll_interval_s": 3600, **follow}})   # rounds driven by the test
    return _start(cfg, LocalStore(str(store)))


def _journal(store, path, legacy=False, removed=False):
    """A journal record of `path` as a training mount writes it (in its time slice's folder), or as
    mounts before that wrote it (`legacy`: directly in the journal folder); `removed`: the record
    a mount writes when it unlinks `path` or renames it away."""
    size = mtime_ns = 0
    if not removed:
        st = os.stat(store / path)
        size, mtime_ns = st.st_size, st.st_mtime_ns
    name = record_name(removed=removed)
    dst = store / ".hintfs-journal" / (name if legacy else record_key(name))
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(encode_record(path, size, mtime_ns))


def _records(store) -> list:
    return [p for p in (store / ".hintfs-journal").rglob("*") if p.is_file()]


def _following_agent(tmp_path):
    """A store with an empty checkpoint folder ckpt/job/step_1, and an agent following ckpt/."""
    store = tmp_path / "store"
    ck = store / "ckpt" / "job" / "step_1"
    ck.mkdir(parents=True)
    server, loc = _agent(tmp_path, store, prefixes=["ckpt"])
    return store, ck, server, loc


def test_marker_is_copied_last_and_keep_last(tmp_path):
    store = tmp_path / "store"
    ck1 = store / "ckpt" / "job" / "step_1"
    ck1.mkdir(parents=True)
    server, loc = _agent(tmp_path, store, prefixes=["ckpt"], keep_last=1)
    f = server.agent.follower
    try:
        (ck1 / "__0_0.distcp").write_bytes(b"a" * 100_000)
        _journal(store, "ckpt/job/step_1/__0_0.distcp")
        (ck1 / ".metadata").write_bytes(b"meta")
        _journal(store, "ckpt/job/step_1/.metadata")
        (ck1 / "__1_0.distcp").write_bytes(b"b" * 50_000)   # closed after the marker was journaled
        f.step(wait=True)
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
        f.step(wait=True)
        assert f.status()["complete"] == ["ckpt/job/step_2"]
        assert set(c.status()["replicas"]) == {"ckpt/job/step_2/__0_0.distcp", "ckpt/job/step_2/.metadata"}
    finally:
        server.shutdown()


def test_a_long_running_follower_holds_only_what_keep_last_keeps(tmp_path):
    """The follower's memory of journaled files is dropped with their checkpoint at keep_last:
    it grew with every file ever followed (a month of 4,096-rank checkpoints is millions)."""
    store = tmp_path / "store"
    server, loc = _agent(tmp_path, store, prefixes=["ckpt"], keep_last=2)
    f = server.agent.follower
    try:
        for k in range(12):
            ck = store / "ckpt" / "job" / f"step_{k}"
            ck.mkdir(parents=True)
            for r in range(3):
                (ck / f"__{r}_0.distcp").write_bytes(b"%d" % r)
                _journal(store, f"ckpt/job/step_{k}/__{r}_0.distcp")
            (ck / ".metadata").write_bytes(b"m")
            _journal(store, f"ckpt/job/step_{k}/.metadata")
            f.step(wait=True)
        assert f.status()["complete"] == ["ckpt/job/step_10", "ckpt/job/step_11"]
        assert len(AgentClient(loc).status()["replicas"]) == 8
        assert {p.rsplit("/", 1)[0] for p in f.journaled} == {"ckpt/job/step_10", "ckpt/job/step_11"}
        assert len(f.copied) == 8 and set(f.folder_files) <= {"ckpt/job/step_10", "ckpt/job/step_11"}
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
        server.agent.follower.step(wait=True)
        assert server.agent.follower.status()["complete"] == ["ckpt/j/s1"]
        assert AgentClient(loc).has("ckpt/j/s1/x.distcp", 10, os.stat(ck / "x.distcp").st_mtime_ns)
        for p in ck.iterdir():                 # deleted from the store: the follower forgets it
            p.unlink()
        server.agent.follower.step(wait=True)
        assert server.agent.follower.seen_files == {}
    finally:
        server.shutdown()


@needs_fuse
def test_training_mount_journal_to_eval_mount_local_reads(mount_factory, tmp_path):
    train = mount_factory(name="train", extra='\n[journal]\nenabled = true\n')
    store = train.store
    cfg = parse_config({"store": {"uri": f"file://{store}"}, "agent": {"data_dir": str(tmp_path / "tier")},
                        "follow": {"prefixes": ["ckpt"], "poll_interval_s": 0.1}})
    server, loc = _start(cfg, LocalStore(str(store)))
    try:
        ck = train.mnt / "ckpt" / "run" / "step_10"
        ck.mkdir(parents=True)
        payload = {f"__{i}_0.distcp": os.urandom(300_000) for i in range(3)}
        for name, data in payload.items():
            (ck / name).write_bytes(data)
        (ck / ".metadata").write_bytes(b"metadata")            # the commit marker, written last
        assert ".hintfs-journal" not in os.listdir(train.mnt)   # the journal is hidden
        assert len(_records(store)) == 4
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
    """The link's time is a fake clock moved a chunk's worth at a time: once the urgent job is
    signalled, every chunk the link grants is the urgent copy's until it has all of them, while
    the big copy that held the link waits."""
    import threading
    store = tmp_path / "store"
    (store / "ckpt" / "big" / "s1").mkdir(parents=True)
    (store / "ckpt" / "urgent" / "s1").mkdir(parents=True)
    (store / "ckpt" / "big" / "s1" / "w.distcp").write_bytes(os.urandom(6 << 20))
    (store / "ckpt" / "urgent" / "s1" / "w.distcp").write_bytes(os.urandom(1 << 20))
    chunk = 256 << 10
    cfg = parse_config({"store": {"uri": f"file://{store}"},
                        "agent": {"data_dir": str(tmp_path / "tier"), "link_bytes_s": 4 << 20,
                                  "link_chunk_bytes": chunk}})
    clock = FakeClock()
    server, loc = _start(cfg, LocalStore(str(store)), clock=clock)
    gate = server.agent.link
    finished: list[str] = []

    def copy(name, priority):
        AgentClient(loc).replicate(f"ckpt/{name}/s1/w.distcp", 600, None, priority=priority, job=f"ckpt/{name}")
        finished.append(name)

    def sent(*classes) -> int:
        with gate.cond:
            return sum(gate.sent.get(c, 0) for c in classes)

    def grant_until(done) -> None:
        """Move the clock one chunk's time at a time (4 MiB/s), each time until the gate granted
        the chunk, until `done()`."""
        while not done():
            before = sent("anomaly", "eval")
            clock.advance(1.1 * chunk / (4 << 20))
            assert wait_for(lambda: sent("anomaly", "eval") > before or done(), timeout=20)

    try:
        big = threading.Thread(target=copy, args=("big", "eval"))
        big.start()
        assert wait_for(lambda: sent("eval") >= chunk)            # the big copy holds the link
        grant_until(lambda: sent("eval") >= 4 * chunk)
        assert AgentClient(loc).signal("ckpt/urgent", severity=3.0)["applied"]
        urgent = threading.Thread(target=copy, args=("urgent", "eval"))
        urgent.start()

        def urgent_queued() -> bool:
            with gate.cond:
                return bool(gate.sched.pending("anomaly"))
        assert wait_for(urgent_queued)
        big_before = sent("eval")
        grant_until(lambda: sent("anomaly") >= 1 << 20)   # the urgent copy's 4 chunks
        assert sent("eval") == big_before                         # none of the big copy's meanwhile
        grant_until(lambda: not big.is_alive() and not urgent.is_alive())
        big.join(30)
        urgent.join(30)
        assert finished == ["urgent", "big"]
        by_class = AgentClient(loc).status()["link_bytes_by_class"]
        # every chunk counted in its class, the last of each transfer too (it was "done")
        assert by_class.get("anomaly", 0) >= 1 << 20 and "done" not in by_class, by_class
    finally:
        server.shutdown()


@needs_fuse
def test_signals_control_file(mount_factory, tmp_path):
    from hintfs import client
    cfg = parse_config({"store": {"uri": f"file://{tmp_path}"}, "agent": {"data_dir": str(tmp_path / "tier"),
                                                                        "link_bytes_s": 1 << 30}})
    server, loc = _start(cfg, LocalStore(str(tmp_path)))
    try:
        m = mount_factory(extra=f'\n[[routes]]\nprefix = "ckpt"\nlocal_agent = "{loc}"\n')
        client.signal_anomaly(str(m.mnt), "eval7", "ckpt/run7", "loss_spike", 2.5)
        assert wait_for(lambda: json.loads((m.mnt / ".hintfs" / "signals" / "eval7").read_text())["forwarded"])
        assert server.agent.link.sched._signals == {"ckpt/run7": 2.5}
        with pytest.raises(ValueError, match="kind"):
            client.signal_anomaly(str(m.mnt), "eval7", "ckpt/run7", "bogus", 1)
        client.signal_anomaly(str(m.mnt), "eval7", "ckpt/run7", "clear")
        assert wait_for(lambda: server.agent.link.sched._signals == {})
    finally:
        server.shutdown()


def test_journal_records_in_names_and_content():
    from hintfs.common.journal import decode_name
    name = record_name("ckpt/run/step_1/__0_0.distcp", 123, 456)
    assert name.endswith(".rec") and len(name.encode()) <= 255
    assert decode_name(name) == {"path": "ckpt/run/step_1/__0_0.distcp", "size": 123, "mtime_ns": 456}
    long = "ckpt/" + "x" * 300
    assert record_name(long, 1, 2).endswith(".json")       # too long for a name: the content says it
    assert decode_name("00000000000000000001-h-1-0.json") is None
    assert decode_name("garbage~x.rec") is None
    from hintfs.common.journal import removed_record, streamed_record
    gone = record_name("ckpt/run/step_1/.metadata.tmp", removed=True)
    assert removed_record(gone) and not streamed_record(gone)
    assert decode_name(gone) == {"path": "ckpt/run/step_1/.metadata.tmp", "size": 0, "mtime_ns": 0}
    assert not removed_record(name) and not removed_record(record_name("x", 1, 2, streamed=True))


def test_a_removal_record_drops_the_replica_and_a_file_made_again_since_is_kept(tmp_path):
    store, ck, server, loc = _following_agent(tmp_path)
    f, c = server.agent.follower, AgentClient(loc)
    try:
        for name in ("a.distcp", "b.distcp"):
            (ck / name).write_bytes(name.encode() * 100)
            _journal(store, f"ckpt/job/step_1/{name}")
        f.step(wait=True)
        assert set(c.status()["replicas"]) == {"ckpt/job/step_1/a.distcp", "ckpt/job/step_1/b.distcp"}
        (ck / "a.distcp").unlink()
        _journal(store, "ckpt/job/step_1/a.distcp", removed=True)
        f.step(wait=True)
        assert set(c.status()["replicas"]) == {"ckpt/job/step_1/b.distcp"}   # only the removed one went
        assert c.tier_stat("ckpt/job/step_1/a.distcp")["state"] == "absent"
        with pytest.raises(OSError):
            c.read("ckpt/job/step_1/a.distcp", 0, 10, replica_only=True)
        # Made again after the removal: its record is newer, so it is copied and kept.
        time.sleep(0.01)
        (ck / "a.distcp").write_bytes(b"again")
        _journal(store, "ckpt/job/step_1/a.distcp")
        f.step(wait=True)
        assert c.read("ckpt/job/step_1/a.distcp", 0, 10, replica_only=True) == b"again"
        # A folder's removal (renamed away) drops everything under it, and nothing beside it.
        (ck.parent / "step_2").mkdir()
        (ck.parent / "step_2" / "x.distcp").write_bytes(b"x")
        _journal(store, "ckpt/job/step_2/x.distcp")
        f.step(wait=True)
        ck.rename(ck.parent / "step_1.old")
        _journal(store, "ckpt/job/step_1", removed=True)
        f.step(wait=True)
        assert set(c.status()["replicas"]) == {"ckpt/job/step_2/x.distcp"}
        assert f.status()["errors"] == {}
    finally:
        server.shutdown()


def _dcp_save_with_renamed_marker(store, ck) -> None:
    """A DCP save into ckpt/job/step_1 (`ck`) as a journaled mount records it: a data file, then
    `.metadata.tmp` renamed to `.metadata` (the old name's removal record is the caller's)."""
    (ck / "__0_0.distcp").write_bytes(b"d" * 1000)
    _journal(store, "ckpt/job/step_1/__0_0.distcp")
    (ck / ".metadata.tmp").write_bytes(b"plan")
    _journal(store, "ckpt/job/step_1/.metadata.tmp")
    os.rename(ck / ".metadata.tmp", ck / ".metadata")
    _journal(store, "ckpt/job/step_1/.metadata")


def test_a_file_removed_before_its_copy_is_not_retried_and_its_checkpoint_completes(tmp_path):
    """DCP's `.metadata.tmp`, renamed to `.metadata` before the follower copied it: its record is
    followed by its removal, so the copy is neither made nor retried, and the marker does not wait
    for it."""
    store, ck, server, loc = _following_agent(tmp_path)
    f, c = server.agent.follower, AgentClient(loc)
    try:
        _dcp_save_with_renamed_marker(store, ck)
        _journal(store, "ckpt/job/step_1/.metadata.tmp", removed=True)
        f.step(wait=True)
        assert f.status()["complete"] == ["ckpt/job/step_1"]
        assert f.status()["errors"] == {}
        assert set(c.status()["replicas"]) == {"ckpt/job/step_1/__0_0.distcp", "ckpt/job/step_1/.metadata"}
        assert c.status()["copies"] == 2
    finally:
        server.shutdown()


def test_a_marker_seen_a_round_before_the_removal_of_a_file_it_waits_for_still_completes(tmp_path):
    """The rename's records can land in two rounds: the marker's finisher starts waiting for
    `.metadata.tmp`, and the next round's removal record releases it (it waited 600 s before:
    seen once in CI)."""
    store, ck, server, loc = _following_agent(tmp_path)
    f = server.agent.follower
    try:
        _dcp_save_with_renamed_marker(store, ck)
        f.step()                                   # the finisher waits for .metadata.tmp's copy
        _journal(store, "ckpt/job/step_1/.metadata.tmp", removed=True)
        f.step()
        assert f.drain(timeout_s=20)
        assert f.status()["complete"] == ["ckpt/job/step_1"]
        assert f.status()["errors"] == {}
    finally:
        server.shutdown()


def test_a_copy_that_finishes_after_the_removal_of_its_file_is_not_kept(tmp_path):
    """The agent remembers removals: a copy (or stream) of a version from before one, finishing
    after it, is not cataloged."""
    store, ck, server, loc = _following_agent(tmp_path)
    c = AgentClient(loc)
    try:
        (ck / "late.distcp").write_bytes(b"l" * 100)
        _journal(store, "ckpt/job/step_1/late.distcp")
        (record,) = [p.name for p in _records(store)]
        server.agent.catalog.removed_from_store([("ckpt/job/step_1", time.time_ns() + 10**9)])   # a removal after that record
        st = os.stat(ck / "late.distcp")
        done = server.agent.copier.replicate("ckpt/job/step_1/late.distcp", 60, None,
                                             expect=(st.st_size, st.st_mtime_ns), record=record)
        assert done.removed is True
        assert c.status()["replicas"] == {}
        assert not [p for p in (tmp_path / "tier").rglob("*") if p.is_file() and "late" in p.name]
    finally:
        server.shutdown()


def test_follower_copies_journaled_version_and_recopies_a_rewrite(tmp_path):
    store, ck, server, loc = _following_agent(tmp_path)
    f, c = server.agent.follower, AgentClient(loc)
    try:
        (ck / "w.distcp").write_bytes(b"a" * 100)
        _journal(store, "ckpt/job/step_1/w.distcp")             # a record whose name carries it
        (ck / "w.distcp").write_bytes(b"b" * 150)                # rewritten before the copy ran
        f.step(wait=True)
        # The copy asked for one byte more than journaled, saw 101 bytes: not the journaled
        # version, so nothing is kept and the next round stats the store instead.
        assert "ckpt/job/step_1/w.distcp" in f.status()["errors"]
        assert c.status()["replicas"] == {}
        f.step(wait=True)
        st = os.stat(ck / "w.distcp")
        assert c.has("ckpt/job/step_1/w.distcp", 150, st.st_mtime_ns)
        assert c.read("ckpt/job/step_1/w.distcp", 0, 200, replica_only=True) == b"b" * 150
        # A later journaled version replaces the replica.
        (ck / "w.distcp").write_bytes(b"c" * 80)
        _journal(store, "ckpt/job/step_1/w.distcp")
        f.step(wait=True)
        assert c.read("ckpt/job/step_1/w.distcp", 0, 200, replica_only=True) == b"c" * 80
        assert c.tier_stat("ckpt/job/step_1/w.distcp")["size"] == 80
        assert c.tier_stat("ckpt/job")["state"] == "dir"
        assert c.tier_stat("ckpt/other")["state"] == "absent"
    finally:
        server.shutdown()


def test_follower_serves_a_signalled_job_before_a_backlog(tmp_path):
    store = tmp_path / "store"
    cfg = parse_config({"store": {"uri": f"file://{store}"},
                        "agent": {"data_dir": str(tmp_path / "tier"), "link_bytes_s": 8 << 20,
                                  "link_chunk_bytes": 256 << 10},
                        "follow": {"prefixes": ["ckpt"], "poll_interval_s": 3600}})
    jobs = [f"job{i:02d}" for i in range(12)] + ["urgent"]
    for j in jobs:
        (store / "ckpt" / j / "s1").mkdir(parents=True)
        (store / "ckpt" / j / "s1" / "w.distcp").write_bytes(os.urandom(1 << 20))
        (store / "ckpt" / j / "s1" / ".metadata").write_bytes(b"m")
    server, loc = _start(cfg, LocalStore(str(store)))
    try:
        server.agent.link.signal("ckpt/urgent", 3.0)
        for j in jobs:                                     # the urgent job's records come last
            _journal(store, f"ckpt/{j}/s1/w.distcp")
        for j in jobs:
            _journal(store, f"ckpt/{j}/s1/.metadata")
        server.agent.follower.step(wait=True)
        done = server.agent.follower.status()["complete_at"]
        assert len(done) == len(jobs)
        # 13 MiB at 8 MiB/s: the urgent checkpoint is among the first few, not the last.
        order = sorted(done, key=done.get)
        assert order.index("ckpt/urgent/s1") <= 3, order
    finally:
        server.shutdown()


@needs_fuse
def test_eval_mount_takes_routed_metadata_from_the_tier(mount_factory, tmp_path):
    store = tmp_path / "remote"
    ck = store / "ckpt" / "run" / "step_1"
    ck.mkdir(parents=True)
    payload = {"__0_0.distcp": os.urandom(200_000), ".metadata": b"meta"}
    for name, data in payload.items():
        (ck / name).write_bytes(data)
    (store / "ckpt" / "big.bin").write_bytes(os.urandom(3 << 20))
    server, loc = _agent(tmp_path, store, prefixes=["ckpt"])
    slow_cfg = parse_config({"store": {"uri": f"file://{store}"},
                             "agent": {"data_dir": str(tmp_path / "tier2"), "link_bytes_s": 2 << 20,
                                       "link_chunk_bytes": 256 << 10}})
    slow, slow_loc = _start(slow_cfg, LocalStore(str(store)))
    try:
        for name in payload:
            _journal(store, f"ckpt/run/step_1/{name}")
        server.agent.follower.step(wait=True)
        assert server.agent.follower.status()["complete"] == ["ckpt/run/step_1"]
        ev = mount_factory(name="eval", store_uri=f"file://{store}",
                           extra=f'\n[[routes]]\nprefix = "ckpt/run"\nlocal_agent = "{loc}"\n'
                                 f'\n[[routes]]\nprefix = "ckpt/big.bin"\nlocal_agent = "{slow_loc}"\n')
        # The tier's verified version is what the eval mount serves: even with the remote copy
        # gone, attributes and bytes come from the tier (no remote round trip for them).
        os.unlink(ck / "__0_0.distcp")
        p = ev.mnt / "ckpt" / "run" / "step_1" / "__0_0.distcp"
        assert os.stat(p).st_size == 200_000
        assert p.read_bytes() == payload["__0_0.distcp"]
        counters = ev.stats()["counters"]
        assert counters.get("route_tier_stat", 0) >= 2 and counters.get("route_local", 0) >= 1
        assert not (ev.mnt / "ckpt" / "run" / "nope").exists()    # not in the tier: the store says
        # A copy in flight (2 MiB/s link): the open does not wait for it; each read is answered
        # by the tier, from the ranges it has copied or fetched from the store on demand.
        import threading
        t = threading.Thread(target=lambda: AgentClient(slow_loc).replicate("ckpt/big.bin", 600, None,
                                                                             priority="eval"))
        t.start()
        assert wait_for(lambda: AgentClient(slow_loc).tier_stat("ckpt/big.bin")["state"] == "copying", timeout=5)
        assert (ev.mnt / "ckpt" / "big.bin").read_bytes() == (store / "ckpt" / "big.bin").read_bytes()
        t.join(30)
        counters = ev.stats()["counters"]
        assert counters.get("route_demand_opens", 0) >= 1 and counters.get("route_demand_reads", 0) >= 1
        assert AgentClient(slow_loc).status()["demand"]["reads"] >= 1
        # The tier goes away: routed paths fall back to the store.
        server.shutdown()
        (ck / "__0_0.distcp").write_bytes(payload["__0_0.distcp"])
        meta = ev.mnt / "ckpt" / "run" / "step_1" / ".metadata"
        assert meta.read_bytes() == b"meta"
    finally:
        server.shutdown()
        slow.shutdown()


def test_journal_prune_deletes_only_records_older_than_the_cutoff(tmp_path):
    from hintfs.common.journal import prune, record_time_ns
    store = tmp_path / "store"
    jdir = store / ".hintfs-journal"
    jdir.mkdir(parents=True)
    now = time.time_ns()
    old = f"{now - 10**12:020d}-h-1-0~1~2~YQ.rec"          # 1000 s old
    new = f"{now:020d}-h-1-1~1~2~Yg.rec"
    (jdir / old).write_bytes(b"")
    (jdir / new).write_bytes(b"")
    (jdir / "notes.txt").write_bytes(b"not a record")      # never touched
    assert record_time_ns(old) == now - 10**12 and record_time_ns("notes.txt") is None
    assert prune(LocalStore(str(store)), ".hintfs-journal", now - 10**9) == 1
    assert sorted(os.listdir(jdir)) == sorted([new, "notes.txt"])
    assert prune(LocalStore(str(store)), "absent-journal", now) == 0
    # slice folders: one wholly older than the cutoff goes with its records; in the one the
    # cutoff falls in, only the older records go
    cut = (now // BUCKET_NS + 1) * BUCKET_NS + BUCKET_NS // 2    # after `new`, mid-slice
    names = {t: f"{t:020d}-h-1-{i}~1~2~YQ.rec" for i, t in enumerate(
        [cut - 3 * BUCKET_NS, cut - 10**9, cut + 10**9])}
    for t, name in names.items():
        (jdir / record_key(name)).parent.mkdir(parents=True, exist_ok=True)
        (jdir / record_key(name)).write_bytes(b"")
    assert prune(LocalStore(str(store)), ".hintfs-journal", cut) == 3     # the flat `new` too
    assert not (jdir / TIMED / bucket_of(cut - 3 * BUCKET_NS)).exists()
    assert os.listdir(jdir / TIMED / bucket_of(cut)) == [names[cut + 10**9]]


def test_follower_forgets_pruned_record_names(tmp_path):
    store, ck, server, loc = _following_agent(tmp_path)
    try:
        f = server.agent.follower
        (ck / "a.distcp").write_bytes(b"a" * 1000)
        _journal(store, "ckpt/job/step_1/a.distcp")
        _journal(store, "ckpt/job/step_1/a.distcp", legacy=True)   # as older mounts wrote them
        f.sweep_s = 0                                     # every round lists every folder
        f.step(wait=True)
        assert sum(len(names) for names in f.seen_records.values()) == 2
        for rec in _records(store):
            rec.unlink()                                  # pruned by the writer
        f.step(wait=True)
        assert f.seen_records == {}
    finally:
        server.shutdown()


@needs_fuse
def test_training_mount_prunes_its_journal_by_age(mount_factory):
    m = mount_factory(name="train", extra='\n[journal]\nenabled = true\nretention_s = 0.5\n')
    jdir = m.store / ".hintfs-journal"
    (m.mnt / "a").write_bytes(b"1")
    # the record was written (the counter), then deleted once older than 0.5 s
    assert wait_for(lambda: m.stats()["counters"].get("journal_records") == 1, timeout=10)
    assert jdir.exists()
    assert wait_for(lambda: not _records(m.store), timeout=10)
    (m.mnt / "b").write_bytes(b"2")                                    # the journal goes on
    assert wait_for(lambda: m.stats()["counters"].get("journal_records") == 2, timeout=10)
    assert wait_for(lambda: not _records(m.store), timeout=10)


def test_a_rewrite_with_the_same_size_and_mtime_is_copied_again(tmp_path):
    # S3's Last-Modified has one-second precision: a same-size rewrite within that second has the
    # same (size, mtime). Its journal record is new, and that is what the replica is tied to.
    store, ck, server, loc = _following_agent(tmp_path)
    f, c = server.agent.follower, AgentClient(loc)
    path = "ckpt/job/step_1/w.distcp"
    try:
        (ck / "w.distcp").write_bytes(b"a" * 100)
        first = os.stat(ck / "w.distcp")
        _journal(store, path)
        f.step(wait=True)
        assert c.read(path, 0, 200, replica_only=True) == b"a" * 100
        f.step(wait=True)                                   # no new record: nothing copied again
        assert server.agent.catalog.replicas[path].record is not None
        (ck / "w.distcp").write_bytes(b"b" * 100)
        os.utime(ck / "w.distcp", ns=(first.st_atime_ns, first.st_mtime_ns))   # same size and mtime
        _journal(store, path)
        f.step(wait=True)
        assert c.read(path, 0, 200, replica_only=True) == b"b" * 100
    finally:
        server.shutdown()


class _CountingStore(LocalStore):
    """Records which folders the follower lists."""
    def __init__(self, root):
        super().__init__(root)
        self.listed: list[str] = []

    def iter_dir(self, rel):
        self.listed.append(rel)
        return super().iter_dir(rel)


def test_a_poll_lists_only_the_current_journal_slice_however_many_records_it_holds(tmp_path):
    # A flat journal folder was listed whole on every poll: the S3 server's work per poll grew
    # with every record the retention keeps (bench: 300 records slowed the training writes 20%).
    store = tmp_path / "store"
    (store / "ckpt" / "job" / "step_1").mkdir(parents=True)
    jdir = store / ".hintfs-journal"
    now = time.time_ns()
    for k in range(300):                                   # an hour of older records
        name = f"{now - 3600 * 10**9 + k * 10**10:020d}-h-1-{k}~1~2~YQ.rec"
        (jdir / record_key(name)).parent.mkdir(parents=True, exist_ok=True)
        (jdir / record_key(name)).write_bytes(b"")
    cfg = parse_config({"store": {"uri": f"file://{store}"}, "agent": {"data_dir": str(tmp_path / "tier")},
                        "follow": {"prefixes": ["ckpt"], "poll_interval_s": 3600}})
    counting = _CountingStore(str(store))
    server, _loc = _start(cfg, counting)
    try:
        f = server.agent.follower
        f.step(wait=True)                                  # the first poll lists everything once
        assert len(counting.listed) > len(os.listdir(jdir / TIMED))   # the folders and each slice
        (store / "ckpt/job/step_1/a.distcp").write_bytes(b"a" * 100)
        _journal(store, "ckpt/job/step_1/a.distcp")
        counting.listed.clear()
        f.step(wait=True)
        assert "ckpt/job/step_1/a.distcp" in f.copied
        assert len(counting.listed) <= 2                   # this slice (and a neighbour at its edge)
        assert all(rel.startswith(".hintfs-journal/") for rel in counting.listed)
        # a record that turns up late in the slice of 2 minutes ago: the next sweep finds it
        (store / "ckpt/job/step_1/b.distcp").write_bytes(b"b" * 100)
        st = os.stat(store / "ckpt/job/step_1/b.distcp")
        late = f"{time.time_ns() - 120 * 10**9:020d}-h-2-0~{st.st_size}~{st.st_mtime_ns}~" + \
            record_name("ckpt/job/step_1/b.distcp").split("~")[-1]
        (jdir / record_key(late)).parent.mkdir(parents=True, exist_ok=True)
        (jdir / record_key(late)).write_bytes(b"")
        f.step(wait=True)
        assert "ckpt/job/step_1/b.distcp" not in f.copied   # not in the current slice
        f.sweep_s = 0
        f.step(wait=True)
        assert "ckpt/job/step_1/b.distcp" in f.copied
    finally:
        server.shutdown()


def test_a_finisher_gives_up_after_finish_wait_s_and_a_later_round_finishes_the_checkpoint(tmp_path):
    """The follower's clock is a fake one: a checkpoint whose file cannot be copied (gone from the
    store) keeps its finisher waiting FINISH_WAIT_S, not longer; a later round starts it again,
    and once the file is there the checkpoint completes."""
    from hintfs.agent.follower import FINISH_WAIT_S
    store = tmp_path / "store"
    ck = store / "ckpt" / "job" / "step_1"
    ck.mkdir(parents=True)
    clock = FakeClock(wall=time.time())
    cfg = parse_config({"store": {"uri": f"file://{store}"}, "agent": {"data_dir": str(tmp_path / "tier")},
                        "follow": {"prefixes": ["ckpt"], "poll_interval_s": 3600}})
    server, _loc = _start(cfg, LocalStore(str(store)), clock=clock)
    f = server.agent.follower
    marker = "ckpt/job/step_1/.metadata"
    try:
        for name in ("a.distcp", "b.distcp", ".metadata"):
            (ck / name).write_bytes(name.encode())
            _journal(store, f"ckpt/job/step_1/{name}")
        (ck / "b.distcp").unlink()                        # journaled, then lost: its copy fails
        f.step()
        assert wait_for(lambda: "ckpt/job/step_1/b.distcp" in f.errors and marker in f.finishing)
        clock.advance(FINISH_WAIT_S - 1)
        f.step()                                          # (a round: the copy fails again)
        assert wait_for(lambda: "ckpt/job/step_1/b.distcp" in f.errors) and marker in f.finishing
        clock.advance(2)
        assert wait_for(lambda: marker not in f.finishing)   # gave up, the checkpoint not complete
        assert f.status().complete == []
        (ck / "b.distcp").write_bytes(b"b.distcp")
        f.step(wait=True)                                 # started again: the file is there now
        assert f.status().complete == ["ckpt/job/step_1"]
    finally:
        server.shutdown()


def test_records_of_older_mounts_directly_in_the_journal_folder_are_followed(tmp_path):
    store, ck, server, _loc = _following_agent(tmp_path)
    try:
        (ck / "a.distcp").write_bytes(b"a" * 1000)
        _journal(store, "ckpt/job/step_1/a.distcp", legacy=True)
        server.agent.follower.step(wait=True)                    # the first poll is a sweep
        assert "ckpt/job/step_1/a.distcp" in server.agent.follower.copied
    finally:
        server.shutdown()

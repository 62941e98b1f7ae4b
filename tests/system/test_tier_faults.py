"""Cross-DC faults (issue 5): a cut link resumes, a changing file is copied again, a full tier
evicts by policy, and a restarted agent rebuilds its catalog from disk."""
import json
import os
import threading

import pytest

from hintfs.agent.server import AgentServer, start_in_process
from hintfs.agent.client import AgentClient, AgentError
from hintfs.stores.local import LocalStore
from mountconfig import parse_config
from policy.tier import TierEntry, pick_evictions
from tests.conftest import wait_for
from tests.helpers.agent_process import AgentProcess

CHUNK = 64 << 10


class FlakyStore(LocalStore):
    """A LocalStore whose copy readers fail ("the link drops") after `fail_after` reads, once,
    or run `on_read` before each read."""

    def __init__(self, root):
        super().__init__(root)
        self.fail_after = None
        self.on_read = None
        self.reads = 0

    def open_data(self, rel):
        reader, _st = self.open_reader(rel)
        store = self

        class R:
            def read(self, off, n):
                store.reads += 1
                if store.fail_after is not None and store.reads > store.fail_after:
                    store.fail_after = None
                    raise ConnectionResetError("link dropped")
                if store.on_read is not None:
                    store.on_read(store.reads)
                return reader.read(off, n)

            def read_nowait(self, off, n):
                return None

            def close(self):
                reader.close()
        return R()


def _cfg(tmp_path, store, **agent):
    return parse_config({"store": {"uri": f"file://{store}"},
                         "agent": {"data_dir": str(tmp_path / "tier"), "link_bytes_s": 1 << 30,
                                   "link_chunk_bytes": CHUNK, **agent}})


def _start(cfg, store):
    """The in-process agent of `cfg`'s slices over `store`."""
    return start_in_process(store, cfg.agent, peers=cfg.agents, follow=cfg.follow, transform_load=cfg.transform_load)


def _tcp(cfg, store) -> AgentServer:
    """A persistent agent (`hintfs agent`'s kind) of `cfg`'s slices over `store`, on loopback."""
    return AgentServer(store, cfg.agent, peers=cfg.agents, follow=cfg.follow, transform_load=cfg.transform_load,
                       location="grpc://127.0.0.1:0", persistent=True)


def test_cut_link_resumes_from_offsets_and_never_serves_a_torn_copy(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    data = os.urandom(16 * CHUNK)
    (store / "w.bin").write_bytes(data)
    fs = FlakyStore(str(store))
    server, loc = _start(_cfg(tmp_path, store), fs)
    c = AgentClient(loc)
    try:
        fs.fail_after = 5
        with pytest.raises(ConnectionResetError):
            server.agent.copier.replicate("w.bin", 600, None, parallel=1)
        assert c.tier_stat("w.bin")["state"] == "absent"          # the .part file is not served
        with pytest.raises(AgentError):
            c.read("w.bin", 0, 10, replica_only=True)
        fs.reads = 0
        server.agent.copier.replicate("w.bin", 600, None, parallel=1)
        assert fs.reads == 16 - 5                                   # only the ranges not yet here
        assert c.status()["resumed_ranges"] == 5
        assert c.read("w.bin", 0, len(data) + 1, replica_only=True) == data
    finally:
        server.shutdown()


def test_file_changing_during_copy_is_detected_and_copied_again(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / "w.bin").write_bytes(b"a" * (8 * CHUNK))
    fs = FlakyStore(str(store))
    server, loc = _start(_cfg(tmp_path, store), fs)
    try:
        def rewrite(n):
            if n == 3:
                (store / "w.bin").write_bytes(b"b" * (8 * CHUNK + 10))
        fs.on_read = rewrite
        import pyarrow.flight as fl
        with pytest.raises(fl.FlightServerError, match="changed"):
            server.agent.copier.replicate("w.bin", 600, None, parallel=1)
        assert AgentClient(loc).tier_stat("w.bin")["state"] == "absent"
        fs.on_read = None
        server.agent.copier.replicate("w.bin", 600, None, parallel=1)
        assert AgentClient(loc).read("w.bin", 0, 1 << 20, replica_only=True) == b"b" * (8 * CHUNK + 10)
    finally:
        server.shutdown()


def test_eviction_policy_order_and_refusal():
    e = [TierEntry("new/a", 10, last_used=1.0, newest=True),
         TierEntry("old/a", 10, last_used=5.0),
         TierEntry("old/b", 10, last_used=2.0),
         TierEntry("exp", 10, last_used=9.0, expired=True),
         TierEntry("busy", 100, last_used=0.0, pinned=True)]
    assert pick_evictions(e, 15) == ["exp", "old/b"]
    assert pick_evictions(e, 35) == ["exp", "old/b", "old/a", "new/a"]
    assert pick_evictions(e, 41) == []            # pinned bytes never count: refuse instead
    assert pick_evictions(e, 0) == []
    # room for the next copies: expired and not-newest replicas only, past what is needed
    assert pick_evictions(e, 5, want_bytes=25) == ["exp", "old/b"]      # old/a would pass 25
    assert pick_evictions(e, 5, want_bytes=30) == ["exp", "old/b", "old/a"]
    assert pick_evictions(e, 5, want_bytes=1000) == ["exp", "old/b", "old/a"]   # not new/a
    assert pick_evictions(e, 35, want_bytes=1000) == ["exp", "old/b", "old/a", "new/a"]
    assert pick_evictions(e, 41, want_bytes=1000) == []


def test_full_tier_evicts_least_recently_used_and_reads_stay_correct(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    files = {f"f{i}": os.urandom(1 << 20) for i in range(4)}
    for n, d in files.items():
        (store / n).write_bytes(d)
    server, loc = _start(_cfg(tmp_path, store, budget_bytes=3 << 20), LocalStore(str(store)))
    c = AgentClient(loc)
    try:
        for n in ("f0", "f1", "f2"):
            c.replicate(n, 600)
        c.read("f0", 0, 10, replica_only=True)          # f1 is now the least recently used
        c.replicate("f3", 600)
        st = c.status()
        assert set(st["replicas"]) == {"f0", "f2", "f3"} and st["budget"]["evictions"] == 1
        assert st["budget"]["used"] <= 3 << 20
        for n in ("f0", "f2", "f3"):
            assert c.read(n, 0, 2 << 20, replica_only=True) == files[n]
        assert c.read("f1", 0, 2 << 20) == files["f1"]     # not in the tier: read from the store
        big = os.urandom(4 << 20)
        (store / "big").write_bytes(big)
        with pytest.raises(AgentError) as err:             # more than the whole budget
            c.replicate("big", 600)
        assert "ENOSPC" in str(err.value)
    finally:
        server.shutdown()


def test_persistent_agent_rebuilds_its_catalog_after_a_stop(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / "a").write_bytes(b"a" * 1000)
    (store / "b").write_bytes(b"b" * 3000)
    cfg = _cfg(tmp_path, store)
    first = _tcp(cfg, LocalStore(str(store)))
    first.agent.copier.replicate("a", 600, None)
    first.agent.copier.replicate("b", 600, None)
    first.shutdown()
    second = _tcp(cfg, LocalStore(str(store)))
    try:
        assert set(second.agent.catalog.replicas) == {"a", "b"}
        assert second.agent.reads.read_range("b", 0, 5000, replica_only=True) == (b"b" * 3000, None)
        st = os.stat(store / "a")
        assert second.agent.catalog.has("a", 1000, st.st_mtime_ns)
    finally:
        second.shutdown()


def test_agent_killed_with_sigkill_restarts_with_its_replicas(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    payload = os.urandom(300_000)
    (store / "ck.distcp").write_bytes(payload)
    agent = AgentProcess(tmp_path, store)
    c = agent.start()
    try:
        c.replicate("ck.distcp", 600)
        # a torn copy left behind by the crash: never adopted
        folder = next((tmp_path / "tier").glob("agent-*"))
        (folder / "deadbeef.part").write_bytes(b"half")
        agent.kill()
        c = agent.start()
        st = c.status()
        assert set(st["replicas"]) == {"ck.distcp"}
        assert c.read("ck.distcp", 0, 1 << 20, replica_only=True) == payload
        assert not list((tmp_path / "tier").glob("*/deadbeef.part"))
    finally:
        agent.stop()


def test_a_cut_copy_resumes_after_the_agent_restarts(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    data = os.urandom(16 * CHUNK)
    (store / "w.bin").write_bytes(data)
    cfg = _cfg(tmp_path, store)
    fs = FlakyStore(str(store))
    first = _tcp(cfg, fs)
    fs.fail_after = 5
    with pytest.raises(ConnectionResetError):
        first.agent.copier.replicate("w.bin", 600, None, parallel=1)
    first.shutdown()                      # the cut copy and its progress stay on disk
    fs2 = FlakyStore(str(store))
    second = _tcp(cfg, fs2)
    try:
        assert "w.bin" not in second.agent.catalog.replicas   # a cut copy is not a replica
        second.agent.copier.replicate("w.bin", 600, None, parallel=1)
        assert fs2.reads == 16 - 5 and second.agent.copier.resumed_ranges == 5
        assert second.agent.reads.read_range("w.bin", 0, len(data) + 1, replica_only=True) == (data, None)
        assert not list((tmp_path / "tier").glob("*/*.progress"))
    finally:
        second.shutdown()


def test_a_copy_cut_by_sigkill_resumes_from_its_saved_progress(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    data = os.urandom(32 * CHUNK)         # 2 MiB at 512 KiB/s through the link gate: about 4 s
    (store / "big.bin").write_bytes(data)
    agent = AgentProcess(tmp_path, store, f"link_bytes_s = {512 << 10}\nlink_chunk_bytes = {CHUNK}\n")
    c = agent.start()
    try:
        def copy():
            try:
                c.replicate("big.bin", 600)
            except AgentError:
                pass                      # the agent is killed under it
        t = threading.Thread(target=copy, daemon=True)
        t.start()
        def saved_ranges() -> int:
            try:
                return sum(len(json.loads(p.read_text())["done"]) for p in (tmp_path / "tier").glob("*/*.part.progress"))
            except (OSError, ValueError):
                return 0                  # (renamed over while read: the next look)
        assert wait_for(lambda: saved_ranges() > 0, timeout=20)
        agent.kill()
        t.join(10)
        c = agent.start()
        c.replicate("big.bin", 600)
        st = c.status()
        assert 0 < st["resumed_ranges"] < 32
        assert c.read("big.bin", 0, len(data) + 1, replica_only=True) == data
    finally:
        agent.stop()

"""The eval read path driven without a kernel or an agent: `Filesystem.open` over the routed store
layer (`fusefs.routes.RoutedStore`) and the replica reads, with a fake tier agent and a fake
clock. What a routed open reads from (tier replica, demand read, store), what the tier's state
remembers and for how long, and the hinted replicas' fallback to the reader the open made.
No sleeps: time moves when the test says so."""
from __future__ import annotations

import logging
import os
import threading

import pytest
import trio

from hintfs.common.clock import FakeClock
from fusefs.attrs import ROOT_INODE
from fusefs.filesystem import Filesystem
from fusefs.handles import ReplicaRead, StoreRead
from fusefs.hints import ReplicaRouter
from fusefs.interfaces import Source
from fusefs.readpath import ReadPath
from fusefs.replicaread import ReplicaReads
from fusefs.routes import (APPEAR_SLICE_S, APPEAR_WAIT_S, LATER_HINTS_S, READY_MEMORY_S, TIER_DOWN_LOG_S,
                           RoutedStore, TierDemandReader, TierReplicaReader)
from fusefs.stats import Stats
from mountconfig.schema import ReplicasConfig, RouteConfig
from hintfs.stores.local import LocalStore

TIER = "grpc://tier.test:1"


class FakeTier:
    """The calls the mount makes of a tier agent (hintfs.agent.client.AgentClient), answered from a
    table: path -> tier_stat document; `holds` -> the bytes of each complete replica."""

    def __init__(self, clock: FakeClock):
        self.clock = clock
        self.docs: dict[str, dict] = {}
        self.holds: dict[str, bytes] = {}
        self.calls: list[tuple] = []
        self.down = False
        self.on_tier_stat = None

    def _call(self, *what) -> None:
        self.calls.append(what)
        if self.down:
            raise ConnectionRefusedError(111, "tier down")

    def count(self, name: str, path: str = "") -> int:
        return sum(1 for c in self.calls if c[0] == name and (not path or c[1] == path))

    def tier_stat(self, path, wait_s=0.0, appear_s=0.0):
        self._call("tier_stat", path, appear_s)
        if self.on_tier_stat is not None:
            return self.on_tier_stat(path, appear_s)
        return dict(self.docs.get(path, {"state": "absent"}))

    def has(self, path, size, mtime_ns):
        self._call("has", path)
        doc = self.docs.get(path, {})
        return doc.get("state") == "ready" and (doc["size"], doc["mtime_ns"]) == (size, mtime_ns)

    def read(self, path, offset, length, replica_only=False, expect=None, demand=False):
        self._call("read", path, offset, length, demand)
        return self.holds[path][offset:offset + length]

    def replicate(self, path, ttl_s, source=None, priority="background", job=None, importance=1.0, expect=None):
        self._call("replicate", path, priority)
        return {}

    def prefetch(self, path, version, ranges):
        self._call("prefetch", path, version, tuple(map(tuple, ranges)))
        return len(ranges)


def ready(data: bytes, mtime_ns: int = 7) -> dict:
    return {"state": "ready", "size": len(data), "mtime_ns": mtime_ns}


@pytest.fixture
def rig(tmp_path):
    clock = FakeClock()
    tier = FakeTier(clock)
    stats = Stats()
    limiter = trio.CapacityLimiter(4)
    store = LocalStore(str(tmp_path))
    routes = RoutedStore(store, [RouteConfig(prefix="ckpt", local_agent=TIER)], {TIER: tier}, stats,
                         io_limiter=limiter, clock=clock)
    router = ReplicaRouter()
    replicas = ReplicaReads(router, {TIER: tier}, ReplicasConfig(hedge_after_ms=0), stats, io_limiter=limiter)
    fs = Filesystem(routes, stats=stats, reads=ReadPath(stats, routes=routes, replicas=replicas), io_limiter=limiter)
    (tmp_path / "ckpt").mkdir()
    return fs, tier, clock, tmp_path


async def open_path(fs: Filesystem, path: str) -> tuple[int, object]:
    ino = ROOT_INODE
    for name in path.split("/"):
        ino = (await fs.lookup(ino, name.encode())).st_ino
    fh = (await fs.open(ino, os.O_RDONLY)).fh
    return fh, fs.handles[fh]


def test_a_version_the_tier_holds_is_read_from_its_replica(rig):
    fs, tier, clock, root = rig
    data = os.urandom(10_000)
    tier.docs["ckpt/a.bin"] = ready(data)
    tier.holds["ckpt/a.bin"] = data          # (the store has no such file: the tier's version is served)

    async def main():
        fh, h = await open_path(fs, "ckpt/a.bin")
        assert isinstance(h, ReplicaRead) and h.locations == (TIER,)
        assert isinstance(h.reader, TierReplicaReader) and h.reader.source is Source.TIER
        assert await fs.read(fh, 0, 20_000) == data
        await fs.release(fh)

    trio.run(main)
    c = fs.stats.counters
    assert c["route_local"] == 1 and c["replica_reads"] == 1 and not c.get("route_remote")
    # lookup, getattr and open of one file within READY_MEMORY_S: one call to the tier, no `has`
    assert tier.count("tier_stat", "ckpt/a.bin") == 1 and tier.count("has") == 0
    assert fs.reads.replicas.router.replicas == {}     # the tier's state is the routes' own


def test_a_ready_answer_is_remembered_for_a_second_of_the_clock(rig):
    fs, tier, clock, root = rig
    tier.docs["ckpt/a.bin"] = ready(b"x" * 10)
    routes = fs.store
    routes.stat("ckpt/a.bin")
    clock.advance(READY_MEMORY_S * 0.9)
    routes.stat("ckpt/a.bin")
    assert tier.count("tier_stat") == 1
    clock.advance(READY_MEMORY_S * 0.2)
    routes.stat("ckpt/a.bin")
    assert tier.count("tier_stat") == 2
    # another answer replaces it: copying is never remembered as ready
    tier.docs["ckpt/a.bin"] = {"state": "copying", "size": 10, "mtime_ns": 7}
    clock.advance(READY_MEMORY_S)
    routes.stat("ckpt/a.bin")
    routes.stat("ckpt/a.bin")
    assert tier.count("tier_stat") == 4
    assert not routes.state.holds("ckpt/a.bin", (10, 7))


def test_a_file_still_arriving_is_read_by_demand_from_the_tier(rig):
    fs, tier, clock, root = rig
    data = os.urandom(5000)
    tier.docs["ckpt/b.bin"] = {"state": "copying", "size": len(data), "mtime_ns": 9}
    tier.holds["ckpt/b.bin"] = data

    async def main():
        fh, h = await open_path(fs, "ckpt/b.bin")
        assert type(h) is StoreRead and isinstance(h.reader, TierDemandReader)
        assert await fs.read(fh, 100, 50) == data[100:150]
        await fs.release(fh)

    trio.run(main)
    c = fs.stats.counters
    assert c["route_demand_opens"] == 1 and c["route_demand_reads"] == 1
    assert c["route_remote"] == 1 and tier.count("has") == 1
    assert ("replicate", "ckpt/b.bin", "eval") in tier.calls      # fetch_on_read (deduplicated by the tier)


def test_a_file_the_tier_lacks_is_read_from_the_store_and_fetched(rig):
    fs, tier, clock, root = rig
    (root / "ckpt" / "c.bin").write_bytes(b"store bytes")

    async def main():
        fh, h = await open_path(fs, "ckpt/c.bin")
        assert type(h) is StoreRead and h.reader is not None and not hasattr(h.reader, "source")
        assert await fs.read(fh, 0, 100) == b"store bytes"
        await fs.release(fh)
        # the tier has it by now: the next open reads the tier's replica (asked with `has`)
        st = os.stat(root / "ckpt" / "c.bin")
        tier.docs["ckpt/c.bin"] = {"state": "ready", "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        tier.holds["ckpt/c.bin"] = b"store bytes"
        fh, h = await open_path(fs, "ckpt/c.bin")
        assert isinstance(h, ReplicaRead) and h.locations == (TIER,)
        await fs.release(fh)

    trio.run(main)
    c = fs.stats.counters
    assert c["route_remote"] == 1 and c["route_local"] == 1 and c["route_fetches"] == 1


def test_an_unrouted_path_never_asks_the_tier(rig):
    fs, tier, clock, root = rig
    (root / "other.bin").write_bytes(b"plain")

    async def main():
        fh, h = await open_path(fs, "other.bin")
        assert type(h) is StoreRead
        assert await fs.read(fh, 0, 10) == b"plain"
        await fs.release(fh)

    trio.run(main)
    assert tier.calls == []


def test_hinted_replicas_fall_back_to_the_reader_the_open_made(rig):
    fs, tier, clock, root = rig
    (root / "h.bin").write_bytes(b"v1" * 1000)
    fs.reads.replicas.router.replicas["h.bin"] = [TIER]      # (what the hints manager records)
    tier.down = True

    async def main():
        fh, h = await open_path(fs, "h.bin")
        assert isinstance(h, ReplicaRead) and h.locations is None
        os.rename(root / "h.bin", root / "old")               # replaced in the store after the open:
        (root / "h.bin").write_bytes(b"v2" * 1000)
        assert await fs.read(fh, 0, 4) == b"v1v1"             # the version opened, never a mix
        await fs.release(fh)

    trio.run(main)
    c = fs.stats.counters
    assert c["replica_failovers"] == 1 and c["replica_store_fallbacks"] == 1


def test_a_tier_down_is_logged_once_per_period_of_the_clock(rig, caplog):
    fs, tier, clock, root = rig
    (root / "ckpt" / "d.bin").write_bytes(b"d")
    tier.down = True
    routes = fs.store
    with caplog.at_level(logging.WARNING, logger="hintfs.routes"):
        for _ in range(3):
            assert routes.stat("ckpt/d.bin").size == 1          # the store answers
        clock.advance(TIER_DOWN_LOG_S + 1)
        routes.stat("ckpt/d.bin")
    assert len([r for r in caplog.records if "unavailable" in r.message]) == 2
    assert fs.stats.counters["route_tier_down"] == 4


def test_a_read_hint_for_a_file_not_arriving_yet_is_kept_for_a_minute_of_the_clock(rig):
    fs, tier, clock, root = rig
    routes = fs.store
    assert routes.prefetch({"ckpt/e.bin": [(0, 10)], "ckpt/f.bin": [(5, 5)]}) == 2   # (the tier holds them too)
    tier.docs["ckpt/e.bin"] = tier.docs["ckpt/f.bin"] = {"state": "copying", "size": 100, "mtime_ns": 1}
    routes.open_reader("ckpt/e.bin")[0].close()             # arriving now: the hint goes with the open
    assert ("prefetch", "ckpt/e.bin", (100, 1), ((0, 10),)) in tier.calls
    clock.advance(LATER_HINTS_S + 1)
    routes.open_reader("ckpt/f.bin")[0].close()             # too old: dropped
    assert not any(c[0] == "prefetch" and c[2] is not None and c[1] == "ckpt/f.bin" for c in tier.calls)
    assert fs.stats.counters["route_hints_at_open"] == 1


def test_a_stat_of_a_file_expected_at_the_tier_takes_the_first_answer(rig):
    fs, tier, clock, root = rig
    routes = fs.store
    (root / "ckpt" / "s.bin").write_bytes(b"s" * 3)
    # The tier has it on its third short wait (the store's thread may answer first: either is right).
    answers = iter([{"state": "absent", "expected": True}] * 3 + [ready(b"s" * 3, 5)])

    def by_turn(path, appear_s):
        clock.advance(appear_s)
        return next(answers, ready(b"s" * 3, 5))

    tier.on_tier_stat = by_turn
    assert routes.stat("ckpt/s.bin").size == 3
    c = fs.stats.counters
    assert c.get("route_stat_race_tier", 0) + c.get("route_stat_race_store", 0) == 1


def test_a_stat_race_ends_at_its_deadline_of_the_clock(tmp_path):
    """The store's stat hangs; the tier keeps saying "expected": after APPEAR_WAIT_S of the clock
    the tier is asked no more and the store's answer is awaited (as a stat without the race)."""
    clock = FakeClock()
    tier = FakeTier(clock)
    release = threading.Event()

    class HangingStore(LocalStore):
        def stat(self, rel):
            assert release.wait(30)
            return super().stat(rel)

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "late").write_bytes(b"late")
    routes = RoutedStore(HangingStore(str(tmp_path)), [RouteConfig(prefix="ckpt", local_agent=TIER)], {TIER: tier},
                         Stats(), clock=clock)

    def expected(path, appear_s):
        clock.advance(appear_s)
        if clock.monotonic() > start + APPEAR_WAIT_S:
            release.set()                                   # (the store answers once the tier was given up)
        return {"state": "absent", "expected": True}

    tier.on_tier_stat = expected
    start = clock.monotonic()
    assert routes.stat("ckpt/late").size == 4
    asked = tier.count("tier_stat")
    assert asked == pytest.approx(APPEAR_WAIT_S / APPEAR_SLICE_S + 1, abs=2)
    assert routes.stats.counters["route_stat_race_store"] == 1

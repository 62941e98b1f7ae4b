"""Reads of remote stores (issue 39): read-ahead of sequential readers (a window that grows, bounded
memory), small objects read whole at open, stats answered from listings, the host cache filled
from the bytes an open already has. A fake ranged reader and pyarrow's local filesystem stand in
for S3 (the gateway tests are tests/mount/test_s3_store.py)."""
from __future__ import annotations

import os
import threading

import pyarrow.fs as pafs
import pytest

from hintfs.stores.arrow import ArrowStore
from hintfs.stores.hostcache import HostCachedStore
from hintfs.stores.local import LocalReader
from hintfs.stores.readahead import Budget, ReadAhead, ReadPool
from mountconfig.schema import CacheConfig

KiB = 1 << 10
MiB = 1 << 20


class Ranged:
    """A remote object: records each ranged read; `gate` holds reads at or past `hold_from`."""

    def __init__(self, data: bytes):
        self.data = data
        self.reads: list[tuple[int, int]] = []
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.hold_from = None
        self.fail_once_at = None

    def read_at(self, offset: int, size: int) -> bytes:
        with self.lock:
            self.reads.append((offset, size))
            fail = self.fail_once_at == offset
            if fail:
                self.fail_once_at = None
        if self.hold_from is not None and offset >= self.hold_from:
            assert self.gate.wait(10)
        if fail:
            raise OSError("connection reset")
        return self.data[offset:offset + size]

    def fetched(self) -> int:
        with self.lock:
            return sum(n for _o, n in self.reads)


@pytest.fixture
def pool():
    return ReadPool(4, "test-readahead")


def sequential(ra: ReadAhead, size: int, step: int) -> bytes:
    out = []
    for off in range(0, size, step):
        out.append(ra.read(off, step))
    return b"".join(out)


def test_a_sequential_reader_gets_a_window_that_grows_and_costs_little_more_than_it_reads(pool):
    data = os.urandom(8 * MiB)
    obj = Ranged(data)
    budget = Budget(64 * MiB)
    ra = ReadAhead(obj.read_at, len(data), 2 * MiB, budget, pool, chunk=256 * KiB)
    assert sequential(ra, len(data), 128 * KiB) == data
    # the first read is read as asked; then whole chunks, ahead of the reader
    assert obj.reads[0] == (0, 128 * KiB)
    chunks = [r for r in obj.reads[1:]]
    assert all(n == 256 * KiB for _o, n in chunks)
    assert ra._window == 2 * MiB                       # grew to read_ahead_bytes, no further
    assert obj.fetched() <= len(data) + 256 * KiB      # fetched / read close to 1
    assert budget.used <= 2 * MiB + 256 * KiB          # bounded by the window
    ra.close()
    assert budget.used == 0


def test_random_reads_are_read_as_asked_without_read_ahead(pool):
    data = os.urandom(4 * MiB)
    obj = Ranged(data)
    budget = Budget(64 * MiB)
    ra = ReadAhead(obj.read_at, len(data), 2 * MiB, budget, pool, chunk=256 * KiB)
    for off in (3 * MiB, 17, 2 * MiB + 5, 1 * MiB, 3 * MiB + 999):
        assert ra.read(off, 4 * KiB) == data[off:off + 4 * KiB]
    assert obj.reads == [(o, 4 * KiB) for o in (3 * MiB, 17, 2 * MiB + 5, 1 * MiB, 3 * MiB + 999)]
    assert budget.used == 0


def test_the_budget_bounds_what_all_open_files_hold(pool):
    data = os.urandom(4 * MiB)
    budget = Budget(512 * KiB)                         # two chunks for everyone
    readers = [ReadAhead(Ranged(data).read_at, len(data), 2 * MiB, budget, pool, chunk=256 * KiB)
               for _ in range(3)]
    for step in range(0, len(data), 128 * KiB):
        for ra in readers:
            assert ra.read(step, 128 * KiB) == data[step:step + 128 * KiB]
            assert budget.used <= 512 * KiB
    for ra in readers:
        ra.close()
    assert budget.used == 0


def test_read_nowait_answers_only_what_has_arrived(pool):
    data = os.urandom(2 * MiB)
    obj = Ranged(data)
    ra = ReadAhead(obj.read_at, len(data), 1 * MiB, Budget(64 * MiB), pool, chunk=256 * KiB)
    assert ra.read(0, 64 * KiB) == data[:64 * KiB]
    obj.hold_from = 512 * KiB
    obj.gate.clear()                                   # chunks from 512 KiB on do not arrive
    assert ra.read(64 * KiB, 64 * KiB) == data[64 * KiB:128 * KiB]   # opens the window (chunks 0, 1)
    assert ra.read_nowait(128 * KiB, 64 * KiB) == data[128 * KiB:192 * KiB]
    got = ra.read_nowait(520 * KiB, 10)
    assert got is None                                  # held: never waits on the event loop
    obj.gate.set()
    assert ra.read(520 * KiB, 10) == data[520 * KiB:520 * KiB + 10]
    ra.close()


def test_a_failed_read_ahead_is_read_again_as_asked(pool):
    data = os.urandom(2 * MiB)
    obj = Ranged(data)
    ra = ReadAhead(obj.read_at, len(data), 1 * MiB, Budget(64 * MiB), pool, chunk=256 * KiB)
    obj.fail_once_at = 256 * KiB                        # the read ahead of chunk 1 fails
    assert sequential(ra, len(data), 64 * KiB) == data
    ra.close()


# -- the store ------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def local_store(tmp_path, **kw) -> ArrowStore:
    root = tmp_path / "bucket"
    root.mkdir(exist_ok=True)
    return ArrowStore(pafs.LocalFileSystem(), str(root), str(tmp_path / "spool"), "local://bucket", **kw)


def test_a_small_object_is_read_whole_at_open_and_served_from_memory(tmp_path):
    store = local_store(tmp_path, whole_object_bytes=64 * KiB)
    small, big = os.urandom(40 * KiB), os.urandom(200 * KiB)
    (tmp_path / "bucket" / "small").write_bytes(small)
    (tmp_path / "bucket" / "big").write_bytes(big)
    reader, st = store.open_reader("small")
    assert st.size == len(small) and reader.whole == small
    assert reader.read_nowait(100, 50) == small[100:150]   # no thread, no request
    assert store.read_budget.used == len(small)
    reader.close()
    assert store.read_budget.used == 0 and store.read_counters["whole_object_opens"] == 1
    reader, st = store.open_reader("big")                   # over the bound: read as it goes
    assert reader.whole is None and reader.read(0, 10) == big[:10]
    reader.close()


def test_whole_objects_stop_at_the_read_budget(tmp_path):
    store = local_store(tmp_path, whole_object_bytes=64 * KiB, read_buffer_bytes=1 * MiB)
    for i in range(40):
        (tmp_path / "bucket" / f"f{i}").write_bytes(os.urandom(40 * KiB))
    readers = [store.open_reader(f"f{i}")[0] for i in range(40)]
    assert sum(r.whole is not None for r in readers) == 1 * MiB // (40 * KiB)
    assert store.read_budget.used <= 1 * MiB
    for i, r in enumerate(readers):
        assert r.read(0, 5) == (tmp_path / "bucket" / f"f{i}").read_bytes()[:5]
        r.close()
    assert store.read_budget.used == 0


def test_a_stat_after_a_listing_needs_no_request_until_its_timeout(tmp_path):
    clock = Clock()
    store = local_store(tmp_path, listing_ttl=lambda p: 5.0 if p.startswith("imm/") else 1.0, clock=clock)
    (tmp_path / "bucket" / "a").write_bytes(b"x" * 10)
    (tmp_path / "bucket" / "imm").mkdir()
    (tmp_path / "bucket" / "imm" / "b").write_bytes(b"y" * 20)
    assert dict(store.iter_dir(""))["a"].size == 10
    assert dict(store.iter_dir("imm"))["b"].size == 20
    (tmp_path / "bucket" / "a").write_bytes(b"x" * 11)        # changed behind the mount's back
    assert store.stat("a").size == 10                           # from the listing: no request
    assert store.read_counters["stat_from_listing"] == 1
    assert store.current("a").size == 11                        # close-to-open asks the store, always
    clock.t += 1.5
    assert store.stat("a").size == 11                           # past the path's timeout: asked
    assert store.stat("imm/b").size == 20                       # (immutable: 5 s)
    store.unlink("imm/b")                                       # a change through the store forgets it
    with pytest.raises(FileNotFoundError):
        store.stat("imm/b")


def test_no_listing_timeout_no_listing_answers(tmp_path):
    store = local_store(tmp_path)
    (tmp_path / "bucket" / "a").write_bytes(b"x")
    list(store.iter_dir(""))
    (tmp_path / "bucket" / "a").write_bytes(b"xy")
    assert store.stat("a").size == 2


def test_the_host_cache_keeps_a_small_object_from_the_bytes_the_open_read(tmp_path):
    store = local_store(tmp_path, whole_object_bytes=64 * KiB)
    data = os.urandom(30 * KiB)
    (tmp_path / "bucket" / "s").write_bytes(data)
    hc = HostCachedStore(store, CacheConfig(dir=str(tmp_path / "hc"), fetch_block_bytes=64 * KiB),
                         store_id="local://bucket")
    try:
        reader, st = hc.open_reader("s")
        # the open's own bytes, served from the copy just kept (a passthrough backing on a mount)
        assert isinstance(reader, LocalReader) and reader.read_nowait(0, len(data)) == data
        assert hc.counters["hostcache_whole"] == 1 and hc.counters["hostcache_fetches"] == 1
        reader.close()
        again, _st = hc.open_reader("s")                       # a complete local copy: a hit
        assert isinstance(again, LocalReader) and again.read(0, len(data)) == data
        again.close()
        assert hc.counters["hostcache_hits"] == 1
        newer = os.urandom(31 * KiB)
        (tmp_path / "bucket" / "s").write_bytes(newer)        # another version: read whole, kept again
        third, st3 = hc.open_reader("s")
        assert st3.size == len(newer) and third.read(0, len(newer)) == newer
        assert hc.counters["hostcache_whole"] == 2 and hc.counters["hostcache_stale"] == 1
        third.close()
    finally:
        hc.close()

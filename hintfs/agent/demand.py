"""Demand-first reads at the eval tier (docs/cross_dc.md, "Demand-first reads").

An eval mount opens a routed file while the tier is still receiving it: a write-time stream the
training mount has published but not finished sending, or a copy in flight. Before this, the open
waited for the whole file; a merge that needs half a megabyte of a 340 MB checkpoint waited for
all of it. Now each read is answered at once:

- from the bytes the tier already holds of exactly the version the reader opened (a stream's
  chunks verified against the publish's CRCs, a copy's finished ranges), or else
- fetched from the store at once, only the bytes asked for, while the stream or the copy goes on;
  whichever comes first answers (the held bytes when they land while the fetch is in flight).
  When the file comes by a stream whose backlog needs under `PREFETCH_BEHIND_S` of the link
  (`[agent] link_bytes_s`), the read first waits for the stream, about that long: a fetch would
  share the link with the backlog, arrive no sooner, and send the bytes twice.

An eval job that knows the byte ranges it is about to read (the tensors a DCP load takes, from
the `.metadata` it reads anyway) says so (`.hintfs/reads/<job>` on the eval mount, forwarded as
`prefetch`): every range the tier does not hold is fetched at once, all in parallel, so a merge
that reads a hundred small tensors one after another waits one round trip, not a hundred. Each
range is widened to the kernel's reads around it (page-aligned, plus `PREFETCH_PAD` of readahead,
`FIRST_READ_BYTES` at a file's start), and what is fetched is kept (at most `CACHE_BYTES`) for the
demand reads that follow. A hint for a file whose version the tier does not know yet (a stream
not published: the commit marker can land before the last data file's publish) is held
(`hold_hint`) and fetched when the publish or the journal record announces the version.

The store is read through one reader per (path, version), opened at the publish (so that the
first read does not pay the open's own round trip) and checked against that version: a store
file of another version is never read (ESTALE; the eval mount then reads the store as without a
tier). Demand fetches do not wait for the link scheduler: they are the eval's own bytes, bounded
by the kernel's read size, and the class above every scheduled copy; their bytes are counted in
`status` ("demand").
"""
from __future__ import annotations

import errno
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable

from cachetools import FIFOCache, TTLCache

from hintfs.agent.lru import EvictingLRU
from hintfs.agent.readmemory import ReadMemory
from hintfs.agent.rpc import rpc_error
from hintfs.common.clock import SYSTEM_CLOCK, Clock
from policy.stream import merged_ranges
from hintfs.stores.base import Store

log = logging.getLogger("hintfs.demand")

Version = tuple[int, int]          # (size, mtime_ns) of the store's file
_READERS = 64                      # store readers kept open, most recently used
_WAKE_S = 0.01                     # a waiting read re-checks the held bytes at least this often
PREFETCH_PAD = 256 << 10           # a hinted range is read by the kernel with readahead after it
# A read at a file's start is the kernel's "initial readahead": four times the reader's request,
# and a Python reader asks for its buffer, the mount's st_blksize (128 KiB). Seen: 512 KiB at
# offset 0 where the hinted piece had 288 KiB, a fetch of one more round trip after the prefetch.
FIRST_READ_BYTES = 512 << 10
# Hints for a file whose version the tier does not know yet (its stream not published, its
# journal record not here) are kept this long, at most this many files, and fetched when the
# version is announced: the merge's hint comes at the commit, a file's publish can land after it.
PENDING_HINT_S = 10.0
PENDING_HINT_FILES = 256
PENDING_HINT_RANGES = 1 << 16      # ranges held in all (one request may carry 65,536)
CACHE_BYTES = 256 << 20            # prefetched bytes kept for the reads that follow
_PAGE = 4096
PIECE_BYTES = 1 << 20              # prefetched pieces are cut at MiB boundaries: held ones are skipped
# A hinted range of a file arriving by stream is fetched from the store only when the streams'
# backlog needs more than this long on the link: a fetch takes a round trip and shares the link
# with that backlog, so against a short one it arrives no sooner and sends the bytes twice.
PREFETCH_BEHIND_S = 0.5
# A read of such a file waits this much longer than the backlog's link time for the stream
# before it fetches from the store (a stream that stalls costs at most this wait).
STREAM_GRACE_S = 0.25


def prefetch_pieces(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The hinted (offset, length) ranges of a file of `size` bytes as the kernel will ask for
    them: page-aligned start, `PREFETCH_PAD` more after the end (at least `FIRST_READ_BYTES`
    from a range in the first page), overlaps merged, cut at `size`,
    then at every `PIECE_BYTES` boundary (so that what the tier holds already is not fetched)."""
    widened = [(off - off % _PAGE,
                min(size, max(off + n + PREFETCH_PAD, FIRST_READ_BYTES if off < _PAGE else 0)) - (off - off % _PAGE))
               for off, n in ranges if off < size]
    pieces = []
    for a, n in merged_ranges(widened):
        b = a + n
        while a < b:
            cut = min(b, (a // PIECE_BYTES + 1) * PIECE_BYTES)
            pieces.append((a, cut - a))
            a = cut
    return pieces


class DemandReads:
    def __init__(self, store: Store, cond: threading.Condition,
                 held: Callable[[str, Version, int, int], bytes | None],
                 arriving: Callable[[str, Version], bool], timeout_s: float = 60.0, parallel: int = 16,
                 stream_behind_s: Callable[[str, Version], float | None] | None = None,
                 clock: Clock = SYSTEM_CLOCK):
        self.store = store
        self.clock = clock
        self.cond = cond            # notified when chunks land or copies finish ranges
        self.held = held            # bytes of exactly this version the tier holds, or None
        self.arriving = arriving    # a stream or a copy of this version is on its way here
        # seconds of link until the streams' backlog has arrived, when this version comes by a
        # stream and the link's rate is known; None otherwise
        self.stream_behind_s = stream_behind_s
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(parallel, thread_name_prefix="hintfs-demand")
        # Store readers open in a pool of their own: a fetch (in `_pool`) waits for its reader,
        # and with the open queued behind `parallel` such fetches in the same pool, none would
        # ever run (seen: a merge stalled 51 s, until `timeout_s`, with 20 pieces hinted at once).
        self._opener = ThreadPoolExecutor(4, thread_name_prefix="hintfs-demand-open")
        self._lock = threading.Lock()
        self._readers: EvictingLRU[tuple[str, Version], Future] = self._new_readers()
        self._retired: list[tuple[float, Future]] = []   # evicted readers a fetch may still use
        # prefetched pieces: (path, version) -> [(offset, length, future of the bytes)], at most
        # CACHE_BYTES of them; a file's list is set again (to its end) when it grows
        self._pieces: FIFOCache[tuple[str, Version], list[tuple[int, int, Future]]] = FIFOCache(
            CACHE_BYTES, getsizeof=lambda pieces: min(CACHE_BYTES, sum(m for _o, m, _f in pieces)))
        # hints of files whose version is not known here yet: path -> ranges, at most
        # PENDING_HINT_FILES files and PENDING_HINT_RANGES ranges in all, each PENDING_HINT_S
        self._pending: TTLCache[str, list[tuple[int, int]]] = TTLCache(
            PENDING_HINT_RANGES, PENDING_HINT_S, timer=clock.monotonic, getsizeof=len)
        # reads; answered from held bytes at once; fetched from the store; answered by bytes that
        # landed while the fetch was in flight; and the milliseconds those last two waited
        self.counts = {"reads": 0, "held": 0, "fetched": 0, "bytes_fetched": 0, "raced": 0, "wait_ms": 0,
                       "prefetched": 0, "bytes_prefetched": 0, "prefetch_hits": 0, "prefetch_left_to_stream": 0,
                       "stream_waits": 0}

    # -- store readers, one per version ----------------------------------------------------------
    def prepare(self, path: str, version: Version) -> None:
        """Open the store reader of this version now, in the background (a publish says demand
        reads of it may come: the open's round trip is paid before the first one)."""
        self._reader(path, (int(version[0]), int(version[1])))

    def _new_readers(self) -> EvictingLRU[tuple[str, Version], Future]:
        return EvictingLRU(_READERS, lambda _key, fut: self._retired.append((self.clock.monotonic(), fut)))

    def _reader(self, path: str, version: Version) -> Future:
        key = (path, version)
        with self._lock:
            known: Future | None = self._readers.get(key)
            if known is not None:
                return known
            fut = self._opener.submit(self._open, path, version)
            self._readers[key] = fut
            now = self.clock.monotonic()
            # closed once no fetch that took them before their eviction can still be reading
            old = [f for t, f in self._retired if now - t > 2 * self.timeout_s]
            self._retired = [(t, f) for t, f in self._retired if now - t <= 2 * self.timeout_s]
        for f in old:
            f.add_done_callback(_close_reader)
        return fut

    def _open(self, path: str, version: Version):
        # lazy: no byte fetched at the open (a small object's whole GET would bring across the
        # link what the stream is bringing: bench/scale_xdc.py, 0.28x the bytes written)
        reader, st = self.store.open_reader(path, lazy=True)
        if (st.size, st.mtime_ns) != version:
            reader.close()
            raise rpc_error(errno.ESTALE, f"{path} in the store is no longer the version being copied")
        return reader

    def _fetch(self, path: str, version: Version, offset: int, length: int) -> bytes:
        fut = self._reader(path, version)
        try:
            reader = fut.result(timeout=self.timeout_s)
        except OSError:
            with self._lock:            # a failed open is not kept: the next read tries again
                if self._readers.get((path, version)) is fut:
                    del self._readers[(path, version)]
            raise
        data: bytes = reader.read(offset, max(0, min(length, version[0] - offset)))
        with self.cond:
            self.cond.notify_all()      # wake the read waiting for this fetch
        return data

    # -- prefetch (read hints) ----------------------------------------------------------------------
    def prefetch(self, path: str, version: Version, ranges: list[tuple[int, int]]) -> int:
        """Fetch at once, in parallel, the pieces of these ranges the tier does not hold; how
        many. Nothing when no stream or copy of this version is on its way (held or absent)."""
        version = (int(version[0]), int(version[1]))
        if not self.arriving(path, version):
            return 0
        if self._stream_soon(path, version) is not None:
            self._count("prefetch_left_to_stream")   # its reads race the stream as without a hint
            return 0
        key = (path, version)
        with self._lock:
            known = [(o, n) for o, n, _f in self._pieces.get(key, ())]
        n = 0
        for off, length in prefetch_pieces(ranges, version[0]):
            if any(o <= off and off + length <= o + m for o, m in known):
                continue
            if self.held(path, version, off, length) is not None:
                continue
            fut = self._pool.submit(self._fetch, path, version, off, length)
            with self._lock:
                self._pieces[key] = [*self._pieces.get(key, ()), (off, length, fut)]
            self._count("prefetched")
            self._count("bytes_prefetched", length)
            n += 1
        return n

    def hold_hint(self, path: str, ranges: list[tuple[int, int]]) -> None:
        """Keep the hinted ranges of a file whose version this tier does not know yet, for
        `take_hint` when it is announced (at most `PENDING_HINT_S`; the newest hint of a file
        replaces an older one)."""
        with self._lock:
            self._pending.pop(path, None)              # (the newest hint goes last)
            self._pending[path] = list(ranges)
            while len(self._pending) > PENDING_HINT_FILES:
                self._pending.popitem()

    def take_hint(self, path: str) -> list[tuple[int, int]] | None:
        """The ranges held for `path` (once: a second call answers None), unless too old."""
        with self._lock:
            return self._pending.pop(path, None)      # (one older than PENDING_HINT_S is gone)

    def _pieces_for(self, path: str, version: Version, offset: int, length: int) -> list | None:
        """Prefetched pieces that together hold [offset, offset + length) (cut at the end of the
        file), in order; None if they do not cover it all."""
        end = min(offset + length, version[0])
        with self._lock:
            found = sorted((o, m, f) for o, m, f in self._pieces.get((path, version), ()) if o < end and o + m > offset)
        pos = offset
        for o, m, _f in found:
            if o > pos:
                return None
            pos = max(pos, o + m)
        return found if found and pos >= end else None

    # -- reads ------------------------------------------------------------------------------------
    def read(self, path: str, version: Version, offset: int, length: int) -> bytes:
        """[offset, offset + length) of `path` at `version`, held or fetched; ENOENT when nothing
        of this version is held or on its way (the reader then reads the store itself)."""
        version = (int(version[0]), int(version[1]))
        self._count("reads")
        data = self.held(path, version, offset, length)
        if data is not None:
            self._count("held")
            return data
        if not self.arriving(path, version):
            raise rpc_error(errno.ENOENT, f"{path}: no replica, stream or copy of this version here")
        pieces = self._pieces_for(path, version, offset, length)
        if pieces is not None:
            end = min(offset + length, version[0])
            try:
                parts = []
                for o, _m, fut in pieces:
                    data = fut.result(timeout=self.timeout_s)
                    parts.append(data[max(offset, o) - o:end - o])
                self._count("prefetch_hits")
                return b"".join(parts)
            except Exception as err:   # (a failed prefetch: read as without it)
                log.debug("prefetch of %s at %d failed: %s", path, offset, err)
        t0 = self.clock.monotonic()
        behind = self._stream_soon(path, version)
        if behind is not None:
            # the stream's short backlog brings these bytes about as soon as a fetch would
            data = self._wait_held(path, version, offset, length, t0 + 2 * behind + STREAM_GRACE_S)
            if data is not None:
                self._count("stream_waits")
                self._count("wait_ms", round((self.clock.monotonic() - t0) * 1000))
                return data
        fetch = self._pool.submit(self._fetch, path, version, offset, length)
        deadline = t0 + self.timeout_s
        while True:
            if fetch.done():
                data = fetch.result()          # the fetch's error, if it failed
                self._count("fetched")
                self._count("bytes_fetched", len(data))
                self._count("wait_ms", round((self.clock.monotonic() - t0) * 1000))
                return data
            data = self.held(path, version, offset, length)
            if data is not None:               # the stream or the copy was first
                self._count("raced")
                self._count("wait_ms", round((self.clock.monotonic() - t0) * 1000))
                return data
            if self.clock.monotonic() > deadline:
                raise rpc_error(errno.ETIMEDOUT, f"{path}: no bytes at {offset} within {self.timeout_s:.0f} s")
            with self.cond:
                self.cond.wait(_WAKE_S)

    def _stream_soon(self, path: str, version: Version) -> float | None:
        """The link time of the streams' backlog when this version comes by a stream and that
        backlog is under PREFETCH_BEHIND_S (leave it to the stream); None: fetch as usual."""
        behind = self.stream_behind_s(path, version) if self.stream_behind_s is not None else None
        return behind if behind is not None and behind < PREFETCH_BEHIND_S else None

    def _wait_held(self, path: str, version: Version, offset: int, length: int, until: float) -> bytes | None:
        while True:
            data = self.held(path, version, offset, length)
            if data is not None or self.clock.monotonic() >= until:
                return data
            with self.cond:
                self.cond.wait(min(_WAKE_S, max(0.0, until - self.clock.monotonic())))

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def status(self) -> dict:
        with self._lock:
            return dict(self.counts)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._opener.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            readers = list(self._readers.values()) + [f for _t, f in self._retired]
            self._readers, self._retired = self._new_readers(), []
        for fut in readers:
            fut.add_done_callback(_close_reader)


class ReadHints:
    """What the tier does with an eval's read hints and with each version it learns is on its
    way: a hint of a known version is remembered for the next checkpoint's streams (`memory`) and
    its pieces the tier does not hold are fetched at once (`DemandReads.prefetch`); a hint of a
    file whose version is not known here yet is held (`hold_hint`) until the version is announced
    (`announce`: a publish, a journal record, a copy's start), and fetched then."""

    def __init__(self, demand: DemandReads, memory: ReadMemory,
                 announced_version: Callable[[str], Version | None]) -> None:
        self.demand = demand
        self.memory = memory
        self.announced_version = announced_version   # (TierView) the version on its way, or None

    def prefetch(self, path: str, version: Version, ranges: list[tuple[int, int]]) -> int:
        """An eval's read hint of `version` of `path`: remembered for the next checkpoint's stream,
        and the ranges the tier does not hold fetched at once; how many pieces."""
        self.memory.remember(path, prefetch_pieces(ranges, version[0]), hinted=True)
        return self.demand.prefetch(path, version, ranges)

    def hint_unversioned(self, path: str, ranges: list[tuple[int, int]]) -> int:
        """A read hint of a file the eval mount found without a version here (a stream not yet
        published): held until the version is announced (`announce`). Held first, then looked
        at: a publish between the mount's look and this call is not missed."""
        self.demand.hold_hint(path, ranges)
        version = self.announced_version(path)
        return 0 if version is None else self._fetch_held(path, version)

    def _fetch_held(self, path: str, version: Version) -> int:
        """The pieces a hint held for `path` asks for (if one is), fetched for `version`; how many."""
        held = self.demand.take_hint(path)
        return self.prefetch(path, version, held) if held else 0

    def announce(self, path: str, version: Version, open_reader: bool = True) -> None:
        """This version of `path` was announced (a publish, a journal record, a copy's start)
        while its bytes are still on their way: open its store reader now (unless the caller
        reads the store itself), and fetch what a held hint asks for."""
        if open_reader:
            self.demand.prepare(path, version)
        n = self._fetch_held(path, version)
        if n:
            log.debug("read hint of %s held until its version was announced: %d pieces fetching", path, n)


def _close_reader(fut: Future) -> None:
    if not fut.cancelled() and fut.exception() is None:
        try:
            fut.result().close()
        except OSError:
            pass


__all__ = ["DemandReads", "ReadHints", "prefetch_pieces"]

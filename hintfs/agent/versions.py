"""Whether the store has the version a write-time stream was published as, by the store's own
word (docs/cross_dc.md, "Versions the store has"): journal records, else a batched stat.
`hintfs.agent.intake` makes a confirmed complete stream the replica and drops a refused one."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable

from cachetools import FIFOCache

from hintfs.agent.rpc import as_version
from hintfs.common.journal import ListingBudget, SliceListings, bucket_of, decode_name, removed_record

log = logging.getLogger("hintfs.streams")

KNOWN_KEPT = 65536     # store versions learned from the journal, remembered (LRU)
LISTS_IN_FLIGHT = 1    # journal listings of `VersionCheck` at once (two would list the same slice)
LIST_AFTER_PUBLISH_S = 2.0   # ... listed this long after each publish (the next file's is near)
IDLE_TICK_S = 0.5      # how often `VersionCheck` looks when nothing waits
STAT_WORKERS = 16      # store stats of one batch at once
EDGE_NS = 2 * 10**9    # the journal slice before now is listed too within this long of its end


class VersionCheck:
    """Whether the store has the version a stream was published as, by the store's own word,
    without a round trip per file where a journal is followed:

    - journal records: what the follower's rounds read (`learned`), and a listing of the
      journal's current time slice every `poll_s` (or as the listings' bytes allow:
      `journal.ListingBudget`) while a version waits or within LIST_AFTER_PUBLISH_S of a publish
      (a checkpoint's files close one after another: its commit marker follows its data files),
      at most LISTS_IN_FLIGHT at once. A record's name
      carries (path, size, mtime_ns), so one listing confirms every file the training mounts
      closed in that slice. An honest mount writes the record before it publishes the stream,
      and both cross the link once: a listing that reaches the store every `poll_s` sees the
      record about `poll_s` after the publish could have reached the tier (a listing sent
      only when the publish arrives would add a round trip);
    - a stat of the store file, for a version no record confirmed within `record_wait_s` of
      its publish (at once on a tier that follows no journal): the versions due are stat-ed
      together (STAT_WORKERS at a time), one round of round trips per batch, not one per file.

    `confirm(path, version, record)` and `refuse(path, version, why)` are the caller's (the
    agent: a confirmed complete stream becomes the replica, a refused one is dropped);
    `unconfirmed()` lists the published versions waiting (path, version, published at).
    One thread; stats and listings run in a small pool. Time comes from `clock` (monotonic) and
    `wall_ns` (the journal's slices are wall-clock time)."""

    def __init__(self, store, clock: Callable[[], float], confirm: Callable[[str, tuple[int, int], str | None], None],
                 refuse: Callable[[str, tuple[int, int], str], None],
                 unconfirmed: Callable[[], list[tuple[str, tuple[int, int], float]]],
                 journal_dir: str | None, record_wait_s: float, poll_s: float,
                 wall_ns: Callable[[], int] = time.time_ns, start: bool = True):
        self.store = store
        self.budget = ListingBudget()   # shared with the follower, which is given this check
        # what is known of the journal's recent slices (listed from their newest record; shared too)
        self.listings = SliceListings(store, journal_dir, self.budget) if journal_dir else None
        self.clock = clock
        self.wall_ns = wall_ns
        self._confirm, self._refuse, self._unconfirmed = confirm, refuse, unconfirmed
        self.journal_dir = journal_dir
        self.record_wait_s = record_wait_s if journal_dir else 0.0
        self.poll_s = poll_s
        # (a path noted again moves to the end; a lookup does not)
        self.known: FIFOCache[tuple[str, int, int], str | None] = FIFOCache(KNOWN_KEPT)
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._stat_due: dict[tuple[str, tuple[int, int]], float] = {}   # next stat of a version
        self._statting: set[tuple[str, tuple[int, int]]] = set()
        self._listing = 0
        self._next_list = 0.0
        self._last_publish = float("-inf")
        self.counts = {"by_record": 0, "by_stat": 0, "refused": 0, "stats": 0, "listings": 0}
        self.pool = ThreadPoolExecutor(STAT_WORKERS + LISTS_IN_FLIGHT, thread_name_prefix="hintfs-stream-verify")
        self.thread = threading.Thread(target=self._run, name="hintfs-stream-verify", daemon=True)
        if start:
            self.thread.start()

    # -- what the store said ---------------------------------------------------------------------
    def learned(self, entries) -> None:
        """Journal records (path, (size, mtime_ns), record name): the store has those versions."""
        with self.lock:
            for path, version, record in entries:
                key = (path, int(version[0]), int(version[1]))
                self.known[key] = record
        self.wake.set()

    def record_of(self, path: str, version: tuple[int, int]) -> tuple[bool, str | None]:
        """(whether a journal record says the store has `version` of `path`, that record)."""
        with self.lock:
            key = (path, int(version[0]), int(version[1]))
            return (key in self.known, self.known.get(key))

    def published(self) -> None:
        """A stream was published (a version may wait): look now, and list the journal often for
        LIST_AFTER_PUBLISH_S."""
        self._last_publish = self.clock()
        self.wake.set()

    def _busy(self, now: float, waiting: bool) -> bool:
        return waiting or now - self._last_publish < LIST_AFTER_PUBLISH_S

    # -- the thread ------------------------------------------------------------------------------
    def step(self) -> None:
        """One look: confirm what the journal confirms, stat what waited long enough, list the
        journal's current slice when due. (The thread calls it; tests may too.)"""
        now = self.clock()
        waiting = self._unconfirmed()
        due: list[tuple[str, tuple[int, int]]] = []
        for path, version, since in waiting:
            known, record = self.record_of(path, version)
            if known:
                self.counts["by_record"] += 1
                self._confirm(path, version, record)
                continue
            key = (path, as_version(version))
            with self.lock:
                if key in self._statting:
                    continue
                at = self._stat_due.get(key, since + self.record_wait_s)
                if now >= at:
                    self._statting.add(key)
                    self._stat_due[key] = now + max(self.record_wait_s, 1.0)   # a failed stat: again then
                    due.append(key)
        live = {(p, tuple(v)) for p, v, _t in waiting}
        with self.lock:
            for key in [k for k in self._stat_due if k not in live and k not in self._statting]:
                del self._stat_due[key]
        for key in due:
            self.pool.submit(self._stat, *key)
        if (self.journal_dir and now >= self._next_list and self._busy(now, bool(waiting))
                and self.budget.wait_s(now) == 0):
            with self.lock:
                go = self._listing < LISTS_IN_FLIGHT
                if go:
                    self._listing += 1
            if go:
                self._next_list = now + self.poll_s     # (and the budget's wait: `_list`)
                self.pool.submit(self._list)

    def _stat(self, path: str, version: tuple[int, int]) -> None:
        key = (path, version)
        try:
            self.counts["stats"] += 1
            try:
                st = self.store.stat(path)
            except FileNotFoundError:
                st = None
            except NotADirectoryError:
                st = None
            if st is not None and st.is_file and st.identity() == tuple(version):
                self.counts["by_stat"] += 1
                self._confirm(path, version, None)
            else:
                has = "no such file" if st is None else (
                    f"it has ({st.size}, {st.mtime_ns})" if st.is_file else "it is not a file there")
                self.counts["refused"] += 1
                self._refuse(path, version, f"the store does not have version ({version[0]}, {version[1]}) ({has})")
        except OSError as err:
            log.info("cannot check the version of stream %s against the store (will retry): %s", path, err)
        except Exception:
            log.exception("checking the version of stream %s failed", path)
        finally:
            with self.lock:
                self._statting.discard(key)

    def _list(self) -> None:
        try:
            journal_dir = self.journal_dir
            if not journal_dir:         # step lists only with a journal
                return
            now_ns = self.wall_ns()
            slices = {bucket_of(now_ns), bucket_of(now_ns - EDGE_NS)}
            found = []
            assert self.listings is not None
            for b in sorted(slices):
                # (charged to the budget: the next listing, ours or the follower's, waits)
                for n in self.listings.listing(b, self.clock()):
                    rec = decode_name(n)
                    if rec is not None and not removed_record(n):
                        found.append((rec["path"], (rec["size"], rec["mtime_ns"]), n))
            self.counts["listings"] += 1
            if found:
                self.learned(found)
        except Exception as err:   # a listing that fails: the next one, or the stat, will do
            log.debug("journal listing for stream versions failed: %s", err)
        finally:
            with self.lock:
                self._listing -= 1

    def _run(self) -> None:
        busy = False
        while not self._stop.is_set():
            self.wake.wait(max(0.002, min(self.poll_s, 0.05)) if busy else IDLE_TICK_S)
            self.wake.clear()
            if self._stop.is_set():
                return
            try:
                self.step()
                busy = self._busy(self.clock(), bool(self._statting) or bool(self._stat_due))
            except Exception:
                log.exception("stream version check failed")

    def status(self) -> dict:
        return {**self.counts, "known": len(self.known)}

    def close(self) -> None:
        self._stop.set()
        self.wake.set()
        self.pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["VersionCheck"]

"""Predictive checkpoint replication in an eval-side agent.

The agent follows the training side's closed-file journal in the (remote) store, or, without a
journal, the listing of the followed prefixes. Every new file under a followed prefix is queued
for copying at once (large ranged reads, many in flight); a checkpoint's commit marker (`.metadata`
for DCP) is copied last, after every other file of its folder, and then the checkpoint is complete.
The last `keep_last` complete checkpoints of each job folder are kept; older ones are dropped.

Nothing here waits for a copy on the polling thread: a round lists the journal, queues copies and
starts a finisher per new marker, and returns. Copy workers take the queue in priority order (files
of a job with an anomaly signal first, then oldest first), so an urgent checkpoint does not wait
behind a backlog before it even reaches the link scheduler. Finishers run concurrently, so one
checkpoint's marker never waits for another's.
"""
from __future__ import annotations

import errno
import logging
import posixpath
import resource
import threading
from concurrent.futures import ThreadPoolExecutor

from hintfs.agent.catalog import Catalog
from hintfs.agent.copier import Copier
from hintfs.agent.copyqueue import CopyQueue
from hintfs.agent.linkgate import LinkGate
from hintfs.common.paths import PathDict, PathSet
from hintfs.common.refusals import RefusalLog
from hintfs.agent.rpc import FollowStatus
from hintfs.agent.versions import VersionCheck
from hintfs.common.clock import SYSTEM_CLOCK, Clock
from hintfs.common.journal import (BUCKET_NS, MAX_RECORD_BYTES, TIMED, ListingBudget, SliceListings, bucket_of,
                            bucket_start_ns, decode_name, decode_record, journal_problem, list_folder, record_time_ns,
                            record_version, refusal, removed_record, slice_dir, version_refusal, Removals)
from mountconfig.schema import FollowConfig
from hintfs.stores.base import Stat, Store, walk_files

log = logging.getLogger("hintfs.follower")

COPY_WORKERS = 8          # files copied at once (each with `parallel` ranged reads in flight)
FINISH_WAIT_S = 600.0     # a finisher gives up (and is started again next round) after this
# Each poll lists the journal's slice folder of now (and the one before or after it within
# SLACK_NS of its edges: a record of the last moment, a writer's clock a little ahead), by name,
# from its newest record (`journal.SliceListings`); a sweep every SWEEP_S lists the journal folder
# itself (records of older mounts) and, whole, the current slices and those of the last
# SWEEP_BACK_NS (records that became visible late, clocks further off): an ended slice again
# once its age has doubled since its last whole listing (30, 60, 120, 240 s: each listed whole
# 4-5 times, not 10). The first poll lists every slice the retention kept.
SLACK_NS = 2 * 10**9
SWEEP_S = 30.0
SWEEP_BACK_NS = 300 * 10**9

class Follower:
    """Follows `cfg.prefixes` of `store`: copies by `copier` into `catalog`, drops what the store
    removed and what `keep_last` lets go, and tells the catalog which checkpoint folders eviction
    spares (`Catalog.keep`). `versions`: told the versions journal records say the store has
    (write-time streams wait for that word); `link`: whose signals put a job's copies first."""

    def __init__(self, cfg: FollowConfig, store: Store, catalog: Catalog, copier: Copier, *,
                 versions: VersionCheck | None = None, link: LinkGate | None = None,
                 clock: Clock = SYSTEM_CLOCK):
        self.cfg = cfg
        self.store = store
        self.catalog = catalog
        self.copier = copier
        self.versions = versions
        self.link = link
        self.clock = clock
        # record names seen, per slice folder of the journal ("" for records directly in it)
        self.seen_records: dict[str, set[str]] = {}
        self.swept_at: float | None = None     # monotonic time of the last sweep; None: never
        self.sweep_s = SWEEP_S
        # the agent's journal listings share one budget and what they know of the recent slices
        # (the version check's, when there is one)
        self.budget = versions.budget if versions is not None else ListingBudget()
        self.listings = (versions.listings if versions is not None and versions.listings is not None
                         and versions.journal_dir == cfg.journal_dir
                         else SliceListings(store, cfg.journal_dir or "", self.budget))
        self.swept_ages: dict[str, int] = {}   # slice -> its age (ns past its end) at its last whole listing
        # records of a journal version this agent does not read: one line a minute, with a count
        # (a newer training mount writes one per file: docs/versions.md)
        self.version_refusals = RefusalLog(60.0, keep=16)
        self.fd_refusals = RefusalLog(60.0, keep=1)   # copies refused for want of open files
        self._root_records: dict[str, Stat] = {}  # records of older mounts, at the last sweep
        # why the journal is not followed (the listing is, meanwhile), as of the last sweep
        self.journal_refused: str | None = None
        self.seen_files: dict[str, tuple[int, int]] = {}
        self.copied = PathSet()   # (by folder too, as `journaled`)
        # journaled version of each file, (size, mtime_ns), and the record that announced it
        # (by folder too: a round's removal records look only at the files under them)
        self.journaled: PathDict[tuple[tuple[int, int], str | None]] = PathDict()
        self.folder_files: dict[str, set[str]] = {}       # journaled files per folder
        self.queued = CopyQueue(self._job)                # files waiting for a copy
        self.running: set[str] = set()
        self.pending_markers: set[str] = set()
        self.finishing: set[str] = set()
        self.complete: dict[str, float] = {}      # checkpoint folder -> when it completed
        self.errors: dict[str, str] = {}
        self.removals = Removals()    # to tell a copy that failed because its file was removed
        self.cond = threading.Condition()
        self._stop = threading.Event()
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="hintfs-follow-io")
        self.finishers = ThreadPoolExecutor(max_workers=16, thread_name_prefix="hintfs-follow-marker")
        self.workers = [threading.Thread(target=self._work, name=f"hintfs-follow-copy-{i}", daemon=True)
                        for i in range(COPY_WORKERS)]
        self.thread = threading.Thread(target=self._run, name="hintfs-follower", daemon=True)

    def start(self) -> Follower:
        for w in self.workers:
            w.start()
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.finishers.shutdown(wait=False, cancel_futures=True)

    def _followed(self, path: str) -> bool:
        return any(path == p or path.startswith(p.rstrip("/") + "/") for p in self.cfg.prefixes)

    @staticmethod
    def _job(path: str) -> str:
        # The job is the checkpoint's parent folder: a signal for it promotes its copies.
        return posixpath.dirname(posixpath.dirname(path))

    # -- discovering new files -------------------------------------------------------------------
    def _folders_to_list(self) -> tuple[list[str], bool] | None:
        """The journal folders this poll lists: slice names, and "" for the journal folder's own
        records (older mounts'), and whether this poll is a sweep (its slices are listed whole);
        None if there is no journal. See SWEEP_S."""
        store = self.store
        now_ns = self.clock.time_ns()
        into = now_ns % BUCKET_NS
        recent = [bucket_of(now_ns - BUCKET_NS)] if into < SLACK_NS else []
        recent.append(bucket_of(now_ns))
        if BUCKET_NS - into < SLACK_NS:
            recent.append(bucket_of(now_ns + BUCKET_NS))
        if self.swept_at is not None and self.clock.monotonic() - self.swept_at < self.sweep_s:
            return None if self.journal_refused else (recent, False)
        try:
            entries = list(store.iter_dir(self.cfg.journal_dir))
            why = journal_problem(store, self.cfg.journal_dir, dict(entries))
        except FileNotFoundError:
            return None
        except OSError as err:    # (an agent whose user may not read the journal, a store error)
            why = f"cannot be read: {err}"
        if why:                   # not followed until a sweep finds it fit: the listing instead
            self.swept_at = self.clock.monotonic()
            if why != self.journal_refused:
                log.warning("journal %s not followed (the listing of %s is, meanwhile): %s",
                            self.cfg.journal_dir, ", ".join(self.cfg.prefixes), why)
            self.journal_refused = why
            return None
        if self.journal_refused:
            log.info("journal %s followed again", self.cfg.journal_dir)
            self.journal_refused = None
        self._root_records = {n: st for n, st in entries if not st.is_dir}
        self.budget.spent(self._root_records, self.clock.monotonic())
        back = bucket_of(now_ns - SWEEP_BACK_NS)
        if self.swept_at is None:      # the first poll: every slice the retention kept
            kept = [n for n, st in list_folder(store, f"{self.cfg.journal_dir}/{TIMED}")
                    if st.is_dir and bucket_start_ns(n) is not None]
        else:
            kept = [b for t in range(now_ns - SWEEP_BACK_NS, now_ns, BUCKET_NS)
                    if self._sweep_due(b := bucket_of(t), now_ns)]
        for b in kept:
            start = bucket_start_ns(b)
            if start is not None:
                self.swept_ages[b] = now_ns - start - BUCKET_NS
        self.swept_at = self.clock.monotonic()
        for b in list(self.seen_records):
            if b and b < back:
                del self.seen_records[b]   # never listed again
        for b in [b for b in self.swept_ages if b < back]:
            del self.swept_ages[b]
        return [""] + sorted(set(kept) | set(recent)), True

    def _sweep_due(self, bucket: str, now_ns: int) -> bool:
        """A sweep lists the slice `bucket` whole: it has not ended, was never listed whole after
        its end, or is twice as old as at its last whole listing."""
        start = bucket_start_ns(bucket)
        assert start is not None
        age = now_ns - start - BUCKET_NS
        last = self.swept_ages.get(bucket)
        return age < 0 or last is None or last < 0 or age >= 2 * last

    def _new_from_journal(self) -> list[tuple[str, tuple[int, int] | None, str | None]] | None:
        store = self.store
        to_list = self._folders_to_list()
        if to_list is None:
            return None
        folders, whole = to_list
        names: list[tuple[str, str]] = []      # (folder, record name)
        listed_st: dict[tuple[str, str], Stat] = {}

        def listing(folder: str) -> dict[str, Stat]:
            if not folder:
                return dict(self._root_records)
            return self.listings.listing(folder, self.clock.monotonic(), whole=whole)

        # (concurrently: each listing is a round trip on a long link)
        listings = list(self.pool.map(listing, folders) if len(folders) > 1 else map(listing, folders))
        for folder, listed in zip(folders, listings):
            seen = self.seen_records.get(folder, set()) & listed.keys()   # pruned records are gone: forget them
            new = [n for n in sorted(listed) if n not in seen and (n.endswith(".json") or n.endswith(".rec"))]
            if seen or new:
                self.seen_records[folder] = seen | set(new)
            else:
                self.seen_records.pop(folder, None)
            names.extend((folder, n) for n in new)
            listed_st.update(((folder, n), listed[n]) for n in new)
        # A record dated past the store's clock, in another time's folder, or too large is not
        # acted on (hintfs.common.journal.refusal): one line, once (its name is seen now).
        now_ns = self.clock.time_ns()
        accepted = []
        for key in names:
            why = refusal(key[1], listed_st[key], key[0] or None, now_ns)
            if why and version_refusal(record_version(key[1])):
                since = self.version_refusals.note(why)
                if since is not None:
                    log.warning("journal record %s refused: %s%s", key[1], why, RefusalLog.more(since))
            elif why:
                log.warning("journal record %s refused: %s", key[1], why)
            else:
                accepted.append(key)
        names = accepted
        records = {key: decode_name(key[1]) for key in names}

        def read(key: tuple[str, str]):
            folder, name = key
            rel = f"{slice_dir(self.cfg.journal_dir, folder) if folder else self.cfg.journal_dir}/{name}"
            try:
                reader, st = store.open_reader(rel)
                try:
                    return decode_record(reader.read(0, min(st.size, MAX_RECORD_BYTES + 1)))
                finally:
                    reader.close()
            except Exception as err:   # bounded parse (ValueError), the store's errors: never out of a round
                log.warning("journal record %s refused: %s", name, err)
                return None

        # Records whose name does not carry them are read concurrently (round trips overlap).
        unread = [n for n, r in records.items() if r is None]
        for n, r in zip(unread, self.pool.map(read, unread) if len(unread) > 1 else map(read, unread)):
            records[n] = r
        out: list[tuple[str, tuple[int, int] | None, str | None]] = []
        for key in sorted(names, key=lambda k: k[1]):   # record names sort by their time
            r = records[key]
            if r is not None and self._followed(r["path"]):
                out.append((r["path"], (r["size"], r["mtime_ns"]), key[1]))
        return out

    def _walk(self, rel: str):
        return walk_files(self.store, rel)

    def _new_from_listing(self) -> list[tuple[str, tuple[int, int] | None, str | None]]:
        new: list[tuple[str, tuple[int, int] | None, str | None]] = []
        listed: dict[str, tuple[int, int]] = {}   # only what is there now: deleted files are forgotten
        for prefix in self.cfg.prefixes:
            try:
                for path, st in self._walk(prefix.rstrip("/")):
                    listed[path] = st.identity()
                    if self.seen_files.get(path) != st.identity():
                        new.append((path, None, None))   # listing times may not match a stat's: stat it
            except FileNotFoundError:
                continue
        self.seen_files = listed
        return new

    # -- copying ---------------------------------------------------------------------------------
    def _enqueue(self, path: str) -> None:
        """Queue a copy (caller holds the lock)."""
        if path in self.copied or path in self.queued or path in self.running:
            return
        self.queued.add(path)
        self.cond.notify_all()

    def _urgent(self, path: str) -> bool:
        return self._signalled(self._job(path))

    def _signalled(self, job: str) -> bool:
        return self.link is not None and self.link.is_signalled(job)

    def _work(self) -> None:
        while not self._stop.is_set():
            with self.cond:
                while not self.queued and not self._stop.is_set():
                    self.cond.wait(0.5)
                if self._stop.is_set():
                    return
                path = self.queued.take(self._signalled)
                assert path is not None   # (not empty: checked above, under the same lock)
                self.running.add(path)
            try:
                self._copy(path)
            finally:
                with self.cond:
                    self.running.discard(path)
                    self._publish_kept()
                    self.cond.notify_all()

    def _copy(self, path: str) -> bool:
        expect, record = self.journaled.get(path, (None, None))
        try:
            done = self.copier.replicate(path, self.cfg.ttl_s, None, parallel=self.cfg.parallel, priority="eval",
                                         job=self._job(path), expect=expect, record=record)
            with self.cond:
                # (a removal this round may reach the agent after the copy: not copied either)
                if not done.removed and not self._removed_since(path, record):
                    self.copied.add(path)
                self.errors.pop(path, None)
            return True
        except Exception as err:   # FlightServerError/OSError: retried on the next round
            with self.cond:
                self.journaled.pop(path, None)
                if self._removed_since(path, record):
                    return False           # the store removed it: nothing to retry
                self.errors[path] = str(err)
                # The journaled version may be gone (rewritten): the retry stats the store.
            if isinstance(err, OSError) and err.errno == errno.EMFILE:
                self._out_of_files(path, err)
            else:
                log.warning("predictive copy of %s failed (will retry): %s", path, err)
            return False

    def _out_of_files(self, path: str, err: OSError) -> None:
        """A copy refused for want of open files. The replicas' fds take at most half the limit
        (`Catalog.max_open_fds`), the streams' a quarter; the rest (copies, connections, store
        readers) ran out. One error line a minute that says what to set, not a warning per copy
        (16,384-file checkpoints, when every replica kept an fd: 4,830 warnings; docs/operations.md)."""
        since = self.fd_refusals.note("EMFILE")
        if since is None:
            return
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        log.error("predictive copies fail: this agent is out of open files (limit %s; half of it for "
                  "replicas read lately, a quarter for streams) and retries them; raise LimitNOFILE / "
                  "ulimit -Hn, e.g. %s: %s%s",
                  soft, path, err.strerror or err, RefusalLog.more(since))

    def _removed_since(self, path: str, record: str | None) -> bool:
        """(under cond) A removal record of `path` or a folder above it is newer than `record`
        (any removal when the version copied had no record)."""
        made = record_time_ns(record) if record else None
        t = self.removals.newest(path)
        return t is not None and (made is None or made < t)

    def _forget(self, removals: list[tuple[str, int]]) -> None:
        """(under cond) A round's removal records: each path, a file or a folder, left the store
        at its time. Forget the files at and under them journaled before then (no copy, no wait
        for them at a checkpoint's completion, no retries); a removed commit marker takes its
        checkpoint off the complete list. The agent drops the replicas (`step`). One pass over
        the known files per round: a deleted checkpoint of thousands of files is thousands of
        records (one pass per record took 13 s for 4,096 records and 12,288 files)."""
        batch = self.removals.note_round(removals)

        def gone_by_now(p: str) -> bool:   # a file journaled after its removal was made again since
            t = batch.newest(p)
            if t is None:
                return False
            j = self.journaled.get(p)
            made = record_time_ns(j[1]) if j and j[1] else None
            return made is None or made <= t

        # The files known at or under the removed paths, found by folder (`PathDict`, `PathSet`):
        # not a pass over every file known (20 rounds a second while jobs delete old steps).
        # folder_files holds journaled files only.
        known = {q for path, _t in removals for q in (*self.journaled.under(path), *self.copied.under(path))}
        known |= set(self.queued) | set(self.errors) | self.pending_markers   # (the work in flight: few)
        gone = {p for p in known if gone_by_now(p)}
        for p in gone:
            self.journaled.pop(p, None)
            self.queued.discard(p)
            self.errors.pop(p, None)
            files = self.folder_files.get(posixpath.dirname(p))
            if files is not None:
                files.discard(p)
                if not files:
                    del self.folder_files[posixpath.dirname(p)]
            if p in self.pending_markers or posixpath.basename(p) == self.cfg.commit_marker:
                self.pending_markers.discard(p)
                self.complete.pop(posixpath.dirname(p), None)
        self.copied -= gone
        self.cond.notify_all()        # a finisher waiting for one of them goes on

    # -- completing checkpoints ------------------------------------------------------------------
    def _finish(self, marker: str, deadline: float) -> None:
        """Copy every other file of the marker's folder, then the marker: the checkpoint is complete.
        The folder is listed too, so a file that was closed without a journal record still counts."""
        folder = posixpath.dirname(marker)
        try:
            try:
                listed = {p for p, _st in self._walk(folder)}
            except FileNotFoundError:
                listed = set()
            with self.cond:
                files = (listed | self.folder_files.get(folder, set())) - {marker}
                for p in files:
                    self._enqueue(p)
                self._publish_kept()
                # a file removed since (a removal record of a later round) is not waited for
                while not all(self._removed_since(p, self.journaled.get(p, (None, None))[1])
                              for p in files - self.copied):   # (a set difference: woken per copy)
                    if self._stop.is_set() or self.clock.monotonic() > deadline:
                        return
                    self.cond.wait(0.5)
            if self._copy(marker):
                with self.cond:
                    self.pending_markers.discard(marker)
                    self.complete[folder] = self.clock.time()
                    self._publish_kept()
                log.info("checkpoint %s complete in the local tier", folder)
                self._keep_last(posixpath.dirname(folder))
        except Exception:
            log.exception("finishing checkpoint %s failed (will retry)", folder)
        finally:
            with self.cond:
                self.finishing.discard(marker)
                self.cond.notify_all()

    def _keep_last(self, job: str) -> None:
        with self.cond:
            done = sorted((t, f) for f, t in self.complete.items() if posixpath.dirname(f) == job)
            old = [f for _t, f in done[: max(0, len(done) - self.cfg.keep_last)]]
            if not old:
                return
            drop = [p for f in old for p in self.copied.under(f)]
            for f in old:
                del self.complete[f]
                self.folder_files.pop(f, None)
            for p in drop:
                self.copied.discard(p)
            # what the journal said of them too: kept, it grew with every file ever followed
            for p in [p for f in old for p in self.journaled.under(f)]:
                del self.journaled[p]
            self._publish_kept()
        for p in drop:
            self.catalog.drop(p)
        for f in old:
            log.info("checkpoint %s dropped from the local tier (keep_last=%d)", f, self.cfg.keep_last)

    # -- what eviction must respect (policy/tier.py) ----------------------------------------------
    def _publish_kept(self) -> None:
        """(under cond) Tell the catalog which checkpoint folders eviction spares: each job's newest
        complete one (the likely next eval), and those still being copied (evicting their files
        would stall their completion). Said again whenever either changes; never asked back."""
        newest: dict[str, tuple[float, str]] = {}
        for folder, t in self.complete.items():
            job = posixpath.dirname(folder)
            if job not in newest or t > newest[job][0]:
                newest[job] = (t, folder)
        pinned = {posixpath.dirname(m) for m in self.pending_markers} | self.queued.folders()
        pinned |= {posixpath.dirname(p) for p in self.running}
        self.catalog.keep(frozenset(f for _t, f in newest.values()), frozenset(pinned))

    # -- rounds ----------------------------------------------------------------------------------
    def step(self, wait: bool = False) -> None:
        """One round: learn of new files, queue their copies, start finishers for new markers.
        `wait` blocks until everything started is done (tests drive rounds this way)."""
        new = self._new_from_journal()
        if new is None:
            new = self._new_from_listing()
        elif self.versions is not None:   # the store's word for the versions of streams published here
            self.versions.learned([(p, v, r) for p, v, r in new if v is not None and not removed_record(r)])
        removals: list[tuple[str, int]] = []
        with self.cond:
            for path, version, record in new:
                if removed_record(record):
                    t = record_time_ns(record or "")
                    assert t is not None   # (a removal record is a record name)
                    removals.append((path, t))
                    continue
                if version is not None:
                    self.journaled[path] = (version, record)
                    if path in self.copied:        # a new version of a copied file
                        self.copied.discard(path)
                if posixpath.basename(path) == self.cfg.commit_marker:
                    self.pending_markers.add(path)
                else:
                    self.folder_files.setdefault(posixpath.dirname(path), set()).add(path)
                    self._enqueue(path)
            if removals:
                self._forget(removals)
            for path in list(self.errors):         # earlier failures, again
                if path not in self.pending_markers:
                    self._enqueue(path)
            start = sorted(self.pending_markers - self.finishing, key=lambda m: not self._urgent(m))
            self.finishing.update(start)
            self._publish_kept()
        if removals:                  # (the catalog's lock after ours, never inside it)
            self.catalog.removed_from_store(removals)
        # The wait is counted from the round that starts a finisher, not from whenever its thread
        # gets to run (a clock that moves meanwhile must not move its deadline).
        deadline = self.clock.monotonic() + FINISH_WAIT_S
        for marker in start:
            self.finishers.submit(self._finish, marker, deadline)
        if wait:
            self.drain()

    def drain(self, timeout_s: float = 120.0) -> bool:
        """Wait until no copy is queued or running and no finisher is working."""
        deadline = self.clock.monotonic() + timeout_s
        with self.cond:
            while self.queued or self.running or self.finishing:
                if self.clock.monotonic() > deadline:
                    return False
                self.cond.wait(0.05)
        return True

    def _run(self) -> None:
        # (no sooner than the agent's last listings allow: `journal.ListingBudget`)
        while not self._stop.wait(max(self.cfg.poll_interval_s, self.budget.wait_s(self.clock.monotonic()))):
            try:
                self.step()
            except Exception:
                if self._stop.is_set():   # stop() cancelled the round's listings: not a failure
                    return
                log.exception("follower round failed")

    def status(self) -> FollowStatus:
        with self.cond:
            return FollowStatus(complete=sorted(self.complete), complete_at=dict(self.complete),
                                copied=len(self.copied), queued=len(self.queued), copying=sorted(self.running),
                                pending_markers=sorted(self.pending_markers), errors=dict(self.errors))

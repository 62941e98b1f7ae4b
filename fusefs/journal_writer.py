"""The publish journal, writer side: one small record in the store per published file.

Followers in other datacenters list the journal folder instead of walking the store
(`hintfs.common.journal` has the record format, `hintfs.agent.follower` the reader, docs/cross_dc.md the
design). The filesystem calls `published` after each commit (`PublishJournal`); a record
that cannot be written is logged, never an error of the close: the file is published and
followers fall back to listing.

A folder renamed into place (a checkpoint saved to a temporary folder, then renamed) is a
folder of new files to followers: `folder_renamed` queues it, and `run`, beside the FUSE loop,
journals each file under it, so the rename itself costs no more than before.

Records name files, so on stores with owners and modes (file://) they are private to the
mount's user: before the first record the journal folder is made 0700 (`prepare_journal`: group
read kept where the operator gave it a group), each time folder is made with that mode and
each record chmod-ed 0600 (0640 with a group). A journal folder another user owns or may write
is refused (one log line, the `journal_records_refused` counter, checked again every
`RETRY_S`): no record goes into it. The files are published as ever.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from hintfs.common.journal import JournalRefused, encode_record, has_modes, prepare_journal, record_key, record_name
from fusefs import workers
from fusefs.stats import Stats
from hintfs.stores.base import Stat, Store, walk_files

log = logging.getLogger("hintfs.ops")

FOLDER_FILES_MAX = 10_000   # a renamed folder with more files is not journaled (logged, counted)
FOLDER_QUEUE = 64           # renamed folders waiting for `run`; past that, not journaled
FOLDER_PARALLEL = 4         # records of renamed folders written at once (the rest of io_limiter
                            # stays for the FUSE requests)
RETRY_S = 60.0              # a refused journal folder is checked again after this
_SLICES_KEPT = 8            # time folders this writer knows it made (one per 10 s)


class JournalWriter:
    def __init__(self, store: Store, journal_dir: str, stats: Stats, io_limiter: trio.CapacityLimiter):
        self.store = store
        self.dir = journal_dir
        self.stats = stats
        self.io_limiter = io_limiter   # the filesystem's: a record is one more store call
        self._folders_in, self._folders_out = trio.open_memory_channel[str](FOLDER_QUEUE)
        self._folder_limiter = trio.CapacityLimiter(FOLDER_PARALLEL)
        self._modes = has_modes(store)
        # (folder mode, record mode) once the journal folder is checked (`prepare_journal`)
        self._private: tuple[int, int] | None = None
        self._prepare_lock = trio.Lock()
        self._refused_until = 0.0
        self._refused_why: str | None = None
        self._slices: list[str] = []      # time folders made (or found) by this writer, newest last

    async def published(self, path: str, st: Stat, streamed: bool = False) -> str | None:
        """Write the record of `path` at version `st`; `streamed`: this mount streams the file to
        the eval tiers too (followers wait for the stream instead of copying). Its name, or None."""
        # (if it fails, the file is still published; followers fall back to listing)
        return await self._put(lambda: record_name(path, st.size, st.mtime_ns, streamed), path, st.size, st.mtime_ns,
                               "journal_records")

    async def removed(self, path: str) -> None:
        """Write the record that `path` is gone from the store (unlinked, or renamed away): eval
        tiers drop what they hold of it. A failure is logged; the tier then keeps serving the old
        bytes until its TTL or `keep_last` drops them, as before removal records existed."""
        await self._put(lambda: record_name(path, removed=True), path, 0, 0, "journal_removals")

    def folder_renamed(self, path: str) -> None:
        """(trio loop) The folder `path` was renamed into place: `run` journals every file under
        it as published now. A full queue is logged: followers then learn of those files only
        by a read that fetches them, as before folder records existed."""
        try:
            self._folders_in.send_nowait(path)
        except trio.WouldBlock:
            log.warning("journal: %d renamed folders already queued; %s is not journaled", FOLDER_QUEUE, path)
            self.stats.add("journal_folders_skipped")

    async def run(self) -> None:
        """Beside the FUSE loop: journal the files of each renamed folder, in the order renamed."""
        async for folder in self._folders_out:
            try:
                files = await workers.run_sync(self._files_under, folder, limiter=self.io_limiter)
            except OSError as err:    # renamed or removed again since: its new name has its own turn
                log.info("journal: renamed folder %s not listed: %s", folder, err)
                continue
            except Exception:         # never the mount's end: this task runs beside the FUSE loop
                log.exception("journal: renamed folder %s not listed", folder)
                continue
            if files is None:
                log.warning("journal: renamed folder %s holds more than %d files; not journaled", folder,
                            FOLDER_FILES_MAX)
                self.stats.add("journal_folders_skipped")
                continue
            async with trio.open_nursery() as nursery:
                for path, st in files:
                    nursery.start_soon(self._folder_file, path, st)
            self.stats.add("journal_folders")

    async def _folder_file(self, path: str, st: Stat) -> None:
        async with self._folder_limiter:
            try:
                await self.published(path, st)
            except Exception:   # (OSError is logged inside): never the mount's end, as in `run`
                log.exception("journal record for %s (a renamed folder's file) failed", path)

    def _files_under(self, folder: str) -> list[tuple[str, Stat]] | None:
        """(thread) Every regular file under `folder` with its store stat (the version a close
        would journal); None past FOLDER_FILES_MAX. Files gone while listing are left out."""
        files: list[tuple[str, Stat]] = []
        for path, _listed in walk_files(self.store, folder):
            if len(files) == FOLDER_FILES_MAX:
                return None
            try:
                files.append((path, self.store.stat(path)))
            except FileNotFoundError:
                continue
        return files

    async def _ready(self) -> bool:
        """The journal folder is checked and private (`prepare_journal`, once; again every
        RETRY_S while refused). A refusal is logged once per reason."""
        if self._private is not None:
            return True
        async with self._prepare_lock:
            if self._private is not None:
                return True
            if time.monotonic() < self._refused_until:
                return False
            try:
                self._private = await workers.run_sync(prepare_journal, self.store, self.dir,
                                                       limiter=self.io_limiter)
            except JournalRefused as err:
                self._refused_until = time.monotonic() + RETRY_S
                if err.strerror != self._refused_why:
                    self._refused_why = err.strerror
                    log.warning("journal: not writing records into %s: %s (records would name files to that "
                                "user, who could also forge them); files are published as usual, followers "
                                "fall back to listing", self.dir, err.strerror)
                return False
            except OSError as err:   # the store failed: tried again at the next record
                log.warning("journal folder %s not ready: %s", self.dir, err)
                return False
            if self._refused_why is not None:
                log.info("journal: %s is private now; writing records again", self.dir)
                self._refused_why = None
            return True

    def _write(self, named: Callable[[], str], data: bytes) -> str:
        """(thread) The record `named()` (its time: now, when the PUT is about to be made, so that
        records become visible in about the order of their names: readers list a slice from its
        newest name, `journal.SliceListings`), in a time folder of the journal's mode, 0600
        itself. Its name."""
        assert self._private is not None
        name = named()
        key = f"{self.dir}/{record_key(name)}"
        folder_mode, record_mode = self._private
        if self._modes:
            folder = key.rpartition("/")[0]
            if folder not in self._slices:
                try:
                    self.store.mkdir(folder, folder_mode)
                except FileExistsError:
                    pass
                self._slices = (self._slices + [folder])[-_SLICES_KEPT:]
        self.store.put_small(key, data)
        if self._modes:
            try:
                self.store.chmod(key, record_mode)
            except OSError as err:    # (written, in a private folder: followers may use it)
                log.warning("journal record %s left at its created mode: %s", key, err)
        return name

    async def _put(self, named: Callable[[], str], path: str, size: int, mtime_ns: int, counter: str) -> str | None:
        """Write the record `named()` of `path`; counted in `counter` when written, logged when not.
        Its name, or None."""
        if not await self._ready():
            self.stats.add("journal_records_refused")
            return None
        try:
            name = await workers.run_sync(self._write, named, encode_record(path, size, mtime_ns),
                                          limiter=self.io_limiter)
        except OSError as err:
            log.warning("journal record for %s failed: %s", path, err)
            return None
        self.stats.add(counter)
        return name


__all__ = ["JournalWriter"]

"""The filesystem's semantics over a `Store`, with no FUSE binding (tests drive it directly).

Every method answers one FUSE request; `fusefs/fuse.py` converts arguments and results and turns
exceptions into errnos for the kernel: `Refused(errno, reason)` is an expected answer (counted,
not logged), any other `OSError` is counted and logged, anything else is EIO. Results are the
plain types of `fusefs/attrs.py`. Request contexts (`ctx.uid/gid/pid/umask`) and setattr's
`attr`/`fields` are duck-typed.

Concurrency: the FUSE binding runs every handler as a trio task on one thread. A handler never blocks
that thread: store calls that may block go to worker threads (`io`), bounded by a
CapacityLimiter; only page-cache hits (`read_nowait`) and local metadata syscalls of a
`file://` store run inline. docs/concurrency.md has the rules, docs/semantics.md the
consistency model this implements.

What a handle does is chosen at open (`fusefs/handles.py`); replicas, tensors, cross-DC routes
and the journal are collaborators behind the interfaces of `fusefs/interfaces.py`, assembled by
`fusefs/mount.py`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fnmatch
import itertools
import logging
import os
import re
import stat as stat_mod
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import trio

from hintfs.common import access, paths
from hintfs.common.errors import HintfsError
from fusefs.attrs import (BLOCK_SIZE, RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INODE, Attributes, FsStats, OpenFile,
                          Refused)
from fusefs.control import Caller, ControlDir, ControlFile
from fusefs import workers
from fusefs.walks import Walks
from fusefs.fastpath import (CHECKED_NAMES_MAX, CHECKED_NAMES_S, MARK_SWEEP_CHUNK, FastBackend, FastNames, FastPath, FetchAhead,
                             ReadFolders, fast_eligible, mark_limit)
from fusefs.handles import (ControlDirHandle, ControlHandle, DirHandle, Handle, HandleKind, OpenFacts, PassthroughRead,
                            PassthroughWrite, Reply, ReplyNames, StagingRead, StoreRead, TensorHandle, WriteHandle, choose_handle)
from fusefs.inodes import Inode, InodeTable
from fusefs.listings import Listings
from fusefs.interfaces import KernelNotices, ListingEnds, PublishJournal, Source, StreamHooks, TensorSource
from fusefs.passthrough import Backing, HeldFd, Passthrough, backing_key
from fusefs.readpath import ReadPath, source_of
from fusefs.stats import Stats
from mountconfig.schema import CacheConfig, MountOptions
from hintfs.stores.base import Reader, Stat, StatxDirFactory, Store

log = logging.getLogger("hintfs.ops")


def _umask(ctx) -> int:
    return getattr(ctx, "umask", 0) if ctx is not None else 0


def _futimens(fd: int, atime_ns: int, mtime_ns: int) -> None:
    os.utime(fd, ns=(atime_ns, mtime_ns))


def fuse_device_of(mountpoint: str) -> int:
    """The st_dev of the FUSE mount at `mountpoint`, from /proc/self/mountinfo (a stat of the
    mountpoint would ask this very daemon); 0 if not found."""
    want = os.fsencode(os.path.abspath(mountpoint))   # no realpath: it would stat the mountpoint
    dev = 0
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4])
            if point == want:
                major, minor = fields[2].split(b":")
                dev = os.makedev(int(major), int(minor))   # the last one mounted there wins
    return dev


_CONTROL_KEY = "\0control"  # prefix of control inode keys; cannot collide with a store path


@dataclasses.dataclass(slots=True)
class _Seen:
    """What `Filesystem._see` found for one open (the impure half of `fusefs.handles.OpenFacts`)."""
    writing: bool
    shared: bool = False              # passthrough opens of the inode were active
    writer: bool = False              # a writer had the file open
    keep_cache: bool = True
    reader: Reader | None = None   # a read of a store file: its reader and attributes
    st: Stat | None = None
    source: Source = Source.STORE
    local_fd: int = -1                # the fd a passthrough open would hand the kernel
    space_ok: bool = True


# Lookups answered inside pyfuse3 (`FastNames`): a folder of more names is not registered (its
# lookups are answered from its kept listing in Python, as before), and the entries of one are
# made this many at a time, the event loop free between.
FAST_NAMES_MAX = 20_000
NAME_CHUNK = 512
# Files of a folder marked ahead for the fast path (`_open_ahead`) at a time, the loop free between
# (~15 µs each here).
AHEAD_CHUNK = 64
# A local store's folder listed for lookups: entries read on the loop at a time (~3 µs each).
LIST_CHUNK = 256
# An object store's small objects fetched ahead (`_fetch_ahead`): opened in one worker-thread call
# at a time (one GET each, then kept in the host cache), and such calls at once.
FETCH_AHEAD_CHUNK = 16
FETCH_AHEAD_CALLS = 8


def _open_each(store: Store, rels: list[str], stop: threading.Event) -> list:
    """Each of `rels` opened for reading (`Store.open_reader`: an object store's small object is
    read whole and kept in the host cache), in one worker thread: (reader, stat) or the error;
    the first ones only once `stop` is set (the request was cancelled: an unmount)."""
    out: list = []
    for rel in rels:
        if stop.is_set():
            break
        try:
            out.append(store.open_reader(rel))
        except Exception as err:   # (each file's own: the others are still opened)
            out.append(err)
    return out


def _list_all(store: Store, folder: str, most: int) -> list[tuple[str, Stat]]:
    """A folder's listing, at most `most` names, in a worker thread (a local store's off-loop
    listing)."""
    in_thread = getattr(store, "iter_dir_in_thread", None)
    entries = (in_thread or store.iter_dir)(folder)
    try:
        return list(itertools.islice(entries, most))
    finally:
        close = getattr(entries, "close", None)
        if close is not None:
            close()


class Filesystem:
    """Collaborators, each optional, all given here (`fusefs/mount.py` builds them): the mount
    options and the kernel cache settings it uses, the control files' root, where an open's reads
    come from (`reads`), `.tensor` files, the journal, the write-time streams, the limiter of
    store calls in worker threads and what it tells the kernel outside replies (`kernel`)."""

    def __init__(self, store: Store, *, options: MountOptions | None = None, cache: CacheConfig | None = None,
                 journal_dir: str = paths.JOURNAL_DIR, stats: Stats | None = None,
                 control_root: ControlDir | None = None,
                 reads: ReadPath | None = None,
                 tensors: TensorSource | None = None,
                 journal: PublishJournal | None = None,
                 streams: StreamHooks | None = None,
                 io_limiter: trio.CapacityLimiter | None = None,
                 kernel: KernelNotices | None = None):
        options = options or MountOptions()
        cache = cache or CacheConfig()
        self.store = store
        self.stats = stats or Stats()
        self.reads = reads or ReadPath(self.stats)   # routes and replicas: where reads come from
        self.tensors = tensors               # `x.mp4.tensor` paths
        self.journal = journal               # a record per published file, for followers
        self.streams = streams               # training side: files sent to eval tiers as written
        self.io_limiter = io_limiter or trio.CapacityLimiter(options.io_threads)
        self.meta_inline = store.inline_metadata
        self.journal_dir = journal_dir
        self.inodes = InodeTable()
        self.handles: dict[int, Handle] = {}
        self._fh = itertools.count(1)
        self._attr_timeout = cache.attr_timeout_s
        self._entry_timeout = cache.entry_timeout_s
        self._immutable = list(cache.immutable_globs)
        self._immutable_timeout = cache.immutable_timeout_s
        # The globs as one regular expression (fnmatchcase's meaning): asked for every entry a
        # listing replies, where a loop of fnmatch calls cost more than the rest of the entry.
        self._immutable_match = (re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in self._immutable)).match
                                 if self._immutable else None)
        self.max_entries = cache.max_entries
        self.listings = Listings(cache.max_entries, quiet_s=cache.relist_quiet_s)   # (fusefs/listings.py)
        self.stats.kept_listings = self.listings.snapshot
        # Listings may give files by name only (a readdirplus entry with nodeid 0): set by the
        # mount where pyfuse3 has patches/pyfuse3-readdir.patch; to whom: `fusefs.walks`.
        self.names_listings = False
        self.walks = Walks()
        self.readdir_page = options.readdir_page
        self.control_root = control_root or ControlDir(paths.CONTROL_DIR)
        self._control_inodes: dict[int, Inode] = {}
        self._control_ino_of: dict[int, int] = {}   # id(node) -> ino
        self.control_inode(self.control_root)
        self.own_dev = 0
        # Names the kernel must forget (fusefs.fuse.KernelNotices); none without a kernel.
        self.kernel = kernel
        # Inodes published in place whose name a new open took since, by that name
        # (`_renew(still_named=True)`, `_end_still_named`)
        self._named_still: dict[str, list[Inode]] = {}
        # listings the FUSE binding finishes (`readdir`); set at FUSE init where pyfuse3 can
        self.listing_ends: ListingEnds | None = None
        # Folders whose listing the kernel may keep (opened with FOPEN_CACHE_DIR): a file published
        # in one later is a name that listing lacks (`_published` tells the kernel).
        self._kernel_listed: set[int] = set()
        # Such folders a file was published in since (inode -> when, ns): the kernel keeps an empty
        # listing whatever drops its pages, and lists again only for a new mtime of the folder,
        # which a store's folder may not have of its own (S3's): `getattr` gives at least this one.
        self._listing_changed: dict[int, int] = {}
        self._root_daemon = os.geteuid() == 0
        # FUSE passthrough: on at FUSE init when the kernel granted it (`set_passthrough`).
        self.pt = Passthrough(self.stats, options.passthrough_min_free_mb << 20)
        # The fast path (fusefs/fastpath.py): on with passthrough where pyfuse3 has it.
        self.fast = FastPath(mark_limit(options.fast_path_inodes), self._let_go, self._adopt_lazy,
                             self.inodes.release_open)
        # Marks of paths not declared immutable, each open checked by pyfuse3 (`_fast_mark`): where
        # the store can say how (a local store) and pyfuse3 can check (`set_passthrough`).
        self._checked_marks = options.fast_checked_opens and hasattr(store, "same_file_check")
        self.stats.fast_path = self.fast.snapshot
        # Lookups of kept folders' names answered in pyfuse3 (fusefs/fastpath.py): set at FUSE init.
        self.names = FastNames(self._unname, options.fast_lookups, share=self.max_entries // 2)
        self.open_ahead = options.fast_opens_ahead   # (`_open_ahead`: after this many first opens; 0: never)
        # An object store's small objects fetched ahead of their opens (`_fetch_ahead`): the sizes
        # an open reads whole (ArrowStore's `whole_bytes`: one GET) and its host cache keeps (none
        # without one), and the bytes one folder's fetch may take (a quarter of the cache's budget).
        whole = getattr(store, "whole_bytes", 0) if not self.meta_inline else 0
        self._ahead_sizes = (max(1, getattr(store, "min_bytes", 1)), min(whole, getattr(store, "max_bytes", 0)),
                             getattr(store, "budget", 0) // 4)
        self.ahead = FetchAhead(self.open_ahead)
        self.reading = ReadFolders(self.open_ahead)   # (`_mark_at_lookup`)
        self.stats.fast_lookups = self.names.snapshot
        self.listings.on_drop = self.names.drop
        if self.reads.replicas is not None:   # a hint's first replica of a path: reads go there now
            self.reads.replicas.router.routed = lambda path: self._fast_off(self.inodes.by_path_get(path))

    # -- passthrough ------------------------------------------------------------------------------
    def passthrough_capable(self) -> bool:
        """Whether this store's files can be backing files (a file:// store seen without routes)."""
        return self.store.passthrough_capable

    def set_passthrough(self, result: tuple[Backing | None, str], fast: FastBackend | None = None) -> None:
        """At FUSE init: passthrough on (a backend) or off (None), and why (`fusefs.fuse`); the
        fast path's table where pyfuse3 has one (used only with passthrough on)."""
        self.pt.set(result)
        self.fast.backend = fast if result[0] is not None else None
        self._checked_marks = self._checked_marks and fast is not None and fast.checks

    def _fast_mark(self, node: Inode, kind: HandleKind, backing_id: int, st: Stat | None, uid: int) -> bool:
        """Mark `node` for the fast path if this open of it (`kind`, `backing_id`) may
        (`_fast_markable`), held as one more passthrough open, with the attributes its GETATTRs get
        meanwhile (fusefs/fastpath.py); whether it was."""
        got = self._fast_markable(node, kind, st)
        if got is None or st is None:
            return False
        self.pt.attach(node, -1, None)    # (shares the backing id this open just got)
        node.opens += 1
        self._mark_held(node, backing_id, st, uid, False, *got)
        return node.ino in self.fast

    def _fast_markable(self, node: Inode, kind: HandleKind, st: Stat | None) -> tuple[float, tuple | None] | None:
        """Whether an open of `node` that got `kind` and saw `st` may mark it (`fast_eligible`):
        (its immutable timeout, or 0, and the check pyfuse3 makes at each open: a path not declared
        immutable), else None."""
        if self.fast.draining:
            self.fast.settle()
        ttl = self.immutable(node.path)   # (an eligible path's timeouts, for `attrs`: matched once)
        check = None
        if not ttl and self._checked_marks and st is not None:   # (close-to-open made by pyfuse3)
            check = self.store.same_file_check(node.path, st)   # type: ignore[attr-defined]
        if node.ino in self.fast or node.changing or st is None or not fast_eligible(
                kind, ttl > 0, check is not None,
                self.reads.routes is not None and self.reads.routes.routes_path(node.path), node.unlinked):
            return None
        return ttl, check

    def _mark_held(self, node: Inode, backing_id: int, st: Stat, uid: int, ahead: bool, ttl: float,
                   check: tuple | None) -> None:
        """The mark of `node` (`_fast_markable` said it may be), holding one passthrough open of it
        that the caller took; a table with no place lets that hold go (`FastPath.mark`). `ahead`
        (`_mark_ahead`): a full table gives up only `uid`'s own oldest marks for it."""
        # (a checked mark's GETATTRs stay Python's: its attributes may change in place)
        self.fast.mark(node, backing_id, self.attrs(node, st, (ttl, ttl)) if ttl else None, uid, own=ahead,
                       check=check)

    async def _open_ahead(self, folder: str, uid: int) -> None:
        """A reader is going through `folder`, whose names pyfuse3 answers (`FastNames.opened`):
        mark its other registered files for the fast path now, as their own first opens would
        (`_mark_seen`, as `_mark_ahead`), so that those opens and their releases are answered in pyfuse3 too. In
        the table's free places, then in place of `uid`'s own oldest marks (a reader going through
        more files than the table holds: those it read before), never another user's; at most as
        many as were free or the user's when it started, so that these never give up each other.
        AHEAD_CHUNK at a time with the loop free between; it stops when the folder's names go (a
        change in it, the listing gone). A system task: it never fails the mount."""
        got = self.names.folders.get(folder)
        if got is None:
            return
        marked = 0
        budget = self.fast.room_for(uid)
        # (a local store opens a chunk's files in one call: the folder resolved beneath its root
        # once, `LocalStore.open_readers_in`; another store each by its path, `_open_each`; what
        # each open then sees is `_seen_open`'s, as for the open of `_see`, which a node
        # `_markable_ahead` goes straight to)
        open_in = getattr(self.store, "open_readers_in", None)
        try:
            left = iter(list(got[1]))   # (its inodes named)
            for first in itertools.count():
                if first:
                    await trio.sleep(0)
                    if self.names.folders.get(folder) is not got:
                        break
                if marked >= budget or not self.fast.on:
                    break
                chunk = list(itertools.islice((n for n in left if n.fast_named and self._markable_ahead(n)
                                               and n.path.rpartition("/")[0] == folder),
                                              min(AHEAD_CHUNK, budget - marked)))
                if not chunk:
                    break
                try:
                    opened = (open_in(folder, [n.path.rpartition("/")[2] for n in chunk]) if open_in is not None
                              else _open_each(self.store, [n.path for n in chunk], threading.Event()))
                except OSError as err:   # (the folder itself: gone, or now leading out of the store)
                    log.debug("the files of %r not marked ahead: %s", folder, err)
                    break
                for i, (node, got_open) in enumerate(zip(chunk, opened)):
                    try:
                        if isinstance(got_open, BaseException):
                            log.debug("%s not marked ahead: %s", node.path, got_open)
                        elif not self.fast.on or not self._markable_ahead(node):
                            got_open[0].close()
                        else:
                            marked += await self._mark_seen(node, await self._seen_open(node, *got_open), uid)
                    except (Refused, OSError) as err:   # (its own open would have met the same)
                        log.debug("%s not marked ahead: %s", node.path, err)
                    except BaseException:   # (the readers not yet used are closed)
                        for rest in opened[i + 1:]:
                            if not isinstance(rest, BaseException):
                                rest[0].close()
                        raise
        except Exception:   # (a system task's error would end the mount: opens go to Python)
            log.exception("marking the files of %r ahead failed", folder)
        self.fast.counts["marked_ahead"] += marked

    async def _fetch_ahead(self, folder: str, uid: int) -> None:
        """A reader is going through `folder` of an object store with a host cache (its
        `fast_opens_ahead`-th small object opened and marked, `FetchAhead.opened`): its other small
        objects (`_ahead_sizes`) that the kernel knows, in the listing's order, are opened now
        as their own first opens would open them (one GET each, the copy kept in the host cache)
        and marked for the fast path (`_mark_opened`), so that their opens and releases are
        answered in pyfuse3. FETCH_AHEAD_CHUNK objects per worker-thread call, FETCH_AHEAD_CALLS
        calls at once; as many as `_open_ahead` would mark (`FastPath.room_for`), a quarter of the
        host cache's budget in bytes at most, never past a change in the folder. An open of an object being fetched waits for it and shares it
        (`FetchAhead.fetching`). A system task: it never fails the mount."""
        listing = self.listings.folder(folder)
        if listing is None:
            return
        prefix = folder + "/" if folder else ""
        budget = self.fast.room_for(uid)
        smallest, largest, room = self._ahead_sizes
        nodes: list[Inode] = []
        for name, st in listing.items():
            if len(nodes) >= budget:
                break
            if st is None or not st.is_file or not smallest <= st.size <= largest:
                continue
            node = self.inodes.by_path_get(prefix + name)
            if node is not None and self._ahead_ok(node):
                room -= st.size
                if room < 0:
                    break
                nodes.append(node)
        chunks = [nodes[i:i + FETCH_AHEAD_CHUNK] for i in range(0, len(nodes), FETCH_AHEAD_CHUNK)]
        chunks.reverse()
        marked = 0

        async def fetch_chunks() -> None:
            nonlocal marked
            while chunks and self.fast.on and self.listings.folder(folder) is listing:
                chunk = [n for n in chunks.pop() if self._ahead_ok(n) and n.ino not in self.ahead.fetching]
                if not chunk:
                    continue
                for n in chunk:
                    self.ahead.fetching[n.ino] = trio.Event()
                stop = threading.Event()
                try:
                    opened = await workers.run_sync(_open_each, self.store, [n.path for n in chunk], stop,
                                                    limiter=self.io_limiter, on_cancel=stop.set)
                    done = 0
                    try:
                        for node, got in zip(chunk, opened):
                            done += 1
                            if isinstance(got, BaseException):
                                log.debug("%s not fetched ahead: %s", node.path, got)
                                continue
                            try:
                                marked += await self._mark_opened(node, got[0], got[1], uid)
                            except (Refused, OSError) as err:   # (its own open would have met the same)
                                log.debug("%s not marked ahead: %s", node.path, err)
                    finally:   # (cancelled meanwhile: the readers not marked are closed)
                        for got in opened[done:]:
                            if not isinstance(got, BaseException):
                                got[0].close()
                finally:
                    for n in chunk:
                        self.ahead.fetching.pop(n.ino).set()

        try:
            async with trio.open_nursery() as nursery:
                for _ in range(FETCH_AHEAD_CALLS):
                    nursery.start_soon(fetch_chunks)
        except Exception:   # (a system task's error would end the mount: opens go to Python)
            log.exception("fetching the files of %r ahead failed", folder)
        self.fast.counts["fetched_ahead"] += marked

    def _markable_ahead(self, node: Inode) -> bool:
        """Whether `node` may be marked ahead of its open now (`_open_ahead`, `_fetch_ahead`): still
        the table's, no handle, mark, writer or pending write open, not unlinked, not routed (a
        routed path is never marked, `fast_eligible`: its open may read elsewhere)."""
        routes = self.reads.routes
        return not (node.ino in self.fast or node.opens or node.writer is not None or node.writers_pending
                    or node.changing or node.unlinked or self.inodes.get(node.ino) is not node
                    or (routes is not None and routes.routes_path(node.path)))

    def _ahead_ok(self, node: Inode) -> bool:
        """`_markable_ahead`, of an inode the kernel knows (a mark of one it does not know could never
        be used): what `_fetch_ahead` may mark."""
        return node.lookups > 0 and self._markable_ahead(node)

    async def _mark_at_lookup(self, node: Inode, st: Stat, uid: int) -> None:
        """A lookup of a plain file in a folder a reader is going through (`ReadFolders`: its files
        got checked marks at their first opens): the file is marked now, as its own first open
        would mark it (`_mark_ahead`: the same open, the same check; or a lazy mark, pyfuse3 making
        that open, with the check of the file the lookup found, `st`), so that the open that
        follows, and its release, are answered in pyfuse3. In the table's free places or in place
        of `uid`'s own oldest marks, never another user's. Any failure leaves it to that open."""
        if not self.fast.on or self.fast.room_for(uid) <= 0 or not self._markable_ahead(node):
            return
        if self._marks_lazily():
            check = self.store.same_file_check(node.path, st)   # type: ignore[attr-defined]
            if check is not None and self._lazy_markable(node, check):
                self.fast.counts["marked_at_lookup"] += self.fast.mark_lazy([(node, check)], uid)
            return
        try:
            if await self._mark_ahead(node, uid):
                self.fast.counts["marked_at_lookup"] += 1
        except (Refused, OSError) as err:
            log.debug("%s not marked at its lookup: %s", node.path, err)

    async def _mark_opened(self, node: Inode, reader: Reader, st: Stat, uid: int) -> bool:
        """`_mark_ahead` for a file opened ahead (`_fetch_ahead`): what its open sees with that
        store file (`_seen_open`), if it may still be marked now."""
        if not self._ahead_ok(node):
            reader.close()
            return False
        seen = await self._seen_open(node, reader, st)
        if seen.reader is None or not self._ahead_ok(node):
            if seen.reader is not None:
                seen.reader.close()
            return False
        return await self._mark_seen(node, seen, uid)

    async def _mark_ahead(self, node: Inode, uid: int) -> bool:
        """What a read-only open of `node` would do, up to its mark, without the open: its
        close-to-open check, the handle kind (`choose_handle`), the backing id and the mark
        (`_fast_markable`), which keeps that open as its hold (no handle is kept)."""
        return await self._mark_seen(node, await self._see(node, os.O_RDONLY), uid)

    async def _mark_seen(self, node: Inode, seen: _Seen, uid: int) -> bool:
        kind = self._kind(node, seen)
        if kind is HandleKind.CONTROL or kind is HandleKind.TENSOR:   # (never a named file)
            return False
        handle, backing_id = self._make(kind, node, seen)
        node.opens += 1
        got = self._fast_markable(node, kind, seen.st) if backing_id else None
        if got is None:
            await handle.release(self)
            return False
        # The mark takes this open as its hold: the handle (a PassthroughRead, whose release would
        # only let that hold go) is not kept.
        assert isinstance(handle, PassthroughRead) and seen.st is not None
        self._mark_held(node, backing_id, seen.st, uid, True, *got)
        return node.ino in self.fast

    async def let_go_removed_marks(self) -> int:
        """A mark holds its file open (fusefs/fastpath.py): once the store no longer has that file
        (its last name removed or replaced outside this mount, or a host cache's copy evicted: no
        link left, `st_nlink` 0 through the fd the mark holds), the mark goes, so the file is not
        kept allocated past this pass (`MARK_SWEEP_S` apart: `fast_sweep`). Its
        next open, if any, is Python's. How many went."""
        if self.fast.draining:
            self.fast.settle()
        self.fast.take_opened()   # (a lazy mark pyfuse3 opened holds its fd here from now on)
        gone = 0
        for i, (ino, (node, _uid)) in enumerate(list(self.fast.marked.items())):
            if i and i % MARK_SWEEP_CHUNK == 0:
                await trio.sleep(0)
            got = self.fast.marked.get(ino)
            fd = getattr(node.pt_reader, "fd", -1)
            if got is None or got[0] is not node or fd < 0:
                continue
            try:
                removed = os.fstat(fd).st_nlink == 0
            except OSError:
                removed = True
            if removed:
                self.fast.unmark(node)
                gone += 1
        self.fast.counts["let_go_removed"] += gone
        return gone

    def _let_go(self, node: Inode) -> None:
        """The open a fast-path mark held is released (as `PassthroughRead.release`)."""
        self.pt.detach(node)
        self.inodes.release_open(node)

    def _fast_off(self, node: Inode | None) -> None:
        """`node` changes through this mount (a write open or create, a truncate or setattr, a
        link, rename or unlink) or its reads go elsewhere (a hint's first replica): no more fast
        opens or GETATTRs of it; the open its mark holds goes once the fast opens C served are
        released (fusefs/fastpath.py). Its folder's names are no longer answered in pyfuse3.
        A change whose store calls let the loop run meanwhile goes through `_changing`."""
        if node is None:
            return
        if node.ino in self.fast:
            self.fast.unmark(node)
        self.names.drop(node.path.rpartition("/")[0])

    @contextlib.contextmanager
    def _changing(self, *nodes: Inode | None) -> Iterator[None]:
        """`nodes` change through this mount (an unlink, a rename, a link, a setattr) while this
        lasts: their marks end now (`_fast_off`) and none is made until it is over
        (`_fast_markable`, `_markable_ahead`), whatever the loop does while the change's store
        calls run in a worker thread: a mark made meanwhile, ahead of its open (`_open_ahead`) or
        at a first open, would be of the file as it was, and outlive the change (it did: the
        unlink and rename ended the marks before the store call only)."""
        held = [n for n in nodes if n is not None]
        for n in held:
            n.changing += 1
            self._fast_off(n)
        try:
            yield
        finally:
            for n in held:
                n.changing -= 1

    def _unname(self, node: Inode, answered: int) -> None:
        """A name's registration in pyfuse3 ends (`FastNames.drop`): the lookups pyfuse3 answered
        for it are the kernel's now, and the registration's own goes. An inode the kernel does not
        know (marked ahead, never looked up) can be opened no more: its mark goes too."""
        node.lookups += answered - 1
        if node.lookups <= 0 and node.ino in self.fast:
            self.fast.unmark(node)
        self.inodes.maybe_drop(node)

    async def _name_checked(self, folder: str, uid: int) -> None:
        """A reader is going through `folder` of a local store, not declared immutable
        (`ReadFolders`: two of its files got checked marks at their first opens): its plain files'
        names are registered for LOOKUPs answered in pyfuse3, each checked there (the path still
        that file; its attributes read then: docs/fastpath.md, "Checked names") for
        CHECKED_NAMES_S, and its other files are marked ahead (`_open_ahead`), so that their
        LOOKUP, OPEN and RELEASE are all answered in pyfuse3. Not for a folder of more than
        CHECKED_NAMES_MAX entries (nor past the user's share). A system task: it never fails the mount."""
        if folder in self.names.folders:
            return
        most = min(self.names.users.share, CHECKED_NAMES_MAX)
        try:
            listing = await self._list_inline(folder, most + 1)
        except Exception as err:   # (its lookups go to Python, as before)
            log.debug("listing %r for checked names failed: %s", folder, err)
            return
        if len(listing) > most:
            return
        named = await self._name_folder(folder, listing, CHECKED_NAMES_S, uid, checked=True)
        if folder in self.names.folders:
            if self._marks_lazily():
                self._mark_lazy(folder, named, uid)
            else:
                await self._open_ahead(folder, uid)

    def _mark_lazy(self, folder: str, named: list[tuple[Inode, tuple[int, bytes, int, int]]], uid: int) -> None:
        """`_open_ahead` without the opens: the files of `folder` just named (`named`: each with the
        check its name was registered with) are marked now, each opened by pyfuse3 at its own first
        open (`FastPath.mark_lazy`; docs/fastpath.md, "Lazy marks"). Each mark is one its first
        open in Python would make: the handle kind `choose_handle` gives a read open of the store
        file with nothing else open (`fast_eligible`), and the open that pyfuse3 makes is that
        open (the store's `open_reader`, the same check). As many as `_open_ahead` would mark, in
        the same places."""
        budget = self.fast.room_for(uid)
        marks: list[tuple[Inode, tuple[int, bytes, int, int]]] = []
        for node, check in named:
            if len(marks) >= budget:
                break
            if (node.fast_named and self._markable_ahead(node) and node.path.rpartition("/")[0] == folder
                    and self._lazy_markable(node, check)):
                marks.append((node, check))
        self.fast.counts["marked_ahead"] += self.fast.mark_lazy(marks, uid)

    def _marks_lazily(self) -> bool:
        """Marks made ahead of an open are lazy ones (pyfuse3 opens them; a local store's files)."""
        return self.fast.lazy_on and hasattr(self.store, "held_reader")

    def _lazy_markable(self, node: Inode, check: tuple[int, bytes, int, int]) -> bool:
        """Whether `node` (`_markable_ahead`) gets a lazy mark: the mark its first open would make,
        the handle kind `choose_handle` gives a read open of the store's file with nothing else
        open (`fast_eligible`), whose open pyfuse3 makes (the store's `open_reader`, `check`'s).
        If so, the mark's hold is taken (one open of the inode, no fd until pyfuse3 opens it)."""
        source = self.reads.source_unopened(node.path)
        if source is None:
            return False   # (routed: the tier decides at the open, which is then Python's)
        # (OpenFacts of a read open of the store's file with nothing else open: in field order)
        kind = choose_handle(OpenFacts(node.control is not None, node.virtual is not None, False, self.pt.on,
                                       False, False, False, source, source is Source.STORE, True))
        if not fast_eligible(kind, False, True, False, node.unlinked):
            return False
        node.opens += 1
        node.file_key = (check[2], check[3])
        return True

    def _adopt_lazy(self, node: Inode, fd: int, backing_id: int) -> None:
        """A lazy mark pyfuse3 opened (`FastPath.take_opened`): its fd and backing id become the
        mark's hold, as the first open in Python that would have made it leaves them
        (`_make`, `Passthrough.read_handle`)."""
        key = node.file_key   # ((dev, ino): what the mark's check and pyfuse3's open found)
        assert key is not None
        node.pt_id, node.pt_refs, node.pt_staging = backing_id, 1, None
        self.pt.read_handle(node, key, self.store.held_reader(fd, key[0]))   # type: ignore[attr-defined]
        self.stats.add("passthrough_backing_open")

    async def fast_sweep(self) -> None:
        """Every MARK_SWEEP_S (`mount._fast_sweep`): checked names past their time go, and the
        marks of files the store no longer has (`let_go_removed_marks`)."""
        if self.names.checked_until and self.names.backend is not None:
            now = self.names.backend.now_ns()
            for folder in [f for f, until in self.names.checked_until.items() if until <= now]:
                self.names.drop(folder)
        if self.fast.marked:
            await self.let_go_removed_marks()

    async def _name_folder(self, folder: str, listing: list[tuple[str, Stat]], ttl: float, uid: int = 0,
                           checked: bool = False) -> list[tuple[Inode, tuple[int, bytes, int, int]]]:
        """Register the plain files of `folder`'s kept listing for lookups answered in pyfuse3
        (`FastNames`): each name whose Python lookup would answer from that listing, as it would,
        counted to `uid` (whose lookups had it listed: `FastNames.users`: a share per user). Not past
        FAST_NAMES_MAX names or `[cache] max_entries`. The entries are made NAME_CHUNK at
        a time, the loop free between (~8 µs a name here); anything that drops names meanwhile
        (a change in the folder, the listing gone) ends it with nothing registered. `checked`: the
        folder is not declared immutable (`_name_checked`): its plain files not declared so are
        registered, each with its check (`LocalStore.same_file_check`) and the mount's timeouts,
        and no kept listing is involved. What was registered with a check: (inode, check) each."""
        parent = self.inodes.by_path_get(folder)
        if (parent is None or parent.path != folder or parent.control is not None or len(listing) > FAST_NAMES_MAX
                or len(self.inodes.by_ino) + len(listing) > self.max_entries):
            return []
        epoch, kept = self.names.epoch, self.listings.folder(folder)

        def undisturbed() -> bool:
            return self.names.epoch == epoch and (checked or self.listings.folder(folder) is kept)

        prefix = folder + "/" if folder else ""
        # (per name, what costs: a reserved name can be in a few folders only; an immutable path's
        # timeouts are the immutable ones, without matching it again as `attrs` would)
        reserved = self.reserved if paths.may_hold_reserved(folder, self.journal_dir) else None
        timeouts = (self._attr_timeout, self._entry_timeout) if checked else (self._immutable_timeout,
                                                                              self._immutable_timeout)
        immutable, by_path, own_dev = self.immutable, self.inodes.by_path_get, self.own_dev
        named: list[tuple[bytes, Inode, Attributes | None]] = []
        checks: list[tuple[int, bytes, int, int]] = []
        encoded = [name.encode("utf-8", "surrogateescape") for name, _st in listing]
        # (a checked name's entry: its inode number, its attributes read at each LOOKUP, and the
        # rest the same for every name, given once where pyfuse3 takes that; the checks made in
        # one store call, the folder's part of the path encoded once: `LocalStore.same_file_checks_in`)
        template = None
        if checked and getattr(self.names.backend, "templates", False):
            template = Attributes(0, stat_mod.S_IFREG, 1, 0, 0, 0, BLOCK_SIZE, 0, 0, 0, 0, *timeouts, 0)
        checks_in = getattr(self.store, "same_file_checks_in", None) if checked else None
        all_checks = checks_in(folder, list(zip(encoded, (st for _name, st in listing)))) if checks_in else None
        for i, (name, st) in enumerate(listing):
            if i and i % NAME_CHUNK == 0:
                await trio.sleep(0)
                if not undisturbed():
                    break
            path = prefix + name
            if (st is None or not st.is_file or st.nlink > 1 or (own_dev and st.dev == own_dev)
                    or paths.is_hidden_name(name) or (reserved is not None and reserved(path))
                    or bool(immutable(path)) == checked):
                continue
            known = by_path(path)
            if known is not None and (known.writer is not None or known.writers_pending or known.path != path
                                      or known.unlinked or known.fast_named or known.ino in self.fast):
                continue   # (a write open pending dropped the names before this began: its size will change)
            if self._named_still and self._still_named_at(path):
                continue
            if checked:
                check = all_checks[i] if all_checks is not None else None
                if check is None:
                    continue
                checks.append(check)
            node = self.inode_for(path, st)
            named.append((encoded[i], node, None if template is not None else self.attrs(node, st, timeouts)))
        if (undisturbed() and self.inodes.get(parent.ino) is parent
                and self.names.register(folder, parent, named, ttl, uid, checks if checked else None, template)):
            return [(node, check) for (_name, node, _attrs), check in zip(named, checks)]
        for _name, node, _attrs in named:   # (made for this: no one else holds them)
            self.inodes.maybe_drop(node)
        return []

    def passthrough_detach(self, node: Inode) -> None:
        """One passthrough handle of `node` released (`fusefs.passthrough.Passthrough.detach`)."""
        self.pt.detach(node)

    # -- services (also used by handles) --------------------------------------------------------
    async def io(self, fn: Callable, *args, inline: bool = False):
        """Run a store call: inline if it cannot block for long, else in a worker thread."""
        if inline:
            return fn(*args)
        return await workers.run_sync(fn, *args, limiter=self.io_limiter)

    def reserved(self, path: str) -> bool:
        """Names no request may create, rename, link or look up: `.hintfs` at the root, the journal
        folders (the configured one and the default) and what is under them (`hintfs.common.paths`)."""
        return paths.reserved(path, self.journal_dir)

    def _new_name(self, parent: Inode, name: bytes) -> str:
        """The store path of a name a request creates in `parent` (create, mkdir, mknod, symlink,
        link, the target of a rename): never a staging file's or a reserved name."""
        path = paths.child(parent.path, name)
        if paths.is_hidden_name(path.rsplit("/", 1)[-1]) or self.reserved(path):
            log.warning("refused to create %r through the mount: a reserved name", path)
            raise Refused(errno.EACCES, "a reserved name")
        self.listings.drop(parent.path)
        return path

    def _stale_name(self, path: str) -> None:
        """A new node was made at `path`: an inode this mount still has there is of a file another
        host removed (the kernel asked to create, so the name was free): it keeps its open handles,
        the name gets a new inode (else the kernel would see a file turn into another kind)."""
        old = self.inodes.by_path_get(path)
        if old is not None and old.writer is None:
            self.inodes.detach(path)

    def _inode(self, ino: int) -> Inode:
        if self.fast.lazy:   # (lazy marks pyfuse3 opened: their fds are the inodes' open files from now on)
            self.fast.take_opened()
        inode = self.inodes.get(ino)
        if inode is None:
            raise Refused(errno.ESTALE, f"inode {ino} is not known")
        return inode

    def _add_handle(self, handle: Handle) -> int:
        fh = next(self._fh)
        self.handles[fh] = handle
        return fh

    def immutable(self, path: str) -> float:
        """How long a listing of `path`'s folder may be kept: `immutable_timeout_s` where the
        config declares `path` immutable, else 0."""
        if self._immutable_match is not None and self._immutable_match(path):
            return self._immutable_timeout
        return 0.0

    def _timeouts(self, path: str) -> tuple[float, float]:
        if self._immutable_match is not None and self._immutable_match(path):
            return self._immutable_timeout, self._immutable_timeout
        return self._attr_timeout, self._entry_timeout

    def bound_entries(self) -> None:
        """[cache] max_entries: past it, ask the kernel to forget the oldest idle names (down to
        90% of the bound); each forget it sends drops an inode here. Without a kernel (tests
        driving the filesystem) nothing is asked."""
        if self.kernel is None or self.inodes.over(self.max_entries) <= 0:
            return
        target = self.inodes.over(self.max_entries) + self.max_entries // 10
        asked = self.inodes.to_forget(target)
        for _inode, parent, name in asked:
            self.kernel.invalidate_entry(parent.ino, name.encode("utf-8", "surrogateescape"))
        self.stats.add("entries_trimmed", len(asked))

    def attrs(self, inode: Inode, st: Stat, timeouts: tuple[float, float] | None = None) -> Attributes:
        """What the kernel gets for `inode`, whose store attributes are `st`; `timeouts` (attr,
        entry) where the caller knows them (else `_timeouts` of its path)."""
        attr_timeout, entry_timeout = timeouts or self._timeouts(inode.path)
        # Positional, in field order (keywords cost twice as much on every lookup and getattr).
        return Attributes(inode.ino, st.mode, st.nlink, st.size, st.uid, st.gid, BLOCK_SIZE, (st.size + 511) // 512,
                          st.mtime_ns, st.ctime_ns, st.atime_ns or st.mtime_ns, attr_timeout, entry_timeout, st.rdev)

    async def _stat_inode(self, inode: Inode) -> Stat:
        """Attributes as a reader through the mount sees them (staged writes included; a file
        unlinked while open is stat'ed through its open fd, with st_nlink 0)."""
        if inode.writer is not None and inode.writer.fd >= 0:
            staged = Stat.from_os(os.fstat(inode.writer.fd))
            return staged._replace(nlink=0) if inode.unlinked else staged
        if inode.unlinked:
            fd = inode.open_fd()
            if fd >= 0:
                return Stat.from_os(os.fstat(fd))
        st: Stat | None
        try:
            st = await self.io(self.store.stat, inode.path, inline=self.meta_inline)
        except FileNotFoundError:
            st = None
        if st is not None and (not inode.opens or st.is_file or st.is_dir):
            return st
        # Removed from the store by another host while open here (or the name now holds a
        # symlink or another kind of node, which the kernel would take for a changed inode): the
        # open file keeps working through its descriptor, as an unlinked file does (st_nlink 0).
        fd = inode.open_fd() if inode.opens else -1
        if fd < 0:
            if st is None:
                raise FileNotFoundError(errno.ENOENT, f"{inode.path} is gone")
            return st
        return Stat.from_os(os.fstat(fd))._replace(nlink=0)

    def inode_for(self, path: str, st: Stat) -> Inode:
        """The inode of `path`, whose store attributes are `st`: a file with several names
        (hard links, st_nlink > 1) is one inode for all of them."""
        inode = self.inodes.by_path_get(path)
        if st.nlink > 1 and st.ino and not st.is_dir:
            key = (st.dev, st.ino)
            if inode is None:
                other = self.inodes.linked(key)
                if other is not None and self.meta_inline and other.writer is None and self._same_file(other.path, key):
                    self.inodes.alias(other, path)
                    return other
                inode = self.inodes.ensure(path)
            if inode.writer is None:
                self.inodes.set_backing(inode, key)
            return inode
        kind = stat_mod.S_IFMT(st.mode)
        if inode is not None and inode.kind and inode.kind != kind and inode.writer is None and inode.path == path:
            # Another host replaced the file by another kind of node (a symlink, a folder): the
            # name gets a new inode (the kernel would make the old one, still open here, a bad inode)
            self.inodes.detach(path)
            inode = None
        if inode is None:
            inode = self.inodes.ensure(path)
        # (a file this mount is writing is a regular file, whatever another host has put at its name
        # meanwhile: its publish replaces that, and the name must not become a new inode after it)
        inode.kind = stat_mod.S_IFREG if inode.writer is not None else kind
        return inode

    def _same_file(self, path: str, key: tuple[int, int]) -> bool:
        try:
            st = self.store.stat(path)
        except OSError:
            return False
        return (st.dev, st.ino) == key

    def refuse_device(self, st_dev: int, statx_dir: StatxDirFactory | None = None) -> None:
        """The mount's own FUSE device, known once mounted: the store never serves entries of it
        (a bind mount of the mountpoint inside the store would otherwise make a lookup wait on
        this daemon itself). Stores without devices (object stores) ignore it. `statx_dir`: the
        FUSE library's lister of a folder's entries (`Store.refuse_device`)."""
        self.own_dev = st_dev
        self.store.refuse_device(st_dev, statx_dir)

    # -- control files -------------------------------------------------------------------------
    def control_inode(self, node) -> Inode:
        key = id(node)
        ino = self._control_ino_of.get(key)
        if ino is not None:
            return self.inodes[ino]
        inode = self.inodes.add_control(f"{_CONTROL_KEY}/{node.name}/{key}", node)
        self._control_ino_of[key] = inode.ino
        self._control_inodes[inode.ino] = inode
        return inode

    def control_attrs(self, inode: Inode) -> Attributes:
        node = inode.control
        # Directories where jobs create files are sticky like /tmp; a job file belongs to the user
        # who created it (and the mount's owner); everything else is read-only.
        uid, gid = os.getuid(), os.getgid()
        nlink = 1
        if isinstance(node, ControlDir):
            mode = stat_mod.S_IFDIR | (0o755 if node.make_file is None else 0o1777)
            nlink = 2
        elif isinstance(node, ControlFile) and node.writable:
            mode = stat_mod.S_IFREG | 0o644
            uid, gid = node.uid, node.gid
        else:
            mode = stat_mod.S_IFREG | 0o444
        now = time.time_ns()
        # st_size 0: content is generated; control files are opened with direct_io
        return Attributes(st_ino=inode.ino, st_mode=mode, st_nlink=nlink, st_size=0, st_uid=uid, st_gid=gid,
                          st_mtime_ns=now, st_ctime_ns=now, st_atime_ns=now, attr_timeout=0, entry_timeout=0)

    def control_lookup(self, parent: Inode, name: str) -> Inode:
        node = parent.control.child(name)
        if node is None:
            raise Refused(errno.ENOENT, f"no control file {name!r}")
        return self.control_inode(node)

    def _virtual_attrs(self, inode: Inode, source: Stat) -> Attributes:
        """A `.tensor` grants exactly what its source grants (`hintfs.common.access.attrs_of_derived`): the
        source's owner and group and its read bits, read-only. The kernel checks opens against
        these (`default_permissions`); the size is known only while the file is open."""
        mode, uid, gid = access.attrs_of_derived(source.mode, source.uid, source.gid)
        now = time.time_ns()
        return Attributes(st_ino=inode.ino, st_mode=mode, st_nlink=1,
                          st_size=len(inode.tensor_data) if inode.tensor_data is not None else 0,
                          st_uid=uid, st_gid=gid,
                          st_blksize=BLOCK_SIZE, st_mtime_ns=now, st_ctime_ns=now, st_atime_ns=now,
                          attr_timeout=0,   # the size is known only while the file is open; the mode follows the source
                          entry_timeout=self._entry_timeout)

    async def _source_stat(self, inode: Inode) -> Stat:
        if inode.virtual is None:   # (asked of `.tensor` inodes only)
            raise Refused(errno.ENOENT, f"{inode.path} is not a .tensor file")
        source = inode.virtual[0]
        st: Stat = await self.io(self.store.stat, source, inline=self.meta_inline)
        if not st.is_file:
            raise Refused(errno.ENOENT, f"{source} is not a file")
        return st

    # -- namespace -----------------------------------------------------------------------------
    async def lookup(self, parent_inode: int, name: bytes, ctx=None) -> Attributes:
        parent = self._inode(parent_inode)
        if parent.control is not None:
            return self.control_attrs(self.control_lookup(parent, name.decode("utf-8", "surrogateescape")))
        if parent_inode == ROOT_INODE and name == paths.CONTROL_DIR.encode():
            return self.control_attrs(self.control_inode(self.control_root))
        path = paths.child(parent.path, name)
        if paths.is_hidden_name(path.rsplit("/", 1)[-1]) or self.reserved(path):
            raise Refused(errno.ENOENT, "hidden name")
        inode = self.inodes.by_path_get(path)
        if inode is not None and inode.writer is not None and inode.path == path:
            st = await self._stat_inode(inode)
        else:
            # (not for a name a writer of a file published in place may still be writing, since a
            # close-to-open renewal gave the name a new inode: the store file changes under it)
            kept = (self._listed(parent.path, path, ctx.uid if ctx is not None else 0)
                    if self._immutable_match is not None and not self._still_named_at(path) else None)
            try:
                # (a local store's stat directly, not through `io`'s coroutine: one per lookup)
                st = kept or (self.store.stat(path) if self.meta_inline else await self.io(self.store.stat, path))
            except FileNotFoundError:
                virtual = self.tensors.match(path) if self.tensors is not None else None
                if virtual is None:
                    raise
                inode = self.inodes.ensure(path)
                inode.virtual = virtual
                try:
                    source = await self._source_stat(inode)   # ENOENT if no source
                except BaseException:
                    self.inodes.maybe_drop(inode)
                    raise
                inode.lookups += 1
                return self._virtual_attrs(inode, source)
            if self.own_dev and st.dev == self.own_dev:
                raise Refused(errno.ELOOP, f"{path} is this mount itself")
            inode = self.inode_for(path, st)
            if not st.is_dir and self.names_listings:
                self.walks.looked_up(getattr(ctx, "pid", 0), parent_inode)   # a walker that stats
            if st.is_file and self.reading.reading(parent.path) and kept is None:
                await self._mark_at_lookup(inode, st, ctx.uid if ctx is not None else os.getuid())
        inode.lookups += 1
        if inode.lookups == 1:
            self.bound_entries()
        return self.attrs(inode, st)

    def _listed(self, folder: str, path: str, uid: int = 0) -> Stat | None:
        """`path`'s attributes from the kept listing of its folder, where `path` is immutable
        (`fusefs.listings`); a folder looked up in by path again and again is listed once, in the
        background, for the next lookups. None: ask the store."""
        ttl = self.immutable(path)
        if not ttl:
            return None
        names = self.listings.folder(folder)
        if names is None:
            if self.listings.missed(folder):
                self.listings.listing.add(folder)
                trio.lowlevel.spawn_system_task(self._list_for_lookups, folder, ttl, self.listings.changes, uid)
            return None
        st = names.get(path[len(folder) + 1:] if folder else path)
        if st is not None:
            self.stats.add("lookup_from_listing")
        return st

    async def _list_for_lookups(self, folder: str, ttl: float, since: int, uid: int = 0) -> None:
        """List `folder` for the lookups to come (a system task: it never fails the mount). A
        folder of more names than one user's share of `max_entries` is not kept (nor listed again)."""
        most = self.listings.users.share
        try:
            if self.meta_inline:   # a local store: on the loop, a chunk at a time (see _list_inline)
                listing = await self._list_inline(folder, most + 1)
            else:
                listing = await trio.to_thread.run_sync(_list_all, self.store, folder, most + 1,
                                                        limiter=self.io_limiter, abandon_on_cancel=True)
        except Exception as err:   # (the lookups asked the store meanwhile, and still do)
            log.debug("listing %r for lookups failed: %s", folder, err)
            return
        finally:
            self.listings.listing.discard(folder)
        self.stats.add("lookup_listings")
        if len(listing) > most:
            self.listings.too_big(folder)
        else:
            self.listings.put(folder, listing, ttl, since=since, uid=uid)
            if self.names.on and self.listings.folder(folder) is not None:
                try:
                    await self._name_folder(folder, listing, ttl, uid)
                except Exception:   # (a system task's error would end the mount: Python answers)
                    log.exception("fast lookups of %r not registered", folder)

    async def _list_inline(self, folder: str, most: int) -> list[tuple[str, Stat]]:
        """A local store's listing of `folder` (at most `most` names) on the event loop,
        LIST_CHUNK entries at a time with the loop free between. In a worker thread it came too
        late to answer a walker's lookups: each entry's stat gave up the GIL, and taking it back
        from a loop kept busy by that walker's requests took up to the interpreter's switch
        interval (5 ms) each time. 200,000 stats by path in folders of 100, unpinned: 9% of the
        later lookups answered from the listing, against 85% with the daemon and the walker each
        pinned to a CPU (docs/fastpath.md, "Lookups")."""
        entries = self.store.iter_dir(folder)
        out: list[tuple[str, Stat]] = []
        try:
            for entry in entries:
                out.append(entry)
                if len(out) >= most:
                    break
                if len(out) % LIST_CHUNK == 0:
                    await trio.sleep(0)
        finally:
            close = getattr(entries, "close", None)
            if close is not None:
                close()
        return out

    def forget(self, inode_list) -> None:
        for ino, n in inode_list:
            answered = self.names.taken(ino)   # (the lookups pyfuse3 answered are in the kernel's count)
            if answered:
                node = self.inodes.get(ino)
                if node is not None:
                    node.lookups += answered
            if ino in self.fast:      # forgotten: no open file is left, so neither is a fast open
                node = self.inodes.get(ino)
                if node is not None and node.lookups - n <= 0:
                    self.fast.unmark(node)
            self.inodes.forget(ino, n)
            if ino not in self.inodes.by_ino:
                self._kernel_listed.discard(ino)
                self._listing_changed.pop(ino, None)

    async def getattr(self, inode: int, ctx=None) -> Attributes:
        node = self._inode(inode)
        if node.control is not None:
            return self.control_attrs(node)
        if node.virtual is not None:
            return self._virtual_attrs(node, await self._source_stat(node))
        st = await self._stat_inode(node)
        changed = self._listing_changed.get(inode)
        if changed is not None and st.is_dir and st.mtime_ns < changed:
            st = st._replace(mtime_ns=changed, ctime_ns=max(st.ctime_ns, changed))
        return self.attrs(node, st)

    async def setattr(self, inode: int, attr, fields, fh: int | None, ctx) -> Attributes:
        node = self._inode(inode)
        with self._changing(node):   # (the fast path answers GETATTR from the attributes of its mark)
            return await self._setattr(node, attr, fields, fh)

    async def _setattr(self, node: Inode, attr, fields, fh: int | None) -> Attributes:
        if node.control is not None:
            if fields.update_size:  # `echo x > .hintfs/loglevel` truncates first
                h = self.handles.get(fh) if fh is not None else None
                if isinstance(h, ControlHandle):
                    h.truncate(attr.st_size)
                return self.control_attrs(node)
            raise Refused(errno.EPERM, "control files have fixed attributes")
        if fields.update_size:
            if node.unlinked and node.writer is None:
                raise Refused(errno.ENOENT, f"{node.path} was unlinked")
            await self._truncate(node, attr.st_size)
        uid = attr.st_uid if fields.update_uid else -1
        gid = attr.st_gid if fields.update_gid else -1
        # Owners first: chown clears set-id bits, a mode given in the same request sets them again.
        if uid != -1 or gid != -1:
            await self._apply(node, self._chown, os.fchown, uid, gid)
        if fields.update_mode:
            await self._apply(node, self.store.chmod, os.fchmod, stat_mod.S_IMODE(attr.st_mode))
        if fields.update_atime or fields.update_mtime:
            # Only what was asked changes (utimensat's UTIME_OMIT); UTIME_NOW comes as the time.
            st = await self._stat_inode(node)
            atime = attr.st_atime_ns if fields.update_atime else (st.atime_ns or st.mtime_ns)
            mtime = attr.st_mtime_ns if fields.update_mtime else st.mtime_ns
            staging = node.writer
            if staging is not None and staging.unseen_writes and not node.unlinked and staging.fd >= 0:
                # Open for writing under passthrough: the times go on its staging file, and its
                # next close publishes them (the name may hold another opener's published file,
                # whose own next publish must not take this for a write of its own).
                _futimens(staging.fd, atime, mtime)
                staging.dirty = True
            else:
                await self._apply(node, self.store.utimens, _futimens, atime, mtime)
        if node.path and (fields.update_size or uid != -1 or gid != -1 or fields.update_mode
                          or fields.update_atime or fields.update_mtime):
            # a kept listing of its folder has the attributes from before: a lookup answered from
            # it (after a close-to-open renewal, say) or a later readdirplus would give them to the
            # kernel again, kept for an immutable path's timeout (model seed 500142: a truncate,
            # then the size from before the truncate)
            self.listings.drop(node.path.rpartition("/")[0])
        return self.attrs(node, await self._stat_inode(node))

    async def _apply(self, node: Inode, by_path: Callable, by_fd: Callable, *args) -> None:
        """A metadata change: to the staged file of an open writer (so the publish keeps it) and
        to the store file; only through the open fd once the file was unlinked while open."""
        fd = node.open_fd()
        if node.unlinked:
            if fd < 0:
                raise Refused(errno.ENOENT, f"{node.path} was unlinked")
            by_fd(fd, *args)
            return
        if node.writer is not None and node.writer.fd >= 0:
            # The store's file first: a store that refuses (an object store has no modes: EPERM)
            # leaves the open file as it was.
            try:
                await self.io(by_path, node.path, *args, inline=self.meta_inline)
            except (FileNotFoundError, NotADirectoryError):
                pass   # created through the mount, not published yet: the staged file has it
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.ELOOP):
                    raise
                # the name holds another kind of node by now (another host's symlink): the staged
                # file has the change, its next publish carries it
                log.debug("%s of %s by name: %s (kept on the open file)", by_path.__name__, node.path, err.strerror)
            by_fd(node.writer.fd, *args)
            return
        await self.io(by_path, node.path, *args, inline=self.meta_inline)

    def _chown(self, rel: str, uid: int, gid: int) -> None:
        self.store.chown(rel, uid, gid)

    def publish_lock(self, node: Inode) -> trio.Lock:
        """The lock of `node`'s staging changes that may wait (the last release's publish, a
        truncate by path), made on first use."""
        if node.publishing is None:
            node.publishing = trio.Lock()
        return node.publishing

    async def _truncate(self, node: Inode, size: int) -> None:
        async with self.publish_lock(node):
            if node.writer is not None and node.writer_refs > 0:
                # a write handle is open: cut its staging, published at its close
                await self.ensure_private(node)
                await self.io(os.ftruncate, node.writer.fd, size, inline=node.writer.inline_io)
                node.writer.dirty = True
                return
            await self._truncate_closed(node, size)

    async def _truncate_closed(self, node: Inode, size: int) -> None:
        # A truncate without an open writer (`truncate -s`): stage, cut, commit at once.
        staging = await self.io(self.store.new_staging, node.path, size > 0)
        try:
            await self.io(os.ftruncate, staging.fd, size)
            st = await self.io(self.store.commit, staging, node.path)
        finally:
            self.store.discard(staging)
        node.cached_identity = None
        # A new version at the name, as a close publishes one: kept listings of its folder go
        # (their Stat said the old size: a lookup after this truncate answered it), followers
        # are told (the journal), the stats count it.
        await self._published(node, st, True)

    async def readlink(self, inode: int, ctx=None) -> bytes:
        node = self._inode(inode)
        target = await self.io(self.store.readlink, node.path, inline=self.meta_inline)
        if not paths.symlink_target_ok(node.path, target):
            log.warning("refusing symlink %s -> %s: it points outside the store", node.path, target)
            raise Refused(errno.EACCES, "symlink points outside the store")
        return os.fsencode(target)

    async def _own_new(self, parent: Inode, path: str, ctx, mode: int | None, is_dir: bool = False) -> None:
        """A node just made by this daemon (root) belongs to the caller: uid from ctx, gid from
        ctx unless the parent directory is set-group-ID (then the backing filesystem already gave
        it the parent's group, and a new directory S_ISGID). Its mode is set exactly (the
        daemon's own umask must not apply; the caller's umask is applied here, where the
        kernel has not already done it)."""
        if ctx is None:
            return
        inline = self.meta_inline
        if self._root_daemon and (ctx.uid or ctx.gid):
            parent_st = await self._stat_inode(parent)
            gid = -1 if parent_st.mode & stat_mod.S_ISGID else ctx.gid
            await self.io(self._chown, path, ctx.uid, gid, inline=inline)
        if mode is not None:
            st = await self.io(self.store.stat, path, inline=inline)
            want = mode | (st.mode & stat_mod.S_ISGID if is_dir else 0)
            if stat_mod.S_IMODE(st.mode) != want:
                await self.io(self.store.chmod, path, want, inline=inline)

    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx=None) -> Attributes:
        parent = self._inode(parent_inode)
        if parent.control is not None:
            raise Refused(errno.EPERM, "no symlinks in control directories")
        path = self._new_name(parent, name)
        target_s = os.fsdecode(target)
        if not paths.symlink_target_ok(path, target_s):
            log.warning("refusing to create symlink %s -> %s: it would point outside the store", path, target_s)
            raise Refused(errno.EPERM, "symlink would point outside the store")
        inline = self.meta_inline
        await self.io(self.store.symlink, path, target_s, inline=inline)
        self._stale_name(path)
        await self._own_new(parent, path, ctx, None)
        st = await self.io(self.store.stat, path, inline=inline)
        inode = self.inode_for(path, st)
        inode.lookups += 1
        return self.attrs(inode, st)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx=None) -> Attributes:
        parent = self._inode(parent_inode)
        if parent.control is not None:
            raise Refused(errno.EPERM, "no folders in control directories")
        path = self._new_name(parent, name)
        # mkdir(2) keeps the permission bits and the sticky bit; S_ISGID comes from the parent
        bits = mode & (0o777 | stat_mod.S_ISVTX) & ~_umask(ctx)
        await self.io(self.store.mkdir, path, bits)
        self._stale_name(path)
        await self._own_new(parent, path, ctx, bits, is_dir=True)
        st = await self.io(self.store.stat, path, inline=self.meta_inline)
        inode = self.inodes.ensure(path)
        inode.kind = stat_mod.S_IFDIR   # (as `create`'s)
        inode.lookups += 1
        return self.attrs(inode, st)

    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx=None) -> Attributes:
        """FIFOs, sockets, device nodes (the kernel checks CAP_MKNOD for devices) and regular
        files. The kernel itself serves opens of FIFOs and devices of the mount: they never
        reach the daemon's data path."""
        parent = self._inode(parent_inode)
        if parent.control is not None:
            raise Refused(errno.EPERM, "no nodes in control directories")
        path = self._new_name(parent, name)
        bits = stat_mod.S_IMODE(mode) & ~_umask(ctx)
        await self.io(self.store.mknod, path, stat_mod.S_IFMT(mode) | bits, rdev, inline=self.meta_inline)
        self._stale_name(path)
        await self._own_new(parent, path, ctx, bits)
        st = await self.io(self.store.stat, path, inline=self.meta_inline)
        inode = self.inode_for(path, st)
        inode.lookups += 1
        return self.attrs(inode, st)

    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx=None) -> Attributes:
        """A hard link: the new name is one more name of the same inode (one st_ino, nlink
        counted by the store). Publishing a write replaces only the name it was written through
        (docs/semantics.md)."""
        node = self._inode(inode)
        parent = self._inode(new_parent_inode)
        if parent.control is not None or node.control is not None or node.virtual is not None:
            raise Refused(errno.EPERM, "control and virtual files have no hard links")
        path = self._new_name(parent, new_name)
        if node.unlinked:
            raise Refused(errno.ENOENT, f"{node.path} was unlinked")
        with self._changing(node):   # (its nlink changes)
            if node.writer is not None and node.writer.changed():
                await self.commit(node)   # link what was written so far (as rename does)
            await self.io(self.store.link, node.path, path, inline=self.meta_inline)
            st = await self.io(self.store.stat, path, inline=self.meta_inline)
            self.inodes.alias(node, path)
            if st.ino:
                self.inodes.set_backing(node, (st.dev, st.ino))
        node.lookups += 1
        return self.attrs(node, st)

    async def rmdir(self, parent_inode: int, name: bytes, ctx=None) -> None:
        parent = self._inode(parent_inode)
        if parent.control is not None:
            raise Refused(errno.EPERM, "control directories are fixed")
        path = paths.child(parent.path, name)
        if self.reserved(path):
            raise Refused(errno.EACCES, "a reserved name")
        self._refuse_if_writing_in(path)
        await self.io(self.store.rmdir, path)
        self.listings.drop_under(path)
        self.inodes.detach(path)

    def _refuse_if_writing_in(self, folder: str) -> None:
        """A folder holding a file this mount has open for writing is not empty, on every store
        (on file:// its staging file lies there; on an object store it is not in the store yet,
        and a folder removed or renamed over under it would lose the file or, renamed over, give
        its name two files). ENOTEMPTY, as rmdir(2) and rename(2) say."""
        prefix = folder + "/" if folder else ""
        for handle in self.handles.values():       # (a file open for writing has a handle)
            node = handle.inode
            if node.writer is not None and not node.unlinked and node.path.startswith(prefix) \
                    and "/" not in node.path[len(prefix):] and not self._still_named(node):
                raise Refused(errno.ENOTEMPTY, f"{folder} holds {node.path}, open for writing")

    def _end_still_named(self, path: str) -> None:
        """`path` went through this mount (unlinked, or a file renamed over it): the writers of
        a file published in place there whose name a new open took since (`_still_named`) no
        longer publish to it (their descriptors keep working, on a nameless file), as the
        writer of an unlinked file never publishes. Such an inode whose writers are all gone
        while readers are still open (`_reads_name_file`) reads a file that has left the name too:
        its attributes are now that file's, through its open descriptors, as for any file
        unlinked while open (before, a GETATTR stat'ed the path: the new file's)."""
        for node in self._still_named_at(path):
            if not node.unlinked:
                node.unlinked = True
                if self.streams is not None:
                    self.streams.dropped(node.ino)
        self._readers_keep_their_file(path)
        self._named_still.pop(path, None)

    def _readers_keep_their_file(self, path: str) -> None:
        """The name `path` left the file its older inodes' readers read (`_reads_name_file`): a
        rename or unlink through this mount, or a publish of the name's inode. Those inodes are
        nameless from now on, their attributes their own file's (as for a file unlinked while
        open), not the name's."""
        for node in self._named_still.get(path, ()):
            if self._reads_name_file(node, path):
                node.unlinked = True

    def _reads_name_file(self, node: Inode, path: str) -> bool:
        """`node` (of `_named_still[path]`) is not the name's inode any more and has no writer, but
        readers still read the file it had at the name (kept for them, `keep_for_readers`)."""
        return (node.writer is None and node.opens > 0 and not node.unlinked and node.path == path
                and self.inodes.by_path_get(path) is not node)

    def _still_named_at(self, path: str) -> list[Inode]:
        """The writers of a file published in place at `path` whose name a new inode took since
        (`_still_named`): they may still write the store file there, and publish to the name."""
        return [n for n in self._named_still.get(path, ()) if self._still_named(n) and n.path == path]

    def _still_named(self, node: Inode) -> bool:
        """`node` was published in place and its name became a new inode (`_renew(still_named=
        True)`): a dup may still write it and publish to the name, but it has no staging file in
        the folder (it is the file the store had there, or a nameless one once that name went):
        it keeps no folder from being removed (the store says whether it is empty), and its
        publish, if the folder is gone, fails."""
        return node.writer is not None and node.writer.live and self.inodes.by_path_get(node.path) is not node

    async def unlink(self, parent_inode: int, name: bytes, ctx=None) -> None:
        parent = self._inode(parent_inode)
        if parent.control is not None:
            ctl: ControlDir = parent.control
            if ctl.make_file is None:
                raise Refused(errno.EPERM, "control files are not removed by unlink")
            caller = Caller.of(ctx) if ctx is not None else Caller(os.getuid(), os.getgid())
            try:
                ctl.remove(name.decode("utf-8", "surrogateescape"), caller)
            except OSError as err:
                raise Refused(err.errno or errno.EPERM, err.strerror or "refused") from None
            self.stats.add("job_files_removed")
            return
        path = paths.child(parent.path, name)
        if self.reserved(path):
            raise Refused(errno.EACCES, "a reserved name")
        inode = self.inodes.by_path_get(path)
        with self._changing(inode):
            try:
                # In a thread even for file://: freeing a large file's blocks can take 100s of ms.
                await self.io(self.store.unlink, path)
            except FileNotFoundError:
                # A file created through the mount but not yet closed exists only as staging.
                if inode is None or inode.writer is None:
                    raise
            else:
                if self.journal is not None:      # eval tiers drop their replica of it
                    await self.journal.removed(path)
            if inode is not None and inode.writer is not None and self.streams is not None:
                self.streams.dropped(inode.ino)   # never published: the tier drops what it was sent
            self.listings.drop(parent.path)
            self.inodes.detach(path)
        await self._unnamed(inode)
        self._end_still_named(path)

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                     flags: int, ctx=None) -> None:
        old_parent = self._inode(parent_inode_old)
        new_parent = self._inode(parent_inode_new)
        if old_parent.control is not None or new_parent.control is not None:
            raise Refused(errno.EPERM, "control files are not renamed")
        if flags & RENAME_EXCHANGE:
            raise Refused(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        old = paths.child(old_parent.path, name_old)
        if self.reserved(old):
            raise Refused(errno.EACCES, "a reserved name")
        new = self._new_name(new_parent, name_new)
        inode = self.inodes.by_path_get(old)
        if inode is not None and inode.writer is not None and inode.writer.changed():
            # Not in the store yet (or stale there): commit what was written so far first, so
            # the rename moves the data the writer has produced (`mv` of a file still open).
            await self.commit(inode)
        replaced = self.inodes.by_path_get(new)
        with self._changing(inode, replaced):
            if replaced is not None and replaced is not inode and replaced.kind in (0, stat_mod.S_IFDIR):
                self._refuse_if_writing_in(new)
            await self.io(self.store.rename, old, new, bool(flags & RENAME_NOREPLACE))
            if new != old and new in self._named_still:
                try:                            # (a file renamed over a name still-named writers had)
                    moved_dir = (await self._store_now(new)).is_dir
                except OSError:
                    moved_dir = False           # (gone again meanwhile: the name went all the same)
                if not moved_dir:
                    self._end_still_named(new)
            self.listings.drop_under(old)
            self.listings.drop_under(new)
            self.inodes.move(old, new)
        if replaced is not None and replaced is not inode:
            await self._unnamed(replaced)
        self._stagings_moved(old, new)
        if not self.store.inode_numbers:
            await self._objects_moved(new)
        if inode is not None and inode.writer is not None and not inode.unlinked:
            await self.io(self.store.follow, inode.writer, new, inline=self.meta_inline)
        if self.journal is not None or self.streams is not None:
            await self._renamed(new, inode)
        if self.journal is not None:
            # After the new name's record and stream (DCP's marker must not wait on this): the
            # old name, a file or a folder, is gone; eval tiers drop what they hold under it.
            await self.journal.removed(old)

    async def keep_for_readers(self, node: Inode, staging) -> None:
        """The last writer of `node` is gone while other handles are open on it: keep its staging
        (the published file itself after a rename, else a copy of it) for them, nameless."""
        if not staging.live:
            await self.io(self.store.unname, staging, inline=self.meta_inline)
        old, node.kept = node.kept, staging
        mine = os.fstat(staging.fd)
        node.file_key = (mine.st_dev, mine.st_ino) if staging.live else (-1, -1)   # (a copy: no store file)
        if old is not None:
            await self.io(self.store.discard, old, inline=old.inline_io)

    async def _unnamed(self, inode: Inode | None) -> None:
        """`inode` left the namespace (unlinked, or renamed over) while open for writing: its
        staging is never published, so its name goes now (rmdir of its folder works)."""
        if inode is not None and inode.unlinked and inode.writer is not None:
            await self.io(self.store.unname, inode.writer, inline=self.meta_inline)

    async def _objects_moved(self, new: str) -> None:
        """A rename through this mount on an object store copied each object it moved: another
        version at another key, but the same file to the handles open on it. Their `file_key`
        (and a passthrough backing's) becomes the new object's, or close-to-open would take the
        moved file for a replaced one (a writer opened beside a reader would get a new inode
        while the reader read a key that is gone). One HEAD per moved file with handles open."""
        prefix = new + "/"
        moved = [n for p, n in list(self.inodes.by_path.items())
                 if (p == new or p.startswith(prefix)) and n.path == p and n.opens > 0
                 and n.file_key is not None and n.file_key[0] == "object"]
        for node in moved:
            try:
                key = (await self._store_now(node.path)).file_key()
            except OSError:
                key = ("object", "gone")    # removed meanwhile: the next open finds another file
            theirs = node.file_key
            if theirs is not None and key[0] == "object" and len(key) == 4 and key[1] != theirs[1]:
                # another size: not the handles' file but one published at its name since (a
                # truncate through this mount): theirs is not at the new name either
                continue
            if node.pt_file == node.file_key:
                node.pt_file = key
            node.file_key = key

    def _stagings_moved(self, old: str, new: str) -> None:
        """A folder renamed: the staging files of files open for writing under it (beside their
        targets, on file:// stores) moved with it."""
        prefix = old + "/"
        for handle in self.handles.values():
            staging = handle.inode.writer
            if staging is not None and staging.path.startswith(prefix):
                staging.path = new + staging.path[len(old):]

    async def _renamed(self, new: str, inode: Inode | None) -> None:
        """A file renamed into place is a new file to followers (DCP writes `.metadata.tmp`, then
        renames it: the commit marker appears by a rename): journal it, and stream it again when
        no write handle is streaming it (a small file: one round trip). A folder's files are
        journaled in the background, not streamed again (docs/cross_dc.md)."""
        try:
            st = await self.io(self.store.stat, new)
        except OSError:
            return
        if stat_mod.S_ISDIR(st.mode) and self.journal is not None:
            self.journal.folder_renamed(new)   # a checkpoint saved in a temporary folder
            return
        if not stat_mod.S_ISREG(st.mode):
            return
        key = inode.ino if inode is not None else None
        streamed = self.streams is not None and self.streams.will_stream_renamed(key, new, st.size)
        record = await self.journal.published(new, st, streamed) if self.journal is not None else None
        if self.streams is not None:
            self.streams.renamed(key, new, st, record)

    async def statfs(self, ctx=None) -> FsStats:
        sv = await self.io(self.store.statfs, inline=self.meta_inline)
        if sv is None:  # object stores: report a large, mostly free filesystem
            return FsStats(f_bsize=1 << 20, f_frsize=1 << 20, f_blocks=1 << 30, f_bfree=1 << 30, f_bavail=1 << 30,
                           f_files=1 << 40, f_ffree=1 << 40, f_favail=1 << 40, f_namemax=1024)
        return FsStats(f_bsize=sv.f_bsize, f_frsize=sv.f_frsize, f_blocks=sv.f_blocks, f_bfree=sv.f_bfree,
                       f_bavail=sv.f_bavail, f_files=sv.f_files, f_ffree=sv.f_ffree, f_favail=sv.f_favail,
                       f_namemax=sv.f_namemax)

    # -- directories ---------------------------------------------------------------------------
    async def opendir(self, inode: int, ctx=None) -> int:
        await self.listings_released()
        node = self._inode(inode)
        if node.control is not None:
            handle: DirHandle = ControlDirHandle(node)
        else:
            immutable = bool(node.path) and self.immutable(node.path) > 0
            if not (immutable and node.kind == stat_mod.S_IFDIR):   # (declared unchanging, known a folder)
                st = await self._stat_inode(node)
                if not st.is_dir:
                    raise Refused(errno.ENOTDIR, f"{node.path} is not a folder")
            by_name = self.names_listings and self.walks.opened(getattr(ctx, "pid", 0), inode)
            if by_name:
                self.stats.add("listings_by_name")
            # A folder declared immutable: the kernel may keep its listing too (pass 2 of a
            # `find` or `ls` then never reaches the daemon; docs/semantics.md).
            handle = DirHandle(node, kernel_keeps=immutable, by_name=by_name, uid=getattr(ctx, "uid", 0))
            if immutable:
                self._kernel_listed.add(inode)
        node.opens += 1
        fh = self._add_handle(handle)
        if self.listing_ends is not None:
            # its RELEASEDIR is answered by the FUSE binding (a listing the kernel keeps reaches
            # no readdir here: its handle's release would be the only request left but this one)
            self.listing_ends.ended(fh, None)
        return fh

    async def readdir(self, fh: int, start_id: int, reply: Reply, names: ReplyNames | None = None) -> None:
        """Offer the entries from `start_id` on to `reply` until it returns False (the kernel's
        buffer is full) or the listing ends. Only entries it took count as lookups. `names`: where
        the FUSE binding can, files given by name alone (`fusefs.walks`) go a run at a time."""
        end = await self.handles[fh].readdir(self, start_id, reply, names)
        if end is not None and self.listing_ends is not None:
            # given to its end: the kernel's next READDIR (it finds nothing) and the RELEASEDIR
            # are answered by the FUSE binding; the handle comes back in `listings_released`
            self.listing_ends.ended(fh, end)
            self.stats.add("listings_ended")
        self.bound_entries()

    async def releasedir(self, fh: int) -> None:
        await self.handles.pop(fh).release(self)

    async def listings_released(self) -> int:
        """Release the directory handles the FUSE binding released for us (`opendir`); how many.
        Called at each opendir and about once a second (`fusefs.mount`)."""
        if self.listing_ends is None:
            return 0
        fhs = self.listing_ends.released()
        for fh in fhs:
            handle = self.handles.pop(fh, None)
            if handle is not None:
                await handle.release(self)
        if fhs:
            self.stats.add("listings_released_by_pyfuse3", len(fhs))
        return len(fhs)

    # -- files ---------------------------------------------------------------------------------
    async def open(self, inode: int, flags: int, ctx=None) -> OpenFile:
        """What the open sees (`_see`: its close-to-open checks, the reader or the staging it
        opens) decides the kind of handle (`choose_handle`, a pure function); `_make` builds it."""
        node = self._inode(inode)
        fetching = self.ahead.fetching.get(inode)
        if fetching is not None:   # (fetched and marked ahead right now: this open shares that)
            await fetching.wait()
        if self.fast.lazy:   # (again here: `fetching` may have waited since `_inode` took them)
            self.fast.take_opened()
            if inode in self.fast.lazy:
                # A lazy mark pyfuse3 could not open (the path names another file now, or none):
                # it ends, and this is the inode's first open (the kernel serves an inode from one
                # backing file: a mark never opened must not register one of its own later).
                self.fast.unmark(node)
        seen = await self._see(node, flags)
        kind = self._kind(node, seen)
        if kind is HandleKind.CONTROL:
            return self._open_control(node, flags, Caller.of(ctx))
        if kind is HandleKind.TENSOR:
            return await self._open_tensor(node, flags, ctx)
        handle, backing_id = self._make(kind, node, seen)
        node.opens += 1
        fh = next(self._fh)
        self.handles[fh] = handle
        if backing_id and self.fast.on and (self._immutable_match is not None or self._checked_marks):
            uid = ctx.uid if ctx is not None else os.getuid()
            if self._fast_mark(node, kind, backing_id, seen.st, uid) and self.open_ahead:
                folder = node.path.rpartition("/")[0]
                if node.ino in self.fast.checked:
                    if self.reading.opened(folder) and self.names.on and self.meta_inline:
                        trio.lowlevel.spawn_system_task(self._name_checked, folder, uid)
                elif self.meta_inline:
                    if node.fast_named and self.names.opened(folder, self.open_ahead):
                        trio.lowlevel.spawn_system_task(self._open_ahead, folder, uid)
                elif self._ahead_sizes[1] and self.ahead.opened(folder, self.listings.folder(folder)):
                    trio.lowlevel.spawn_system_task(self._fetch_ahead, folder, uid)
        # (keep_cache with a backing id makes the kernel fail the open: the pages are the backing file's)
        # A read-only handle does nothing at close: no FLUSH request, close(2) does not wait.
        # (OpenFile's fields in order: fh, keep_cache, direct_io, backing_id, noflush)
        return OpenFile(fh, seen.keep_cache and not backing_id, False, backing_id, not isinstance(handle, WriteHandle))

    def _kind(self, node: Inode, seen: _Seen) -> HandleKind:
        """The handle an open of `node` that saw `seen` gets (`choose_handle`, pure)."""
        # (OpenFacts positionally, in field order: keywords cost as much as the choice itself)
        return choose_handle(OpenFacts(node.control is not None, node.virtual is not None, seen.writing, self.pt.on,
                                       seen.shared, seen.writer, node.opens > 0, seen.source, seen.local_fd >= 0,
                                       seen.space_ok))

    async def _see(self, node: Inode, flags: int) -> _Seen:
        """What an open of a store file sees, once its close-to-open checks passed (else ESTALE:
        the name becomes a new inode, `_renew`; ETXTBSY for a write that passthrough reads block)."""
        writing = flags & os.O_ACCMODE != os.O_RDONLY or bool(flags & os.O_TRUNC)
        if node.control is not None or node.virtual is not None:
            return _Seen(writing)
        if writing:
            return await self._see_write(node, truncate=bool(flags & os.O_TRUNC))
        if node.pt_refs:
            # Passthrough opens are active: this one must share their backing file. (A file marked
            # for the fast path as immutable by the config: its opens in pyfuse3 skip this check,
            # and so does one that came here, e.g. while it was being marked ahead. A checked mark's
            # open comes here when pyfuse3's check found another file: this one decides.)
            if node.pt_staging is None:
                if node.ino not in self.fast.marked or node.ino in self.fast.checked:
                    await self._check_backing_current(node)
            elif node.writer is None:
                await self._check_staging_current(node, node.pt_staging)
            if node.pt_refs:   # (else they were all released while the check waited: a first open)
                return _Seen(False, shared=True)
        if node.writer is not None:
            return _Seen(False, writer=True)   # reads the staged data of the open writer
        # (The read of a small file spends most of its daemon time here: inline store calls are
        # made directly, not through `io`'s coroutine; `_Seen` is built positionally.)
        if self.meta_inline:
            reader, st = self.store.open_reader(node.path)
        else:
            reader, st = await self.io(self.store.open_reader, node.path)
        return await self._seen_open(node, reader, st)

    async def _seen_open(self, node: Inode, reader: Reader, st: Stat) -> _Seen:
        """What a read open of `node` sees once its store file is open (`reader`, `st`)."""
        if node.opens > 0 and self._replaced_under_open_handles(node, st):
            reader.close()
            raise self._renew(node, "was replaced in the store")
        node.file_key = st.file_key()
        keep_cache = self._same_as_cached(node, st)
        reads = self.reads
        if reads.routes is None and reads.replicas is None:
            source = source_of(reader)   # (what `ReadPath.source` answers without routes or replicas)
        else:
            reader, source = await reads.source(node.path, reader, st)
        if node.writers_pending:
            # A write open is making its staging: a passthrough backing taken now would be shared
            # by its handle (the kernel serves an inode from one backing file), and its writes
            # would go into this file in place, then be replaced by its publish. The daemon reads.
            local = -1
        elif source is Source.STORE:
            local = getattr(reader, "fd", -1) if self.pt.backend is not None else -1
        elif self.pt.on:
            local = await reads.local_fd(node.path, reader, source, st.identity())
        else:
            local = -1
        if node.pt_refs:
            # Another open of this file got a passthrough backing while this one waited for the
            # store: the kernel serves an inode's opens from one backing file and fails an open
            # without it (EIO), so this one shares that file (its version was current as late).
            reader.close()
            self.stats.add("passthrough_joined")
            return _Seen(False, shared=True)
        # (fields in order: writing, shared, writer, keep_cache, reader, st, source, local_fd)
        return _Seen(False, False, False, keep_cache, reader, st, source, local)

    async def _see_write(self, node: Inode, truncate: bool) -> _Seen:
        self._fast_off(node)
        # Under the publish lock: a last release may be publishing and dropping this very staging
        # (it waits, then closes its fd); the open takes the writer only before or after that.
        # Meanwhile read opens get no passthrough backing (`writers_pending`, `_see`).
        node.writers_pending += 1
        try:
            async with self.publish_lock(node):
                return await self._see_write_locked(node, truncate)
        finally:
            node.writers_pending -= 1

    async def _see_write_locked(self, node: Inode, truncate: bool) -> _Seen:
        if node.pt_refs and node.writer is not None and node.writer.live and node.pt_staging is node.writer:
            # The file was published in place and a descriptor of it (a dup) may still write
            # there: a new open for writing gets a file of its own (this name becomes a new
            # inode), the old one still publishes.
            self.stats.add("passthrough_replaced")
            raise self._renew(node, "is published in place", still_named=True)
        if node.writer is None and node.opens and node.file_key is not None:
            st = await self._store_now(node.path)
            if self._replaced_under_open_handles(node, st):
                raise self._renew(node, "was replaced in the store")
        if node.writer is None and node.pt_refs and node.pt_staging is not None:
            # passthrough readers of what a last writer left: a new file at the name, if the store
            # no longer has that very file there (an object store never does: its upload is a copy)
            await self._check_staging_current(node, node.pt_staging)
        if node.pt_refs and (node.pt_staging is None or node.pt_staging is not node.writer):
            # Open for reading through passthrough from the store file: a writer would need
            # another backing file (its staging), which the kernel refuses for one inode.
            self.stats.add("passthrough_conflicts")
            raise Refused(errno.ETXTBSY, f"{node.path} is open for reading (passthrough): not opened for writing")
        await self._acquire_writer(node, truncate=truncate)
        staging = node.writer
        assert staging is not None
        space_ok = True
        if staging.fd >= 0 and not node.pt_refs and self.pt.on:
            space_ok = self.pt.write_ok(staging)
        return _Seen(True, shared=node.pt_refs > 0, local_fd=staging.fd, space_ok=space_ok)

    def _make(self, kind: HandleKind, node: Inode, seen: _Seen) -> tuple[Handle, int]:
        """The handle of `kind` and its backing id (0: none); a passthrough kind whose backing the
        kernel refuses is served as `kind.fallback`."""
        if kind is HandleKind.PASSTHROUGH_STORE:   # (the common read of a file:// store: first)
            reader, st = seen.reader, seen.st
            assert reader is not None and st is not None
            backing_id = self.pt.attach(node, seen.local_fd, None)
            if backing_id:
                return self.pt.read_handle(node, st.file_key(), reader), backing_id   # backing_key(st, replica=False)
            return StoreRead(node, reader), 0
        if kind is HandleKind.PASSTHROUGH_SHARED:
            return PassthroughRead(node), self.pt.attach(node, -1, node.pt_staging)
        if kind in (HandleKind.WRITE, HandleKind.PASSTHROUGH_WRITE):
            staging = node.writer
            assert staging is not None
            if kind is HandleKind.PASSTHROUGH_WRITE:
                backing_id = self.pt.attach(node, staging.fd, staging)
                if backing_id:
                    staging.unseen_writes = True   # the daemon sees no write(): compared at each publish
                    return PassthroughWrite(node), backing_id
            return WriteHandle(node), 0
        if kind is HandleKind.STAGING_READ:
            return StagingRead(node), 0
        reader, st = seen.reader, seen.st
        assert reader is not None and st is not None
        if kind is HandleKind.PASSTHROUGH_REPLICA:
            backing_id = self.pt.attach(node, seen.local_fd, None)
            if backing_id:
                # A replica on this host (the in-process agent's, or a tier agent's): the kernel reads it.
                reader.close()
                self.stats.add("passthrough_replica_opens")
                return self.pt.read_handle(node, backing_key(st, replica=True), HeldFd(seen.local_fd)), backing_id
        if seen.local_fd >= 0 and seen.source in (Source.REPLICAS, Source.TIER):
            os.close(seen.local_fd)            # a replica's fd the kernel did not take
        if kind is HandleKind.REPLICA_READ or kind is HandleKind.PASSTHROUGH_REPLICA:   # (or its fallback)
            return self.reads.replica_handle(node, reader, seen.source, st.identity()), 0
        return StoreRead(node, reader), 0

    async def _check_staging_current(self, node: Inode, staging) -> None:
        """Passthrough opens read what the last writer left (their backing file): a new open
        shares it only while the store still has that very file at the name."""
        try:
            st = await self.io(self.store.stat, node.path, inline=self.meta_inline)
        except FileNotFoundError:
            st = None
        if st is None or staging.fd < 0 or (st.dev, st.ino) != (os.fstat(staging.fd).st_dev,
                                                                os.fstat(staging.fd).st_ino):
            self.stats.add("passthrough_replaced")
            raise self._renew(node, "was replaced in the store")

    def _replaced_under_open_handles(self, node: Inode, st: Stat) -> bool:
        """Handles are open on `node` reading one store file, and the name now holds another.
        (The kernel keeps one page cache per inode: the two files must not share one.) Handles
        reading a last writer's kept copy (`keep_for_readers`: file_key (-1, -1)) read no store
        file: the name always holds another, also on a store without inode numbers (S3)."""
        if node.opens <= 0 or node.writer is not None or node.file_key is None:
            return False
        return node.file_key == (-1, -1) or node.file_key != st.file_key()

    async def _store_now(self, path: str) -> Stat:
        """What the store has at `path` now, with what `Stat.file_key` needs (`Store.current`: a
        stat, or on an object store its HEAD with the ETag: one request either way)."""
        st: Stat = await self.io(self.store.current, path, inline=self.meta_inline)
        return st

    def _renew(self, node: Inode, why: str, still_named: bool = False) -> Refused:
        """Close-to-open while handles are open on an older file: this name becomes a new inode
        (the old one stays with its open handles), and ESTALE makes the kernel look the name up
        again and retry the open on it, once, inside open(2). `still_named`: the old inode's
        writer still publishes to the name (a dup of a file published in place)."""
        self.stats.add("opens_renewed")
        self.names.drop(node.path.rpartition("/")[0])   # (pyfuse3 answers the name with this inode no more)
        if node.ino in self.fast.marked:   # (nor opens it: the name is another file now)
            self.fast.unmark(node)
        self.inodes.detach(node.path)
        if still_named:
            node.unlinked = False
            if len(self._named_still) > 4096:   # (names whose writers and readers are gone: let go)
                self._named_still = {p: live for p, nodes in self._named_still.items()
                                     if (live := [n for n in nodes if (self._still_named(n) and n.path == p)
                                                  or self._reads_name_file(n, p)])}
            self._named_still.setdefault(node.path, []).append(node)
        if self.kernel is not None:
            # the old inode is now the older file its handles read: attributes the kernel keeps
            # of it were the name's (a truncate's reply, say: kept for an immutable path's timeout)
            self.kernel.invalidate_attrs(node.ino)
        self._kernel_forgets_name(node.path)
        return Refused(errno.ESTALE, f"{node.path} {why}: open it again")

    def _kernel_forgets_name(self, path: str) -> None:
        """The kernel looks `path` up again (its entry, if it has one, is dropped: queued)."""
        head, _, name = path.rpartition("/")
        parent = self.inodes.by_path_get(head)
        if parent is not None and self.kernel is not None:
            self.kernel.invalidate_entry(parent.ino, name.encode("utf-8", "surrogateescape"))

    async def _kernel_forgets_name_at_once(self, path: str, no_dir_locks: bool) -> None:
        """As `_kernel_forgets_name`, but done before this returns where the request being
        answered holds no directory lock in the kernel (`no_dir_locks`: a close's FLUSH), in a
        worker thread (the kernel takes the folder's lock); queued otherwise, or it would wait on
        itself."""
        head, _, name = path.rpartition("/")
        parent = self.inodes.by_path_get(head)
        if not no_dir_locks:
            self._kernel_forgets_name(path)
        elif parent is not None and self.kernel is not None:
            await trio.to_thread.run_sync(self.kernel.invalidate_entry_now, parent.ino,
                                          name.encode("utf-8", "surrogateescape"))

    async def _check_backing_current(self, node: Inode) -> None:
        """Close-to-open under passthrough: the open files of `node` read the store file they
        were opened on, and the kernel gives one inode one backing file. If the store now has
        another file at that name (replaced, e.g. by a rename from another host), this name
        becomes a new inode: the old one stays with its open files, and ESTALE makes the kernel
        look the name up again and retry the open on the new inode (once, in open(2) itself)."""
        st = await self._store_now(node.path)
        if backing_key(st, replica=node.pt_file[0] == "replica") == node.pt_file:
            return
        self.stats.add("passthrough_replaced")
        raise self._renew(node, "was replaced in the store")

    def _same_as_cached(self, node: Inode, st: Stat) -> bool:
        """Close-to-open: keep the kernel's cached pages only if the file did not change."""
        ident = st.version()
        if node.cached_identity == ident:
            self.stats.add("open_keep_cache")
            return True
        if node.cached_identity is not None:
            self.stats.add("open_invalidate")
        node.cached_identity = ident
        return False

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int, ctx) -> tuple[OpenFile, Attributes]:
        parent = self._inode(parent_inode)
        if parent.control is not None:
            return await self._create_control(parent, name, flags, Caller.of(ctx))
        path = self._new_name(parent, name)
        self._stale_name(path)
        # the staging file is beside the target: a set-group-ID parent already gave its group
        set_owner = self._root_daemon and bool(ctx.uid or ctx.gid)
        parent_st = await self._stat_inode(parent) if set_owner else None
        inode = self.inodes.ensure(path)
        # (the kernel knows it as a regular file from this reply on: a lookup that later finds
        # another kind of node at the name gives the name a new inode, `inode_for`)
        inode.kind = stat_mod.S_IFREG
        self._fast_off(inode)
        async with self.publish_lock(inode):    # (as `_see_write`: never a staging a release drops)
            if self.inodes.by_ino.get(inode.ino) is not inode:
                # forgotten by the release this create waited for: a fresh inode for the name
                return await self.create(parent_inode, name, mode, flags, ctx)
            if inode.writer is None:
                inode.writer = await self.io(self.store.new_staging, path, False)
                self._stream_started(inode)
            if parent_st is not None:
                os.fchown(inode.writer.fd, ctx.uid, -1 if parent_st.mode & stat_mod.S_ISGID else ctx.gid)
            os.fchmod(inode.writer.fd, stat_mod.S_IMODE(mode) & ~ctx.umask)
            inode.writer.dirty = True   # an empty new file is still a file to create on close
            backing_id = 0
            if (inode.pt_staging is inode.writer and inode.pt_refs) or (
                    self.pt.on and not inode.pt_refs and self.pt.write_ok(inode.writer)):
                backing_id = self.pt.attach(inode, inode.writer.fd, inode.writer)
            if backing_id:
                inode.writer.unseen_writes = True
            inode.writer_refs += 1
            inode.lookups += 1
            inode.opens += 1
            inode.unlinked = False
        handle = PassthroughWrite(inode) if backing_id else WriteHandle(inode)
        fi = OpenFile(self._add_handle(handle), keep_cache=not backing_id, backing_id=backing_id)
        inode.cached_identity = None
        return fi, self.attrs(inode, await self._stat_inode(inode))

    # The data path returns the handle's coroutine (no await of its own: one frame per read).
    def read(self, fh: int, off: int, size: int) -> Awaitable[bytes]:
        h = self.handles.get(fh)
        if h is None:
            # An open pyfuse3 answered (the fast path): the kernel fills the FUSE file's own pages
            # (readahead asked for through it, `posix_fadvise(WILLNEED)`), answered from the
            # mark's backing file as a Python passthrough open's READ is.
            node = self.fast.node_of(fh)
            if node is None:
                raise Refused(errno.EBADF, f"no open file {fh}")
            h = PassthroughRead(node)
        return h.read(self, off, size)

    def write(self, fh: int, off: int, buf: bytes) -> Awaitable[int]:
        return self.handles[fh].write(self, off, buf)

    async def flush(self, fh: int) -> None:
        h = self.handles.get(fh)
        if h is not None:
            await h.flush(self)

    async def fsync(self, fh: int, datasync: bool) -> None:
        h = self.handles.get(fh)
        if h is not None:
            await h.fsync(self)

    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is not None:
            await h.release(self)
            if not isinstance(h, ControlHandle):
                kept = h.inode.kept
                if kept is not None and h.inode.opens <= 0:
                    h.inode.kept = None
                    await self.io(self.store.discard, kept, inline=kept.inline_io)
                self.stats.add("file_releases")   # (the model-based test waits for these)

    # -- writes: staging and publish ----------------------------------------------------------
    async def _acquire_writer(self, node: Inode, truncate: bool) -> None:
        if node.writer is None:
            staging = await self.io(self.store.new_staging, node.path, not truncate)
            node.writer = staging
            if truncate:
                staging.dirty = True
            self._stream_started(node)
        elif truncate:
            await self.ensure_private(node)
            await self.io(os.ftruncate, node.writer.fd, 0, inline=node.writer.inline_io)
            node.writer.dirty = True
            self._stream_started(node)   # a new generation: the tier forgets what it was sent
        node.writer_refs += 1

    async def ensure_private(self, node: Inode) -> None:
        """After a commit to a file:// store the staging fd *is* the live file: before writing
        again, stage a fresh copy so readers of the store never see a half-written file."""
        staging = node.writer
        if staging is None:   # dropped at unmount: the write says so (WriteHandle.write)
            return
        if staging.live and node.unlinked and not (node.pt_refs and node.pt_staging is staging):
            # The published file's name went through this mount, but the file may still be in the
            # store under another name (another host renamed it): writes go to a nameless copy,
            # never published.
            fresh = await self.io(self.store.nameless_copy, staging)
            self.store.discard(staging)
            node.writer = fresh
            self._stream_started(node)
            return
        if staging.live and not (node.pt_refs and node.pt_staging is staging):
            # (with passthrough the kernel writes into this very file: it cannot be swapped)
            # A copy of this open file's own content (the store may hold another file there by now)
            fresh = await self.io(self.store.new_staging, node.path, True, staging)
            self.store.discard(staging)
            node.writer = fresh
            await self._unnamed(node)     # (unlinked meanwhile: this copy is never published either)
            self._stream_started(node)

    async def commit(self, node: Inode, *, no_dir_locks: bool = False, closing: bool = False) -> None:
        """Publish the inode's staged writes, if any (and journal them): the one publish rule
        (docs/semantics.md, "The publish rule"). A publish happens at every close(2) of a write
        descriptor (`closing`: a FLUSH) that follows writes, at fsync, before a rename or link of
        the open file, and at the last release if anything was written since: every byte written
        through any descriptor is published, each time as a whole file. The stream to the tiers
        is told the version is final only at the last release (a FLUSH is per descriptor: a
        dup'ed one may still write). `no_dir_locks`: the request being answered holds no
        directory lock in the kernel (a close's flush), so the other names of a split hard link
        are forgotten before it returns, not some time after."""
        staging = node.writer
        if staging is None:
            return
        if node.unlinked:
            staging.dirty = False  # written to a name that no longer exists: nothing to publish
            return
        if staging.failed:
            # A close of this file failed: every later close and fsync fails too (a program that
            # checks only its last close learns it), and these bytes are never published.
            raise HintfsError(errno.EIO, f"not publishing {node.path}: {staging.failed}")
        unseen = staging.changed_unseen()
        if not staging.dirty and not unseen:
            return
        if staging.unseen_writes:
            await self.pt.check_unseen_writes(node, staging, self.io)
        writers_left = node.writer_refs - (1 if closing else 0)
        final = not closing and writers_left == 0
        if staging.live:
            # Passthrough writes after an earlier publish went into the published file itself:
            # nothing to move, but a new version to count, journal and stream. If the name holds
            # another file by now (replaced or removed by another mount or opener), this open's
            # file is published again, whole, by copy: the last close wins.
            staging.dirty = False
            staging.published = staging.identity()
            node.cached_identity = None
            if await self.io(self._still_published, node, staging, inline=self.meta_inline):
                await self._published(node, Stat.from_os(os.fstat(staging.fd)), final)
            else:
                st = await self.io(self.store.commit, staging, node.path, True)
                await self._name_replaced(node, no_dir_locks)
                await self._published(node, st, final)
            return
        # (taken before an upload: a write while it runs makes the next publish send it again)
        before = staging.identity() if staging.unseen_writes else None
        # With passthrough the kernel writes into the staging file itself: while another write
        # handle (or, for fsync/rename/link, this one) can still write, publish a copy, so the
        # published file never changes under its readers (docs/semantics.md).
        keep = node.pt_refs > 0 and node.pt_staging is staging and writers_left > 0
        if keep:
            self.stats.add("passthrough_copy_publishes")
        st = await self.io(self.store.commit, staging, node.path, keep)
        staging.dirty = False      # (also after a copy: what changes next is seen by the identity)
        # A rename made the staging the published file (and changed its ctime): that is the version.
        staging.published = staging.identity() if staging.live else before
        if node.aliases or node.backing is not None:
            # The other names keep the file as it was: the kernel must look them up again.
            for path in self.inodes.split_aliases(node):
                await self._kernel_forgets_name_at_once(path, no_dir_locks)
        node.cached_identity = st.version()
        await self._published(node, st, final and not keep)

    def _still_published(self, node: Inode, staging) -> bool:
        """The store's file at `node`'s name is this live staging file itself."""
        try:
            st = self.store.stat(node.path)
        except OSError:
            return False
        mine = os.fstat(staging.fd)
        return (st.dev, st.ino) == (mine.st_dev, mine.st_ino)

    async def _name_replaced(self, node: Inode, no_dir_locks: bool) -> None:
        """A file published in place, whose name this mount gave a new inode since (`_still_named`),
        was just published to the name again, by copy: what the name held on this mount (another
        file, a symlink) was replaced, as by a rename over it from elsewhere: the kernel looks the
        name up again, before the close returns where it can (`no_dir_locks`: a queued
        invalidation came after the next `stat` under load, which saw the symlink the kernel kept
        for an immutable path's timeout). A writer of the name keeps it (the mount shows its staged
        file there, and its own publish comes later)."""
        holder = self.inodes.by_path_get(node.path)
        if not self._still_named(node) or (holder is not None and holder.writer is not None):
            return
        self._stale_name(node.path)
        await self._kernel_forgets_name_at_once(node.path, no_dir_locks)

    async def _published(self, node: Inode, st: Stat, final: bool) -> None:
        """A version of `node` is in the store: count it, journal it, tell the stream; a listing the
        kernel keeps of its folder may lack its name (it was created through this mount and
        listed before its close): the kernel drops it first."""
        if self._named_still and self.inodes.by_path_get(node.path) is node:
            self._readers_keep_their_file(node.path)   # (the name holds this version now)
        folder = node.path.rpartition("/")[0]
        self.listings.drop(folder)
        if folder:
            # (the folder's own entry in its parent's kept listing has its mtime from before: a
            # lookup of the folder answered from it would let the kernel take its kept listing,
            # which the kernel checks against that mtime, for current)
            self.listings.drop(folder.rpartition("/")[0])
        parent = self.inodes.by_path_get(folder)
        if parent is not None and parent.ino in self._kernel_listed and self.kernel is not None:
            self._kernel_listed.discard(parent.ino)
            if not self.meta_inline:   # (a local folder's own mtime changed with the publish)
                # (dropping its pages does not drop an empty listing: a new mtime does, `getattr`)
                self._listing_changed[parent.ino] = time.time_ns()
            await trio.to_thread.run_sync(self.kernel.invalidate_listing, parent.ino)
        self.stats.add("commits")
        self.stats.add("bytes_uploaded", st.size)
        record = None
        if self.journal is not None:
            record = await self.journal.published(node.path, st, self.streams is not None
                                                  and self.streams.wants(node.path))
        if self.streams is not None:
            self.streams.published(node.ino, node.path, st, record, final=final)

    def _stream_started(self, node: Inode) -> None:
        if self.streams is not None and node.writer is not None and node.writer.fd >= 0:
            self.streams.started(node.ino, node.path, node.writer.fd)

    def writer_released(self, node: Inode) -> None:
        """The last write handle of `node` is gone (after its commit)."""
        if self.streams is not None:
            self.streams.released(node.ino)

    # -- tensors and control files --------------------------------------------------------------
    async def _open_tensor(self, node: Inode, flags: int, ctx) -> OpenFile:
        """Tensor or raw is fixed here, at the first open; handles open at once share it. The
        kernel checked the caller against the source's owner and mode (`_virtual_attrs`); the
        daemon checks again by the one access rule (folders included), so a `.tensor` never grants
        more than its source, whatever the kernel had cached."""
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise Refused(errno.EACCES, "tensor files are read-only")
        if node.virtual is None or self.tensors is None:   # (only `.tensor` inodes open here)
            raise Refused(errno.ENOENT, f"{node.path} is not a .tensor file")
        source, rule = node.virtual
        if ctx is not None and ctx.uid != 0:
            who = Caller.of(ctx)
            if not await self.io(access.Checker(self.store, who).may_read, source):
                log.warning("refused %s to uid %d: its source is not readable by them", node.path, who.uid)
                raise Refused(errno.EACCES, "the source is not readable by this user")
        if node.tensor_data is None:
            data = await self.tensors.fetch(source, rule)
            if node.tensor_data is None:
                node.tensor_data = data
        fh = self._add_handle(TensorHandle(node))
        node.opens += 1
        return OpenFile(fh, keep_cache=True, direct_io=True, noflush=True)

    def _open_control(self, node: Inode, flags: int, caller: Caller) -> OpenFile:
        target = node.control
        if isinstance(target, ControlDir):
            raise Refused(errno.EISDIR, "a control directory")
        accmode = flags & os.O_ACCMODE
        if accmode != os.O_RDONLY and not (isinstance(target, ControlFile) and target.may_open_for_write(caller)):
            raise Refused(errno.EACCES, "not writable by this caller")
        render = getattr(target, "render", None)
        if accmode == os.O_RDONLY and render is None:
            raise Refused(errno.EACCES, "write-only control file")
        content = render() if accmode != os.O_WRONLY and render is not None else b""
        fh = self._add_handle(ControlHandle(node, target, content, caller, writing=accmode != os.O_RDONLY))
        node.opens += 1
        return OpenFile(fh, keep_cache=True, direct_io=True, noflush=accmode == os.O_RDONLY)

    async def _create_control(self, parent: Inode, name: bytes, flags: int,
                              caller: Caller) -> tuple[OpenFile, Attributes]:
        ctl: ControlDir = parent.control
        text = name.decode("utf-8", "surrogateescape")
        node = ctl.child(text)
        if node is None:
            if ctl.make_file is None:
                raise Refused(errno.EACCES, "no files are created in this control directory")
            try:
                paths.job_name(text)
            except OSError as err:
                log.warning("refused to create .hintfs/%s/%s: %s", ctl.name, text[:80], err.strerror)
                raise Refused(errno.EINVAL, err.strerror or str(err)) from None
            full = ctl.room_for(caller)
            if full is not None:
                log.warning("refused to create .hintfs/%s/%r for uid %d: %s", ctl.name, text, caller.uid, full)
                raise Refused(errno.ENOSPC, full)
            node = ctl.make_file(text)
            node.uid, node.gid = caller.uid, caller.gid
            ctl.add(node)
        inode = self.control_inode(node)
        fi = self._open_control(inode, flags | os.O_WRONLY, caller)
        return fi, self.control_attrs(inode)

    # -- shutdown ------------------------------------------------------------------------------
    def abandon_open_writes(self) -> int:
        """At unmount: drop staged writes of files still open (never publish a torn file)."""
        dropped = [h.inode for h in list(self.handles.values()) if h.abandon(self.store)]
        if self.streams is not None:
            for node in dropped:
                self.streams.dropped(node.ino)
        return len(dropped)

    def open_write_paths(self) -> list[str]:
        """Store paths of files open for writing whose writes are not published yet (sorted)."""
        return sorted({h.inode.path for h in self.handles.values()
                       if isinstance(h, WriteHandle) and h.inode.writer is not None})


__all__ = ["Filesystem"]

"""Open file handles: what a handle does is decided once, at open, by its class.

`choose_handle` is that decision, a pure function of what the open sees (`OpenFacts`: flags,
control or virtual file, writer present, passthrough state, where the bytes come from — store,
replicas, the local tier — and whether a local fd of them can back the open). Its `HandleKind`
names the class; a passthrough kind whose backing file the kernel refuses falls back to
`HandleKind.fallback`, served on the daemon's path.

| class             | opened for                                   | read from                         |
|-------------------|----------------------------------------------|-----------------------------------|
| `StoreRead`       | reading a file with no writer open           | the store's reader (page cache)   |
| `StagingRead`     | reading a file some writer has open          | the writer's staging, then store  |
| `ReplicaRead`     | reading a hinted file with ready replicas, or a routed one the local tier holds | the agents (`ReplicaReads`) |
| `WriteHandle`     | writing (shares the inode's `Staging`)       | the staging                       |
| `PassthroughRead` | reading, served by the kernel (passthrough)  | the backing file (the daemon: only readahead through the FUSE file) |
| `PassthroughWrite`| writing, served by the kernel (passthrough)  | the staging, as backing file      |
| `ControlHandle`   | a `.hintfs/` control file                    | the document rendered at open     |
| `TensorHandle`    | an `x.tensor` virtual file                   | the bytes fixed at the first open |
| `DirHandle`, `ControlDirHandle` | a store / control directory    | (readdir)                         |

Each method takes the filesystem's services (`Services`) it needs; the filesystem calls
`handle.read(...)` etc. without asking which kind it holds. The hot path is `StoreRead.read`:
a page-cache hit is answered inline (`read_nowait`), a miss goes to a worker thread.
"""
from __future__ import annotations

import enum
import errno
import itertools
import logging
import os
from typing import NamedTuple, Protocol
from collections.abc import Awaitable, Callable, Iterator, Sequence

import trio

from hintfs.common import paths

from fusefs.attrs import Attributes, DirEntry, Refused
from fusefs.control import MAX_CONTROL_WRITE, Caller, ControlDir, ControlInputError, apply_write, refuse
from fusefs.inodes import Inode, InodeTable
from fusefs.listings import Listings
from fusefs.interfaces import ReplicaSource, Source
from fusefs.stats import Stats
from hintfs.stores.base import Reader, Staging, Stat, Store
from hintfs.stores.errors import errno_of

log = logging.getLogger("hintfs.ops")

EMPTY_DOCUMENT = "an empty document: nothing applied"

# readdir's callback: False when the kernel's buffer is full (the entry was not taken).
Reply = Callable[[DirEntry], bool]
# readdir's batch of name-only entries (the patched pyfuse3's `readdir_names`): names, their
# inode numbers, their types (S_IFMT >> 12, one byte each) and the next_id before the first; how
# many the kernel's buffer took.
ReplyNames = Callable[[list, list, bytes, int], int]
# The inode number of a name listed without an inode (libfuse's FUSE_UNKNOWN_INO): its `stat`
# gives the real one.
UNKNOWN_INO = 0xFFFFFFFF


# -- the choice, at open ------------------------------------------------------------------------
class HandleKind(enum.Enum):
    CONTROL = "control"                       # ControlHandle (`Filesystem._open_control`)
    TENSOR = "tensor"                         # TensorHandle (`Filesystem._open_tensor`)
    WRITE = "write"                           # WriteHandle
    PASSTHROUGH_WRITE = "passthrough write"   # PassthroughWrite: the kernel writes the staging file
    PASSTHROUGH_SHARED = "passthrough shared"  # PassthroughRead of the backing the inode's opens share
    STAGING_READ = "staging read"             # StagingRead
    REPLICA_READ = "replica read"             # ReplicaRead
    PASSTHROUGH_REPLICA = "passthrough replica"  # PassthroughRead: the kernel reads a replica on this host
    STORE_READ = "store read"                 # StoreRead
    PASSTHROUGH_STORE = "passthrough store"   # PassthroughRead: the kernel reads the store file

    @property
    def fallback(self) -> HandleKind:
        """The kind served when the kernel refuses this kind's backing file (itself if none)."""
        return _FALLBACK.get(self, self)


_FALLBACK = {HandleKind.PASSTHROUGH_WRITE: HandleKind.WRITE, HandleKind.PASSTHROUGH_REPLICA: HandleKind.REPLICA_READ,
             HandleKind.PASSTHROUGH_STORE: HandleKind.STORE_READ}


class OpenFacts(NamedTuple):
    """What an open sees, once its close-to-open checks passed and its reader (or staging) is open.
    (Immutable; a NamedTuple: built at every open, it costs a third of a frozen dataclass.)"""
    control: bool = False          # a `.hintfs/` node
    virtual: bool = False          # an `x.tensor` path
    writing: bool = False          # opened for writing, or with O_TRUNC
    passthrough: bool = False      # the kernel granted FUSE passthrough on this mount (still on)
    shared_backing: bool = False   # passthrough opens of this inode are active: one backing file for all
    writer: bool = False           # a writer of this mount has the file open (reads see its staging)
    other_opens: bool = False      # handles of this inode are open: a new backing file is never mixed in
    source: Source = Source.STORE  # where a read's bytes come from (`fusefs.readpath`)
    local_fd: bool = False         # an fd on this host can back the open: store file, replica, staging
    space_ok: bool = True          # writing: the staging file's filesystem has passthrough_min_free_mb


def choose_handle(f: OpenFacts) -> HandleKind:
    """The kind of handle an open gets (docs/semantics.md, "FUSE passthrough"); pure."""
    if f.control:
        return HandleKind.CONTROL
    if f.virtual:
        return HandleKind.TENSOR
    fresh_backing = f.passthrough and f.local_fd and not f.other_opens
    if f.writing:
        if f.local_fd and (f.shared_backing or (fresh_backing and f.space_ok)):
            return HandleKind.PASSTHROUGH_WRITE
        return HandleKind.WRITE
    if f.shared_backing:
        return HandleKind.PASSTHROUGH_SHARED
    if f.writer:
        return HandleKind.STAGING_READ
    if f.source in (Source.REPLICAS, Source.TIER):
        return HandleKind.PASSTHROUGH_REPLICA if fresh_backing else HandleKind.REPLICA_READ
    if f.source is Source.STORE and fresh_backing:
        return HandleKind.PASSTHROUGH_STORE
    return HandleKind.STORE_READ


class Services(Protocol):
    """What handles use of the filesystem (`fusefs.filesystem.Filesystem` provides it)."""
    store: Store
    stats: Stats
    inodes: InodeTable
    readdir_page: int
    meta_inline: bool
    listings: Listings

    def immutable(self, path: str) -> float: ...

    def io(self, fn: Callable, *args, inline: bool = False) -> Awaitable: ...
    async def commit(self, node: Inode, *, no_dir_locks: bool = False, closing: bool = False) -> None: ...
    async def ensure_private(self, node: Inode) -> None: ...
    def attrs(self, inode: Inode, st: Stat) -> Attributes: ...
    def inode_for(self, path: str, st: Stat) -> Inode: ...
    def control_attrs(self, inode: Inode) -> Attributes: ...
    def control_lookup(self, parent: Inode, name: str) -> Inode: ...
    def passthrough_detach(self, node: Inode) -> None: ...
    def writer_released(self, node: Inode) -> None: ...
    def publish_lock(self, node: Inode) -> trio.Lock: ...
    def reserved(self, path: str) -> bool: ...
    async def keep_for_readers(self, node: Inode, staging: Staging) -> None: ...


class Handle:
    """The default of every operation for a handle that does not support it."""
    __slots__ = ("inode",)

    def __init__(self, inode: Inode):
        self.inode = inode

    async def read(self, fs: Services, off: int, size: int) -> bytes:
        raise Refused(errno.EBADF, "not open for reading")

    async def write(self, fs: Services, off: int, buf: bytes) -> int:
        raise Refused(errno.EBADF, "not open for writing")

    async def readdir(self, fs: Services, start_id: int, reply: Reply, names: ReplyNames | None = None) -> int | None:
        raise Refused(errno.ENOTDIR, "not a folder")

    async def flush(self, fs: Services) -> None:
        return None

    async def fsync(self, fs: Services) -> None:
        return None

    async def release(self, fs: Services) -> None:
        fs.inodes.release_open(self.inode)

    def abandon(self, store: Store) -> bool:
        """At unmount: drop unpublished writes; True if there were any."""
        return False


# -- reads of store files ---------------------------------------------------------------------
class StoreRead(Handle):
    """A file read through the store's reader (page-cache hits served inline); while this mount
    writes the file, what it staged (one file, one page cache per mount)."""
    __slots__ = ("reader",)

    def __init__(self, inode: Inode, reader: Reader | None):
        self.inode = inode
        self.reader = reader
        if reader is not None:
            inode.add_reader(reader)

    async def read(self, fs: Services, off: int, size: int) -> bytes:
        node = self.inode
        staging = node.writer or node.kept
        if staging is not None:
            # The kernel keeps one page cache per file on a mount: while this mount writes the
            # file (or kept what its last writer left for the handles still open), every handle
            # reads that, as every open file of one inode does on a disk.
            return await read_staging(fs, staging, off, size)
        reader = self.reader
        if reader is None:   # (a StagingRead opens one before it reads here)
            raise OSError(errno.EIO, f"{node.path}: no reader")
        data = reader.read_nowait(off, size)
        if data is None:
            fs.stats.add("read_thread")
            data = await fs.io(reader.read, off, size)
        else:
            fs.stats.add("read_nowait_hit")
        fs.stats.add("bytes_read", len(data))
        return data

    async def release(self, fs: Services) -> None:
        if self.reader is not None:
            self.inode.drop_reader(self.reader)
            self.reader.close()
        fs.inodes.release_open(self.inode)


class StagingRead(StoreRead):
    """Opened while a writer had the file open: reads what the file's current writer on this
    mount has staged, else what the last one left (`Inode.kept`: the published file, kept open for
    the handles still open on it, so a rename or unlink of the name cannot swap another file in)."""
    __slots__ = ()

    def __init__(self, inode: Inode):
        self.inode = inode
        self.reader = None

    async def read(self, fs: Services, off: int, size: int) -> bytes:
        if self.reader is None:
            staging = self.inode.writer or self.inode.kept
            if staging is not None:
                return await read_staging(fs, staging, off, size)
            # The writer closed meanwhile: fall back to the store copy.
            self.reader, _st = await fs.io(fs.store.open_reader, self.inode.path, inline=fs.meta_inline)
            self.inode.add_reader(self.reader)
        return await StoreRead.read(self, fs, off, size)


class ReplicaRead(StoreRead):
    """Blocks come from replicas: a hinted file's (`locations` None: the ready ones at each read)
    or the local tier's (`locations`: that agent). The reader opened at open is kept for the
    handle's life: the store's copy of that version, which reads fall back to."""
    __slots__ = ("identity", "replicas", "locations")

    def __init__(self, inode: Inode, reader: Reader, identity: tuple[int, int], replicas: ReplicaSource,
                 locations: Sequence[str] | None = None):
        StoreRead.__init__(self, inode, reader)
        self.identity = identity
        self.replicas = replicas
        self.locations = locations

    async def read(self, fs: Services, off: int, size: int) -> bytes:
        assert self.reader is not None
        data = await self.replicas.read(self.inode.path, self.identity, off, size, fallback=self.reader,
                                        locations=self.locations)
        fs.stats.add("bytes_read", len(data))
        return data


async def read_staging(fs: Services, staging: Staging, off: int, size: int) -> bytes:
    """Read staged writes: inline when the staging file is in memory, else in a worker thread."""
    if staging.inline_io:
        data = os.pread(staging.fd, size, off)
    else:
        data = await fs.io(os.pread, staging.fd, size, off)
    fs.stats.add("bytes_read", len(data))
    return data


# -- writes -----------------------------------------------------------------------------------
class WriteHandle(Handle):
    """A file open for writing; all such handles of one inode share its Staging."""
    __slots__ = ()

    async def read(self, fs: Services, off: int, size: int) -> bytes:
        staging = self.inode.writer
        if staging is None:
            raise OSError(errno.EIO, f"the writes of {self.inode.path} were dropped at unmount")
        return await read_staging(fs, staging, off, size)

    async def write(self, fs: Services, off: int, buf: bytes) -> int:
        node = self.inode
        if node.writer is not None:
            await fs.ensure_private(node)
        staging = node.writer
        if staging is None:   # abandoned at unmount (abandon_open_writes), as `read` says
            raise OSError(errno.EIO, f"the writes of {node.path} were dropped at unmount")
        try:
            if staging.inline_io:
                n = os.pwrite(staging.fd, buf, off)
            else:
                n = await fs.io(os.pwrite, staging.fd, buf, off)
        except OSError as err:
            # A file with a hole where a write failed must not be published on close.
            staging.failed = f"write at offset {off} failed: {err.strerror}"
            raise
        staging.dirty = True
        fs.stats.add("bytes_written", n)
        return n

    async def flush(self, fs: Services) -> None:
        # close(2): the kernel holds no lock here
        await self._publish(fs, "close", no_dir_locks=True, closing=True)

    async def fsync(self, fs: Services) -> None:
        staging = self.inode.writer
        if staging is not None:
            await fs.io(os.fsync, staging.fd)
            await self._publish(fs, "fsync")

    async def _publish(self, fs: Services, what: str, **kw) -> None:
        """A close's or an fsync's publish. If it fails, the store keeps its previous content,
        the application is told (ENOSPC, EDQUOT, EACCES as they are, anything else EIO, as
        fsync(2) and close(2) say: not the ENOENT of a folder renamed away under a file published
        in place, model regression fast_fsync_of_a_still_named_writer_whose_folder_moved), and
        these bytes are never published later."""
        node = self.inode
        try:
            await fs.commit(node, **kw)
        except OSError as err:
            code = errno_of(err)
            log.error("%s of %s failed, the store kept its previous content: %s", what, node.path, err)
            if node.writer is not None and not node.writer.failed:
                node.writer.failed = f"an earlier {what} failed: {err}"
            code = code if code in (errno.ENOSPC, errno.EDQUOT, errno.EACCES) else errno.EIO
            raise Refused(code, f"{what} of {node.path} failed") from None

    async def release(self, fs: Services) -> None:
        node = self.inode
        node.writer_refs -= 1
        # The kernel closed this file before it sent RELEASE: an open that arrives while this
        # release waits below must not count it (it would be refused passthrough for a mix).
        fs.inodes.closing(node)
        dropped = None
        if node.writer_refs == 0:
            # Under the publish lock, as every change of which staging the inode has (an open for
            # writing, a create, a truncate by path): one that arrives meanwhile waits until this
            # staging is published and dropped; one that came first took it over (writer_refs).
            async with fs.publish_lock(node):
                staging = node.writer
                if staging is not None and node.writer_refs == 0:
                    try:
                        # Writes after the last flush (a dup'ed or inherited descriptor, mmap writeback).
                        await fs.commit(node)
                    except OSError as err:
                        log.error("publish of %s at its last release failed, the store keeps its previous "
                                  "version: %s", node.path, err)
                    finally:
                        if node.writer is staging and node.writer_refs == 0:   # (unmount drops it)
                            node.writer = None
                            fs.writer_released(node)
                            if node.opens > 0:
                                # Handles still open on the file read (and stat) what it was written
                                # to, whatever the name holds later (Filesystem.release drops it).
                                await fs.keep_for_readers(node, staging)
                            else:
                                dropped = staging
        if dropped is not None:
            # (no longer the inode's: an open waiting for the lock need not wait for this too)
            await fs.io(fs.store.discard, dropped, inline=dropped.inline_io)
        fs.inodes.maybe_drop(node)

    def abandon(self, store: Store) -> bool:
        node = self.inode
        if node.writer is None:
            return False
        log.warning("unmounting with %s still open for writing: its unclosed writes are dropped", node.path)
        store.discard(node.writer)
        node.writer = None
        return True


# -- FUSE passthrough ---------------------------------------------------------------------------
class PassthroughRead(Handle):
    """Opened with a backing id: the kernel reads (and maps) the backing file itself; the daemon
    sees the open and the release, and only the reads the kernel makes to fill the FUSE file's own
    page cache: readahead asked for through it (`posix_fadvise(POSIX_FADV_WILLNEED)`,
    `readahead(2)`: pyarrow's `read_table` does it), answered from the same backing file. (Refusing
    them was a counted EBADF per such call, issue 38.)"""
    __slots__ = ()

    async def read(self, fs: Services, off: int, size: int) -> bytes:
        node = self.inode
        if node.pt_staging is not None:   # a write open's staging is the backing file
            return await read_staging(fs, node.pt_staging, off, size)
        holder = node.pt_reader
        if holder is None:
            raise Refused(errno.EBADF, "passthrough open without a backing reader")
        fs.stats.add("passthrough_daemon_reads")
        if hasattr(holder, "read"):       # the store file's reader
            data = await fs.io(holder.read, off, size)
        else:                             # a replica's fd (`fusefs.passthrough.HeldFd`)
            data = await fs.io(os.pread, holder.fd, size, off)
        fs.stats.add("bytes_read", len(data))
        return data

    async def release(self, fs: Services) -> None:
        fs.passthrough_detach(self.inode)
        fs.inodes.release_open(self.inode)


class PassthroughWrite(WriteHandle):
    """Opened for writing with the staging file as backing file: writes and reads go to it
    without the daemon; flush and release publish it as for `WriteHandle`."""
    __slots__ = ()

    async def release(self, fs: Services) -> None:
        fs.passthrough_detach(self.inode)
        await WriteHandle.release(self, fs)


# -- control files and virtual files ------------------------------------------------------------
class ControlHandle(Handle):
    """An open `.hintfs/` file: reads see the document rendered at open; writes collect a
    document applied at flush (close) or, failing that, at release."""
    __slots__ = ("node", "content", "written", "dirty", "caller", "failed", "writing", "empty_unlogged")

    def __init__(self, inode: Inode, node, content: bytes, caller: Caller, writing: bool = False):
        self.inode = inode
        self.node = node
        self.content = content
        self.written = bytearray()
        # An open for writing is a document, also when nothing is written (an empty document is
        # refused at close like any invalid one, never silently accepted).
        self.dirty = writing
        self.writing = writing
        self.caller = caller
        self.failed = ""    # a write() of this open failed: the document is refused whole
        self.empty_unlogged = False   # an empty document was refused at a close, not logged yet

    async def read(self, fs: Services, off: int, size: int) -> bytes:
        return self.content[off:off + size]

    async def write(self, fs: Services, off: int, buf: bytes) -> int:
        end = off + len(buf)
        if end > MAX_CONTROL_WRITE:
            self.failed = f"document larger than {MAX_CONTROL_WRITE} bytes (EFBIG): nothing applied"
            self.dirty = True
            raise Refused(errno.EFBIG, self.failed)
        if len(self.written) < end:
            self.written.extend(b"\0" * (end - len(self.written)))
        self.written[off:end] = buf
        self.dirty = True
        return len(buf)

    def truncate(self, size: int) -> None:
        """`echo x > .hintfs/loglevel` truncates first."""
        del self.written[size:]

    async def apply(self, fs: Services) -> None:
        if not self.dirty:
            return
        self.dirty = False
        if self.failed:
            refuse(self.node, self.failed)
            fs.stats.add("control_refused")
            raise Refused(errno.EINVAL, self.failed)
        data = bytes(self.written)
        if not data.strip():
            # A shell redirect's first close (before its dup writes) lands here too: its later
            # close applies the document. So the reason is recorded now (close fails with EINVAL,
            # `<name>.error` says why) and logged at release only if no document came after it.
            self.node.last_error = EMPTY_DOCUMENT
            self.empty_unlogged = True
            raise Refused(errno.EINVAL, EMPTY_DOCUMENT)
        self.empty_unlogged = False
        try:
            await apply_write(self.node, data, self.caller, fs.store)
        except ControlInputError as err:
            fs.stats.add("control_refused")
            raise Refused(errno.EINVAL, str(err)) from None
        fs.stats.add("control_applied")

    async def flush(self, fs: Services) -> None:
        await self.apply(fs)

    async def release(self, fs: Services) -> None:
        # Control inodes are pinned: their open count is not kept.
        if self.dirty:
            try:
                await self.apply(fs)
            except Refused:
                pass
        if self.empty_unlogged:
            refuse(self.node, EMPTY_DOCUMENT, self.caller)
            fs.stats.add("control_refused")


class TensorHandle(Handle):
    """An `x.tensor` file: its bytes were fixed at the first open and are shared by all handles."""
    __slots__ = ()

    async def read(self, fs: Services, off: int, size: int) -> bytes:
        tensor = self.inode.tensor_data
        if tensor is None:   # (kept while any handle has the file open: Inodes.closing)
            raise OSError(errno.EIO, f"{self.inode.path}: the sample is gone")
        data = tensor[off:off + size]
        fs.stats.add("bytes_read", len(data))
        return data


# -- directories --------------------------------------------------------------------------------
class DirHandle(Handle):
    """A store directory, listed page by page as the kernel asks (remote stores: at once)."""
    __slots__ = ("entries", "source", "done", "in_thread", "hides", "since", "kernel_keeps", "by_name", "types_only",
                 "uid")

    def __init__(self, inode: Inode, kernel_keeps: bool = False, by_name: bool = False, uid: int = 0):
        self.inode = inode
        self.uid = uid   # whose opendir: a listing kept from it counts to that user (`Listings.users`)
        # The kernel may keep this listing (FOPEN_CACHE_DIR): a folder declared immutable
        # (`Filesystem.opendir`); it drops it when the folder changes through this mount.
        self.kernel_keeps = kernel_keeps
        # Files are given by name, type and inode number only (no inode made, no lookup
        # counted): the caller walks a tree (`fusefs.walks`). Folders keep their attributes.
        self.by_name = by_name
        self.types_only = False   # listed by `iter_names`: files' attributes are their types alone
        self.entries: list[tuple[str, Stat | None]] = []
        self.source: Iterator[tuple[str, Stat]] | None = None
        self.done = False
        self.in_thread = False   # pages of `source` are taken in a worker thread
        # Whether a reserved name (`Services.reserved`) can be in this folder (the folder of
        # the control dir or of a journal's): None until the first entry asks.
        self.hides: bool | None = None
        self.since = -1          # `Listings.changes` when the listing began

    async def fill(self, fs: Services, upto: int) -> None:
        """Fetch directory entries from the store until `upto` are known (paged listing)."""
        if self.done:
            return
        folder = self.inode.path
        if self.source is None and folder and fs.immutable(folder):
            kept = fs.listings.folder(folder)   # a folder declared immutable: its kept listing
            if kept is not None:
                self.entries.extend(kept.items())
                self.done = True
                return
        if self.source is None:
            self.since = fs.listings.changes
            if fs.meta_inline:
                # A local store lists in a worker thread where it can (a page at a time: its
                # stats are C calls there, and the loop answers requests meanwhile).
                in_thread = getattr(fs.store, "iter_dir_in_thread", None)
                names = getattr(fs.store, "iter_names", None) if self.by_name else None
                if names is not None:   # files by name: their d_type suffices, no stat (on the loop)
                    in_thread = None
                    self.types_only = True
                self.in_thread = in_thread is not None
                self.source = (names or in_thread or fs.store.iter_dir)(self.inode.path)
            else:
                # Remote listings come in one response; fetch them in a thread once.
                listing = await fs.io(lambda p: list(fs.store.iter_dir(p)), self.inode.path)
                self.entries.extend(listing)
                self.done = True
                self.keep(fs)
                return
        page_size = fs.readdir_page
        while not self.done and len(self.entries) < upto:
            page = await fs.io(_take, self.source, page_size, inline=not self.in_thread)
            self.entries.extend(page)
            if len(page) < page_size:
                self.done = True
                self.keep(fs)

    def keep(self, fs: Services) -> None:
        """A whole listing: kept for lookups (and later listings) where the folder or one of its
        names is declared immutable (`fusefs.listings`); not one of files' types alone."""
        if self.types_only:
            return
        folder = self.inode.path
        prefix = f"{folder}/" if folder else ""
        ttl = fs.immutable(folder) if folder else 0.0
        if not ttl:
            ttl = next((t for name, _ in self.entries if (t := fs.immutable(prefix + name))), 0.0)
        if ttl:
            fs.listings.put(folder, self.entries, ttl, since=self.since, uid=self.uid)

    async def readdir(self, fs: Services, start_id: int, reply: Reply, names: ReplyNames | None = None) -> int | None:
        """`names`: files given by name (`by_name`) go to the kernel a run at a time
        (`reply_names`), not one by one. The offset the listing ends at when this call gave its
        last entry (or had none left to give), else None (the kernel's buffer filled first)."""
        page_size = fs.readdir_page
        await self.fill(fs, start_id + page_size)
        if names is not None and (not self.by_name or self._hides(fs)):
            names = None
        i = start_id
        while True:
            if i >= len(self.entries):
                if self.done:
                    return len(self.entries)
                await self.fill(fs, i + page_size)
                if i >= len(self.entries):
                    return len(self.entries) if self.done else None
            if names is not None:
                i, full = self.reply_names(fs, i, names)
                if full:
                    return None
                if i >= len(self.entries):
                    continue
            name, st = self.entries[i]
            i += 1
            if not self.reply_one(fs, name, st, i, reply):
                return None

    def reply_names(self, fs: Services, i: int, reply: ReplyNames) -> tuple[int, bool]:
        """The run of files (not folders) from entry `i` on, given by name in one batch: (the
        entry after the last one the kernel took, whether its buffer is full). The same entries
        `reply_one` gives one at a time."""
        entries = self.entries
        end = i
        while end < len(entries) and (st := entries[end][1]) is not None and not st.is_dir:
            end += 1
        if end == i:
            return i, False
        parent = self.inode.path
        prefix = f"{parent}/" if parent else ""
        known = fs.inodes.by_path.get
        run = entries[i:end]
        raw = [os.fsencode(name) for name, _ in run]
        inos = [k.ino if (k := known(prefix + name)) is not None else UNKNOWN_INO for name, _ in run]
        kinds = bytes((st.mode & 0o170000) >> 12 for _, st in run if st is not None)
        took = reply(raw, inos, kinds, i)
        return i + took, took < len(run)

    def _hides(self, fs: Services) -> bool:
        """Whether this folder may hold a store folder named like the control dir or the journal
        (hidden from listings): the root, or the folder of a configured journal."""
        hides = self.hides
        if hides is None:
            parent = self.inode.path
            journal = getattr(fs, "journal_dir", paths.JOURNAL_DIR)
            hides = self.hides = parent in {t.rpartition("/")[0] for t in (paths.CONTROL_DIR, paths.JOURNAL_DIR, journal)}
        return hides

    def reply_one(self, fs: Services, name: str, st: Stat | None, next_id: int, reply: Reply) -> bool:
        """Offer one entry; False when the kernel took no more. An entry the kernel took counts
        as a lookup of its inode (it may `forget` it later)."""
        parent = self.inode.path
        path = f"{parent}/{name}" if parent else name
        if self._hides(fs) and fs.reserved(path):
            return True   # a store folder named like the control dir or the journal stays hidden
        if self.by_name and st is not None and not st.is_dir:
            known = fs.inodes.by_path_get(path)
            return reply(DirEntry(os.fsencode(name), Attributes(known.ino if known is not None else UNKNOWN_INO,
                                                                 st.mode, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0),
                                  next_id, plus=False))
        child = fs.inodes.ensure(path) if st is None else fs.inode_for(path, st)
        staging = child.writer
        if staging is not None and staging.fd >= 0 and child.path == path:
            # Being written through this mount: the kernel must get the staged attributes, as
            # lookup and getattr give them, not the store's (an O_APPEND write would land at
            # the store file's size, over what was written since).
            st = Stat.from_os(os.fstat(staging.fd))
        if st is None:   # (store listings carry attributes; the control folder's handle replies its own way)
            raise OSError(errno.EIO, f"{path}: listed without attributes")
        if not reply(DirEntry(os.fsencode(name), fs.attrs(child, st), next_id)):
            fs.inodes.maybe_drop(child)
            return False
        child.lookups += 1
        return True

    async def release(self, fs: Services) -> None:
        close = getattr(self.source, "close", None)   # a generator, or a listing with no close
        if close is not None:
            close()
        fs.inodes.release_open(self.inode)


class ControlDirHandle(DirHandle):
    """A `.hintfs/` directory: its entries are listed at once; they are pinned, no lookups count."""
    __slots__ = ()

    async def fill(self, fs: Services, upto: int) -> None:
        if not self.done:
            ctl: ControlDir = self.inode.control
            self.entries.extend((name, None) for name in ctl.entries())
            self.done = True

    def reply_one(self, fs: Services, name: str, st: Stat | None, next_id: int, reply: Reply) -> bool:
        child = fs.control_lookup(self.inode, name)
        return reply(DirEntry(name.encode(), fs.control_attrs(child), next_id))


def _take(iterator, n: int) -> list:
    return list(itertools.islice(iterator, n))

__all__ = ["HandleKind", "OpenFacts", "choose_handle", "Handle", "StoreRead", "StagingRead", "ReplicaRead", "WriteHandle", "PassthroughRead", "PassthroughWrite", "ControlHandle", "TensorHandle",
           "DirHandle", "ControlDirHandle", "Services", "Reply", "ReplyNames"]

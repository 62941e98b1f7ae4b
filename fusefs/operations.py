"""The FUSE operations: a thin translation between kernel requests and a `Store`.

Concurrency: pyfuse3 runs every handler as a trio task on one thread. A handler never blocks
that thread: store calls that may block go to worker threads (`_io`), bounded by a
CapacityLimiter; only page-cache hits (`read_nowait`) and local metadata syscalls of a
`file://` store run inline. docs/semantics.md states the consistency model this implements.
"""
from __future__ import annotations

import errno
import fnmatch
import functools
import itertools
import logging
import os
import stat as stat_mod
import time
from typing import Callable, Optional

import pyfuse3
import trio

from common import paths
from fusefs.control import (MAX_CONTROL_WRITE, MAX_JOB_FILES, Caller, ControlDir, ControlFile, ControlInputError,
                      ErrorView, apply_write, refuse)
from common.errors import HintfsError
from stores.errors import errno_of
from fusefs.inodes import Inode, InodeTable
from fusefs.routedstore import route_of
from fusefs.stats import Stats
from stores.base import Stat, Store

log = logging.getLogger("hintfs.ops")

_CONTROL_KEY = "\0control"  # prefix of control inode keys; cannot collide with a store path


def _op(name: str):
    """Time the handler, count errors, and turn any exception into an errno for the kernel."""

    def deco(fn):
        @functools.wraps(fn)
        async def wrapper(self, *args):
            t0 = time.perf_counter_ns()
            try:
                return await fn(self, *args)
            except pyfuse3.FUSEError as err:
                self.stats.error(name, err.errno)
                raise
            except OSError as err:
                code = errno_of(err)
                self.stats.error(name, code)
                level = logging.DEBUG if code in (errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY) else logging.WARNING
                log.log(level, "%s%r failed: %s (%s)", name, args[:2], err, errno.errorcode.get(code, code))
                raise pyfuse3.FUSEError(code) from None
            except trio.Cancelled:
                raise
            except Exception:
                self.stats.error(name, errno.EIO)
                log.exception("%s%r: unexpected error", name, args[:2])
                raise pyfuse3.FUSEError(errno.EIO) from None
            finally:
                self.stats.record(name, time.perf_counter_ns() - t0)

        return wrapper

    return deco


class ReadHandle:
    __slots__ = ("inode", "reader", "replicated", "identity")

    def __init__(self, inode: Inode, reader):
        self.inode = inode
        self.reader = reader
        self.replicated = False   # a hinted file with ready replicas: read from the agents
        self.identity = None


class WriteHandle:
    """A handle on a file open for writing; all such handles of one inode share its Staging."""
    __slots__ = ("inode",)

    def __init__(self, inode: Inode):
        self.inode = inode


class ControlHandle:
    __slots__ = ("inode", "node", "content", "written", "dirty", "caller", "failed")

    def __init__(self, inode: Inode, node, content: bytes, caller: Caller):
        self.inode = inode
        self.node = node
        self.content = content
        self.written = bytearray()
        self.dirty = False
        self.caller = caller
        self.failed = ""    # a write() of this open failed: the document is refused whole


class TensorHandle:
    __slots__ = ("inode",)

    def __init__(self, inode: Inode):
        self.inode = inode


class DirHandle:
    __slots__ = ("inode", "entries", "source", "done")

    def __init__(self, inode: Inode, source):
        self.inode = inode
        self.entries: list[tuple[str, Stat]] = []
        self.source = source
        self.done = False


class Operations(pyfuse3.Operations):
    def __init__(self, store: Store, cfg, stats: Optional[Stats] = None,
                 control_root: Optional[ControlDir] = None, replica_reads=None, tensors=None):
        super().__init__()
        self.tensors = tensors               # fusefs.tensorfile.TensorFiles: `x.mp4.tensor` paths
        self._journal_dir = cfg.journal.dir if cfg.journal.enabled else None
        self._hidden_root = {paths.CONTROL_DIR, cfg.journal.dir.split("/")[0]}
        self.routes = list(cfg.routes)
        self._route_checked: dict[tuple, bool] = {}
        self._route_fetching: set[str] = set()
        self.replica_reads = replica_reads   # fusefs.replicaread.ReplicaReads, for hinted files
        self.store = store
        self.cfg = cfg
        self.stats = stats or Stats()
        self.enable_writeback_cache = cfg.mount.writeback_cache
        self.inodes = InodeTable()
        self.handles: dict[int, object] = {}
        self._fh = itertools.count(1)
        self.io_limiter = trio.CapacityLimiter(cfg.mount.io_threads)
        self._attr_timeout = cfg.cache.attr_timeout_s
        self._entry_timeout = cfg.cache.entry_timeout_s
        self._immutable = list(cfg.cache.immutable_globs)
        self._immutable_timeout = cfg.cache.immutable_timeout_s
        self._readdir_page = cfg.mount.readdir_page
        self.control_root = control_root or ControlDir(paths.CONTROL_DIR)
        self._control_inodes: dict[int, Inode] = {}
        self._control_ino_of: dict[int, int] = {}   # id(node) -> ino
        self.control_inode(self.control_root)

    # -- helpers -------------------------------------------------------------------------------
    async def _io(self, fn: Callable, *args, inline: bool = False):
        """Run a store call: inline if it cannot block for long, else in a worker thread."""
        if inline:
            return fn(*args)
        return await trio.to_thread.run_sync(fn, *args, limiter=self.io_limiter)

    def _meta_inline(self) -> bool:
        return self.store.inline_metadata

    def _inode(self, ino: int) -> Inode:
        inode = self.inodes.get(ino)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ESTALE)
        return inode

    def _timeouts(self, path: str) -> tuple[float, float]:
        for pattern in self._immutable:
            if fnmatch.fnmatchcase(path, pattern):
                return self._immutable_timeout, self._immutable_timeout
        return self._attr_timeout, self._entry_timeout

    def _attrs(self, inode: Inode, st: Stat) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode.ino
        a.st_mode = st.mode
        a.st_nlink = st.nlink
        a.st_size = st.size
        a.st_uid = st.uid
        a.st_gid = st.gid
        a.st_blksize = 1 << 17
        a.st_blocks = (st.size + 511) // 512
        a.st_mtime_ns = st.mtime_ns
        a.st_ctime_ns = st.ctime_ns
        a.st_atime_ns = st.mtime_ns
        a.attr_timeout, a.entry_timeout = self._timeouts(inode.path)
        return a

    async def _stat_inode(self, inode: Inode) -> Stat:
        """Attributes as a reader through the mount sees them (staged writes included)."""
        if inode.writer is not None and inode.writer.fd >= 0:
            st = os.fstat(inode.writer.fd)
            return Stat.from_os(st)
        return await self._io(self.store.stat, inode.path, inline=self._meta_inline())

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

    def _control_attrs(self, inode: Inode) -> pyfuse3.EntryAttributes:
        node = inode.control
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode.ino
        # Directories where jobs create files are sticky like /tmp; a job file belongs to the user
        # who created it (and the mount's owner); everything else is read-only.
        a.st_uid, a.st_gid = os.getuid(), os.getgid()
        if isinstance(node, ControlDir):
            a.st_mode = stat_mod.S_IFDIR | (0o755 if node.make_file is None else 0o1777)
            a.st_nlink = 2
        elif isinstance(node, ControlFile) and node.writable:
            a.st_mode = stat_mod.S_IFREG | 0o644
            a.st_uid, a.st_gid = node.uid, node.gid
        else:
            a.st_mode = stat_mod.S_IFREG | 0o444
        a.st_size = 0  # content is generated; control files are opened with direct_io
        now = time.time_ns()
        a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = now
        a.attr_timeout = 0
        a.entry_timeout = 0
        return a

    def _control_lookup(self, parent: Inode, name: str):
        node = parent.control.child(name)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.control_inode(node)

    # -- namespace -----------------------------------------------------------------------------
    @_op("lookup")
    async def lookup(self, parent_inode, name, ctx=None):
        parent = self._inode(parent_inode)
        if parent.control is not None:
            inode = self._control_lookup(parent, name.decode("utf-8", "surrogateescape"))
            return self._control_attrs(inode)
        if parent_inode == pyfuse3.ROOT_INODE and name == paths.CONTROL_DIR.encode():
            return self._control_attrs(self.control_inode(self.control_root))
        path = paths.child(parent.path, name)
        if paths.is_hidden_name(path.rsplit("/", 1)[-1]):
            raise pyfuse3.FUSEError(errno.ENOENT)
        inode = self.inodes.by_path_get(path)
        if inode is not None and inode.writer is not None:
            st = await self._stat_inode(inode)
        else:
            try:
                st = await self._io(self.store.stat, path, inline=self._meta_inline())
            except FileNotFoundError:
                virtual = self.tensors.match(path) if self.tensors is not None else None
                if virtual is None:
                    raise
                await self._io(self.store.stat, virtual[0], inline=self._meta_inline())  # ENOENT if no source
                inode = self.inodes.ensure(path)
                inode.virtual = virtual
                inode.lookups += 1
                return self._virtual_attrs(inode)
            inode = self.inodes.ensure(path)
        inode.lookups += 1
        return self._attrs(inode, st)

    def _virtual_attrs(self, inode: Inode) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode.ino
        a.st_mode = stat_mod.S_IFREG | 0o444
        a.st_nlink = 1
        a.st_size = len(inode.tensor_data) if inode.tensor_data is not None else 0
        a.st_blksize = 1 << 17
        now = time.time_ns()
        a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = now
        a.attr_timeout = 0          # the size is known only while the file is open
        a.entry_timeout = self._entry_timeout
        return a

    async def forget(self, inode_list):
        for ino, n in inode_list:
            self.inodes.forget(ino, n)

    @_op("getattr")
    async def getattr(self, inode, ctx=None):
        node = self._inode(inode)
        if node.control is not None:
            return self._control_attrs(node)
        if node.virtual is not None:
            return self._virtual_attrs(node)
        return self._attrs(node, await self._stat_inode(node))

    @_op("setattr")
    async def setattr(self, inode, attr, fields, fh, ctx):
        node = self._inode(inode)
        if node.control is not None:
            if fields.update_size:  # `echo x > .hintfs/loglevel` truncates first
                h = self.handles.get(fh) if fh is not None else None
                if isinstance(h, ControlHandle):
                    del h.written[attr.st_size:]
                return self._control_attrs(node)
            raise pyfuse3.FUSEError(errno.EPERM)
        inline = self._meta_inline()
        if fields.update_size:
            await self._truncate(node, attr.st_size)
        if fields.update_mode:
            await self._io(self.store.chmod, node.path, stat_mod.S_IMODE(attr.st_mode), inline=inline)
            if node.writer is not None:
                os.fchmod(node.writer.fd, stat_mod.S_IMODE(attr.st_mode))
        if fields.update_uid or fields.update_gid:
            uid = attr.st_uid if fields.update_uid else -1
            gid = attr.st_gid if fields.update_gid else -1
            await self._io(self._chown, node.path, uid, gid, inline=inline)
        if fields.update_atime or fields.update_mtime:
            now = time.time_ns()
            st = await self._stat_inode(node)
            atime = attr.st_atime_ns if fields.update_atime else st.mtime_ns
            mtime = attr.st_mtime_ns if fields.update_mtime else st.mtime_ns
            del now
            if node.writer is not None:
                os.utime(node.writer.fd, ns=(atime, mtime))
            else:
                await self._io(self.store.utimens, node.path, atime, mtime, inline=inline)
        return self._attrs(node, await self._stat_inode(node))

    def _chown(self, rel: str, uid: int, gid: int) -> None:
        chown = getattr(self.store, "chown", None)
        if chown is None:
            raise HintfsError(errno.EPERM, "this store has no owners to change")
        chown(rel, uid, gid)

    async def _truncate(self, node: Inode, size: int) -> None:
        if node.writer is not None:
            await self._ensure_private(node)
            await self._io(os.ftruncate, node.writer.fd, size, inline=node.writer.inline_io)
            node.writer.dirty = True
            return
        # A truncate without an open writer (`truncate -s`): stage, cut, commit at once.
        staging = await self._io(self.store.new_staging, node.path, size > 0)
        try:
            await self._io(os.ftruncate, staging.fd, size)
            st = await self._io(self.store.commit, staging, node.path)
        finally:
            self.store.discard(staging)
        node.cached_identity = None
        del st

    @_op("readlink")
    async def readlink(self, inode, ctx):
        node = self._inode(inode)
        target = await self._io(self.store.readlink, node.path, inline=self._meta_inline())
        if not paths.symlink_target_ok(node.path, target):
            log.warning("refusing symlink %s -> %s: it points outside the store", node.path, target)
            raise pyfuse3.FUSEError(errno.EACCES)
        return os.fsencode(target)

    @_op("symlink")
    async def symlink(self, parent_inode, name, target, ctx):
        parent = self._inode(parent_inode)
        if parent.control is not None:
            raise pyfuse3.FUSEError(errno.EPERM)
        path = paths.child(parent.path, name)
        target_s = os.fsdecode(target)
        if not paths.symlink_target_ok(path, target_s):
            log.warning("refusing to create symlink %s -> %s: it would point outside the store", path, target_s)
            raise pyfuse3.FUSEError(errno.EPERM)
        inline = self._meta_inline()
        await self._io(self.store.symlink, path, target_s, inline=inline)
        st = await self._io(self.store.stat, path, inline=inline)
        inode = self.inodes.ensure(path)
        inode.lookups += 1
        return self._attrs(inode, st)

    @_op("mkdir")
    async def mkdir(self, parent_inode, name, mode, ctx):
        parent = self._inode(parent_inode)
        if parent.control is not None:
            raise pyfuse3.FUSEError(errno.EPERM)
        path = paths.child(parent.path, name)
        inline = self._meta_inline()
        await self._io(self.store.mkdir, path, stat_mod.S_IMODE(mode))
        st = await self._io(self.store.stat, path, inline=inline)
        inode = self.inodes.ensure(path)
        inode.lookups += 1
        return self._attrs(inode, st)

    @_op("rmdir")
    async def rmdir(self, parent_inode, name, ctx):
        parent = self._inode(parent_inode)
        if parent.control is not None:
            raise pyfuse3.FUSEError(errno.EPERM)
        path = paths.child(parent.path, name)
        await self._io(self.store.rmdir, path)
        self.inodes.detach(path)

    @_op("unlink")
    async def unlink(self, parent_inode, name, ctx):
        parent = self._inode(parent_inode)
        if parent.control is not None:
            raise pyfuse3.FUSEError(errno.EPERM)
        path = paths.child(parent.path, name)
        inode = self.inodes.by_path_get(path)
        try:
            # In a thread even for file://: freeing a large file's blocks can take 100s of ms.
            await self._io(self.store.unlink, path)
        except FileNotFoundError:
            # A file created through the mount but not yet closed exists only as staging.
            if inode is None or inode.writer is None:
                raise
        self.inodes.detach(path)

    @_op("rename")
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        old_parent = self._inode(parent_inode_old)
        new_parent = self._inode(parent_inode_new)
        if old_parent.control is not None or new_parent.control is not None:
            raise pyfuse3.FUSEError(errno.EPERM)
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        old = paths.child(old_parent.path, name_old)
        new = paths.child(new_parent.path, name_new)
        inode = self.inodes.by_path_get(old)
        if inode is not None and inode.writer is not None and inode.writer.dirty:
            # Not in the store yet (or stale there): commit what was written so far first, so
            # the rename moves the data the writer has produced (`mv` of a file still open).
            await self._commit(inode)
        await self._io(self.store.rename, old, new, bool(flags & pyfuse3.RENAME_NOREPLACE))
        self.inodes.move(old, new)

    @_op("statfs")
    async def statfs(self, ctx):
        sv = await self._io(self.store.statfs, inline=self._meta_inline())
        out = pyfuse3.StatvfsData()
        if sv is None:  # object stores: report a large, mostly free filesystem
            out.f_bsize = out.f_frsize = 1 << 20
            out.f_blocks = out.f_bfree = out.f_bavail = 1 << 30
            out.f_files = out.f_ffree = out.f_favail = 1 << 40
            out.f_namemax = 1024
            return out
        for field in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
                      "f_favail", "f_namemax"):
            setattr(out, field, getattr(sv, field))
        return out

    # -- directories ---------------------------------------------------------------------------
    @_op("opendir")
    async def opendir(self, inode, ctx):
        node = self._inode(inode)
        if node.control is not None:
            source = None
        else:
            st = await self._stat_inode(node)
            if not st.is_dir:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            source = None
        fh = next(self._fh)
        node.opens += 1
        self.handles[fh] = DirHandle(node, source)
        return fh

    async def _fill(self, h: DirHandle, upto: int) -> None:
        """Fetch directory entries from the store until `upto` are known (paged listing)."""
        if h.done:
            return
        if h.inode.control is not None:
            if not h.done:
                ctl: ControlDir = h.inode.control
                for name in ctl.entries():
                    h.entries.append((name, None))
                h.done = True
            return
        if h.source is None:
            if self._meta_inline():
                h.source = self.store.iter_dir(h.inode.path)
            else:
                # Remote listings come in one response; fetch them in a thread once.
                listing = await self._io(lambda p: list(self.store.iter_dir(p)), h.inode.path)
                h.entries.extend(listing)
                h.done = True
                return
        while not h.done and len(h.entries) < upto:
            page = await self._io(_take, h.source, self._readdir_page, inline=True)
            h.entries.extend(page)
            if len(page) < self._readdir_page:
                h.done = True

    @_op("readdir")
    async def readdir(self, fh, start_id, token):
        h: DirHandle = self.handles[fh]
        await self._fill(h, start_id + self._readdir_page)
        i = start_id
        while True:
            if i >= len(h.entries):
                if h.done:
                    return
                await self._fill(h, i + self._readdir_page)
                if i >= len(h.entries):
                    return
            name, st = h.entries[i]
            if h.inode.control is not None:
                child = self._control_lookup(h.inode, name)
                attrs = self._control_attrs(child)
                if not pyfuse3.readdir_reply(token, name.encode(), attrs, i + 1):
                    return
            else:
                path = f"{h.inode.path}/{name}" if h.inode.path else name
                if not h.inode.path and name in self._hidden_root:
                    i += 1  # a store folder named like the control dir stays hidden
                    continue
                child = self.inodes.ensure(path)
                attrs = self._attrs(child, st)
                if not pyfuse3.readdir_reply(token, os.fsencode(name), attrs, i + 1):
                    self.inodes._maybe_drop(child)
                    return
                child.lookups += 1
            i += 1

    @_op("releasedir")
    async def releasedir(self, fh):
        h: DirHandle = self.handles.pop(fh)
        close = getattr(h.source, "close", None)
        if close is not None:
            close()
        self.inodes.release_open(h.inode)

    # -- files ---------------------------------------------------------------------------------
    @_op("open")
    async def open(self, inode, flags, ctx):
        node = self._inode(inode)
        if node.control is not None:
            return self._open_control(node, flags, Caller.of(ctx))
        if node.virtual is not None:
            return await self._open_tensor(node, flags)
        fi = pyfuse3.FileInfo()
        accmode = flags & os.O_ACCMODE
        if accmode == os.O_RDONLY and not flags & os.O_TRUNC:
            if node.writer is not None:
                handle = ReadHandle(node, None)   # reads the staged data of the open writer
                fi.keep_cache = True
            else:
                reader, st = await self._io(self.store.open_reader, node.path, inline=self._meta_inline())
                handle = ReadHandle(node, reader)
                fi.keep_cache = self._same_as_cached(node, st)
                if self.routes and self.replica_reads is not None:
                    await self._route(node.path, st)
                if self.replica_reads is not None and self.replica_reads.has_replicas(node.path):
                    handle.replicated = True
                    handle.identity = st.identity()
        else:
            await self._acquire_writer(node, truncate=bool(flags & os.O_TRUNC))
            handle = WriteHandle(node)
            fi.keep_cache = True
        fh = next(self._fh)
        node.opens += 1
        self.handles[fh] = handle
        fi.fh = fh
        return fi

    def _same_as_cached(self, node: Inode, st: Stat) -> bool:
        """Close-to-open: keep the kernel's cached pages only if the file did not change."""
        ident = st.identity()
        if node.cached_identity == ident:
            self.stats.add("open_keep_cache")
            return True
        if node.cached_identity is not None:
            self.stats.add("open_invalidate")
        node.cached_identity = ident
        return False

    async def _acquire_writer(self, node: Inode, truncate: bool) -> None:
        if node.writer is None:
            staging = await self._io(self.store.new_staging, node.path, not truncate)
            node.writer = staging
            if truncate:
                staging.dirty = True
        elif truncate:
            await self._ensure_private(node)
            await self._io(os.ftruncate, node.writer.fd, 0, inline=node.writer.inline_io)
            node.writer.dirty = True
        node.writer_refs += 1

    async def _ensure_private(self, node: Inode) -> None:
        """After a commit to a file:// store the staging fd *is* the live file: before writing
        again, stage a fresh copy so readers of the store never see a half-written file."""
        staging = node.writer
        if staging.live:
            fresh = await self._io(self.store.new_staging, node.path, True)
            self.store.discard(staging)
            node.writer = fresh

    @_op("create")
    async def create(self, parent_inode, name, mode, flags, ctx):
        parent = self._inode(parent_inode)
        if parent.control is not None:
            return await self._create_control(parent, name, flags, Caller.of(ctx))
        path = paths.child(parent.path, name)
        if paths.is_hidden_name(path.rsplit("/", 1)[-1]):
            raise pyfuse3.FUSEError(errno.EACCES)
        inode = self.inodes.ensure(path)
        if inode.writer is None:
            inode.writer = await self._io(self.store.new_staging, path, False)
        os.fchmod(inode.writer.fd, stat_mod.S_IMODE(mode) & ~ctx.umask)
        if ctx.uid or ctx.gid:
            try:
                os.fchown(inode.writer.fd, ctx.uid, ctx.gid)
            except OSError:
                pass
        inode.writer.dirty = True   # an empty new file is still a file to create on close
        inode.writer_refs += 1
        inode.lookups += 1
        inode.opens += 1
        inode.unlinked = False
        fh = next(self._fh)
        self.handles[fh] = WriteHandle(inode)
        fi = pyfuse3.FileInfo(fh=fh, keep_cache=True)
        inode.cached_identity = None
        return fi, self._attrs(inode, await self._stat_inode(inode))

    @_op("read")
    async def read(self, fh, off, size):
        h = self.handles[fh]
        if isinstance(h, ControlHandle):
            return h.content[off:off + size]
        if isinstance(h, TensorHandle):
            data = h.inode.tensor_data[off:off + size]
            self.stats.add("bytes_read", len(data))
            return data
        if isinstance(h, WriteHandle) or h.reader is None:
            staging = h.inode.writer
            if staging is None:  # the writer closed meanwhile: fall back to the store copy
                reader, _st = await self._io(self.store.open_reader, h.inode.path, inline=self._meta_inline())
                h.reader = reader
                return await self.read(fh, off, size)
            if staging.inline_io:
                data = os.pread(staging.fd, size, off)
            else:
                data = await self._io(os.pread, staging.fd, size, off)
            self.stats.add("bytes_read", len(data))
            return data
        if h.replicated:
            data = await self.replica_reads.read(h.inode.path, h.identity, off, size)
            self.stats.add("bytes_read", len(data))
            return data
        reader = h.reader
        data = reader.read_nowait(off, size)
        if data is None:
            self.stats.add("read_thread")
            data = await self._io(reader.read, off, size)
        else:
            self.stats.add("read_nowait_hit")
        self.stats.add("bytes_read", len(data))
        return data

    @_op("write")
    async def write(self, fh, off, buf):
        h = self.handles[fh]
        if isinstance(h, ControlHandle):
            end = off + len(buf)
            if end > MAX_CONTROL_WRITE:
                h.failed = f"document larger than {MAX_CONTROL_WRITE} bytes (EFBIG): nothing applied"
                h.dirty = True
                raise pyfuse3.FUSEError(errno.EFBIG)
            if len(h.written) < end:
                h.written.extend(b"\0" * (end - len(h.written)))
            h.written[off:end] = buf
            h.dirty = True
            return len(buf)
        if not isinstance(h, WriteHandle):
            raise pyfuse3.FUSEError(errno.EBADF)
        node = h.inode
        await self._ensure_private(node)
        staging = node.writer
        try:
            if staging.inline_io:
                n = os.pwrite(staging.fd, buf, off)
            else:
                n = await self._io(os.pwrite, staging.fd, buf, off)
        except OSError as err:
            # A file with a hole where a write failed must not be published on close.
            staging.failed = f"write at offset {off} failed: {err.strerror}"
            raise
        staging.dirty = True
        self.stats.add("bytes_written", n)
        return n

    async def _commit(self, node: Inode) -> None:
        staging = node.writer
        if staging is None or not staging.dirty:
            return
        if node.unlinked:
            staging.dirty = False  # written to a name that no longer exists: nothing to publish
            return
        if staging.failed:
            raise HintfsError(errno.EIO, f"not publishing {node.path}: {staging.failed}")
        size = staging.size()
        st = await self._io(self.store.commit, staging, node.path)
        self.stats.add("commits")
        self.stats.add("bytes_uploaded", size)
        node.cached_identity = st.identity()
        if self._journal_dir is not None:
            from common.journal import encode_record, record_name
            try:
                await self._io(self.store.put_small,
                               f"{self._journal_dir}/{record_name(node.path, st.size, st.mtime_ns)}",
                               encode_record(node.path, st.size, st.mtime_ns))
                self.stats.add("journal_records")
            except OSError as err:   # the file is published; followers fall back to listing
                log.warning("journal record for %s failed: %s", node.path, err)

    @_op("flush")
    async def flush(self, fh):
        h = self.handles.get(fh)
        if isinstance(h, ControlHandle):
            return await self._apply_control(h)
        if isinstance(h, WriteHandle):
            try:
                await self._commit(h.inode)
            except OSError as err:
                code = errno_of(err)
                log.error("close of %s failed, the store kept its previous content: %s", h.inode.path, err)
                # The application was told this close failed: never publish these bytes later.
                if h.inode.writer is not None and not h.inode.writer.failed:
                    h.inode.writer.failed = f"an earlier close failed: {err}"
                raise pyfuse3.FUSEError(code if code in (errno.ENOSPC, errno.EDQUOT, errno.EACCES) else errno.EIO)

    @_op("fsync")
    async def fsync(self, fh, datasync):
        h = self.handles.get(fh)
        if isinstance(h, WriteHandle) and h.inode.writer is not None:
            staging = h.inode.writer
            await self._io(os.fsync, staging.fd)
            await self._commit(h.inode)

    @_op("release")
    async def release(self, fh):
        h = self.handles.pop(fh, None)
        if h is None:
            return
        node = h.inode
        if isinstance(h, ControlHandle):
            if h.dirty:
                try:
                    await self._apply_control(h)
                except pyfuse3.FUSEError:
                    pass
            return
        if isinstance(h, ReadHandle) and h.reader is not None:
            h.reader.close()
        if isinstance(h, WriteHandle):
            node.writer_refs -= 1
            if node.writer_refs == 0:
                staging = node.writer
                try:
                    # Writes that arrive after the last flush (mmap writeback) still count.
                    await self._commit(node)
                except OSError as err:
                    log.error("upload of %s at release failed: %s", node.path, err)
                finally:
                    node.writer = None
                    await self._io(self.store.discard, staging, inline=staging.inline_io)
        self.inodes.release_open(node)

    async def _route(self, path: str, st: Stat) -> None:
        """Eval side: serve a routed path from the local tier when it holds exactly this version
        (size and mtime verified by the agent); otherwise read through and ask it to fetch."""
        route = route_of(self.routes, path)
        if route is None:
            return
        key = (path, st.identity())
        if self._route_checked.get(key):
            return
        client = self.replica_reads.clients[route.local_agent]
        try:
            local = await self._io(client.has, path, st.size, st.mtime_ns)
        except OSError as err:
            log.warning("local tier %s unavailable for %s: %s", route.local_agent, path, err)
            local = False
        router = self.replica_reads.router
        if local:
            self._route_checked[key] = True
            router.replicas[path] = [route.local_agent]
            self.stats.add("route_local")
            return
        router.replicas.pop(path, None)
        self.stats.add("route_remote")
        if route.fetch_on_read and path not in self._route_fetching:
            self._route_fetching.add(path)
            trio.lowlevel.spawn_system_task(self._fetch_to_local_tier, client, path)

    async def _fetch_to_local_tier(self, client, path: str) -> None:
        try:
            # An eval is waiting for this file: eval class, twice the weight of predictive copies.
            job = "/".join(path.split("/")[:-2])
            await self._io(client.replicate, path, 86400.0, None, "eval", job, 2.0)
            self.stats.add("route_fetches")
        except OSError as err:
            log.warning("local tier fetch of %s failed: %s", path, err)
        finally:
            self._route_fetching.discard(path)

    async def _open_tensor(self, node: Inode, flags: int) -> pyfuse3.FileInfo:
        """Tensor or raw is fixed here, at the first open; handles open at once share it."""
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EACCES)
        if node.tensor_data is None:
            source, rule = node.virtual
            data = await self.tensors.fetch(source, rule)
            if node.tensor_data is None:
                node.tensor_data = data
        fh = next(self._fh)
        node.opens += 1
        self.handles[fh] = TensorHandle(node)
        return pyfuse3.FileInfo(fh=fh, direct_io=True)

    async def store_read(self, path: str, off: int, length: int) -> bytes:
        """One read of the store copy (the last fallback of replica reads)."""
        def read():
            reader, _st = self.store.open_reader(path)
            try:
                return reader.read(off, length)
            finally:
                reader.close()
        return await self._io(read)

    # -- control files -------------------------------------------------------------------------
    def _open_control(self, node: Inode, flags: int, caller: Caller) -> pyfuse3.FileInfo:
        target = node.control
        if isinstance(target, ControlDir):
            raise pyfuse3.FUSEError(errno.EISDIR)
        accmode = flags & os.O_ACCMODE
        if accmode != os.O_RDONLY and not (isinstance(target, ControlFile) and target.may_open_for_write(caller)):
            raise pyfuse3.FUSEError(errno.EACCES)
        render = getattr(target, "render", None)
        if accmode == os.O_RDONLY and render is None:
            raise pyfuse3.FUSEError(errno.EACCES)
        content = render() if accmode != os.O_WRONLY and render is not None else b""
        fh = next(self._fh)
        self.handles[fh] = ControlHandle(node, target, content, caller)
        node.opens += 1
        return pyfuse3.FileInfo(fh=fh, direct_io=True)

    async def _create_control(self, parent: Inode, name: bytes, flags: int, caller: Caller):
        ctl: ControlDir = parent.control
        text = name.decode("utf-8", "surrogateescape")
        node = ctl.child(text)
        if node is None:
            if ctl.make_file is None:
                raise pyfuse3.FUSEError(errno.EACCES)
            try:
                paths.job_name(text)
            except OSError as err:
                log.warning("refused to create .hintfs/%s/%s: %s", ctl.name, text[:80], err.strerror)
                raise pyfuse3.FUSEError(errno.EINVAL) from None
            if ctl.job_files() >= MAX_JOB_FILES:
                log.warning("refused to create .hintfs/%s/%s: %d job files exist", ctl.name, text, MAX_JOB_FILES)
                raise pyfuse3.FUSEError(errno.ENOSPC)
            node = ctl.make_file(text)
            node.uid, node.gid = caller.uid, caller.gid
            ctl.add(node)
        inode = self.control_inode(node)
        fi = self._open_control(inode, flags | os.O_WRONLY, caller)
        return fi, self._control_attrs(inode)

    async def _apply_control(self, h: ControlHandle) -> None:
        if not h.dirty:
            return
        h.dirty = False
        if h.failed:
            refuse(h.node, h.failed)
            self.stats.add("control_refused")
            raise pyfuse3.FUSEError(errno.EINVAL)
        data = bytes(h.written)
        try:
            await apply_write(h.node, data, h.caller, self.store)
        except ControlInputError:
            self.stats.add("control_refused")
            raise pyfuse3.FUSEError(errno.EINVAL)
        self.stats.add("control_applied")

    # -- shutdown ------------------------------------------------------------------------------
    def abandon_open_writes(self) -> int:
        """At unmount: drop staged writes of files still open (never publish a torn file)."""
        n = 0
        for h in list(self.handles.values()):
            if isinstance(h, WriteHandle) and h.inode.writer is not None:
                log.warning("unmounting with %s still open for writing: its unclosed writes are dropped",
                            h.inode.path)
                self.store.discard(h.inode.writer)
                h.inode.writer = None
                n += 1
        return n


def _take(iterator, n: int) -> list:
    return list(itertools.islice(iterator, n))


__all__ = ["Operations", "ErrorView"]

"""The pyfuse3 adapter: one line per operation over `fusefs.filesystem.Filesystem`.

It converts arguments and results (hintfs's plain types <-> pyfuse3's) and, in one wrapper
(`_op`), times each operation, counts errors in the stats and turns exceptions into the errno
the kernel gets: `Refused` is an expected answer, an `OSError` the store's or the system's,
anything else is logged with its traceback and answered EIO. Every errno answered is counted
and logged, at most one line per errno and operation a minute, with an example path where the
log is the mount owner's alone (`fusefs.stats.ErrnoLog`; every call at DEBUG). The semantics live in the filesystem, which a test drives without a mount.
Like mountpoint-s3's fuse.rs: each operation is one line of `FuseOperations`.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import time
from typing import Any
from collections.abc import Awaitable, Callable, Sequence

import pyfuse3
import trio

from fusefs import attrs
from fusefs.attrs import Attributes, FsStats, OpenFile, Refused
from fusefs.filesystem import Filesystem
from mountconfig.schema import MountOptions
from hintfs.stores.base import StatxDirFactory
from hintfs.stores.errors import errno_of

log = logging.getLogger("hintfs.ops")

assert pyfuse3.ROOT_INODE == attrs.ROOT_INODE
assert (pyfuse3.RENAME_EXCHANGE, pyfuse3.RENAME_NOREPLACE) == (attrs.RENAME_EXCHANGE, attrs.RENAME_NOREPLACE)


def _op(name: str, method: Callable, result: Callable | None = None):
    """The handler pyfuse3 calls for operation `name`: `method(fs, *args)`, its result converted
    by `result`. It times the call, counts errors and turns any exception into an errno for
    the kernel (one coroutine frame: `method`'s; `read`/`write` return the handle's)."""

    async def handler(self, *args):
        t0 = time.perf_counter_ns()
        try:
            out = await method(self.fs, *args)
            return out if result is None else result(out)
        except Refused as err:
            refused = err.errno or errno.EIO   # (every Refused names its errno)
            self.stats.error(name, refused, functools.partial(path_of, self.fs, name, args), err.strerror)
            raise pyfuse3.FUSEError(refused) from None
        except OSError as err:
            code = errno_of(err)
            self.stats.error(name, code, functools.partial(path_of, self.fs, name, args), str(err))
            if self.stats.errno_log.with_paths:   # (names and paths only in a log no other user reads)
                log.debug("%s%r failed: %s (%s)", name, args[:2], err, errno.errorcode.get(code, code))
            raise pyfuse3.FUSEError(code) from None
        except trio.Cancelled:
            raise
        except Exception:
            self.stats.error(name, errno.EIO, functools.partial(path_of, self.fs, name, args), "unexpected error")
            log.exception("%s%r: unexpected error", name, args[:2])
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            self.stats.ops[name].record(time.perf_counter_ns() - t0)   # (Stats.record, one call less)

    handler.__name__ = handler.__qualname__ = name
    return handler


# Operations whose first argument is a file handle; the others name an inode, and those that
# name an entry (lookup, create, mkdir, unlink, rename, ...) a folder's inode and a name.
_FH_OPS = frozenset({"read", "write", "flush", "fsync", "release", "readdir", "releasedir"})


def path_of(fs: Filesystem, op: str, args: tuple) -> str | None:
    """The path a failed request was about, for its log line (`fusefs.stats.ErrnoLog`): asked
    only when a line is written. None if it cannot be told (a handle or inode gone meanwhile)."""
    if not args or not isinstance(args[0], int):
        return None
    if op in _FH_OPS:
        handle = fs.handles.get(args[0])
        inode = getattr(handle, "inode", None)
    else:
        inode = fs.inodes.get(args[0])
    if inode is None:
        return None
    path: str = inode.path
    if op not in _FH_OPS and len(args) > 1 and isinstance(args[1], bytes):
        name = os.fsdecode(args[1])
        path = f"{path}/{name}" if path else name
    return path or "/"


def _entry(a: Attributes, e: pyfuse3.EntryAttributes | None = None) -> pyfuse3.EntryAttributes:
    """`a` as pyfuse3's type: into `e` if given (readdir reuses one: `readdir_reply` copies it)."""
    if e is None:
        e = pyfuse3.EntryAttributes()
    e.st_ino = a.st_ino
    e.st_mode = a.st_mode
    e.st_nlink = a.st_nlink
    e.st_size = a.st_size
    e.st_uid = a.st_uid
    e.st_gid = a.st_gid
    e.st_blksize = a.st_blksize
    e.st_blocks = a.st_blocks
    e.st_mtime_ns = a.st_mtime_ns
    e.st_ctime_ns = a.st_ctime_ns
    e.st_atime_ns = a.st_atime_ns
    e.attr_timeout = a.attr_timeout
    e.entry_timeout = a.entry_timeout
    e.st_rdev = a.st_rdev
    return e


def _name_only(a: Attributes, e: pyfuse3.EntryAttributes) -> pyfuse3.EntryAttributes:
    """What an entry without attributes carries (its inode number and type): the rest of `e` is
    not sent (`readdir_reply(plus=False)`)."""
    e.st_ino = a.st_ino
    e.st_mode = a.st_mode
    return e


# pyfuse3 with patches/pyfuse3-passthrough.patch has `backing_id` and `noflush`; stock has neither.
_PATCHED = hasattr(pyfuse3, "passthrough_supported")
# The patch's additions (passthrough_*, FileInfo's backing_id and noflush) are reached through this
# untyped name: the patched pyfuse3's types declare them, stock pyfuse3's do not.
_patched: Any = pyfuse3


def _info(f: OpenFile) -> pyfuse3.FileInfo:
    if _PATCHED:
        info: pyfuse3.FileInfo = _patched.FileInfo(fh=f.fh, keep_cache=f.keep_cache, direct_io=f.direct_io,
                                                   backing_id=f.backing_id, noflush=f.noflush)
        return info
    return pyfuse3.FileInfo(fh=f.fh, keep_cache=f.keep_cache, direct_io=f.direct_io)


def _statvfs(s: FsStats) -> pyfuse3.StatvfsData:
    out = pyfuse3.StatvfsData()
    for field in FsStats.__slots__:
        setattr(out, field, getattr(s, field))
    return out


def _created(r: tuple[OpenFile, Attributes]) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
    return _info(r[0]), _entry(r[1])


# pyfuse3 with patches/pyfuse3-readdir.patch takes (fh, cache_dir) from opendir and entries
# without attributes in readdir_reply (`plus`); stock, an fh only and readdirplus entries.
_CACHE_DIR = hasattr(pyfuse3, "cache_dir_supported")
# patches/pyfuse3-readdir-names.patch: a run of name-only entries in one call
_READDIR_NAMES = hasattr(pyfuse3, "readdir_names")
names_listings = _CACHE_DIR


async def _opendir(fs: Filesystem, inode: int, ctx=None) -> int | tuple[int, bool]:
    fh = await fs.opendir(inode, ctx)
    if _CACHE_DIR:
        return fh, getattr(fs.handles[fh], "kernel_keeps", False)
    return fh


def _readdir(fs: Filesystem, fh: int, start_id: int, token) -> Awaitable[None]:
    # readdirplus (pyfuse3 asks for it at init): the kernel caches each entry's name and attributes
    # for their timeouts, so `ls -l` or a `stat` after a listing sends no lookups; an entry with
    # `plus` False (the patched pyfuse3's argument) is a name only (`fusefs.walks`).
    attrs = pyfuse3.EntryAttributes()
    if _CACHE_DIR:
        named = _patched.readdir_reply
        batch = functools.partial(_patched.readdir_names, token) if _READDIR_NAMES else None
        return fs.readdir(fh, start_id, lambda e: named(token, e.name, _entry(e.attrs, attrs) if e.plus else
                                                        _name_only(e.attrs, attrs), e.next_id, e.plus), batch)
    reply = pyfuse3.readdir_reply
    return fs.readdir(fh, start_id, lambda e: reply(token, e.name, _entry(e.attrs, attrs), e.next_id))


class KernelNotices:
    """`fusefs.interfaces.KernelNotices` over pyfuse3: names the kernel must forget."""

    def invalidate_entry(self, parent: int, name: bytes) -> None:
        pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)

    def invalidate_listing(self, folder: int) -> None:
        """pyfuse3.invalidate_inode of a folder: its kept listing lives in its page cache."""
        try:
            pyfuse3.invalidate_inode(folder, attr_only=False)
        except FileNotFoundError:
            pass      # the kernel no longer knows the folder: nothing kept

    def invalidate_attrs(self, inode: int) -> None:
        """pyfuse3.invalidate_inode with attr_only: the kernel drops the attributes (no page, no
        lock: it does not wait on a request in flight)."""
        try:
            pyfuse3.invalidate_inode(inode, attr_only=True)
        except FileNotFoundError:
            pass

    def invalidate_entry_now(self, parent: int, name: bytes) -> None:
        """pyfuse3.invalidate_entry, blocking until the kernel applied it; a name it no longer
        caches is fine (the async form's ignore_enoent)."""
        try:
            pyfuse3.invalidate_entry(parent, name)
        except FileNotFoundError:
            pass


# Read requests the kernel has queued for the daemon (the patched pyfuse3; None with stock).
queued_reads: Callable[[], int | None] = getattr(pyfuse3, "queued_reads", lambda: None)


class _Backing:
    """Registers backing files with the kernel (the patched pyfuse3's ioctls on the session fd)."""

    def open(self, fd: int) -> int:
        backing_id: int = _patched.passthrough_open(fd)
        return backing_id

    def close(self, backing_id: int) -> None:
        _patched.passthrough_close(backing_id)


def passthrough_backend(setting: str, store_capable: bool,
                        writeback_cache: bool = False) -> tuple[_Backing | None, str]:
    """(the backend, or None) and why: what `hintfs status` shows."""
    if setting == "off":
        return None, "off (mount.passthrough = \"off\")"
    if not store_capable:
        return None, "off (the store's files are not on this host: file://, or [cache] dir for a remote store)"
    if writeback_cache:   # the kernel grants one or the other
        return None, "off (mount.writeback_cache = true: the kernel does not combine it with passthrough)"
    if not getattr(pyfuse3, "passthrough_supported", lambda: False)():
        return None, "unavailable (pyfuse3 without passthrough: run make passthrough-libs)"
    if not _patched.passthrough_enabled():
        return None, "unavailable (the kernel did not grant FUSE passthrough: Linux >= 6.9 with CONFIG_FUSE_PASSTHROUGH)"
    return _Backing(), "on"


class _Fast:
    """The fast path's table in the patched pyfuse3 (patches/pyfuse3-fastpath.patch)."""

    def mark(self, ino: int, backing_id: int, attrs: Attributes | None,
             check: tuple[int, bytes, int, int] | None = None) -> None:
        if check is None:
            _patched.fast_mark(ino, backing_id, None if attrs is None else _entry(attrs))
        else:
            _patched.fast_mark(ino, backing_id, None if attrs is None else _entry(attrs), check)

    def unmark(self, ino: int) -> int:
        left: int = _patched.fast_unmark(ino)
        return left

    def opens(self, ino: int) -> int:
        n: int = _patched.fast_opens(ino)
        return n

    def stats(self) -> tuple[int, int, int, int]:
        opened, released, serving, getattrs = _patched.fast_stats()
        return opened, released, serving, getattrs

    @property
    def checks(self) -> bool:
        """Whether marks may carry a close-to-open check (patches/pyfuse3-fastverify.patch; a
        check needs openat2 too, which `LocalStore.same_file_check` asks)."""
        return hasattr(_patched, "fast_check_supported")

    def check_stats(self) -> tuple[int, int, int, int]:
        checked, missed, names_checked, names_missed = _patched.fast_check_stats() if self.checks else (0, 0, 0, 0)
        return checked, missed, names_checked, names_missed

    @property
    def lazy(self) -> bool:
        """Whether marks may be made before any open, pyfuse3 opening each at its first open
        (patches/pyfuse3-fastlazy.patch)."""
        return hasattr(_patched, "fast_mark_lazy")

    def mark_lazy(self, entries: list[tuple[int, tuple[int, bytes, int, int]]]) -> None:
        _patched.fast_mark_lazy(entries)

    def lazy_opened(self) -> list[tuple[int, int, int]]:
        got: list[tuple[int, int, int]] = _patched.fast_lazy_opened()
        return got

    def lazy_stats(self) -> tuple[int, int]:
        opened, missed = _patched.fast_lazy_stats()
        return opened, missed


def fast_backend() -> _Fast | None:
    """The fast path's table, or None with a pyfuse3 that has none (stock, or an older build)."""
    return _Fast() if hasattr(pyfuse3, "fast_supported") else None


class _Names:
    """The names answered at LOOKUP in the patched pyfuse3 (patches/pyfuse3-fastlookup.patch)."""

    @property
    def templates(self) -> bool:
        """Whether a checked name may be given by its inode number, with one template for the other
        fields of its entry (patches/pyfuse3-fastlazy.patch)."""
        return hasattr(_patched, "fast_names_put_template")

    def put(self, parent: int, entries: list[tuple[bytes, Attributes | int, tuple[int, bytes, int, int] | None]],
            deadline_ns: int, template: Attributes | None = None) -> None:
        # (an entry given by its inode number without a template: pyfuse3 refuses it, TypeError)
        items = [(name, a if isinstance(a, int) else _entry(a), c) for name, a, c in entries]
        if template is None:
            _patched.fast_names_put(parent, items, deadline_ns)
        else:
            _patched.fast_names_put(parent, items, deadline_ns, _entry(template))

    def drop(self, parent: int) -> int:
        n: int = _patched.fast_names_drop(parent)
        return n

    def take(self, ino: int) -> int:
        n: int = _patched.fast_lookups_take(ino)
        return n

    def stats(self) -> tuple[int, int, int]:
        served, folders, names = _patched.fast_names_stats()
        return served, folders, names

    def now_ns(self) -> int:
        t: int = _patched.fast_monotonic_ns()
        return t


def statx_dir() -> StatxDirFactory | None:
    """The patched pyfuse3's lister of a folder's entries with their statx (patches/pyfuse3-statdir.patch:
    `LocalStore.refuse_device`), or None with a pyfuse3 that has none."""
    return getattr(pyfuse3, "StatxDir", None)


def names_backend() -> _Names | None:
    """The table of names answered at LOOKUP, or None with a pyfuse3 that has none."""
    return _Names() if hasattr(pyfuse3, "fast_names_put") else None


class _ListingEnds:
    """`fusefs.interfaces.ListingEnds` over the patched pyfuse3 (patches/pyfuse3-readdir-names.patch)."""

    def ended(self, fh: int, end: int | None) -> None:
        _patched.dir_ended(fh, (1 << 63) - 1 if end is None else end)

    def released(self) -> Sequence[int]:
        fhs: Sequence[int] = _patched.dirs_released()
        return fhs


def listing_ends() -> _ListingEnds | None:
    """Where pyfuse3 finishes listings itself (`fusefs.interfaces.ListingEnds`), else None."""
    return _ListingEnds() if hasattr(pyfuse3, "dir_ended") else None


# Requests the loop read while spinning after the one before (the patched pyfuse3; None with stock).
spun_reads: Callable[[], int | None] = getattr(pyfuse3, "spun_reads", lambda: None)


def set_request_spin(microseconds: int, after_listing: int = 0) -> None:
    """`[mount] request_spin_us` and `listing_spin_us` for pyfuse3's loop (a pyfuse3 without
    them: nothing)."""
    spin = getattr(pyfuse3, "loop_spin", None)
    if spin is not None:
        spin(microseconds)
    listing = getattr(pyfuse3, "listing_spin", None)
    if listing is not None:
        listing(after_listing)


class FuseOperations(pyfuse3.Operations):
    """What `pyfuse3.init` gets: each operation is `Filesystem`'s method of the same name (the
    function, bound to `self.fs` at each call) with its arguments and result converted."""

    def __init__(self, fs: Filesystem, options: MountOptions):
        super().__init__()
        self.fs = fs
        self.stats = fs.stats
        self.options = options
        self.enable_writeback_cache = options.writeback_cache
        # Asked for at FUSE init (a pyfuse3 without the patch ignores the attribute).
        self.enable_passthrough = (options.passthrough != "off" and fs.passthrough_capable()
                                   and not options.writeback_cache)

    def init(self) -> None:
        """FUSE init (before any request): passthrough is on if the kernel granted it."""
        self.fs.set_passthrough(passthrough_backend(self.options.passthrough, self.fs.passthrough_capable(),
                                                    self.options.writeback_cache), fast_backend())
        self.fs.listing_ends = listing_ends()
        self.fs.names.backend = names_backend() if self.fs.names.enabled else None
        set_request_spin(self.options.request_spin_us, self.options.listing_spin_us)

    async def forget(self, inode_list):   # not timed: the kernel's bookkeeping, never fails
        self.fs.forget(inode_list)

    lookup = _op("lookup", Filesystem.lookup, _entry)
    getattr = _op("getattr", Filesystem.getattr, _entry)
    setattr = _op("setattr", Filesystem.setattr, _entry)
    readlink = _op("readlink", Filesystem.readlink)
    symlink = _op("symlink", Filesystem.symlink, _entry)
    mknod = _op("mknod", Filesystem.mknod, _entry)
    link = _op("link", Filesystem.link, _entry)
    mkdir = _op("mkdir", Filesystem.mkdir, _entry)
    rmdir = _op("rmdir", Filesystem.rmdir)
    unlink = _op("unlink", Filesystem.unlink)
    rename = _op("rename", Filesystem.rename)
    statfs = _op("statfs", Filesystem.statfs, _statvfs)
    opendir = _op("opendir", _opendir)
    readdir = _op("readdir", _readdir)
    releasedir = _op("releasedir", Filesystem.releasedir)
    open = _op("open", Filesystem.open, _info)
    create = _op("create", Filesystem.create, _created)
    read = _op("read", Filesystem.read)
    write = _op("write", Filesystem.write)
    flush = _op("flush", Filesystem.flush)
    fsync = _op("fsync", Filesystem.fsync)
    release = _op("release", Filesystem.release)


__all__ = ["FuseOperations", "KernelNotices", "queued_reads"]

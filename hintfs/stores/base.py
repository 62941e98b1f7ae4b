"""The store interface that the FUSE layer talks to, and the types it exchanges.

A store is the system of record (a local folder, S3, HDFS). Its methods are synchronous and
may block; the operations layer decides whether to call them inline or in a worker thread
(`Store.inline_metadata`). Paths are relative to the store root, '/'-separated, '' for the root,
and have already been checked not to escape it (see `hintfs.common.paths`).
"""
from __future__ import annotations

import errno
import os
import stat as stat_mod
from typing import NamedTuple, Protocol
from collections.abc import Callable, Iterator


from hintfs.common.paths import STAGING_PREFIX  # noqa: F401  (re-exported)


class StatxDirLister(Protocol):
    """A folder's entries, each with its attributes by statx(AT_SYMLINK_NOFOLLOW |
    AT_STATX_DONT_SYNC), `most` at a time ([] at the end): (name, 0, Stat's fields) or (name,
    errno, None) (patches/pyfuse3-statdir.patch)."""
    def next(self, most: int) -> list[tuple[str, int, tuple[int, int, int, int, int, int, int, int, int, int, int] | None]]:
        ...
    def close(self) -> None: ...


StatxDirFactory = Callable[[int], StatxDirLister]   # (a folder's fd, which stays the caller's)


class Stat(NamedTuple):
    """A file's attributes, as the store gives them. Immutable; a NamedTuple rather than a frozen
    dataclass because one is made per listed entry and per open, on the event loop, and a frozen
    dataclass's __init__ costs ~1.1 µs against ~0.25 (bench/notes/small_files.md); use `_replace`
    for a changed copy. Compare Stats with each other only: a tuple of the same values is equal."""
    mode: int            # full st_mode (type bits + permissions)
    size: int
    mtime_ns: int
    ctime_ns: int
    nlink: int = 1
    uid: int = 0
    gid: int = 0
    atime_ns: int = 0    # 0: the store keeps no access time (object stores): mtime is shown
    dev: int = 0         # the backing file's (st_dev, st_ino) where the store has them (file://),
    ino: int = 0         # so hard links share one inode number; 0 elsewhere
    rdev: int = 0        # device nodes
    etag: str = ""       # an object store's version tag where the request that made this Stat had it
                         # (S3's ETag, from an open's HEAD; a listing or `stat` has none)

    @property
    def is_dir(self) -> bool:
        return stat_mod.S_ISDIR(self.mode)

    @property
    def is_symlink(self) -> bool:
        return stat_mod.S_ISLNK(self.mode)

    @property
    def is_file(self) -> bool:
        return stat_mod.S_ISREG(self.mode)

    def identity(self) -> tuple[int, int]:
        """What close-to-open compares: a changed file has another size or mtime."""
        return (self.size, self.mtime_ns)

    def version(self) -> tuple[int, int, str]:
        """What close-to-open compares when it keeps a file's cached pages: `identity()` and,
        where the Stat has one, the ETag."""
        return (self.size, self.mtime_ns, self.etag)

    def file_key(self) -> tuple:
        """Which file of the store this is, for close-to-open with handles open: (st_dev, st_ino)
        where the store has inode numbers (a file changed in place is the same file); else the
        object's version (size, mtime_ns, ETag): another object at the key is another file, even
        of the same size within the same second (S3's Last-Modified has whole seconds)."""
        return (self.dev, self.ino) if self.ino else ("object", self.size, self.mtime_ns, self.etag)

    @classmethod
    def from_os(cls, st: os.stat_result) -> Stat:
        return cls(st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink, st.st_uid, st.st_gid,
                   st.st_atime_ns, st.st_dev, st.st_ino, st.st_rdev)


class Reader(Protocol):
    def read(self, offset: int, size: int) -> bytes: ...
    def read_nowait(self, offset: int, size: int) -> bytes | None:
        """The complete answer (all `size` bytes, or fewer at EOF) if it can be had without
        blocking (page cache, memory filesystem), else None."""
    def close(self) -> None: ...


class Staging:
    """A local file that collects the writes of one open file until close commits it.

    `fd` is a plain read-write fd on local disk. After a commit of a file:// store the fd refers
    to the live file, so `live` is set and the next write must stage a fresh copy first.
    `unseen_writes`: the kernel writes this file itself (a FUSE passthrough backing file), so the
    daemon learns of writes only by comparing `identity()` (size, mtime) with `published`, the
    identity taken just before the last publish (docs/semantics.md, "The publish rule").
    """

    __slots__ = ("fd", "path", "dirty", "live", "target", "failed", "inline_io", "unseen_writes", "published")

    def __init__(self, fd: int, path: str, target: str):
        self.fd = fd
        self.path = path
        self.target = target
        self.dirty = False
        self.live = False
        self.failed = ""   # a write failed: this staging must never be published
        # True when the staging file is in memory (tmpfs): its pread/pwrite never wait for a disk,
        # so they may run on the event loop.
        self.inline_io = False
        self.unseen_writes = False
        self.published: tuple[int, int] | None = None

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def identity(self) -> tuple[int, int]:
        """(size, mtime_ns) of the staged file: any write changes it (the kernel gives a file whose
        times were just read a fine-grained time at its next change: multigrain timestamps,
        Linux >= 6.13 on ext4, xfs, btrfs and tmpfs); a change of mode or owner does not (ctime)."""
        st = os.fstat(self.fd)
        return (st.st_size, st.st_mtime_ns)

    def changed(self) -> bool:
        """Anything to publish: written through the daemon, or by the kernel (passthrough)."""
        return self.dirty or self.changed_unseen()

    def changed_unseen(self) -> bool:
        """Written by the kernel (passthrough) since the last publish, or never published."""
        return self.unseen_writes and self.fd >= 0 and self.identity() != self.published

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Store(Protocol):
    inline_metadata: bool
    description: str
    passthrough_capable: bool   # its files (and staging files) can back FUSE passthrough opens
    # Its Stats have inode numbers (file://). Else (object stores) which object a key holds is
    # its version, which only `open_reader`'s Stat has in full (the ETag): `Stat.file_key`.
    inode_numbers: bool

    def refuse_device(self, st_dev: int, statx_dir: StatxDirFactory | None = None) -> None:
        """Never serve entries of this device (the mount's own, should the store contain its
        mountpoint through a bind mount); a no-op where the store has no devices. `statx_dir`:
        the FUSE library's lister of a folder's entries with their attributes as the kernel has
        them (pyfuse3.StatxDir, where patched), for listings on the event loop."""

    def stat(self, rel: str) -> Stat: ...
    def current(self, rel: str) -> Stat:
        """What the store has at file `rel` now, with what `Stat.file_key` needs: `stat` where the
        store has inode numbers; an object's version (its HEAD, with the ETag) on an object store.
        No side effect (no cache counted, no tier told of a read)."""
    def iter_dir(self, rel: str) -> Iterator[tuple[str, Stat]]: ...
    @property
    def lists_after(self) -> bool:
        """`iter_dir_after` asks the store for those names only (S3's start-after)."""

    def iter_dir_after(self, rel: str, after: str) -> Iterator[tuple[str, Stat]]:
        """The entries of folder `rel` named after `after`, sorted: for the journal's readers,
        whose listings of a time slice should carry only what is new (`journal.SliceListings`).
        Where `lists_after` is False the folder is listed whole and filtered."""
    def open_reader(self, rel: str, lazy: bool = False) -> tuple[Reader, Stat]:
        """An open reader of file `rel` and the version it reads. An object store may read a
        small object whole at the open (one GET) and read ahead of sequential reads; `lazy`: it
        must not (no byte fetched before a read asks for it, and only those: the eval tier's
        demand readers, opened when a stream is published, would fetch a second copy of what the
        stream brings across the link)."""
    def readlink(self, rel: str) -> str: ...
    def symlink(self, rel: str, target: str) -> None: ...
    def mknod(self, rel: str, mode: int, rdev: int) -> None:
        """A FIFO, socket, device node or empty regular file (`mode` has the type bits);
        EPERM where the store has no such nodes."""
    def link(self, src: str, dst: str) -> None:
        """A second name for the file `src`; EPERM where the store has no hard links."""
    def mkdir(self, rel: str, mode: int) -> None: ...
    def rmdir(self, rel: str) -> None: ...
    def unlink(self, rel: str) -> None: ...
    def rename(self, src: str, dst: str, noreplace: bool) -> None: ...
    def chmod(self, rel: str, mode: int) -> None: ...
    def chown(self, rel: str, uid: int, gid: int) -> None:
        """-1 leaves that id as it is (chown(2)); EPERM where the store has no owners."""
    def utimens(self, rel: str, atime_ns: int, mtime_ns: int) -> None: ...
    def statfs(self) -> os.statvfs_result | None: ...
    def new_staging(self, rel: str, copy_existing: bool, source: Staging | None = None) -> Staging:
        """A staging file for `rel`: empty, or (`copy_existing`) a copy of the store file, or of
        `source` when given (an open file's own earlier staging: its content, whatever the store
        holds at `rel` now)."""
    def commit(self, staging: Staging, rel: str, keep: bool = False) -> Stat:
        """Publish the staged file as `rel`, atomically. `keep`: the staging file must stay
        private afterwards (the kernel still writes into it, FUSE passthrough), so a copy of it
        is published and the staging stays as it is."""
    def discard(self, staging: Staging) -> None: ...
    def unname(self, staging: Staging) -> None:
        """The staging of a file unlinked while open is never published: remove its name now
        (where it has one), keep the open file."""
    def follow(self, staging: Staging, rel: str) -> None:
        """The open file of `staging` was renamed to `rel`: a staging file kept beside its target
        moves beside the new name."""
    def nameless_copy(self, staging: Staging) -> Staging:
        """A private copy of a published (live) staging file, with no name in the store: what an
        open file whose name is gone writes into."""
    def put_small(self, rel: str, data: bytes) -> None: ...
    def check(self) -> None:
        """Raise OSError when the store root cannot be reached (used at mount time)."""


def walk_files(store: Store, rel: str) -> Iterator[tuple[str, Stat]]:
    """Every regular file under the folder `rel` of `store`, with its listing's stat, depth
    first in listing order (blocking: call it in a thread). Symlinks and other types are left out."""
    for name, st in store.iter_dir(rel):
        path = f"{rel}/{name}" if rel else name
        if st.is_dir:
            yield from walk_files(store, path)
        elif st.is_file:
            yield path, st


def copy_fd(src: int, dst: int, size: int) -> None:
    """Copy `size` bytes from `src` to `dst` at the same offsets (copy_file_range: a reflink or an
    in-kernel copy where the filesystems allow, else reads and writes)."""
    offset = 0
    while offset < size:
        try:
            n = os.copy_file_range(src, dst, size - offset, offset, offset)
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            n = _copy_plain(src, dst, offset, size)
        if n == 0:
            break
        offset += n


def _copy_plain(src: int, dst: int, offset: int, size: int) -> int:
    start = offset
    while offset < size:
        chunk = os.pread(src, min(8 << 20, size - offset), offset)
        if not chunk:
            break
        os.pwrite(dst, chunk, offset)
        offset += len(chunk)
    return offset - start

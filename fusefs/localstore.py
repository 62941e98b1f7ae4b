"""A store over a local (or kernel-mounted) folder: the embedded default, `file://`.

Data reads try `preadv(RWF_NOWAIT)` first: page-cache hits return inline without a thread hop,
misses go to a worker thread. Metadata syscalls are cheap on a local disk and run inline.
"""
from __future__ import annotations

import errno
import itertools
import os
import socket
import time
from typing import Iterator, Optional

from .errors import StoreError
from .procs import pid_alive
from .store import STAGING_PREFIX, Stat, Staging

_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_HOST = socket.gethostname().replace("/", "_")
_seq = itertools.count()
STALE_STAGING_AGE_S = 60.0
READAHEAD = 4 << 20


def _fs_type_of_dev(st_dev: int) -> str:
    """The filesystem type of a device, from /proc/self/mountinfo ('' if unknown)."""
    want = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if fields[2] == want and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        pass
    return ""


# Filesystems whose pages live in memory: a pread there never waits for a disk.
_MEMORY_FS = {"tmpfs", "ramfs", "shmfs"}
_read_modes: dict[int, str] = {}


def read_mode(st_dev: int) -> str:
    """How reads of files on this device may run on the event loop.

    'memory': tmpfs/ramfs, pread is a memory copy, always inline.
    'nowait': preadv(RWF_NOWAIT) serves page-cache hits inline, misses go to a thread.
    'thread': neither is possible; every read goes to a thread.
    Decided once per device (RWF_NOWAIT support is per filesystem).
    """
    mode = _read_modes.get(st_dev)
    if mode is None:
        if _fs_type_of_dev(st_dev) in _MEMORY_FS:
            mode = "memory"
        else:
            mode = "nowait" if _RWF_NOWAIT else "thread"
        _read_modes[st_dev] = mode
    return mode


def _demote(st_dev: int) -> None:
    _read_modes[st_dev] = "thread"


class LocalReader:
    __slots__ = ("fd", "dev", "_mode")

    def __init__(self, fd: int, st_dev: int):
        self.fd = fd
        self.dev = st_dev
        self._mode = read_mode(st_dev)

    def read(self, offset: int, size: int) -> bytes:
        # On a miss, ask the kernel to start reading ahead, so the next requests of a sequential
        # reader are page-cache hits served inline.
        if self._mode == "nowait":
            os.posix_fadvise(self.fd, offset + size, READAHEAD, os.POSIX_FADV_WILLNEED)
        return os.pread(self.fd, size, offset)

    def read_nowait(self, offset: int, size: int):
        """The complete answer to this read if it can be had without waiting, else None."""
        mode = self._mode
        if mode == "memory":
            return os.pread(self.fd, size, offset)
        if mode != "nowait":
            return None
        buf = bytearray(size)
        try:
            n = os.preadv(self.fd, [buf], offset, _RWF_NOWAIT)
        except BlockingIOError:
            return None
        except OSError as err:
            if err.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                _demote(self.dev)  # this filesystem has no RWF_NOWAIT
                self._mode = "thread"
                return None
            raise
        if n == size:
            return buf
        # Short: either EOF (a complete answer) or only partly cached (let a thread read it all).
        if offset + n >= os.fstat(self.fd).st_size:
            return memoryview(buf)[:n]
        return None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LocalStore:
    inline_metadata = True

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.description = f"file://{self.root}"

    # -- helpers -------------------------------------------------------------------------------
    def _abs(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def check(self) -> None:
        st = os.stat(self.root)
        if not os.path.isdir(self.root):
            raise StoreError(errno.ENOTDIR, f"{self.root} is not a directory")
        os.listdir(self.root)  # readable?
        del st

    # -- metadata ------------------------------------------------------------------------------
    def stat(self, rel: str) -> Stat:
        return Stat.from_os(os.lstat(self._abs(rel)))

    def iter_dir(self, rel: str) -> Iterator[tuple[str, Stat]]:
        now = time.time()
        with os.scandir(self._abs(rel)) as it:
            for entry in it:
                name = entry.name
                if name.startswith(STAGING_PREFIX):
                    self._reap_stale_staging(entry.path, name, now)
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed while listing
                yield name, Stat.from_os(st)

    def _reap_stale_staging(self, path: str, name: str, now: float) -> None:
        """Remove staging files left by a crashed daemon of this host (the pid is in the name)."""
        try:
            _, _, pid, _seqno, host = name.split(".", 4)
            if host != _HOST or pid_alive(int(pid)):
                return
            if now - os.lstat(path).st_mtime > STALE_STAGING_AGE_S:
                os.unlink(path)
        except (ValueError, OSError):
            pass

    def readlink(self, rel: str) -> str:
        return os.readlink(self._abs(rel))

    def statfs(self) -> os.statvfs_result:
        return os.statvfs(self.root)

    # -- namespace changes ---------------------------------------------------------------------
    def symlink(self, rel: str, target: str) -> None:
        os.symlink(target, self._abs(rel))

    def mkdir(self, rel: str, mode: int) -> None:
        os.mkdir(self._abs(rel), mode)

    def rmdir(self, rel: str) -> None:
        os.rmdir(self._abs(rel))

    def unlink(self, rel: str) -> None:
        os.unlink(self._abs(rel))

    def rename(self, src: str, dst: str, noreplace: bool) -> None:
        if noreplace and os.path.lexists(self._abs(dst)):
            raise FileExistsError(errno.EEXIST, "target exists", dst)
        os.rename(self._abs(src), self._abs(dst))

    def chmod(self, rel: str, mode: int) -> None:
        os.chmod(self._abs(rel), mode)

    def utimens(self, rel: str, atime_ns: int, mtime_ns: int) -> None:
        os.utime(self._abs(rel), ns=(atime_ns, mtime_ns), follow_symlinks=False)

    # -- data ----------------------------------------------------------------------------------
    def open_reader(self, rel: str) -> tuple[LocalReader, Stat]:
        fd = os.open(self._abs(rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            raw = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        return LocalReader(fd, raw.st_dev), Stat.from_os(raw)

    def new_staging(self, rel: str, copy_existing: bool) -> Staging:
        """A hidden file beside the target, so the commit is one atomic rename."""
        target = self._abs(rel)
        directory = os.path.dirname(target)
        path = os.path.join(directory, f"{STAGING_PREFIX}{os.getpid()}.{next(_seq)}.{_HOST}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            if copy_existing:
                try:
                    src = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except FileNotFoundError:
                    src = -1
                if src >= 0:
                    try:
                        st = os.fstat(src)
                        os.fchmod(fd, st.st_mode & 0o7777)
                        _copy_fd(src, fd, st.st_size)
                    finally:
                        os.close(src)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        staging = Staging(fd, path, rel)
        staging.inline_io = read_mode(os.fstat(fd).st_dev) == "memory"
        return staging

    def commit(self, staging: Staging, rel: str) -> Stat:
        os.rename(staging.path, self._abs(rel))
        staging.live = True
        staging.dirty = False
        return Stat.from_os(os.fstat(staging.fd))

    def put_small(self, rel: str, data: bytes) -> None:
        """Write a small file whole (journal records): temp name, then rename."""
        path = self._abs(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = os.path.join(os.path.dirname(path), f"{STAGING_PREFIX}{os.getpid()}.{next(_seq)}.{_HOST}")
        with open(tmp, "wb") as f:
            f.write(data)
        os.rename(tmp, path)

    def discard(self, staging: Staging) -> None:
        if not staging.live:
            try:
                os.unlink(staging.path)
            except FileNotFoundError:
                pass
        staging.close()


def _copy_fd(src: int, dst: int, size: int) -> None:
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

"""A store over a local (or kernel-mounted) folder: the embedded default, `file://`.

Data reads try `preadv(RWF_NOWAIT)` first: page-cache hits return inline without a thread hop,
misses go to a worker thread. Metadata syscalls are cheap on a local disk and run inline.
"""
from __future__ import annotations

import ctypes
import errno
import itertools
import os
import socket
import stat as stat_mod
import struct
import threading
import time
from collections.abc import Iterator

from hintfs.common.paths import Beneath, beneath_in_one_call, beneath_in_one_call_raw, open_beneath

from hintfs.common.errors import HintfsError
from hintfs.common.procs import pid_alive
from hintfs.stores.base import STAGING_PREFIX, Stat, Staging, StatxDirFactory, StatxDirLister, copy_fd

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


# statx(2) with AT_STATX_DONT_SYNC: attributes the kernel already has. A FUSE filesystem answers
# it without a request to its server (so a stat of this mount itself never waits on this daemon).
_AT_SYMLINK_NOFOLLOW = 0x100
_AT_STATX_DONT_SYNC = 0x4000
_STATX_BASIC_STATS = 0x7FF
_libc = ctypes.CDLL(None, use_errno=True)
_statx = getattr(_libc, "statx", None)
# Where DONT_SYNC gives exactly what a stat gives (local filesystems keep no remote attributes).
_EXACT_FS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs", "f2fs", "zfs", "overlay", "bcachefs",
             "jfs", "vfat", "exfat"}
_exact: dict[int, bool] = {}


def exact_without_sync(st_dev: int) -> bool:
    ok = _exact.get(st_dev)
    if ok is None:
        ok = _exact[st_dev] = _fs_type_of_dev(st_dev) in _EXACT_FS
    return ok


_STATX = struct.Struct("<16xIIIH2xQQ16xqI4x16xqI4xqI4xIIII")   # nlink uid gid mode ino size atime ctime mtime devs
_tls = threading.local()
if _statx is not None:
    _statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]


def statx_nosync(dir_fd: int, name: str) -> Stat:
    buf = getattr(_tls, "buf", None)
    if buf is None:
        buf = _tls.buf = ctypes.create_string_buffer(256)
    if _statx is None:
        raise HintfsError(errno.ENOSYS, "no statx in this C library")
    if _statx(dir_fd, os.fsencode(name), _AT_SYMLINK_NOFOLLOW | _AT_STATX_DONT_SYNC, _STATX_BASIC_STATS, buf) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), name)
    (nlink, uid, gid, mode, ino, size, a_s, a_n, c_s, c_n, m_s, m_n,
     rmaj, rmin, dmaj, dmin) = _STATX.unpack_from(buf)
    return Stat(mode, size, m_s * 1_000_000_000 + m_n, c_s * 1_000_000_000 + c_n, nlink, uid, gid,
                a_s * 1_000_000_000 + a_n, os.makedev(dmaj, dmin), ino, os.makedev(rmaj, rmin))


# A file or a symlink listed by its type alone (`iter_names`): one Stat each, shared (Stat is frozen).
_A_FILE = Stat(stat_mod.S_IFREG, 0, 0, 0)
_A_SYMLINK = Stat(stat_mod.S_IFLNK, 0, 0, 0)


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


def _reader_of(fd: int, rel: str) -> tuple[LocalReader, Stat]:
    """The reader of `fd`, just opened for reading at `rel`, and its attributes; a file that is not
    a regular file is refused (EINVAL), and `fd` closed on any failure."""
    try:
        raw = os.fstat(fd)
        if not stat_mod.S_ISREG(raw.st_mode):
            raise HintfsError(errno.EINVAL, f"{rel} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return LocalReader(fd, raw.st_dev), Stat.from_os(raw)


class LocalStore:
    """Every path is resolved beneath one fd of the root (`hintfs.common.paths`): no symlink in the store
    leads a call out of it, and paths are never joined onto the root as strings (so a path up to
    PATH_MAX relative to the root works however deep the root itself is)."""
    inline_metadata = True
    passthrough_capable = True   # its files (and staging files) can back FUSE passthrough opens
    inode_numbers = True

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.description = f"file://{self.root}"
        self._root_fd = -1
        self.own_dev = 0      # the mount's own FUSE device, once known (`refuse_device`)
        self._statx_dir: StatxDirFactory | None = None   # (`refuse_device`)

    # -- helpers -------------------------------------------------------------------------------
    @property
    def root_fd(self) -> int:
        if self._root_fd < 0:
            self._root_fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return self._root_fd

    def _at(self, rel: str) -> Beneath:
        return Beneath(self.root_fd, rel)

    def check(self) -> None:
        """HintfsError naming the root and what is wrong with it: missing, not a folder, not listable."""
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            raise HintfsError(errno.ENOENT, f"the folder {self.root} does not exist (create it, or fix "
                              "[store] uri)") from None
        except OSError as err:
            raise HintfsError(err.errno or errno.EIO, f"{self.root}: {err.strerror}") from None
        if not stat_mod.S_ISDIR(st.st_mode):
            raise HintfsError(errno.ENOTDIR, f"{self.root} is not a folder (give the store's root folder "
                              "in [store] uri)")
        try:
            fd = open_beneath(self.root_fd, "", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.listdir(fd)  # readable?
            finally:
                os.close(fd)
        except OSError as err:
            raise HintfsError(err.errno or errno.EIO, f"the folder {self.root} cannot be listed: "
                              f"{err.strerror or err}") from None

    def _iter_statx(self, fd: int, lister: StatxDirLister, now: float) -> Iterator[tuple[str, Stat]]:
        """`_iter_dir` on the event loop with a C lister (`refuse_device`): each entry as
        `_stat_at` gives it (`_as_stat_gives`), a staging file reaped as there."""
        try:
            while chunk := lister.next(64):
                for name, err, fields in chunk:
                    if name.startswith(STAGING_PREFIX):
                        self._reap_stale_staging(fd, name, now)
                        continue
                    try:
                        if err:
                            raise OSError(err, os.strerror(err), name)
                        assert fields is not None
                        st = self._as_stat_gives(Stat(*fields), fd, name)
                    except FileNotFoundError:
                        continue  # removed while listing
                    except HintfsError as e:
                        if e.errno == errno.ELOOP:
                            continue  # the mount itself (through a bind mount): never listed
                        raise
                    yield name, st
        finally:
            lister.close()

    # -- metadata ------------------------------------------------------------------------------
    def refuse_device(self, st_dev: int, statx_dir: StatxDirFactory | None = None) -> None:
        """Never serve files of this device (the mount's own FUSE device, should the store contain
        the mountpoint through a bind mount): such entries are ELOOP to stat and left out of
        listings. From then on every stat first asks the kernel for attributes it has
        (statx AT_STATX_DONT_SYNC), which never sends a request to a FUSE server, so a stat of our
        own mount cannot wait on this daemon. `statx_dir` (the patched pyfuse3's StatxDir): the
        listings on the event loop take each entry's statx in C (~1 µs an entry against ~3 through
        ctypes: a folder's listing for the lookups to come is one per entry, docs/fastpath.md)."""
        self.own_dev = st_dev
        self._statx_dir = statx_dir

    def _stat_at(self, d: int, name: str) -> Stat:
        if self.own_dev:
            return self._as_stat_gives(statx_nosync(d, name), d, name)
        return Stat.from_os(os.stat(name, dir_fd=d, follow_symlinks=False))

    def _as_stat_gives(self, st: Stat, d: int, name: str) -> Stat:
        """`st`, the kernel's attributes of `name` in `d` (statx AT_STATX_DONT_SYNC), as a stat on
        the event loop gives them: ELOOP for the mount's own device; stat'ed again on a file system
        where the kernel's attributes may be stale."""
        if st.dev == self.own_dev:
            raise HintfsError(errno.ELOOP, f"{name!r} is this mount itself (through a bind mount)")
        if exact_without_sync(st.dev):
            return st
        return Stat.from_os(os.stat(name, dir_fd=d, follow_symlinks=False))

    def same_file_check(self, rel: str, st: Stat, attrs: bool = False) -> tuple[int, bytes, int, int] | None:
        """What the fast path's checked marks give the patched pyfuse3 (docs/fastpath.md, "Checked
        marks"): the root's fd, `rel` as one beneath-resolution call takes it, and the file (dev,
        ino) it must still name at each open, which is this store's close-to-open under
        passthrough (`fusefs.passthrough.backing_key`). None where it cannot be checked so, and,
        with `attrs` (a name whose LOOKUP pyfuse3 answers with the attributes it reads then), on a
        file system whose attributes `statx(AT_STATX_DONT_SYNC)` may give stale (`_stat_at` asks
        those again)."""
        return self._check_of(beneath_in_one_call(rel), st, attrs)

    def _check_of(self, raw: bytes | None, st: Stat | None, attrs: bool) -> tuple[int, bytes, int, int] | None:
        """`same_file_check`'s rule, of the path as one beneath-resolution call takes it (`raw`)."""
        if raw is None or st is None or not st.ino or (attrs and not exact_without_sync(st.dev)):
            return None
        return (self.root_fd, raw, st.dev, st.ino)

    def same_file_checks_in(self, folder: str, entries: list[tuple[bytes, Stat | None]]) -> list[tuple[int, bytes, int, int] | None]:
        """`same_file_check(folder/name, st, attrs=True)` of each (name, st) of a listing of
        `folder` (each name one component, as bytes), in one call: the folder's part of the path
        encoded once (`Filesystem._name_folder`, a folder's names registered with checks)."""
        prefix = b""
        if folder:
            head = beneath_in_one_call(folder)
            if head is None:
                return [None] * len(entries)
            prefix = head + b"/"
        return [self._check_of(beneath_in_one_call_raw(prefix + name), st, True) for name, st in entries]

    def stat(self, rel: str) -> Stat:
        if not rel:
            return Stat.from_os(os.stat(self.root_fd))
        with self._at(rel) as (d, name):
            return self._stat_at(d, name)

    def iter_dir(self, rel: str) -> Iterator[tuple[str, Stat]]:
        return self._iter_dir(rel, False)

    lists_after = False    # (a folder is read whole: no link to save bytes on)

    def iter_dir_after(self, rel: str, after: str) -> Iterator[tuple[str, Stat]]:
        """The entries of folder `rel` named after `after`, sorted (`iter_dir_in_thread`, filtered)."""
        return iter(sorted((e for e in self._iter_dir(rel, True) if e[0] > after), key=lambda e: e[0]))

    def iter_dir_in_thread(self, rel: str) -> Iterator[tuple[str, Stat]]:
        """`iter_dir` for a caller outside the daemon's event loop (a worker thread): each entry's
        attributes by lstat (the C call os.scandir makes, a third of the statx through ctypes
        that `_stat_at` needs on the loop), and an entry on the mount's own device left out after
        its stat: that stat was a request to this daemon, which the free loop answered."""
        return self._iter_dir(rel, True)

    def iter_names(self, rel: str) -> Iterator[tuple[str, Stat]]:
        """`iter_dir` for a listing that gives files by name (`fusefs.walks`): a regular file or a
        symlink comes with its type alone (the folder's d_type, no stat: size and times are 0),
        anything else with its attributes (`_stat_at`, as `stat` on the event loop). Cheap enough
        for the loop: one getdents per ~hundred names and a stat per folder. Never kept for lookups."""
        return self._iter_dir(rel, False, types_only=True)

    def _iter_dir(self, rel: str, in_thread: bool, types_only: bool = False) -> Iterator[tuple[str, Stat]]:
        now = time.time()
        fd = open_beneath(self.root_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
        if self.own_dev and self._statx_dir is not None and not in_thread and not types_only:
            try:
                yield from self._iter_statx(fd, self._statx_dir(fd), now)
            finally:
                os.close(fd)
            return
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    name = entry.name
                    if name.startswith(STAGING_PREFIX):
                        self._reap_stale_staging(fd, name, now)
                        continue
                    try:
                        if types_only:
                            # (d_type: no stat, unless the folder's file system gives DT_UNKNOWN)
                            if entry.is_file(follow_symlinks=False):
                                yield name, _A_FILE
                                continue
                            if entry.is_symlink():
                                yield name, _A_SYMLINK
                                continue
                        if in_thread or not self.own_dev:
                            st = Stat.from_os(entry.stat(follow_symlinks=False))
                            if self.own_dev and st.dev == self.own_dev:
                                continue   # the mount itself (through a bind mount): never listed
                        else:
                            st = self._stat_at(fd, name)
                    except FileNotFoundError:
                        continue  # removed while listing
                    except HintfsError as err:
                        if err.errno == errno.ELOOP:
                            continue  # the mount itself: never listed
                        raise
                    yield name, st
        finally:
            os.close(fd)

    def _reap_stale_staging(self, dir_fd: int, name: str, now: float) -> None:
        """Remove staging files left by a crashed daemon of this host (the pid is in the name)."""
        try:
            _, _, pid, _seqno, host = name.split(".", 4)
            if host != _HOST or pid_alive(int(pid)):
                return
            if now - os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime > STALE_STAGING_AGE_S:
                os.unlink(name, dir_fd=dir_fd)
        except (ValueError, OSError):
            pass

    def readlink(self, rel: str) -> str:
        with self._at(rel) as (d, name):
            return os.readlink(name, dir_fd=d)

    def statfs(self) -> os.statvfs_result:
        return os.statvfs(self.root_fd)

    # -- namespace changes ---------------------------------------------------------------------
    def symlink(self, rel: str, target: str) -> None:
        with self._at(rel) as (d, name):
            os.symlink(target, name, dir_fd=d)

    def mknod(self, rel: str, mode: int, rdev: int) -> None:
        with self._at(rel) as (d, name):
            os.mknod(name, mode, rdev, dir_fd=d)

    def link(self, src: str, dst: str) -> None:
        with self._at(src) as (sd, sname), self._at(dst) as (dd, dname):
            os.link(sname, dname, src_dir_fd=sd, dst_dir_fd=dd, follow_symlinks=False)

    def mkdir(self, rel: str, mode: int) -> None:
        with self._at(rel) as (d, name):
            os.mkdir(name, mode, dir_fd=d)

    def _makedirs(self, rel: str) -> None:
        parts = rel.split("/") if rel else []
        for i in range(1, len(parts) + 1):
            try:
                self.mkdir("/".join(parts[:i]), 0o755)
            except FileExistsError:
                pass

    def rmdir(self, rel: str) -> None:
        with self._at(rel) as (d, name):
            os.rmdir(name, dir_fd=d)

    def unlink(self, rel: str) -> None:
        with self._at(rel) as (d, name):
            os.unlink(name, dir_fd=d)

    def rename(self, src: str, dst: str, noreplace: bool) -> None:
        with self._at(src) as (sd, sname), self._at(dst) as (dd, dname):
            if noreplace:
                try:
                    os.stat(dname, dir_fd=dd, follow_symlinks=False)
                    raise FileExistsError(errno.EEXIST, "target exists", dst)
                except FileNotFoundError:
                    pass
            os.rename(sname, dname, src_dir_fd=sd, dst_dir_fd=dd)

    def chmod(self, rel: str, mode: int) -> None:
        # chmod has no no-follow form on Linux: pin the inode with O_PATH|O_NOFOLLOW first, so a
        # symlink swapped in never redirects the change outside the store.
        fd = open_beneath(self.root_fd, rel, os.O_PATH | os.O_NOFOLLOW)
        try:
            if stat_mod.S_ISLNK(os.fstat(fd).st_mode):
                raise HintfsError(errno.EOPNOTSUPP, f"{rel}: symlinks have no mode")
            os.chmod(f"/proc/self/fd/{fd}", mode)
        finally:
            os.close(fd)

    def chown(self, rel: str, uid: int, gid: int) -> None:
        if not rel:
            os.chown(self.root_fd, uid, gid)
            return
        with self._at(rel) as (d, name):
            os.chown(name, uid, gid, dir_fd=d, follow_symlinks=False)

    def utimens(self, rel: str, atime_ns: int, mtime_ns: int) -> None:
        if not rel:
            os.utime(self.root_fd, ns=(atime_ns, mtime_ns))
            return
        with self._at(rel) as (d, name):
            os.utime(name, ns=(atime_ns, mtime_ns), dir_fd=d, follow_symlinks=False)

    # -- data ----------------------------------------------------------------------------------
    def current(self, rel: str) -> Stat:
        return self.stat(rel)

    def open_reader(self, rel: str, lazy: bool = False) -> tuple[LocalReader, Stat]:
        # O_NONBLOCK: a FIFO must never block this open (the kernel serves FIFOs and devices of the
        # mount itself; one reached here is refused).
        return _reader_of(open_beneath(self.root_fd, rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), rel)

    @staticmethod
    def held_reader(fd: int, dev: int) -> LocalReader:
        """The reader of `fd`, a regular file of this store on device `dev` opened for reading as
        `open_reader` opens it, elsewhere (a lazy mark's first open in pyfuse3, which checked it:
        `Filesystem._adopt_lazy`)."""
        return LocalReader(fd, dev)

    def open_readers_in(self, folder: str, names: list[str]) -> list[tuple[LocalReader, Stat] | OSError]:
        """`open_reader` of each `folder/name` (each name one component of a listing of `folder`),
        in order: (reader, stat) or that file's error. The folder is resolved beneath the root once
        (`open_beneath`), each name opened in it with O_NOFOLLOW: a name can lead nowhere but to
        that folder's own entry, so this opens what `open_reader` would have opened at the moment
        the folder was resolved (a mark made ahead of an open, `Filesystem._open_ahead`: 3.3 µs a
        file, its close included, against 5.0 through ctypes' openat2 each). A name that is not one
        component is refused (EINVAL) without being opened."""
        out: list[tuple[LocalReader, Stat] | OSError] = []
        dir_fd = open_beneath(self.root_fd, folder, os.O_PATH | os.O_DIRECTORY)
        try:
            for name in names:
                if not name or "/" in name or name in (".", ".."):
                    out.append(HintfsError(errno.EINVAL, f"{name!r} is not a name in {folder!r}"))
                    continue
                try:
                    out.append(_reader_of(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                                                  dir_fd=dir_fd), f"{folder}/{name}"))
                except OSError as err:
                    out.append(err)
        finally:
            os.close(dir_fd)
        return out

    def _staging_name(self, rel: str) -> str:
        head = rel.rpartition("/")[0]
        name = f"{STAGING_PREFIX}{os.getpid()}.{next(_seq)}.{_HOST}"
        return f"{head}/{name}" if head else name

    def new_staging(self, rel: str, copy_existing: bool, source: Staging | None = None) -> Staging:
        """A hidden file beside the target, so the commit is one atomic rename. `Staging.path` is
        store-relative. `source`: the copy is of that staging file (an open file's own content,
        whatever the store now holds at `rel`), not of the store file."""
        path = self._staging_name(rel)
        fd = open_beneath(self.root_fd, path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            # The published file keeps the target's owner and mode (chown first: it may clear
            # set-id bits), and its data when the file is opened without O_TRUNC.
            try:
                src = (os.dup(source.fd) if source is not None else
                       open_beneath(self.root_fd, rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK))
            except (FileNotFoundError, NotADirectoryError):
                src = -1
            if src >= 0:
                try:
                    st = os.fstat(src)
                    if not stat_mod.S_ISREG(st.st_mode):
                        raise HintfsError(errno.EINVAL, f"{rel} is not a regular file")
                    if os.geteuid() == 0:
                        os.fchown(fd, st.st_uid, st.st_gid)
                    os.fchmod(fd, st.st_mode & 0o7777)
                    if copy_existing:
                        copy_fd(src, fd, st.st_size)
                        # and its times: a publish with no write (utimens, fsync) changes none
                        os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
                finally:
                    os.close(src)
        except BaseException:
            os.close(fd)
            self._unlink_quiet(path)
            raise
        staging = Staging(fd, path, rel)
        staging.inline_io = read_mode(os.fstat(fd).st_dev) == "memory"
        return staging

    def _unlink_quiet(self, rel: str) -> None:
        try:
            self.unlink(rel)
        except FileNotFoundError:
            pass

    def commit(self, staging: Staging, rel: str, keep: bool = False) -> Stat:
        if keep:
            return self._commit_copy(staging, rel)
        self.rename(staging.path, rel, noreplace=False)
        staging.live = True
        staging.dirty = False
        return Stat.from_os(os.fstat(staging.fd))

    def _commit_copy(self, staging: Staging, rel: str) -> Stat:
        """Publish a copy of the staging file (copy_file_range: a reflink or an in-kernel copy),
        with its owner, mode and times; the staging file stays private and dirty."""
        tmp = self._staging_name(rel)
        fd = open_beneath(self.root_fd, tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            st = os.fstat(staging.fd)
            copy_fd(staging.fd, fd, st.st_size)
            if os.geteuid() == 0:
                os.fchown(fd, st.st_uid, st.st_gid)
            os.fchmod(fd, st.st_mode & 0o7777)
            os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
            self.rename(tmp, rel, noreplace=False)
            return Stat.from_os(os.fstat(fd))
        except BaseException:
            self._unlink_quiet(tmp)
            raise
        finally:
            os.close(fd)

    def put_small(self, rel: str, data: bytes) -> None:
        """Write a small file whole (journal records): temp name, then rename."""
        self._makedirs(rel.rpartition("/")[0])
        tmp = self._staging_name(rel)
        fd = open_beneath(self.root_fd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except BaseException:
            self._unlink_quiet(tmp)
            raise
        self.rename(tmp, rel, noreplace=False)

    def discard(self, staging: Staging) -> None:
        self.unname(staging)
        staging.close()

    def nameless_copy(self, staging: Staging) -> Staging:
        """A private copy of `staging`'s file with no name in the store (O_TMPFILE in the store's
        root folder: the same filesystem), for an open file whose name is gone."""
        fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=self.root_fd)
        try:
            st = os.fstat(staging.fd)
            copy_fd(staging.fd, fd, st.st_size)
            os.fchmod(fd, st.st_mode & 0o7777)
        except BaseException:
            os.close(fd)
            raise
        fresh = Staging(fd, "", staging.target)
        fresh.inline_io = staging.inline_io
        return fresh

    def follow(self, staging: Staging, rel: str) -> None:
        """The open file of `staging` was renamed to `rel`: its staging file moves beside it (its
        old folder can be removed; its publish stays one rename in one folder)."""
        if staging.live or not staging.path or staging.path.rpartition("/")[0] == rel.rpartition("/")[0]:
            return
        name = self._staging_name(rel)
        self.rename(staging.path, name, noreplace=True)
        staging.path = name

    def unname(self, staging: Staging) -> None:
        """The staging of a file unlinked while open will never be published: its name goes now
        (its folder can be removed, as on a disk), the open file stays."""
        if not staging.live and staging.path:
            self._unlink_quiet(staging.path)
            staging.path = ""



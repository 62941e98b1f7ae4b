"""FUSE passthrough on one mount: the backing files the kernel reads and writes by itself.

The kernel serves all open files of an inode from one backing file: it is registered at the first
passthrough open of the inode (`Passthrough.attach`) and released at the last close (`detach`);
an inode with handles open on the daemon's path gets none (the kernel refuses to mix them). The
daemon sees no `write()` of a passthrough open, so a write open is served by passthrough only
while its staging file's filesystem has `mount.passthrough_min_free_mb` free (`write_ok`), and a
publish that finds less than 1/16 of that refuses (`check_unseen_writes`): docs/semantics.md,
"The publish rule" and "FUSE passthrough".
"""
from __future__ import annotations

import errno
import logging
import os
from typing import Protocol
from collections.abc import Awaitable, Callable

from hintfs.common.errors import HintfsError
from fusefs.handles import PassthroughRead
from fusefs.inodes import Inode
from fusefs.stats import Stats
from hintfs.stores.base import Staging, Stat

log = logging.getLogger("hintfs.ops")

# Errors of the first registration that mean "never on this mount" (no privilege, no support).
_UNAVAILABLE = {errno.EPERM, errno.EACCES, errno.ENOTTY, errno.ENOSYS, errno.EOPNOTSUPP}


class Backing(Protocol):
    """Registers backing files with the kernel for FUSE passthrough (`fusefs/fuse.py`)."""
    def open(self, fd: int) -> int: ...
    def close(self, backing_id: int) -> None: ...


class HeldFd:
    """An fd the filesystem holds beside a passthrough backing (a replica's): fstat after unlink."""
    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def backing_key(st: Stat, replica: bool) -> tuple:
    """What a passthrough backing of a store file stands for: a replica holds one version of it
    ("replica", size, mtime_ns); the store file itself is its `Stat.file_key` ((st_dev, st_ino) on
    file://: current whatever changes in place; an object's version on S3, whose backing is the
    host cache's copy of it). An open that finds another key than the backing's must not share it."""
    return ("replica", *st.identity()) if replica else st.file_key()


def free_bytes(fd: int) -> int:
    """Free bytes of the filesystem of `fd`, as this daemon may use them (root: the reserve too)."""
    sv = os.fstatvfs(fd)
    return (sv.f_bfree if os.geteuid() == 0 else sv.f_bavail) * sv.f_frsize


class Passthrough:
    """The backing files of one mount: on once the kernel granted passthrough at FUSE init
    (`set`), off again if a registration shows it never will work here."""

    def __init__(self, stats: Stats, min_free_bytes: int):
        self.stats = stats
        self.min_free = min_free_bytes         # mount.passthrough_min_free_mb, in bytes
        self.backend: Backing | None = None
        self._closer: Backing | None = None  # kept to release ids after a late disable
        stats.passthrough = "off (not mounted)"

    @property
    def on(self) -> bool:
        return self.backend is not None

    def set(self, result: tuple[Backing | None, str]) -> None:
        """Turn passthrough on (a backend) or off (None), with the reason shown in the stats."""
        backend, state = result
        self.backend = backend
        if backend is not None:
            self._closer = backend
        self.stats.passthrough = state
        level = logging.WARNING if state.startswith("unavailable") else logging.INFO
        log.log(level, "FUSE passthrough: %s", state)

    def attach(self, node: Inode, fd: int, staging: Staging | None) -> int:
        """A backing id for one more open of `node` served by the kernel from `fd` (the store file,
        or `staging`'s file), registered once per inode; 0: serve this open on today's path."""
        if node.pt_refs:
            node.pt_refs += 1      # all opens of an inode share one backing file (the kernel's rule)
            self.stats.add("passthrough_opens")
            return node.pt_id
        if self.backend is None or node.opens:
            return 0               # handles open on today's path: the kernel refuses to mix the two
        try:
            backing_id = self.backend.open(fd)
        except OSError as err:
            self.stats.add("passthrough_failed")
            if err.errno in _UNAVAILABLE:
                self.set((None, f"unavailable (registering a backing file failed: {err.strerror})"))
            else:
                log.debug("passthrough for %s refused (%s): today's path", node.path, err.strerror)
            return 0
        node.pt_id, node.pt_refs, node.pt_staging = backing_id, 1, staging
        self.stats.add("passthrough_backing_open")
        self.stats.add("passthrough_opens")
        return backing_id

    @staticmethod
    def read_handle(node: Inode, key: tuple, holder) -> PassthroughRead:
        """A read open served by the kernel from the backing just registered for `node`. The
        kernel holds its own reference to that file; `holder` (a reader or `HeldFd` of it) stays
        open until the last passthrough close, for getattr once the name is unlinked."""
        node.pt_file, node.pt_reader = key, holder
        node.add_reader(holder)
        return PassthroughRead(node)

    def detach(self, node: Inode) -> None:
        """One passthrough handle of `node` released; the last one releases the backing id."""
        node.pt_refs -= 1
        if node.pt_refs > 0 or not node.pt_id:
            return
        backing_id, node.pt_id, node.pt_staging = node.pt_id, 0, None
        if node.pt_reader is not None:
            node.drop_reader(node.pt_reader)
            node.pt_reader.close()
            node.pt_reader = None
        try:
            if self._closer is not None:
                self._closer.close(backing_id)
            self.stats.add("passthrough_backing_close")
        except OSError as err:
            log.warning("releasing passthrough backing id %d of %s failed: %s", backing_id, node.path, err.strerror)

    def write_ok(self, staging: Staging) -> bool:
        """Whether a write open may be served by passthrough: its staging file's filesystem has at
        least `mount.passthrough_min_free_mb` free (below, the daemon sees every write and its
        errors). Asked once per new backing registration (one fstatvfs)."""
        if self.min_free <= 0:
            return True
        if free_bytes(staging.fd) >= self.min_free:
            return True
        self.stats.add("passthrough_low_space_opens")
        return False

    async def check_unseen_writes(self, node: Inode, staging: Staging, io: Callable[..., Awaitable]) -> None:
        """Under passthrough a failed write() never reaches the daemon. A write open is served by
        passthrough only while the staging file's filesystem has `passthrough_min_free_mb` free
        (`write_ok`); if it has less than 1/16 of that now, a write may have failed unseen: the
        publish is refused (ENOSPC), the previous version stays, and these bytes are never
        published later. `io`: the filesystem's runner of blocking calls."""
        floor = self.min_free // 16
        if floor <= 0:
            return
        free = await io(free_bytes, staging.fd, inline=staging.inline_io)
        if free < floor:
            staging.failed = (f"its filesystem has {free >> 20} MiB free (under {floor >> 20} MiB): "
                              "a write may have failed unseen (passthrough)")
            self.stats.add("passthrough_full_refusals")
            raise HintfsError(errno.ENOSPC, f"not publishing {node.path}: {staging.failed}")


__all__ = ["Backing", "HeldFd", "Passthrough", "backing_key", "free_bytes"]

"""The private folder of a mount's in-process agent socket: `<tmp>/hintfs-agent-<pid>-XXXXXXXX/`.

The folder is 0700, so only the mount's user can reach the socket (no TCP port at all). A mount
that stops removes it; a mount that is killed (SIGKILL, the OOM killer) cannot, so each new one
first removes the folders of dead mounts of the same user. A folder is dead when the pid in its
name is gone *and* nobody holds the flock on it: the pid keeps a folder being made safe (its
maker is alive), and the lock keeps a live mount's folder safe where the pid is not what it seems
(another pid namespace sharing this /tmp, a reused pid). Folders of other users, symlinks and
names not of this form are never touched: /tmp is shared with everyone.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile

from hintfs.common.procs import pid_alive

log = logging.getLogger("hintfs.agent")

PREFIX = "hintfs-agent-"
SOCKET = "agent.sock"


class SocketDir:
    """A made folder, locked for the life of this process (the kernel drops the lock at death)."""

    def __init__(self, path: str, lock_fd: int):
        self.path = path
        self.lock_fd: int | None = lock_fd

    @property
    def socket(self) -> str:
        return os.path.join(self.path, SOCKET)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


def make(tmp: str | None = None) -> SocketDir:
    """A fresh locked folder in `tmp` (the temp dir by default), after reaping dead ones there."""
    tmp = tmp or tempfile.gettempdir()
    reap_dead(tmp)
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=tmp)   # 0700
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        raise
    return SocketDir(path, fd)


def _maker_pid(name: str) -> int | None:
    rest = name[len(PREFIX):]
    pid, sep, _suffix = rest.partition("-")
    return int(pid) if sep and pid.isdigit() else None


def reap_dead(tmp: str) -> int:
    """Remove this user's socket folders in `tmp` whose mount is gone; how many were removed."""
    removed = 0
    try:
        names = os.listdir(tmp)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = _maker_pid(name)
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        folder = os.path.join(tmp, name)
        try:    # (a symlink or a non-folder fails here: nothing is followed)
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue                  # another user's: theirs to remove
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue                  # held: a live mount's, whatever its name says
            shutil.rmtree(folder, ignore_errors=True)   # (rmtree does not follow links inside)
            removed += 1
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d socket folders of in-process agents of mounts that are gone, in %s", removed, tmp)
    return removed

"""A daemon's own folders: the one rule for a local folder where a daemon keeps what no other user
may touch (a remote store's `cache.spool_dir`, where writes stage; the host cache's `cache.dir`).

Such a folder is made 0700 by the daemon when missing; an existing one must be a folder (not a
symlink) owned by the daemon's user, else it is refused with one line (HintfsError: EACCES for
another user's folder, the kernel's errno otherwise: ELOOP for a symlink, ENOTDIR, ...). One of
the daemon's own whose mode lets others in is made 0700, with a warning. The check is made on
an fd opened with O_NOFOLLOW, and the fd is what the caller then works in (`dir_fd=`): a folder
swapped in after the check is never used."""
from __future__ import annotations

import errno
import logging
import os
import stat as stat_mod

from hintfs.common.errors import HintfsError

log = logging.getLogger("hintfs.owndir")


def open_own_dir(name: str, dir_fd: int | None, what: str, purpose: str) -> int:
    """An fd (O_RDONLY | O_DIRECTORY) of the existing folder `name` (relative to `dir_fd`, if
    given), once it is a folder of this daemon's user and closed to others (made 0700 if not).
    `what` names it in messages ("cache.dir /var/cache/x"), `purpose` says what it is for
    ("keep cached files there")."""
    uid = os.geteuid()
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as err:
        reason = "it is a symlink" if err.errno == errno.ELOOP else err.strerror
        raise HintfsError(err.errno or errno.EIO, f"{what} cannot be used: {reason}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise HintfsError(errno.EACCES, f"{what} is owned by uid {st.st_uid}, not by this daemon's user "
                              f"(uid {uid}): refusing to {purpose}")
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o700)
            log.warning("%s was mode %o: made 0700", what, stat_mod.S_IMODE(st.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_own_dir(path: str, what: str, purpose: str) -> int:
    """`open_own_dir` of the absolute `path`, made first (0700, and its missing parents) if it
    is not there."""
    if not os.path.isabs(path):
        raise HintfsError(errno.EINVAL, f"{what} must be an absolute path")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:      # a dangling symlink, a file ...: open_own_dir says which
        pass
    except OSError as err:
        raise HintfsError(err.errno or errno.EIO, f"{what} cannot be made: {err.strerror}") from None
    return open_own_dir(path, None, what, purpose)


__all__ = ["open_own_dir", "make_own_dir"]

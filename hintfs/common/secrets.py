"""Token files: the shared secrets agents and their clients authenticate with.

A token file must be a regular file owned by the user who reads it and readable by nobody else
(mode 0600 or stricter): a token anyone on the host can read authenticates anyone."""
from __future__ import annotations

import errno
import os
import stat

from hintfs.common.errors import HintfsError

MAX_TOKEN_BYTES = 4096


def read_token_file(path: str) -> str:
    """The token in `path`, stripped; HintfsError with a one-line reason when the file is not
    private to this user or holds no token."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise HintfsError(err.errno or errno.EIO, f"token file {path}: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise HintfsError(errno.EINVAL, f"token file {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise HintfsError(errno.EPERM, f"token file {path} is owned by uid {st.st_uid}, "
                              f"not by this user (uid {os.geteuid()})")
        if st.st_mode & 0o077:
            raise HintfsError(errno.EPERM, f"token file {path} has mode {stat.S_IMODE(st.st_mode):04o}: "
                              "others can read it; chmod 600 it")
        data = os.read(fd, MAX_TOKEN_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_TOKEN_BYTES:
        raise HintfsError(errno.EINVAL, f"token file {path} is larger than {MAX_TOKEN_BYTES} bytes")
    token = data.decode("utf-8", "replace").strip()
    if not token:
        raise HintfsError(errno.EINVAL, f"token file {path} is empty")
    return token


MAX_TLS_ROOTS_BYTES = 1 << 20


def read_tls_roots(path: str) -> bytes:
    """The PEM root certificate(s) in `path` (`[agents] tls_root_file`: the CA that signed the
    agents' certificates); HintfsError with a one-line reason when it cannot be read, is not a
    regular file, is larger than 1 MiB or holds no certificate. Public, so any mode."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise HintfsError(err.errno or errno.EIO, f"TLS root file {path}: {err.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise HintfsError(errno.EINVAL, f"TLS root file {path} is not a regular file")
        data = os.read(fd, MAX_TLS_ROOTS_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_TLS_ROOTS_BYTES:
        raise HintfsError(errno.EINVAL, f"TLS root file {path} is larger than {MAX_TLS_ROOTS_BYTES} bytes")
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise HintfsError(errno.EINVAL, f"TLS root file {path} holds no PEM certificate "
                          "(-----BEGIN CERTIFICATE-----)")
    return data

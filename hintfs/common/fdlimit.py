"""The open-file limit of a long-running hintfs process.

A tier agent keeps fds open for the replicas read lately (at most half its limit,
`share_of_open_files`), a mount one per passthrough open, the GPU governor one per lent page.
Started from a shell, they get its soft limit, often 1,024: a mount with a thousand open files,
or a governor lending a thousand pages, then fails with EMFILE. At start they raise the soft
limit to the hard one, as systemd's `LimitNOFILE` does for the units in systemd/ and as Go's
runtime does for every Go program.
"""
from __future__ import annotations

import fcntl
import os
import resource

_NR_OPEN = "/proc/sys/fs/nr_open"   # the kernel's ceiling for RLIMIT_NOFILE


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (to the kernel's ceiling if unlimited);
    the soft limit now. Never fails: a limit that cannot be raised stays as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open(_NR_OPEN) as f:
                want = int(f.read())
        except (OSError, ValueError):
            want = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def share_of_open_files(share: float, floor: int = 64) -> int:
    """`share` of this process's soft RLIMIT_NOFILE (at least `floor`): what one kind of fd may
    hold open at a time, so that the others (sockets, copies, streams) still find room."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(floor, int(soft * share))


def reserve_fd_table(n: int) -> int:
    """Grow this process's fd table now to hold `n` fds (at most the soft RLIMIT_NOFILE), so
    that holding many fds later (a lend of a hundred pages over SCM_RIGHTS; a mount's fast-path
    marks) does not grow it then. Growing the table of a process with several threads waits for
    an RCU grace period (synchronize_rcu in the kernel's expand_fdtable): 13-14 ms measured on the
    H200 host on the first large lend, 9-16 ms on a mount's open here, once per doubling. The
    table never shrinks. Returns the size reserved (0: nothing)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        n = min(n, soft)
    if n < 4:
        return 0
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:   # F_DUPFD takes the lowest free fd >= n - 1 and never closes one in use
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, n - 1)
        os.close(high)
    except OSError:
        return 0
    finally:
        os.close(fd)
    return n


__all__ = ["raise_open_file_limit", "reserve_fd_table", "share_of_open_files"]

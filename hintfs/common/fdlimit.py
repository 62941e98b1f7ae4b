"""The open-file limit of a long-running hintfs process.

A tier agent keeps one fd open per replica (a read is one pread), a mount one per passthrough
open, the GPU governor one per lent page. Started from a shell, they get its soft limit, often
1,024: past about that many replicas, every copy fails with EMFILE and is retried for ever.
At start they raise the soft limit to the hard one, as systemd's `LimitNOFILE` does for the
units in systemd/ and as Go's runtime does for every Go program.
"""
from __future__ import annotations

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


__all__ = ["raise_open_file_limit"]

"""What is mounted where, from /proc/self/mountinfo: so hintfs's own commands act only on hintfs
mounts, and recognise a dead one (its daemon gone: every access fails with ENOTCONN)."""
from __future__ import annotations

import errno
import os
import subprocess
from dataclasses import dataclass
from typing import Optional

HINTFS_FSTYPE = "fuse.hintfs"      # FUSE type + the subtype the mount daemon sets
DEAD_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)   # what a FUSE mount without its daemon answers


@dataclass(frozen=True)
class MountEntry:
    mountpoint: str
    fstype: str
    source: str

    @property
    def is_hintfs(self) -> bool:
        return self.fstype == HINTFS_FSTYPE


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_at(path: str, mountinfo: str = "/proc/self/mountinfo") -> Optional[MountEntry]:
    """The topmost mount whose mount point is exactly `path` (made absolute, not resolved: a dead
    FUSE mount cannot be resolved), or None."""
    want = os.path.normpath(os.path.abspath(path))
    found = None
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) >= 5 and len(rest) >= 2 and _unescape(fields[4]) == want:
                found = MountEntry(want, rest[0], _unescape(rest[1]))
    return found


def dead_mount_at(path: str, mountinfo: str = "/proc/self/mountinfo") -> Optional[MountEntry]:
    """The mount at `path` if it is dead (its daemon gone: statfs fails with ENOTCONN or
    ECONNABORTED), else None. Any filesystem type: the caller decides what it may touch. statfs,
    not stat: the kernel answers a stat of the mount's root from its attribute cache for a while
    after the daemon died; statfs always asks the daemon."""
    entry = mount_at(path, mountinfo)
    if entry is None:
        return None
    try:
        os.statvfs(path)
        return None
    except OSError as err:
        return entry if err.errno in DEAD_ERRNOS else None


def detach_lazily(path: str) -> None:
    """`fusermount3 -u -z path`: detach a FUSE mount now, even if its daemon is gone or files
    are still open on it (they keep failing; the path is usable again at once). Raises OSError
    with fusermount3's message."""
    r = subprocess.run(["fusermount3", "-u", "-z", path], capture_output=True, text=True)
    if r.returncode != 0:
        raise OSError(errno.EBUSY, r.stderr.strip() or f"fusermount3 -u -z exited with {r.returncode}")

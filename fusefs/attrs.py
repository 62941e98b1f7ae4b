"""The plain types `Filesystem` answers with, and the FUSE constants it needs, without pyfuse3.

`fusefs/fuse.py` copies these into pyfuse3's `EntryAttributes` / `FileInfo` / `StatvfsData`;
a test reads them as they are. `Refused` is the filesystem's answer to a request it declines
(EPERM on a control directory, EBADF for a write on a read handle): like pyfuse3's FUSEError it
is counted in the stats and not logged, unlike an `OSError` from the store, which is logged.
"""
from __future__ import annotations

from dataclasses import dataclass

from hintfs.common.errors import HintfsError

ROOT_INODE = 1           # the kernel's inode number of the mount's root (pyfuse3.ROOT_INODE)
RENAME_NOREPLACE = 1     # rename(2) flags as FUSE passes them (linux/fs.h)
RENAME_EXCHANGE = 2

BLOCK_SIZE = 1 << 17     # st_blksize reported for files (the kernel's preferred I/O size)


class Refused(HintfsError):
    """The filesystem declines a request with this errno: counted, not logged (expected answers)."""


# Defaults are pyfuse3's (EntryAttributes(), FileInfo()), so a field left out means what it did.
@dataclass(slots=True)
class Attributes:
    """What `stat` shows for an inode, and how long the kernel may cache it and its name."""
    st_ino: int
    st_mode: int
    st_nlink: int = 1
    st_size: int = 0
    st_uid: int = 0
    st_gid: int = 0
    st_blksize: int = 4096
    st_blocks: int = 0
    st_mtime_ns: int = 0
    st_ctime_ns: int = 0
    st_atime_ns: int = 0
    attr_timeout: float = 300.0
    entry_timeout: float = 300.0
    st_rdev: int = 0


@dataclass(slots=True)
class OpenFile:
    """An open file handle and how the kernel should cache its data."""
    fh: int
    keep_cache: bool = True
    direct_io: bool = False
    backing_id: int = 0      # > 0: the kernel serves this open from a backing file (passthrough)
    noflush: bool = False    # close(2) sends no FLUSH (the handle has nothing to do at close)


@dataclass(slots=True)
class FsStats:
    """statfs(2) answer."""
    f_bsize: int = 0
    f_frsize: int = 0
    f_blocks: int = 0
    f_bfree: int = 0
    f_bavail: int = 0
    f_files: int = 0
    f_ffree: int = 0
    f_favail: int = 0
    f_namemax: int = 0


@dataclass(slots=True)
class DirEntry:
    """One readdir entry: its name, attributes, and the offset of the entry after it; `plus`
    False: the kernel gets the name, inode number and type only (no inode, no lookup)."""
    name: bytes
    attrs: Attributes
    next_id: int
    plus: bool = True


__all__ = ["ROOT_INODE", "RENAME_NOREPLACE", "RENAME_EXCHANGE", "BLOCK_SIZE", "Refused", "Attributes",
           "OpenFile", "FsStats", "DirEntry"]

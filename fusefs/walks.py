"""Which callers walk a tree, so that their listings can give files by name only.

A readdirplus entry makes an inode, in the kernel and in the daemon, for every name listed: what
`ls -l`, `du` or `rsync` want (their `stat` of each name then sends no lookup), and what `find`,
`os.walk` or a dataset's index (names and types only) pay for without using it: ~23 µs an entry in
the daemon against ~3 µs for a plain name (bench/notes/metadata.md). The kernel asks for
readdirplus always (pyfuse3 clears FUSE_CAP_READDIRPLUS_AUTO), so the daemon chooses per entry: a
readdirplus entry with nodeid 0 is a plain name (`patches/pyfuse3-readdir.patch`).

The rule, per calling thread (the FUSE request's pid): its first `WALK_AFTER` folders are listed
with attributes; past that it is walking, and the files of the folders it lists are given by
name, type and inode number only (folders keep their attributes: the walk descends into them with
no lookup). A thread that then looks up a file in a folder it was given by name (a `stat` or an
`open` of what it listed) is a stat-er: its listings have attributes again, for as long as it is
remembered. Only speed depends on the rule, never what a caller sees: a name listed plain is
looked up on first use like any name the kernel does not know. Remembered: the last `MAX_CALLERS`
threads, and per thread the last `PLAIN_FOLDERS` folders listed by name.
"""
from __future__ import annotations

from collections import OrderedDict

WALK_AFTER = 16        # folders a thread lists with attributes before it counts as walking
MAX_CALLERS = 1024     # threads remembered (least recently seen first out)
PLAIN_FOLDERS = 64     # folders listed by name remembered per thread


class _Caller:
    __slots__ = ("opened", "stats", "plain")

    def __init__(self) -> None:
        self.opened = 0
        self.stats = False                            # looked up a file it was given by name
        self.plain: OrderedDict[int, None] = OrderedDict()   # folders (inodes) listed by name


class Walks:
    def __init__(self, walk_after: int = WALK_AFTER, max_callers: int = MAX_CALLERS,
                 plain_folders: int = PLAIN_FOLDERS):
        self.walk_after = walk_after
        self.max_callers = max_callers
        self.plain_folders = plain_folders
        self._callers: OrderedDict[int, _Caller] = OrderedDict()
        self.by_name = 0        # listings given by name (for `.hintfs/stats`)
        self.back_to_plus = 0   # threads that looked up what they were given by name

    def _caller(self, pid: int) -> _Caller:
        caller = self._callers.get(pid)
        if caller is None:
            caller = self._callers[pid] = _Caller()
            if len(self._callers) > self.max_callers:
                self._callers.popitem(last=False)
        else:
            self._callers.move_to_end(pid)
        return caller

    def opened(self, pid: int, folder: int) -> bool:
        """Thread `pid` opens folder (inode) `folder`: True when its files are to be listed by name."""
        if pid <= 0:
            return False   # (no caller: the daemon's own or a test's)
        caller = self._caller(pid)
        if caller.stats:
            return False
        caller.opened += 1
        if caller.opened <= self.walk_after:
            return False
        caller.plain[folder] = None
        caller.plain.move_to_end(folder)
        if len(caller.plain) > self.plain_folders:
            caller.plain.popitem(last=False)
        self.by_name += 1
        return True

    def looked_up(self, pid: int, folder: int) -> None:
        """Thread `pid` looked up a file (not a folder) in `folder`."""
        caller = self._callers.get(pid)
        if caller is not None and not caller.stats and folder in caller.plain:
            caller.stats = True
            caller.plain.clear()
            self.back_to_plus += 1


__all__ = ["Walks", "WALK_AFTER", "MAX_CALLERS", "PLAIN_FOLDERS"]

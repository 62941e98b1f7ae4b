"""The inode table: kernel inode numbers <-> store paths, with the kernel's lookup counts.

Paths are the identity (the store has no inode numbers of its own that survive a remount).
An inode lives while the kernel holds lookups on it or a handle is open on it; `forget`
drops it. Rename moves a whole subtree of known paths.
"""
from __future__ import annotations

import itertools
from typing import Optional

from fusefs.attrs import ROOT_INODE
from stores.base import Staging


class Inode:
    __slots__ = ("ino", "path", "lookups", "opens", "writer", "writer_refs", "unlinked",
                 "cached_identity", "control", "virtual", "tensor_data")

    def __init__(self, ino: int, path: str, control=None):
        self.ino = ino
        self.path = path
        self.lookups = 0
        self.opens = 0
        self.writer: Optional[Staging] = None   # staged writes shared by all write handles
        self.writer_refs = 0
        self.unlinked = False
        # (size, mtime) of the file when the kernel's page cache was last known to match it;
        # an open that sees another identity drops the cache (close-to-open consistency).
        self.cached_identity: Optional[tuple[int, int]] = None
        self.control = control                  # a control node for `.hintfs/...`, else None
        self.virtual = None                     # (source, rule) of an `x.tensor` path, else None
        self.tensor_data: Optional[bytes] = None  # its bytes while any handle has it open


class InodeTable:
    def __init__(self) -> None:
        root = Inode(ROOT_INODE, "")
        root.lookups = 1 << 62  # the root is never forgotten
        self.by_ino: dict[int, Inode] = {root.ino: root}
        self.by_path: dict[str, Inode] = {"": root}
        self._next = itertools.count(ROOT_INODE + 1)

    def __getitem__(self, ino: int) -> Inode:
        return self.by_ino[ino]

    def get(self, ino: int) -> Optional[Inode]:
        return self.by_ino.get(ino)

    def by_path_get(self, path: str) -> Optional[Inode]:
        return self.by_path.get(path)

    def ensure(self, path: str) -> Inode:
        inode = self.by_path.get(path)
        if inode is None:
            inode = Inode(next(self._next), path)
            self.by_ino[inode.ino] = inode
            self.by_path[path] = inode
        return inode

    def add_control(self, key: str, node) -> Inode:
        """Control nodes get inodes too; they are pinned (never forgotten)."""
        inode = Inode(next(self._next), key, control=node)
        inode.lookups = 1 << 62
        self.by_ino[inode.ino] = inode
        return inode

    def forget(self, ino: int, n: int) -> None:
        inode = self.by_ino.get(ino)
        if inode is None or inode.control is not None or ino == ROOT_INODE:
            return
        inode.lookups -= n
        self.maybe_drop(inode)

    def release_open(self, inode: Inode) -> None:
        inode.opens -= 1
        if inode.opens <= 0:
            inode.tensor_data = None   # the next open gets a fresh sample (it may differ: raw/tensor)
        self.maybe_drop(inode)

    def maybe_drop(self, inode: Inode) -> None:
        if inode.lookups <= 0 and inode.opens <= 0 and inode.writer is None:
            self.by_ino.pop(inode.ino, None)
            if self.by_path.get(inode.path) is inode:
                del self.by_path[inode.path]

    def detach(self, path: str) -> Optional[Inode]:
        """The path is gone from the namespace (unlink/rmdir/replaced by rename)."""
        inode = self.by_path.pop(path, None)
        if inode is not None:
            inode.unlinked = True
        return inode

    def move(self, old: str, new: str) -> None:
        """Rename: the inode at `old` and every known path below it now live under `new`."""
        replaced = self.detach(new)
        del replaced
        inode = self.by_path.pop(old, None)
        if inode is not None:
            inode.path = new
            self.by_path[new] = inode
        prefix = old + "/"
        moved = [p for p in self.by_path if p.startswith(prefix)]
        for p in moved:
            child = self.by_path.pop(p)
            child.path = new + p[len(old):]
            self.by_path[child.path] = child

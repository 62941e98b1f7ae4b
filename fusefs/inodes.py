"""The inode table: kernel inode numbers <-> store paths, with the kernel's lookup counts.

Paths are the identity (the store has no inode numbers of its own that survive a remount), with
one exception: hard links. A file:// file with several names (st_nlink > 1) is one inode with
one primary `path` and other `aliases`, found by its backing (st_dev, st_ino) in `by_backing`;
unlinking or renaming one name keeps the others. An inode lives while the kernel holds lookups on
it or a handle is open on it; `forget` drops it. Rename moves a whole subtree of known paths.
"""
from __future__ import annotations

import itertools
import stat as stat_mod
from typing import TYPE_CHECKING

from fusefs.attrs import ROOT_INODE
from hintfs.stores.base import Staging

if TYPE_CHECKING:
    import trio

    from hintfs.transforms.params import TransformRule


class Inode:
    __slots__ = ("ino", "path", "lookups", "opens", "writer", "writer_refs", "unlinked",
                 "cached_identity", "control", "virtual", "tensor_data", "aliases", "backing", "readers",
                 "pt_id", "pt_refs", "pt_staging", "pt_file", "pt_reader", "publishing", "kept", "file_key", "kind",
                 "writers_pending", "fast_named", "changing")

    def __init__(self, ino: int, path: str, control=None):
        self.ino = ino
        self.path = path
        self.lookups = 0
        self.opens = 0
        self.writer: Staging | None = None   # staged writes shared by all write handles
        self.writer_refs = 0
        self.unlinked = False
        # Stat.version() of the file when the kernel's page cache was last known to match it;
        # an open that sees another identity drops the cache (close-to-open consistency).
        self.cached_identity: tuple[int, int, str] | None = None
        self.control = control                  # a control node for `.hintfs/...`, else None
        self.virtual: tuple[str, TransformRule] | None = None   # (source, rule) of an `x.tensor` path
        self.tensor_data: bytes | None = None  # its bytes while any handle has it open
        # Tuples, not lists: an empty tuple is one shared object the cyclic GC never visits, and
        # most inodes of a big walk keep both empty (in-process lookups from a kept listing at
        # 200,000 cached entries: 12.3 us with a list each, 10.1 with tuples; and the GC's full
        # passes, which stop the FUSE loop, grow with every object they visit: docs/operations.md).
        self.aliases: tuple[str, ...] = ()       # other names of a hard-linked file
        self.backing: tuple[int, int] | None = None   # (st_dev, st_ino) while it has several names
        self.readers: tuple = ()                # store readers open on it (their fds outlive an unlink)
        # FUSE passthrough: the backing id the kernel serves this inode's open files from (0: none),
        # how many handles use it, and the staging it names (None: the store file).
        self.pt_id = 0
        self.pt_refs = 0
        self.pt_staging: Staging | None = None
        # what backs it: (st_dev, st_ino) of the store file, or ("replica", size, mtime_ns) of a replica
        self.pt_file: tuple = (0, 0)
        self.pt_reader = None     # that store file's reader (in `readers`: fstat after an unlink)
        # Held while the last release publishes and drops the staging, and while a truncate by
        # path changes it: one cannot swap the staging under the other (`Filesystem.publish_lock`).
        self.publishing: trio.Lock | None = None
        # The staging of a file unlinked while open, kept after its last writer for the readers
        # still open on it (they read what was written, as from an unlinked file on a disk).
        self.kept: Staging | None = None
        # (st_dev, st_ino) of the store file the open handles of this inode read (file:// stores):
        # an open that finds another file at the name gets a new inode (close-to-open on one
        # page cache per inode, `Filesystem._renew`); None while nothing is open.
        self.file_key: tuple | None = None
        self.kind = 0             # S_IFMT of the store entry it was last looked up as (0: unknown)
        # Write opens between their first check and their staging (`Filesystem._see_write`): a read
        # open meanwhile gets no passthrough backing, which the writer would otherwise share.
        self.writers_pending = 0
        # Its name is answered inside pyfuse3 (`fusefs.fastpath.FastNames`): one lookup here is
        # that registration's, and the kernel's lookups answered there are added at FORGET.
        self.fast_named = False
        # Changes through this mount under way (`Filesystem._changing`: an unlink, rename, link or
        # setattr whose store calls let the loop run): no fast-path mark is made meanwhile.
        self.changing = 0

    def add_reader(self, reader) -> None:
        self.readers = (*self.readers, reader)

    def drop_reader(self, reader) -> None:
        """`reader` is not among the readers any more (its first occurrence; none: nothing)."""
        for i, r in enumerate(self.readers):
            if r is reader:
                self.readers = self.readers[:i] + self.readers[i + 1:]
                return

    def open_fd(self) -> int:
        """An fd of the open file (the writer's staging, else a reader's), or -1: what getattr
        and setattr use once the file has no name (unlinked while open)."""
        for staging in (self.writer, self.kept):
            if staging is not None and staging.fd >= 0:
                return staging.fd
        for reader in self.readers:
            fd = getattr(reader, "fd", -1)
            if fd >= 0:
                return fd
        return -1


class InodeTable:
    def __init__(self) -> None:
        root = Inode(ROOT_INODE, "")
        root.lookups = 1 << 62  # the root is never forgotten
        self.by_ino: dict[int, Inode] = {root.ino: root}
        self.by_path: dict[str, Inode] = {"": root}
        self.by_backing: dict[tuple[int, int], Inode] = {}
        self._next = itertools.count(ROOT_INODE + 1)
        # Inodes the kernel was asked to forget (`to_forget`) and has not yet: not asked again.
        self.asked: set[int] = set()

    def __getitem__(self, ino: int) -> Inode:
        return self.by_ino[ino]

    def get(self, ino: int) -> Inode | None:
        return self.by_ino.get(ino)

    def by_path_get(self, path: str) -> Inode | None:
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
        self.closing(inode)
        self.maybe_drop(inode)

    @staticmethod
    def closing(inode: Inode) -> None:
        """One open of `inode` is gone (its release has begun); `maybe_drop` after."""
        inode.opens -= 1
        if inode.opens <= 0:
            inode.tensor_data = None   # the next open gets a fresh sample (it may differ: raw/tensor)
            inode.file_key = None

    def maybe_drop(self, inode: Inode) -> None:
        if inode.lookups <= 0 and inode.opens <= 0 and inode.writer is None:
            self.by_ino.pop(inode.ino, None)
            self.asked.discard(inode.ino)
            for path in [inode.path, *inode.aliases]:
                if self.by_path.get(path) is inode:
                    del self.by_path[path]
            self.unlink_backing(inode)

    # -- the bound on cached entries ([cache] max_entries) --------------------------------------
    def over(self, limit: int) -> int:
        """How many known inodes past `limit` the kernel has not yet been asked to forget."""
        return len(self.by_ino) - len(self.asked) - limit

    def to_forget(self, n: int) -> list[tuple[Inode, Inode, str]]:
        """Up to `n` of the oldest idle inodes (known the longest: dicts keep insertion order),
        each with its parent's inode and its name: (inode, parent, name). Idle: the kernel holds
        lookups on it and nothing else, no open handle, no writer, not the root nor a control
        node. Each is marked asked (until `maybe_drop` forgets it)."""
        out: list[tuple[Inode, Inode, str]] = []
        if n <= 0:
            return out
        for inode in self.by_ino.values():
            if (inode.lookups <= 0 or inode.opens > 0 or inode.writer is not None or inode.control is not None
                    or inode.ino == ROOT_INODE or inode.ino in self.asked or inode.kept is not None
                    or inode.fast_named):
                continue
            parent_path, _, name = inode.path.rpartition("/")
            parent = self.by_path.get(parent_path)
            if parent is None or not name:
                continue
            self.asked.add(inode.ino)
            out.append((inode, parent, name))
            if len(out) >= n:
                break
        return out

    # -- hard links ----------------------------------------------------------------------------
    def linked(self, key: tuple[int, int]) -> Inode | None:
        """The known inode of the backing file `key`, if it has several names."""
        inode = self.by_backing.get(key)
        return inode if inode is not None and inode.ino in self.by_ino else None

    def set_backing(self, inode: Inode, key: tuple[int, int]) -> None:
        if inode.backing != key:
            self.unlink_backing(inode)
            inode.backing = key
            self.by_backing[key] = inode

    def unlink_backing(self, inode: Inode) -> None:
        if inode.backing is not None:
            if self.by_backing.get(inode.backing) is inode:
                del self.by_backing[inode.backing]
            inode.backing = None

    def alias(self, inode: Inode, path: str) -> None:
        """`path` is another name of `inode` (a hard link)."""
        old = self.by_path.get(path)
        if old is inode:
            return
        if old is not None:
            self.detach(path)
        self.by_path[path] = inode
        inode.aliases = (*inode.aliases, path)

    def split_aliases(self, inode: Inode) -> list[str]:
        """The inode's primary name now is another file (a commit replaced it): its other names
        are forgotten here (and returned, for the kernel to forget) and found again by the next
        lookup."""
        gone = [path for path in inode.aliases if self.by_path.get(path) is inode]
        for path in gone:
            del self.by_path[path]
        inode.aliases = ()
        self.unlink_backing(inode)
        return gone

    # -- namespace changes ---------------------------------------------------------------------
    def detach(self, path: str) -> Inode | None:
        """The path is gone from the namespace (unlink/rmdir/replaced by rename)."""
        inode = self.by_path.pop(path, None)
        if inode is not None:
            if inode.path == path:
                if inode.aliases:
                    inode.path, inode.aliases = inode.aliases[-1], inode.aliases[:-1]
                else:
                    inode.unlinked = True
            elif path in inode.aliases:
                i = inode.aliases.index(path)
                inode.aliases = inode.aliases[:i] + inode.aliases[i + 1:]
        return inode

    def move(self, old: str, new: str) -> None:
        """Rename: the inode at `old` and every known path below it now live under `new`."""
        if self.by_path.get(old) is not None and self.by_path.get(old) is self.by_path.get(new):
            return   # two names of one file: rename(2) does nothing
        if self.detach(new) is not None:
            # A folder renamed over: rename(2) replaces only an empty one, so the names this table
            # still knows beneath it are another host's, changed since (removed, or moved away and
            # perhaps back beneath what replaces it). Its folders, and files with nothing open, are
            # found again as new inodes: one of those folders given to the kernel under the new
            # folder would be a folder it still has under the old one, which it cannot move while
            # a rename holds its lock (ESTALE). A file with handles open stays known at its path,
            # as before: a new file made or found there later renews the name (`_stale_name`,
            # close-to-open), its readers keep their file, its writer its path to publish to.
            prefix = new + "/"
            for p in [p for p, n in self.by_path.items() if p.startswith(prefix)
                      and (n.kind == stat_mod.S_IFDIR or not (n.opens or n.writer is not None))]:
                del self.by_path[p]
        self._rename_one(old, new)
        prefix = old + "/"
        for p in [p for p in self.by_path if p.startswith(prefix)]:
            self._rename_one(p, new + p[len(old):])

    def _rename_one(self, old: str, new: str) -> None:
        inode = self.by_path.pop(old, None)
        if inode is None:
            return
        if inode.path == old:
            inode.path = new
        else:
            inode.aliases = tuple(new if a == old else a for a in inode.aliases)
        self.by_path[new] = inode

"""The one access rule of hintfs: may this user read this store path?

Every action hintfs takes *for a user* (a replica made for a hint, a range fetched for a read hint,
a plan registered, a sample transformed for a plan, a `.tensor` opened, a signal's folder) asks
here first, with the user the kernel named in the request. It grants exactly what the mount itself
grants that user (the kernel checks with `default_permissions` against the attributes the mount
reports): search (x) permission on every folder from the store root down, and read (r) permission
on the file, by the POSIX owner / group / other classes. Root may read everything (CAP_DAC_OVERRIDE).
Object stores (S3, HDFS) have no owners or modes of their own: their `Stat`s carry the owner and
modes the mount reports for every object (root, 0644 files, 0755 folders), so the same rule holds.
ACLs are not consulted (docs/security.md, "Threats that remain").

A refusal is `EACCES` whether the path exists or not, so a refusal is never an existence oracle
(a user who may search every folder on the way learns what `stat` would tell them anyway:
`ENOENT`).

Blocking (stats the store): call `check_readable` in a worker thread.
"""
from __future__ import annotations

import errno
import os
import stat as stat_mod
from dataclasses import dataclass
from collections.abc import Iterable

from hintfs.common.errors import HintfsError


@dataclass(frozen=True)
class Principal:
    """Who asks: the request's uid and gid and the process's supplementary groups."""
    uid: int
    gid: int
    groups: frozenset = frozenset()

    @classmethod
    def of(cls, ctx) -> Principal:
        """The caller of a FUSE request (its context carries uid, gid and pid)."""
        return cls(ctx.uid, ctx.gid, groups_of(ctx.pid))

    @property
    def root(self) -> bool:
        return self.uid == 0

    def privileged(self) -> bool:
        """Root or the daemon's own user (the mount's owner)."""
        return self.uid in (0, os.getuid())


def groups_of(pid: int) -> frozenset:
    """The supplementary groups of `pid` (FUSE requests carry only uid and gid)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()


def _class_bits(st, who: Principal, bits: int) -> bool:
    """Whether the owner / group / other class `who` falls in has all of `bits` (given as the
    "other" triplet: 4 read, 2 write, 1 search) in the mode of `st`."""
    mode = stat_mod.S_IMODE(st.mode)
    if st.uid == who.uid:
        return (mode >> 6) & bits == bits
    if st.gid == who.gid or st.gid in who.groups:
        return (mode >> 3) & bits == bits
    return mode & bits == bits


def may_read_stat(st, who: Principal) -> bool:
    """Whether `who` may read a file with these attributes (its folders not considered)."""
    return who.root or _class_bits(st, who, 4)


def may_search_stat(st, who: Principal) -> bool:
    """Whether `who` may pass through a folder with these attributes."""
    return who.root or _class_bits(st, who, 1)


class Checker:
    """Checks paths of one store for one principal, remembering the folders it has seen (a hint of
    4,096 files in one checkpoint folder stats that folder once)."""

    def __init__(self, store, who: Principal):
        self.store = store
        self.who = who
        self._folders: dict[str, bool] = {}

    def _folder_ok(self, folder: str) -> bool:
        ok = self._folders.get(folder)
        if ok is None:
            try:
                st = self.store.stat(folder)
            except OSError:
                ok = False
            else:
                ok = stat_mod.S_ISDIR(st.mode) and may_search_stat(st, self.who)
            self._folders[folder] = ok
        return ok

    def _folders_ok(self, folder: str) -> bool:
        """`who` may search the store root and every folder down to `folder` (included)."""
        if not self._folder_ok(""):
            return False
        cur = ""
        for part in folder.split("/") if folder else ():
            cur = f"{cur}/{part}" if cur else part
            if not self._folder_ok(cur):
                return False
        return True

    def may_read(self, path: str) -> bool:
        """`path` (a store-relative path, already checked by `hintfs.common.paths`) exists and `who` may
        read it (a file's bytes, a folder's listing) as the mount would let them."""
        if not self.who.root and not self._folders_ok(path.rpartition("/")[0]):
            return False
        try:
            st = self.store.stat(path)
        except OSError:
            return False
        return may_read_stat(st, self.who)


def check_readable(store, paths: Iterable[str], who: Principal, *, what: str = "path") -> None:
    """Blocking: `who` may read every path of `paths` (`Checker.may_read`), or HintfsError(EACCES)
    naming the first they may not. The same answer whether the path is missing or forbidden."""
    checker = Checker(store, who)
    for path in paths:
        if not checker.may_read(path):
            raise HintfsError(errno.EACCES, f"{what} {path}: permission denied for uid {who.uid} "
                              "(or it does not exist)")


def attrs_of_derived(source_mode: int, source_uid: int, source_gid: int) -> tuple[int, int, int]:
    """(mode, uid, gid) of a read-only view derived from a file (a `.tensor`): the source's owner
    and group, the source's read bits, no write or execute bits, no set-id bits."""
    return stat_mod.S_IFREG | (stat_mod.S_IMODE(source_mode) & 0o444), source_uid, source_gid


__all__ = ["Principal", "groups_of", "may_read_stat", "may_search_stat", "Checker", "check_readable",
           "attrs_of_derived"]

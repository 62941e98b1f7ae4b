"""The fast path: later read-only opens of a plain store file answered inside pyfuse3.

(Where the path is not declared immutable, a file:// store's marks are checked: each open
pyfuse3 answers first checks that the path still names the marked file, the store's own
close-to-open under passthrough; docs/fastpath.md, "Checked marks". What follows is written
for immutable paths; a checked mark differs in that check and in leaving GETATTR to Python. A
folder a reader goes through has its names registered the same way, each LOOKUP checked and
answered with the attributes of then: "Checked names", `FastNames.register(checks=...)`.)

A fresh small file costs the daemon three requests answered in Python (LOOKUP, OPEN, RELEASE); a
second pass over a dataset two (OPEN, RELEASE). For a file this mount reads from its store
through FUSE passthrough, where the config declares the path immutable (`cache.immutable_globs`)
and no route or hint replica can send a read elsewhere, the first open marks the inode: the
patched pyfuse3 (`patches/pyfuse3-fastpath.patch`) then answers read-only opens of it, their
releases and its GETATTRs inside its C callbacks, from the backing id and the attributes of that
first open, with no Python frame. (Every read through passthrough makes the kernel ask for the
attributes again at the next `fstat`: it drops the atime it caches.)

Which opens may be marked is `fast_eligible`, a pure function of the handle kind the open got
(`fusefs.handles.choose_handle`, the one rule for every open) and of what the path is: never a
control file, a `.tensor`, a staging file, a file open for writing, a replica or a tier copy.
What a mark skips, and why that is still the mount's rule (docs/fastpath.md):

- the close-to-open check, and fresh attributes: the config declared the path immutable, the same
  declaration that lets the kernel keep its attributes and listings for `immutable_timeout_s`
  (a marked file's atime stays the one of its mark); a setattr, link, write, truncate, rename or
  unlink through this mount ends the mark first;
- the access check: the kernel's (`default_permissions`) runs before any OPEN is sent, the only
  check a plain read open ever had;
- the per-principal bounds on handles: a fast open holds nothing in the daemon. A mark holds one
  fd and one backing id: `[mount] fast_path_inodes` of them in all (at most a quarter of the
  daemon's open-file limit). A mark is charged to the user whose open made it; when the table is
  full, the user holding the most marks gives up its oldest: one user may fill an idle table (a
  training job's dataset), and any other user still gets room.

A mark is held as one more passthrough open of the inode (no handle in the filesystem's table): the inode stays known, its backing id stays registered, and every rule that
already looks at open handles sees it (a write open while reads are open through passthrough is
ETXTBSY; an inode with open handles is never forgotten). `unmark` ends a mark when a write,
truncate, setattr, link, rename or unlink through this mount changes the file, when the kernel forgets the inode,
or when the table needs the room: new opens go to Python at once, and the hold is let go once the
opens the fast path served are released (until then a writer gets ETXTBSY, as with any open
passthrough reader).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Protocol
from collections.abc import Callable

import trio

from fusefs.attrs import Attributes
from fusefs.handles import HandleKind
from fusefs.inodes import Inode
from fusefs.shares import UserShares
from hintfs.common.fdlimit import share_of_open_files


class NamesBackend(Protocol):
    """The patched pyfuse3's table of names answered at LOOKUP (`fusefs.fuse.names_backend`)."""
    def put(self, parent: int, entries: list[tuple[bytes, Attributes | int, tuple[int, bytes, int, int] | None]],
            deadline_ns: int, template: Attributes | None = None) -> None: ...
    def drop(self, parent: int) -> int: ...
    def take(self, ino: int) -> int: ...
    def stats(self) -> tuple[int, int, int]: ...
    def now_ns(self) -> int: ...


class FastBackend(Protocol):
    """The patched pyfuse3's fast-path table (`fusefs.fuse.fast_backend`)."""
    def mark(self, ino: int, backing_id: int, attrs: Attributes | None,
             check: tuple[int, bytes, int, int] | None = None) -> None: ...
    def unmark(self, ino: int) -> int: ...
    def opens(self, ino: int) -> int: ...
    def stats(self) -> tuple[int, int, int, int]: ...
    @property
    def checks(self) -> bool: ...
    def check_stats(self) -> tuple[int, int, int, int]: ...
    @property
    def lazy(self) -> bool: ...
    def mark_lazy(self, entries: list[tuple[int, tuple[int, bytes, int, int]]]) -> None: ...
    def lazy_opened(self) -> list[tuple[int, int, int]]: ...
    def lazy_stats(self) -> tuple[int, int]: ...


# The file handle of an open pyfuse3 answered: FAST_BIT | ino (Python's handles stay below it).
FAST_BIT = 1 << 63


def mark_limit(configured: int) -> int:
    """How many marks this process may hold: `[mount] fast_path_inodes`, at most a quarter of the
    soft open-file limit (each mark holds an fd)."""
    return min(configured, share_of_open_files(0.25, floor=0))


def fast_eligible(kind: HandleKind, immutable: bool, checkable: bool, routed: bool, unlinked: bool) -> bool:
    """Whether an open that got `kind` may mark its inode for the fast path; pure.

    Only `PASSTHROUGH_STORE`: a read of the store file itself, on this host, by passthrough, with no
    writer, no staging and no other source (`choose_handle` gives it to nothing else: no hint
    replica of the path now; one made later ends the mark, `ReplicaRouter.routed`). Only where the
    config declares the path `immutable` (close-to-open is that declaration) or where pyfuse3 can
    make each open's close-to-open check itself (`checkable`: a local store's path, resolved
    beneath its root, must still name the marked file; "Checked marks" in docs/fastpath.md);
    never on a path a route names (`routed`: the eval side's tier may hold it later), and not once
    unlinked."""
    return (kind is HandleKind.PASSTHROUGH_STORE and (immutable or checkable) and not routed
            and not unlinked)


class FastPath:
    """The marks of one mount. Each holds one passthrough open of its inode (taken by the
    filesystem before `mark`); `release(node)` lets it go (the filesystem's release of a
    passthrough open: its backing id at the last one, the inode forgettable again). A mark is
    (inode, uid): every mark made on a first pass over a dataset stays alive, so each is kept small
    (objects made per open cost the daemon's garbage collector more than their making)."""

    def __init__(self, limit: int, release: Callable[[Inode], None],
                 adopt: Callable[[Inode, int, int], None] | None = None,
                 release_unopened: Callable[[Inode], None] | None = None):
        self.limit = max(0, limit)
        self.backend: FastBackend | None = None
        self._release = release
        # Lazy marks (`mark_lazy`): the hold of one pyfuse3 opened, handed over (node, fd, backing
        # id); the hold of one never opened let go (the inode's open count only).
        self._adopt = adopt
        self._release_unopened = release_unopened
        self.marked: dict[int, tuple[Inode, int]] = {}
        self.checked: set[int] = set()           # marks whose opens pyfuse3 checks (not immutable)
        self.lazy: set[int] = set()              # lazy marks not opened, as far as `take_opened` knows
        self.by_uid: dict[int, OrderedDict[int, None]] = {}   # each user's marks, oldest first
        self.draining: dict[int, Inode] = {}     # unmarked, fast opens still open
        self.counts = {"marked": 0, "unmarked": 0, "given_up_for_room": 0, "marked_ahead": 0, "fetched_ahead": 0,
                       "marked_at_lookup": 0, "let_go_removed": 0, "marked_lazy": 0, "lazy_adopted": 0}

    @property
    def on(self) -> bool:
        return self.backend is not None and self.limit > 0

    def __contains__(self, ino: int) -> bool:
        return ino in self.marked or ino in self.draining

    @property
    def lazy_on(self) -> bool:
        """Whether marks may be made before any open (`mark_lazy`: a pyfuse3 that opens them)."""
        return self.on and self._adopt is not None and getattr(self.backend, "lazy", False)

    def _room(self, uid: int, own: bool) -> bool:
        """A place for one more mark of `uid`, a full table first giving up the oldest mark of the
        user that holds the most (`own`: only `uid`'s own); whether there is one."""
        while len(self.marked) + len(self.draining) >= self.limit and self.marked:
            most = self.by_uid.get(uid) if own else max(self.by_uid.values(), key=len)
            if not most:
                break
            self._give_up(next(iter(most)))
        return len(self.marked) + len(self.draining) < self.limit

    def _add(self, node: Inode, uid: int, checked: bool) -> None:
        self.marked[node.ino] = (node, uid)
        if checked:
            self.checked.add(node.ino)
        mine = self.by_uid.get(uid)
        if mine is None:
            mine = self.by_uid[uid] = OrderedDict()
        mine[node.ino] = None

    def mark_lazy(self, marks: list[tuple[Inode, tuple[int, bytes, int, int]]], uid: int) -> int:
        """Mark each (inode, check) before any open of it (`lazy_on`; docs/fastpath.md, "Lazy
        marks"): pyfuse3's first read-only open of it opens the checked path and registers it as
        its backing file, as a first open in Python would have, and answers it; the fd and backing id
        are then the filesystem's (`take_opened`). The caller took each one's hold (one more open of
        the inode, no fd yet). In places as `mark(own=True)` gives them: free ones, then `uid`'s own
        oldest marks; a mark with no place lets its hold go. How many were marked."""
        assert self.backend is not None and self._release_unopened is not None
        made: list[tuple[int, tuple[int, bytes, int, int]]] = []
        for node, check in marks:
            assert node.ino not in self
            if not self._room(uid, True):
                self._release_unopened(node)
                continue
            self._add(node, uid, True)
            self.lazy.add(node.ino)
            made.append((node.ino, check))
        if made:
            self.backend.mark_lazy(made)
        self.counts["marked_lazy"] += len(made)
        return len(made)

    def take_opened(self) -> None:
        """The lazy marks pyfuse3 opened since the last call are held here from now on: each one's fd
        and backing id are handed to the filesystem (`adopt`), whose passthrough state of the inode
        then holds them as a mark made by a first open in Python would. Called before anything looks
        at a marked inode's holds (an open or a change through this mount, the end of a mark, a
        READ of an open pyfuse3 answered, the sweep)."""
        if not self.lazy or self.backend is None:
            return
        for ino, fd, backing_id in self.backend.lazy_opened():
            self.lazy.discard(ino)
            got = self.marked.get(ino)
            assert got is not None and self._adopt is not None, ino   # (unmarked only after taking these)
            self._adopt(got[0], fd, backing_id)
            self.counts["lazy_adopted"] += 1

    def mark(self, node: Inode, backing_id: int, attrs: Attributes | None, uid: int, own: bool = False,
             check: tuple[int, bytes, int, int] | None = None) -> None:
        """Answer later read-only opens of `node` from `backing_id` (its passthrough backing), and
        its GETATTRs with `attrs` (None: in Python), while the mark holds its open; with `check`,
        only the opens whose path still names the marked file (`FastBackend.mark`). A full table
        first gives up the oldest mark of the user that holds the most; `own` (a mark made ahead
        of an open): only `uid`'s own oldest marks, never another user's."""
        assert self.backend is not None and node.ino not in self
        if not self._room(uid, own):
            self._release(node)       # every place is held by opens not yet released: no mark
            return
        self.backend.mark(node.ino, backing_id, attrs, check)
        self._add(node, uid, check is not None)
        self.counts["marked"] += 1

    def unmark(self, node: Inode) -> int:
        """No more fast opens of `node`; how many it served are still open (0: the hold is let go
        now; else at a later `unmark` or `settle` once they are released)."""
        self.take_opened()
        m = self.marked.pop(node.ino, None)
        if m is not None:
            self.checked.discard(node.ino)
            mine = self.by_uid[m[1]]
            del mine[node.ino]
            if not mine:
                del self.by_uid[m[1]]
            self.counts["unmarked"] += 1
            if node.ino in self.lazy:   # (never opened: pyfuse3 drops it, its hold holds no fd)
                self.lazy.discard(node.ino)
                assert self.backend is not None and self._release_unopened is not None
                self.backend.unmark(node.ino)
                self._release_unopened(m[0])
                return 0
            self.draining[node.ino] = m[0]
        held = self.draining.get(node.ino)
        if held is None:
            return 0
        assert self.backend is not None
        left = self.backend.unmark(node.ino)
        if left == 0:
            del self.draining[node.ino]
            self._release(held)
        return left

    def node_of(self, fh: int) -> Inode | None:
        """The inode of an open pyfuse3 answered (`fh` = FAST_BIT | ino), while its mark holds it."""
        if not fh & FAST_BIT:
            return None
        self.take_opened()
        got = self.marked.get(fh & ~FAST_BIT)
        return got[0] if got is not None else self.draining.get(fh & ~FAST_BIT)

    def settle(self) -> None:
        """Let go the holds of unmarked inodes whose fast opens have all been released."""
        for ino in [ino for ino in self.draining if self.backend is not None and self.backend.opens(ino) == 0]:
            self.unmark(self.draining[ino])

    def _give_up(self, ino: int) -> None:
        self.counts["given_up_for_room"] += 1
        self.unmark(self.marked[ino][0])

    def room(self) -> int:
        """Places free in the table."""
        return self.limit - len(self.marked) - len(self.draining)

    def room_for(self, uid: int) -> int:
        """Places marks made ahead for `uid` may take: the free ones, then that user's own marks,
        oldest first (`mark(own=True)`)."""
        mine = self.by_uid.get(uid)
        return self.room() + (len(mine) if mine else 0)

    def snapshot(self) -> dict:
        """What `.hintfs/stats` shows under "fast_path"."""
        if not self.on:
            return {"state": "off" if self.limit == 0 else "unavailable (pyfuse3 without the fast path, or no passthrough)"}
        assert self.backend is not None
        opened, released, serving, getattrs = self.backend.stats()
        checked, missed, names_checked, names_missed = self.backend.check_stats()
        lazy_opens, lazy_missed = self.backend.lazy_stats() if self.lazy_on else (0, 0)
        return {"state": "on", "opens": opened, "releases": released, "getattrs": getattrs, "inodes": serving,
                "inodes_checked": len(self.checked), "opens_checked": checked, "opens_check_missed": missed,
                "inodes_lazy": len(self.lazy), "lazy_first_opens": lazy_opens, "lazy_first_opens_missed": lazy_missed,
                "lookups_checked": names_checked, "lookups_check_missed": names_missed,
                "draining": len(self.draining), "limit": self.limit, "users": len(self.by_uid), **self.counts}


# How often the marks of files no longer in the store are let go (`Filesystem.let_go_removed_marks`),
# and how many are looked at between two passes of the loop.
MARK_SWEEP_S = 10.0
MARK_SWEEP_CHUNK = 1024
# How long the names of a folder not declared immutable are answered in pyfuse3, each checked
# (`Filesystem._name_checked`): the check makes each answer as fresh as Python's; the time only
# bounds how long unused names hold their inodes.
CHECKED_NAMES_S = 300.0
# The most files a folder not declared immutable may hold for its names to be registered and its
# files marked ahead (`Filesystem._name_checked`): a reader that opens two files of a bigger one
# makes no more up-front work than this (a listing, a name and a mark each); its other files are
# marked at their lookups instead (`_mark_at_lookup`).
CHECKED_NAMES_MAX = 8192

# A registration's time, at most (pyfuse3's deadline is a signed 64-bit count of nanoseconds; the
# listing it comes from expires by `immutable_timeout_s`, which the config does not bound).
MAX_TTL_S = 10 * 365 * 86400
# First opens of a named folder's files answered in Python before its other files are marked ahead
# (`[mount] fast_opens_ahead`'s default).
OPEN_AHEAD_AFTER = 2


class FastNames:
    """Names of kept folders whose LOOKUPs pyfuse3 answers (docs/fastpath.md, "Lookups").

    When a folder of immutable paths is listed for the lookups to come (`Filesystem._listed`: a
    tool going through it by path), its plain files' names are registered with the entries the
    Python lookup would answer, until the listing's time is up. Each registered inode holds one
    lookup here (`Inode.fast_named`): it stays known, and the trimming of cached entries passes it
    by. The kernel's lookups answered inside pyfuse3 are counted there per inode; the filesystem
    adds them to the inode's count at FORGET (`taken`) and when the names are dropped (`drop`:
    the listing went, expired or was trimmed, or the folder changed through this mount)."""

    def __init__(self, let_go: Callable[[Inode, int], None], enabled: bool = True, share: int = 1 << 62):
        self.enabled = enabled      # `[mount] fast_lookups`
        # Most names registered for one user (whose lookups had the folder listed), their oldest
        # folders given up first: half of `[cache] max_entries` (`Filesystem`), so that one user's
        # walk never holds every registered inode of the mount.
        self.users = UserShares(share)
        self.backend: NamesBackend | None = None
        self._let_go = let_go       # (inode, lookups answered in pyfuse3): the registration's hold ends
        # folder -> (its inode, the inodes named, the uid they count to)
        self.folders: dict[str, tuple[Inode, list[Inode], int]] = {}
        self.counts = {"folders_named": 0, "names_registered": 0, "folders_dropped": 0, "given_up_for_share": 0}
        # Counts every `drop` (a folder's names or not): a registration whose entries were made
        # across a drop is not made (`Filesystem._name_folder`).
        self.epoch = 0
        self.opened_in: dict[str, int] = {}     # folder -> its named files' first opens answered in Python
        self.checked_until: dict[str, int] = {}  # folders of checked names -> their deadline (`now_ns`)

    @property
    def on(self) -> bool:
        return self.backend is not None

    def register(self, folder: str, parent: Inode, named: list[tuple[bytes, Inode, Attributes | None]],
                 ttl_s: float, uid: int = 0, checks: list[tuple[int, bytes, int, int]] | None = None,
                 template: Attributes | None = None) -> bool:
        """Answer LOOKUPs of `named` (name, its inode, its entry) in `folder` for `ttl_s`, counted to
        `uid`; whether they are. With `checks` (one per name: a folder not declared immutable),
        each LOOKUP pyfuse3 answers first checks the name is still that file and answers with its
        attributes then (docs/fastpath.md, "Checked names"). The folder's inode is held too: pyfuse3 knows the names by its
        number, and a folder the kernel forgot and looks up again must get the same one. A user past
        its share (`share` names) first gives up its oldest folders; more names than the share
        alone are not registered (Python answers them from the listing, as before). A checked name
        may come without its entry (None): pyfuse3 answers it with `template`'s timeouts and block
        size, its inode number and the attributes its check reads (`NamesBackend.templates`)."""
        assert self.backend is not None
        self.drop(folder)
        if not named or ttl_s <= 0 or len(named) > self.users.share:
            return False
        while not self.users.fits(uid, len(named)):
            self.counts["given_up_for_share"] += 1
            self.drop(self.users.oldest(uid))
        deadline_ns = self.backend.now_ns() + int(min(ttl_s, MAX_TTL_S) * 1e9)
        self.backend.put(parent.ino, [(name, attrs if attrs is not None else node.ino,
                                       checks[i] if checks is not None else None)
                                      for i, (name, node, attrs) in enumerate(named)], deadline_ns, template)
        if checks is not None:
            self.checked_until[folder] = deadline_ns
        parent.lookups += 1
        inodes = []
        for _name, node, _attrs in named:
            node.lookups += 1
            node.fast_named = True
            inodes.append(node)
        self.folders[folder] = (parent, inodes, uid)
        self.users.add(uid, folder, len(inodes))
        self.counts["folders_named"] += 1
        self.counts["names_registered"] += len(inodes)
        return True

    def opened(self, folder: str, after: int = OPEN_AHEAD_AFTER) -> bool:
        """A named file of `folder` got its first open in Python (and its mark); True once per
        registration, at the `after`-th: a reader is going through the folder, time to mark its
        other files ahead (`Filesystem._open_ahead`)."""
        if folder not in self.folders:
            return False
        n = self.opened_in[folder] = self.opened_in.get(folder, 0) + 1
        return n == after

    def drop(self, folder: str) -> None:
        """No more LOOKUPs in `folder` answered in pyfuse3; each named inode's hold ends."""
        self.epoch += 1
        self.opened_in.pop(folder, None)
        self.checked_until.pop(folder, None)
        got = self.folders.pop(folder, None)
        if got is None:
            return
        parent, inodes, uid = got
        self.users.remove(uid, folder)
        assert self.backend is not None
        self.backend.drop(parent.ino)
        self.counts["folders_dropped"] += 1
        for node in inodes:
            node.fast_named = False
            self._let_go(node, self.backend.take(node.ino))
        self._let_go(parent, 0)

    def taken(self, ino: int) -> int:
        """The kernel's lookups of `ino` answered in pyfuse3 since last asked."""
        return self.backend.take(ino) if self.backend is not None else 0

    def snapshot(self) -> dict:
        """What `.hintfs/stats` shows under "fast_lookups"."""
        if not self.enabled:
            return {"state": "off"}
        if self.backend is None:
            return {"state": "unavailable (pyfuse3 without fast lookups)"}
        served, folders, names = self.backend.stats()
        return {"state": "on", "lookups": served, "folders": folders, "names": names,
                "users": len(self.users.by_uid), "share": self.users.share, **self.counts}


class _FolderOpens:
    """First opens counted per folder, for the last FOLDERS folders (the least recent ones are
    forgotten), each count tied to a key (a count under another key starts again)."""
    FOLDERS = 256

    def __init__(self, after: int):
        self.after = after   # `[mount] fast_opens_ahead` (0: never)
        self._counts: OrderedDict[str, tuple[object, int]] = OrderedDict()

    def _count(self, folder: str, key: object) -> int:
        """One more first open in `folder` under `key`: how many now."""
        got = self._counts.pop(folder, None)
        n = got[1] + 1 if got is not None and got[0] == key else 1
        self._counts[folder] = (key, n)
        if len(self._counts) > self.FOLDERS:
            self._counts.popitem(last=False)
        return n


class ReadFolders(_FolderOpens):
    """Folders of a local store whose plain files are being opened one after another (a loader's
    pass): once `after` of them got checked marks at their first opens in Python (`opened`), the
    lookups of the folder's other files mark them (`reading`; `Filesystem._mark_at_lookup`), so
    that their first opens and releases are answered in pyfuse3 too."""

    def opened(self, folder: str) -> bool:
        """Counted; True once, at the `after`-th (`Filesystem._name_checked`)."""
        return self._count(folder, None) == self.after

    def reading(self, folder: str) -> bool:
        got = self._counts.get(folder)
        return self.after > 0 and got is not None and got[1] >= self.after


class FetchAhead(_FolderOpens):
    """An object store's folders read one small object after another (`opened`), and the objects
    being fetched and marked ahead of their opens right now (`fetching`: inode number -> the event
    set when that is done; `Filesystem._fetch_ahead`)."""

    def __init__(self, after: int):
        super().__init__(after)
        self.fetching: dict[int, trio.Event] = {}

    def opened(self, folder: str, listing: object | None) -> bool:
        """A small object of `folder` got its first open in Python, and its mark, while `listing`
        (the folder's kept listing) was current: True once per listing, at the `after`-th."""
        if listing is None or self.after <= 0:
            return False
        return self._count(folder, id(listing)) == self.after


__all__ = ["CHECKED_NAMES_MAX", "CHECKED_NAMES_S", "FastBackend", "FastNames", "FastPath", "FetchAhead", "MARK_SWEEP_S", "NamesBackend", "OPEN_AHEAD_AFTER",
           "ReadFolders", "fast_eligible", "mark_limit"]

"""Listings of immutable folders, kept by the daemon for lookups and listings (issue 39).

Where `[cache] immutable_globs` says a path never changes once written, the kernel caches its
name and attributes for `immutable_timeout_s`; the kernel caches no folder listings, nor what
it forgot. This keeps whole folder listings (name -> `Stat`) for that long:

- a lookup of an immutable path in a folder whose listing is kept is answered from it, with no
  store request (on S3 a HEAD each); a name the listing lacks still asks the store (a file
  written since by another host is found);
- a folder where lookups keep missing (`LIST_AFTER` of them: a tool walking it by path) is listed
  once, in the background (no lookup waits for it), in one request per page instead of a HEAD
  per name; a folder of more than `max_entries` names is not kept, nor listed again;
- a listing of a folder that itself matches the globs is answered from here (its names are
  declared never to change: seen up to `immutable_timeout_s` later, as its attributes).

Names created, removed or renamed through this mount drop the folder's listing (`drop`), and a
listing begun before any such change is not kept (one count for all folders: under steady writes
through the mount a listing may not be kept, and lookups ask the store as without it). Bounded:
at most `max_entries` names in all; past it the least recently used folders are dropped. Each
listing counts to the user whose lookups or listing had it made, and one user holds at most half
of the names (`share`): past it, that user's own least recently used folders go first, never
another user's; a folder larger than the share is not kept (nor listed again for lookups).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from fusefs.shares import UserShares
from hintfs.stores.base import Stat

LIST_AFTER = 4            # lookups missing in one folder before it is listed for the next ones
_MISS_FOLDERS = 4096      # folders whose misses are counted at once (then the count starts over)
# A folder changed through this mount is not listed for lookups until it has been left alone this
# long: a writer creating file after file there (a checkpoint's shards) drops its listing at each
# create, and its lookups of new names miss, so it was listed again every LIST_AFTER files, each
# time whole (and its names registered for fast lookups): work growing with the square of the
# folder's size (`make demo`: 235 listings for 400 files written).
QUIET_AFTER_CHANGE_S = 2.0   # (the default of `[cache] relist_quiet_s`)


class Listings:
    def __init__(self, max_entries: int, clock: Callable[[], float] = time.monotonic,
                 quiet_s: float = QUIET_AFTER_CHANGE_S):
        self.quiet_s = quiet_s   # `[cache] relist_quiet_s`
        self.max_entries = max_entries
        self.users = UserShares(max(1, max_entries // 2))   # (names one user's listings may hold)
        self.clock = clock
        # folder -> (expiry, name -> Stat, the uid it counts to), least recently used first
        self._by_folder: OrderedDict[str, tuple[float, dict[str, Stat], int]] = OrderedDict()
        self.given_up_for_share = 0
        self.entries = 0                     # names kept, all folders
        self._misses: dict[str, int] = {}
        self.listing: set[str] = set()       # folders being listed for lookups now
        self._changed: dict[str, float] = {}  # folder -> when it last changed through this mount
        # Folders dropped so far: a listing begun before a drop is not kept (it may lack a name
        # this mount created, or hold one it removed, meanwhile).
        self.changes = 0
        # Told each folder whose listing goes (dropped, expired, replaced, trimmed, cleared): the
        # names pyfuse3 answers from it go too (`FastNames.drop`, set by the filesystem).
        self.on_drop: Callable[[str], None] | None = None

    def __len__(self) -> int:
        return len(self._by_folder)

    def folder(self, folder: str) -> dict[str, Stat] | None:
        """The kept listing of `folder` (name -> Stat), if fresh."""
        hit = self._by_folder.get(folder)
        if hit is None:
            return None
        expires, names, uid = hit
        if self.clock() >= expires:
            self._remove(folder)
            return None
        self._by_folder.move_to_end(folder)
        self.users.used(uid, folder)
        return names

    def get(self, folder: str, name: str) -> Stat | None:
        names = self.folder(folder)
        return None if names is None else names.get(name)

    def missed(self, folder: str) -> bool:
        """A lookup in `folder` found no kept listing: True when the folder should be listed now."""
        if folder in self.listing:
            return False
        if self._misses.get(folder, 0) < 0:
            return False   # too big to keep
        changed = self._changed.get(folder)
        if changed is not None:
            if self.clock() - changed < self.quiet_s:
                return False   # being written through this mount: its lookups ask the store
            del self._changed[folder]
        if len(self._misses) >= _MISS_FOLDERS and folder not in self._misses:
            self._misses.clear()
        n = self._misses.get(folder, 0) + 1
        self._misses[folder] = n
        return n >= LIST_AFTER

    def too_big(self, folder: str) -> None:
        """`folder` has more names than one user's share: its misses no longer list it."""
        self._misses[folder] = -1

    def put(self, folder: str, entries: Iterable[tuple[str, Stat | None]], ttl: float,
            since: int | None = None, uid: int = 0) -> None:
        """Keep `folder`'s whole listing for `ttl` seconds, counted to `uid` (whose lookups or
        listing had it made); `since`: the `changes` count when the listing began (not kept if
        anything was dropped since)."""
        if ttl <= 0 or (since is not None and since != self.changes):
            return
        names = {name: st for name, st in entries if st is not None}
        if len(names) > self.users.share:
            return
        self._remove(folder)
        self._misses.pop(folder, None)
        while not self.users.fits(uid, len(names)):   # that user's own oldest first
            self.given_up_for_share += 1
            self._remove(self.users.oldest(uid))
        self._by_folder[folder] = (self.clock() + ttl, names, uid)
        self.users.add(uid, folder, len(names))
        self.entries += len(names)
        while self.entries > self.max_entries and self._by_folder:
            self._remove(next(iter(self._by_folder)))

    def snapshot(self) -> dict:
        """What `.hintfs/stats` shows under "kept_listings"."""
        return {"folders": len(self._by_folder), "names": self.entries, "users": len(self.users.by_uid),
                "share": self.users.share, "given_up_for_share": self.given_up_for_share}

    def drop(self, folder: str) -> None:
        """`folder` changed through this mount."""
        self.changes += 1
        if len(self._changed) >= _MISS_FOLDERS and folder not in self._changed:
            self._changed.clear()
        self._changed[folder] = self.clock()
        self._remove(folder)

    def _remove(self, folder: str) -> None:
        hit = self._by_folder.pop(folder, None)
        if hit is not None:
            _, names, uid = hit
            self.entries -= len(names)
            self.users.remove(uid, folder)
            if self.on_drop is not None:
                self.on_drop(folder)

    def drop_under(self, path: str) -> None:
        """`path` was removed or renamed: its folder's listing and the listings under it go."""
        self.drop(path.rpartition("/")[0])
        prefix = path + "/"
        for folder in [f for f in self._by_folder if f == path or f.startswith(prefix)]:
            self._remove(folder)

    def clear(self) -> None:
        self._changed.clear()
        if self.on_drop is not None:
            for folder in list(self._by_folder):
                self.on_drop(folder)
        self._by_folder.clear()
        self.users.clear()
        self._misses.clear()
        self.entries = 0


__all__ = ["Listings", "LIST_AFTER", "QUIET_AFTER_CHANGE_S"]

"""Per-user shares of what the daemon keeps for users' walks (docs/security.md): the kept listings
(`fusefs.listings.Listings`) and the names registered for lookups inside pyfuse3
(`fusefs.fastpath.FastNames`) each count to the user whose requests made them, and one user holds
at most `share` names: past it, that user's own least recently used folders are given up first."""
from __future__ import annotations

from collections import OrderedDict


class UserShares:
    """Folders, each counted to one user with its number of names; each user's least recently used
    first. The owner gives up `oldest(uid)` until `fits(uid, n)`; nothing here drops anything."""

    def __init__(self, share: int):
        self.share = share
        self.by_uid: dict[int, OrderedDict[str, int]] = {}   # uid -> its folders (-> names), oldest first
        self.held: dict[int, int] = {}                       # uid -> names its folders hold

    def fits(self, uid: int, n: int) -> bool:
        """Whether `n` more names stay within `uid`'s share."""
        return self.held.get(uid, 0) + n <= self.share

    def oldest(self, uid: int) -> str:
        return next(iter(self.by_uid[uid]))

    def add(self, uid: int, folder: str, n: int) -> None:
        self.by_uid.setdefault(uid, OrderedDict())[folder] = n
        self.held[uid] = self.held.get(uid, 0) + n

    def used(self, uid: int, folder: str) -> None:
        self.by_uid[uid].move_to_end(folder)

    def remove(self, uid: int, folder: str) -> None:
        mine = self.by_uid[uid]
        self.held[uid] -= mine.pop(folder)
        if not mine:
            del self.by_uid[uid], self.held[uid]

    def clear(self) -> None:
        self.by_uid.clear()
        self.held.clear()


__all__ = ["UserShares"]

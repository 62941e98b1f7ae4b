"""Pages lent by training on their way to inference (the daemon's side of the page handoff).

A training client behind the page allocator sends the pages it frees for a shrink as file
descriptors (`pages` op, SCM_RIGHTS). The daemon holds them only until the reservation that
caused the shrink is granted: that grant takes the whole pages it covers, and every page left over
is closed at once. An fd keeps its physical memory alive, so a page parked here would be memory
that the ledger counts as free but nobody can use; hence nothing stays here past one grant.
Pages go only to the client whose reservation they were lent for, and only from a trainer of
that client's own user: a page is memory its lender could still map, and another user's
process must never import it.
"""

from __future__ import annotations

import os
import time


def close_fds(fds: list[int]) -> None:
    """Close fds that nobody will claim (one already closed is no error)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class PageBroker:
    """Pages in transit on one GPU, by the reservation they were lent for (the client whose
    reserve made the trainer shrink: `for_client`) and the user of the trainer that lent them.
    A grant takes only pages lent for it by a trainer of its own user; every other page lent for
    it is closed then. Pages are counted by that user (`parked_by_uid`) for its bound."""

    def __init__(self) -> None:
        self.parked: dict[int, list[tuple[int, int, int]]] = {}   # for_client -> [(fd, bytes, uid)]
        self.parked_by_uid: dict[int, int] = {}
        self.added_at: dict[int, float] = {}
        self.received = 0
        self.handed = 0
        self.dropped = 0

    def add(self, for_client: int, uid: int, fds: list[int], page_bytes: int) -> None:
        self.parked.setdefault(for_client, []).extend((fd, page_bytes, uid) for fd in fds)
        self.parked_by_uid[uid] = self.parked_by_uid.get(uid, 0) + len(fds)
        self.added_at[for_client] = time.monotonic()
        self.received += len(fds)

    def take(self, for_client: int, uid: int, nbytes: int) -> tuple[list[int], int]:
        """The pages lent for `for_client` by trainers of user `uid` that fit wholly inside
        `nbytes`, all of one size (the most common); (fds, page size). The caller owns the fds;
        what it does not take stays parked (the caller drops it)."""
        pages = [p for p in self.parked.get(for_client, []) if p[2] == uid]
        if not pages:
            return [], 0
        sizes: dict[int, int] = {}
        for _, b, _ in pages:
            sizes[b] = sizes.get(b, 0) + 1
        size = max(sizes, key=lambda b: sizes[b])
        n = min(sizes[size], nbytes // size)
        out = [p for p in pages if p[1] == size][:n]
        taken = set(fd for fd, _, _ in out)
        self.parked[for_client] = [p for p in self.parked[for_client] if p[0] not in taken]
        self.parked_by_uid[uid] -= len(out)
        self.handed += len(out)
        return [fd for fd, _, _ in out], size

    def drop(self, for_client: int) -> None:
        """Close what nobody took: the memory goes back to the driver."""
        pages = self.parked.pop(for_client, [])
        self.added_at.pop(for_client, None)
        for _, _, uid in pages:
            self.parked_by_uid[uid] -= 1
        close_fds([fd for fd, _, _ in pages])
        self.dropped += len(pages)

    def drop_all(self) -> None:
        for cid in list(self.parked):
            self.drop(cid)

    def drop_stale(self, max_age_s: float) -> None:
        """Pages whose reclaim ended without them (the reservation failed, or they came late)."""
        now = time.monotonic()
        for cid, t in list(self.added_at.items()):
            if now - t > max_age_s:
                self.drop(cid)

    def parked_count(self) -> int:
        return sum(len(v) for v in self.parked.values())

    def stats(self) -> dict:
        return {"received": self.received, "handed": self.handed, "dropped": self.dropped,
                "parked": self.parked_count()}

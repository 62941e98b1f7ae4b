"""Which replicas a full local tier evicts to make room (pure: no I/O, no clock).

Order, first evicted first:
  1. expired replicas (their TTL passed; the reclaim loop would remove them soon anyway);
  2. replicas of checkpoints that are not the newest complete one of their job (an eval of the
     newest is the likely next read), least recently used first;
  3. any other replica, least recently used first.
Never evicted: `pinned` replicas (a copy of their checkpoint is in flight: evicting its finished
files would make the checkpoint never complete). If the unpinned replicas cannot free `need`
bytes, nothing is evicted and the caller refuses the new copy (ENOSPC). A caller may ask for
more (`want_bytes`): room for the next copies, taken from the first two classes only.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierEntry:
    path: str
    size: int
    last_used: float          # monotonic seconds of the last read or copy
    expired: bool = False
    newest: bool = False      # part of its job's newest complete checkpoint
    pinned: bool = False


def pick_evictions(entries: list[TierEntry], need_bytes: int, want_bytes: int = 0) -> list[str]:
    """Paths to evict, in order, that free at least `need_bytes`; [] if that is impossible
    (or if nothing is needed). Past `need_bytes` they go on, in the same order, while the next
    one still fits under `want_bytes` and is expired or not of a newest checkpoint: room for the
    next copies too, so that a full tier does not sort its whole catalog again for every copy
    (a newest checkpoint's replica, or one larger than the room asked for, goes only when needed)."""
    if need_bytes <= 0:
        return []
    candidates = [e for e in entries if not e.pinned]
    candidates.sort(key=lambda e: (0 if e.expired else 1 if not e.newest else 2, e.last_used, e.path))
    out, freed = [], 0
    for e in candidates:
        if freed >= need_bytes and (freed + e.size > want_bytes or (e.newest and not e.expired)):
            break
        out.append(e.path)
        freed += e.size
    return out if freed >= need_bytes else []

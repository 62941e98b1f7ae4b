"""A `cachetools.LRUCache` that hands what it evicts to its owner (an open reader a read may still
use is retired, not closed, when it leaves the cache). Not thread-safe: its owner's lock guards it."""
from __future__ import annotations

from typing import Generic, TypeVar
from collections.abc import Callable

from cachetools import LRUCache

K = TypeVar("K")
V = TypeVar("V")


class EvictingLRU(LRUCache, Generic[K, V]):
    """At most `maxsize` entries; the least recently used one leaves first, through `on_evict`
    (never through `pop` or `del`, which are the owner's own removals)."""

    def __init__(self, maxsize: int, on_evict: Callable[[K, V], None]) -> None:
        super().__init__(maxsize)
        self._on_evict = on_evict

    def popitem(self) -> tuple[K, V]:
        key, value = super().popitem()
        self._on_evict(key, value)
        return key, value


__all__ = ["EvictingLRU"]

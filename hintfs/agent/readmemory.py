"""What eval jobs read of each checkpoint file, to predict what they will read of the next one
(docs/cross_dc.md, "Eval reads first").

A merge or an eval of step N+1 reads the same tensors as of step N, and DCP lays out the files of
every step alike, so the byte ranges read of `ckpt/run/step_N/__0_0.distcp` are those that will be
read of `ckpt/run/step_N+1/__0_0.distcp` (`policy.stream.checkpoint_family`). The tier agent
remembers the ranges of read hints (as the kernel will ask for them) and of demand reads; a file
that was hinted keeps only its hints (its demand reads include the kernel's readahead past the
last tensor, to the end of the file: bytes nobody waits for); when a
training mount opens a stream for the next checkpoint's file, the tier names the chunks holding
those ranges and the sender sends them first. A wrong guess (a layout that changed) costs only
the order the chunks cross the link in, never a byte served: the guess picks chunks to send, and
only published, verified chunks are ever read.

Bounded: `max_ranges` ranges per family (merged where they touch; beyond that they are not kept)
and `max_total` ranges and `max_files` families in all (the least recently used go first): about
25 MB at most. Memory only: a restarted agent predicts nothing until eval jobs read again.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable

from cachetools import FIFOCache

from policy.stream import checkpoint_family, merged_ranges


class ReadMemory:
    def __init__(self, max_files: int = 16384, max_ranges: int = 4096, max_total: int = 1 << 18):
        self.max_files = max_files
        self.max_ranges = max_ranges
        self.max_total = max_total
        # family -> (path, ranges, whether they came from read hints); sized by its ranges (at most
        # `max_total` in all); what is remembered again moves to the end, what is predicted does not
        self._by_family: FIFOCache[tuple[str, str], tuple[str, list[tuple[int, int]], bool]] = FIFOCache(
            max_total, getsizeof=lambda known: min(max_total, len(known[1])))
        self._lock = threading.Lock()

    def remember(self, path: str, ranges: Iterable[tuple[int, int]], hinted: bool = False) -> None:
        """Eval reads of `path` covered these (offset, length) ranges (`hinted`: a read hint said
        so). Reads of a newer checkpoint's file replace what an older one's taught; reads of the
        same file add up, except that a hinted file keeps only its hints."""
        key = checkpoint_family(path)
        with self._lock:
            known = self._by_family.get(key)
            old: list[tuple[int, int]] = []
            if known is not None and known[0] == path:
                if known[2] and not hinted:
                    return              # demand reads of a hinted file: readahead, mostly
                if known[2] == hinted:
                    old = known[1]
            kept = merged_ranges([*old, *ranges])[: self.max_ranges]
            if not kept:
                return
            self._by_family[key] = (path, kept, hinted)
            while len(self._by_family) > self.max_files:
                self._by_family.popitem()

    def predict(self, path: str) -> list[tuple[int, int]]:
        """The ranges eval jobs read of the last checkpoint's file of `path`'s name (empty: none
        known)."""
        with self._lock:
            known = self._by_family.get(checkpoint_family(path))
            return list(known[1]) if known is not None else []

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_family)


__all__ = ["ReadMemory"]

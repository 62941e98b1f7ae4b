"""Stand-ins for tests that drive `Filesystem` directly: the kernel's FUSE passthrough
registrations (`fusefs.passthrough.Backing`: it checks each fd is open and counts the live ids),
and pyfuse3's fast-path table (`fusefs.fastpath.FastBackend`)."""
from __future__ import annotations

import os


class CountingBacking:
    def __init__(self):
        self.live: set[int] = set()
        self.next = 0

    def open(self, fd: int) -> int:
        os.fstat(fd)
        self.next += 1
        self.live.add(self.next)
        return self.next

    def close(self, backing_id: int) -> None:
        self.live.remove(backing_id)


class FakeFastTable:
    """A stand-in for pyfuse3's fast-path table (`fusefs.fastpath.FastBackend`): the marks, and
    the opens it served that are still open (set `open[ino]` to play them)."""

    checks = True   # (marks may carry a close-to-open check: kept in `check`, never run here)

    def __init__(self) -> None:
        self.serving: dict[int, int] = {}
        self.open: dict[int, int] = {}
        self.check: dict[int, tuple | None] = {}

    def mark(self, ino: int, backing_id: int, attrs, check=None) -> None:
        self.serving[ino] = backing_id
        self.check[ino] = check

    def unmark(self, ino: int) -> int:
        self.serving.pop(ino, None)
        return self.open.get(ino, 0)

    def opens(self, ino: int) -> int:
        return self.open.get(ino, 0)

    def stats(self) -> tuple[int, int, int, int]:
        return 0, 0, len(self.serving), 0

    def check_stats(self) -> tuple[int, int, int, int]:
        return 0, 0, 0, 0

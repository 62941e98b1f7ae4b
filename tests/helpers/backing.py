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


class FakeLazyTable(FakeFastTable):
    """`FakeFastTable` with lazy marks (patches/pyfuse3-fastlazy.patch): `first_open(ino, fd,
    backing_id)` plays pyfuse3 opening one at its first open (`lazy_opened` hands it over)."""

    lazy = True

    def __init__(self) -> None:
        super().__init__()
        self.lazy_marks: dict[int, tuple] = {}
        self.opened: list[tuple[int, int, int]] = []

    def mark_lazy(self, entries) -> None:
        for ino, check in entries:
            assert ino not in self.serving and ino not in self.lazy_marks
            self.lazy_marks[ino] = check
            self.check[ino] = check

    def first_open(self, ino: int, fd: int, backing_id: int) -> None:
        del self.lazy_marks[ino]
        self.serving[ino] = backing_id
        self.open[ino] = self.open.get(ino, 0) + 1
        self.opened.append((ino, fd, backing_id))

    def unmark(self, ino: int) -> int:
        self.lazy_marks.pop(ino, None)
        return super().unmark(ino)

    def lazy_opened(self) -> list[tuple[int, int, int]]:
        got, self.opened = self.opened, []
        return got

    def lazy_stats(self) -> tuple[int, int]:
        return 0, 0

"""A stand-in for the kernel's FUSE passthrough registrations (`fusefs.passthrough.Backing`), for
tests that drive `Filesystem` directly: it checks each fd is open and counts the live ids."""
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

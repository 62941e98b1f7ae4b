"""Pages lent by training on their way to inference (the daemon's side of the page handoff).

A training client behind the page allocator sends the pages it frees for a shrink as file
descriptors (`pages` op, SCM_RIGHTS). The daemon holds them only until the reservation that
caused the shrink is granted: that grant takes the whole pages it covers, and every page left over
is closed at once. An fd keeps its physical memory alive, so a page parked here would be memory
that the ledger counts as free but nobody can use; hence nothing stays here past one grant.
"""

from __future__ import annotations

import fcntl
import os
import resource
import time


def close_fds(fds: list[int]) -> None:
    """Close fds that nobody will claim (one already closed is no error)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def reserve_fd_table(n: int) -> int:
    """Grow this process's fd table now to hold `n` fds (at most the soft RLIMIT_NOFILE), so
    that receiving many fds later (a lend of a hundred pages, SCM_RIGHTS) does not grow it then.
    Growing the table of a process with several threads waits for an RCU grace period
    (synchronize_rcu in the kernel's expand_fdtable): 13-14 ms measured on the H200 host, once,
    on the first large lend. The table never shrinks. Returns the size reserved (0: nothing)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        n = min(n, soft)
    if n < 4:
        return 0
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:   # F_DUPFD takes the lowest free fd >= n - 1 and never closes one in use
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, n - 1)
        os.close(high)
    except OSError:
        return 0
    finally:
        os.close(fd)
    return n


class PageBroker:
    def __init__(self) -> None:
        self.pages: list[int] = []        # fds, oldest first
        self.page_bytes = 0
        self.received = 0
        self.handed = 0
        self.dropped = 0
        self.added_at = 0.0

    def add(self, fds: list[int], page_bytes: int) -> None:
        if self.pages and page_bytes != self.page_bytes:
            self.drop_all()               # one page size at a time
        self.page_bytes = page_bytes
        self.pages.extend(fds)
        self.received += len(fds)
        self.added_at = time.monotonic()

    def take(self, nbytes: int) -> list[int]:
        """The pages wholly inside `nbytes`; the caller owns (and must close) the fds."""
        if not self.pages or self.page_bytes <= 0:
            return []
        n = min(len(self.pages), nbytes // self.page_bytes)
        out, self.pages = self.pages[:n], self.pages[n:]
        self.handed += n
        return out

    def drop_all(self) -> None:
        """Close what nobody took: the memory goes back to the driver."""
        close_fds(self.pages)
        self.dropped += len(self.pages)
        self.pages = []

    def drop_stale(self, max_age_s: float) -> None:
        """Pages whose reclaim ended without them (they came after the grant)."""
        if self.pages and time.monotonic() - self.added_at > max_age_s:
            self.drop_all()

    def stats(self) -> dict:
        return {"received": self.received, "handed": self.handed, "dropped": self.dropped,
                "parked": len(self.pages)}

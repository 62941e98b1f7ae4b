"""The agent's side of the link scheduler: copy threads ask before each chunk they pull across
the (cross-DC) link; a dispatcher thread hands chunks out in the order `policy.link` decides
(strict class priority, deficit round-robin by weight, one bandwidth budget)."""
from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from collections.abc import Hashable

from hintfs.common.clock import SYSTEM_CLOCK, Clock
from policy.link import LinkScheduler

_ids = itertools.count()


class LinkGate:
    def __init__(self, budget_bytes_s: float, quantum_bytes: int, clock: Clock = SYSTEM_CLOCK):
        self.clock = clock
        self.sched = LinkScheduler(budget_bytes_s, quantum_bytes)
        self.cond = threading.Condition()
        self.grants: dict[Hashable, int] = defaultdict(int)
        self.sent: dict[str, int] = defaultdict(int)      # bytes granted per class, for status
        self._stop = False
        self.thread = threading.Thread(target=self._dispatch, name="hintfs-link", daemon=True)
        self.thread.start()

    def open(self, name: str, cls: str, weight: float, chunks: list[int], job: str | None) -> Hashable:
        tid = (name, next(_ids))
        with self.cond:
            self.sched.add(tid, cls, weight, chunks, job=job)
            self.cond.notify_all()
        return tid

    def acquire(self, tid: Hashable, timeout_s: float = 3600.0) -> None:
        """Block until the scheduler grants this transfer its next chunk."""
        deadline = self.clock.monotonic() + timeout_s
        with self.cond:
            while self.grants[tid] == 0:
                if self._stop or self.clock.monotonic() > deadline:
                    raise TimeoutError("link gate closed or timed out")
                self.cond.wait(0.05)
            self.grants[tid] -= 1

    def close(self, tid: Hashable) -> None:
        with self.cond:
            self.sched.done(tid)
            self.grants.pop(tid, None)

    def signal(self, job: str, severity: float) -> None:
        with self.cond:
            self.sched.signal(job, severity)
            self.cond.notify_all()

    def is_signalled(self, job: str) -> bool:
        with self.cond:
            return self.sched.is_signalled(job)

    def clear(self, job: str) -> None:
        with self.cond:
            self.sched.clear(job)

    def _dispatch(self) -> None:
        with self.cond:
            while not self._stop:
                now = self.clock.monotonic()
                pick = self.sched.next_chunk(now)
                if pick is not None:
                    tid, n = pick
                    self.grants[tid] += 1
                    cls = self.sched.last_class     # (set by the pick: its transfer may be gone)
                    assert cls is not None
                    self.sent[cls.name.lower()] += n
                    self.cond.notify_all()
                    continue
                wait = self.sched.ready_in(now)
                self.cond.wait(0.05 if wait is None else min(max(wait, 0.001), 0.05))

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()

"""Priority on the cross-DC link (issue 5): a pure chunk scheduler, no I/O, no clocks of its own.

A *transfer* (one checkpoint file being copied to the eval DC) is a sequence of chunks. The
caller asks ``next_chunk(now)`` which transfer sends its next chunk; the scheduler answers
with ``(transfer_id, nbytes)`` or ``None`` (idle, or the link's budget is spent for now).

Rules:

- three classes, strict priority: ``ANOMALY`` (an eval triggered by a loss or gradient-norm
  spike) > ``EVAL`` (scheduled eval) > ``BACKGROUND``. A lower class sends only when every
  higher class has nothing pending.
- within a class, deficit round-robin: when a transfer's turn comes its deficit grows by
  ``quantum_bytes * weight``; it sends chunks while its next chunk fits in its deficit, then
  the turn passes. Over a long run each transfer's bytes are proportional to its weight.
- preemption only at chunk boundaries: a chunk is never split; when a higher class becomes
  pending, the next call serves it, and the preempted transfer keeps its place and deficit.
- one bandwidth budget per link: a token bucket of ``budget_bytes_s`` refilled from the
  ``now`` passed in, holding at most ``burst_bytes``. A chunk goes when the bucket holds
  ``min(nbytes, burst_bytes)``; it may go into debt for a chunk larger than the burst. Over any
  window of calls [a, b]: bytes sent <= max(burst_bytes, largest chunk) + budget * (b - a).
- ``signal(job, severity)`` moves the job's transfers (and ones added later for that job) into
  ``ANOMALY`` with their weight multiplied by ``severity_factor(severity)``; ``clear(job)``
  moves them back.

The weight formula, :func:`transfer_weight`::

    weight = size_factor(model_bytes) * importance * severity_factor(severity)
    size_factor(b)     = 1 + log2(1 + b / 1 GiB)        (1 at 0 B, 2 at 1 GiB, ~7.7 at 100 GiB)
    severity_factor(s) = 1 + min(max(s, 0), 10)         (s: a spike's size, e.g. loss / EMA - 1)

clamped to [1e-3, 1e6]. Sublinear in size: a 100 GiB checkpoint has more bytes to move and gets a
larger share, but not 100x that of a 1 GiB one, so a small model's eval is not starved. Linear in
importance (the operator's knob, default 1). Severity multiplies, so a worse anomaly drains first
among anomalies; capped so one noisy signal cannot take the whole class.
"""
from __future__ import annotations

import collections
import enum
import math
from dataclasses import dataclass, field
from collections.abc import Hashable, Iterable

GIB = 1 << 30
SEVERITY_CAP = 10.0
MIN_WEIGHT = 1e-3
MAX_WEIGHT = 1e6


class LinkClass(enum.IntEnum):
    """Lower value = higher priority."""
    ANOMALY = 0
    EVAL = 1
    BACKGROUND = 2

    @classmethod
    def parse(cls, value: LinkClass | str | int) -> LinkClass:
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(f"unknown link class {value!r}: anomaly, eval or background") from None
        return cls(value)


def size_factor(model_bytes: float) -> float:
    if not (model_bytes >= 0 and math.isfinite(model_bytes)):
        raise ValueError("model_bytes must be a finite number >= 0")
    return 1.0 + math.log2(1.0 + model_bytes / GIB)


def severity_factor(severity: float) -> float:
    if math.isnan(severity):
        raise ValueError("severity must be a number")
    return 1.0 + min(max(severity, 0.0), SEVERITY_CAP)


def transfer_weight(model_bytes: float, importance: float = 1.0, severity: float = 0.0) -> float:
    """size_factor(model_bytes) * importance * severity_factor(severity), clamped to
    [MIN_WEIGHT, MAX_WEIGHT]. Non-decreasing in each argument."""
    if not (importance >= 0 and math.isfinite(importance)):
        raise ValueError("importance must be a finite number >= 0")
    w = size_factor(model_bytes) * importance * severity_factor(severity)
    return min(max(w, MIN_WEIGHT), MAX_WEIGHT)


@dataclass
class _Transfer:
    tid: Hashable
    base_cls: LinkClass
    base_weight: float
    chunks: collections.deque[int]
    job: Hashable | None
    cls: LinkClass = LinkClass.BACKGROUND
    weight: float = 1.0
    deficit: float = 0.0
    sent_bytes: int = 0


@dataclass
class _ClassQueue:
    queue: collections.deque = field(default_factory=collections.deque)  # transfer ids, head's turn
    head_topped: bool = False  # the head's deficit was already increased for this turn


class LinkScheduler:
    """One per link. See the module docstring for the rules."""

    def __init__(self, budget_bytes_s: float, quantum_bytes: int, burst_bytes: int | None = None):
        if not (budget_bytes_s > 0 and math.isfinite(budget_bytes_s)):
            raise ValueError("budget_bytes_s must be a positive finite number")
        if quantum_bytes < 1:
            raise ValueError("quantum_bytes must be >= 1")
        self.budget = float(budget_bytes_s)
        self.quantum = int(quantum_bytes)
        self.burst = int(burst_bytes if burst_bytes is not None else quantum_bytes)
        if self.burst < 1:
            raise ValueError("burst_bytes must be >= 1")
        self._tokens = float(self.burst)
        self._last: float | None = None
        self._transfers: dict[Hashable, _Transfer] = {}
        self.last_class: LinkClass | None = None   # the class of the chunk `next_chunk` picked last
        self._classes = {c: _ClassQueue() for c in LinkClass}
        self._signals: dict[Hashable, float] = {}

    # -- transfers -----------------------------------------------------------------------

    def add(self, transfer_id: Hashable, cls: LinkClass | str | int, weight: float,
            chunks: Iterable[int], *, job: Hashable | None = None) -> None:
        """Queue a transfer at the tail of its class. A job under a signal goes to ANOMALY."""
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id!r} already queued")
        cls = LinkClass.parse(cls)
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError("weight must be a positive finite number")
        sizes = collections.deque(int(c) for c in chunks)
        if not sizes or any(c < 1 for c in sizes):
            raise ValueError("chunks must be a non-empty list of sizes >= 1")
        t = _Transfer(transfer_id, cls, float(weight), sizes, job)
        self._transfers[transfer_id] = t
        self._place(t)

    def done(self, transfer_id: Hashable) -> None:
        """Forget a transfer (finished or cancelled); its unsent chunks are dropped. Idempotent;
        a transfer whose last chunk was handed out is forgotten already."""
        t = self._transfers.pop(transfer_id, None)
        if t is not None:
            self._unqueue(t)

    def signal(self, job: Hashable, severity: float) -> None:
        """Promote the job's transfers, now and later ones, to ANOMALY, weighted by severity."""
        severity_factor(severity)  # validates
        self._signals[job] = float(severity)
        for t in list(self._transfers.values()):
            if t.job == job:
                self._unqueue(t)
                self._place(t)

    def is_signalled(self, job: Hashable) -> bool:
        return job in self._signals

    def clear(self, job: Hashable) -> None:
        """End a job's signal: its transfers go back to their own class and weight."""
        if self._signals.pop(job, None) is None:
            return
        for t in list(self._transfers.values()):
            if t.job == job:
                self._unqueue(t)
                self._place(t)

    # -- scheduling ----------------------------------------------------------------------

    def next_chunk(self, now: float) -> tuple[Hashable, int] | None:
        """The transfer that sends its next chunk now, and the chunk's size; the chunk counts as
        sent. None when idle or when the budget does not allow the chunk yet."""
        self._refill(now)
        picked = self._pick()
        if picked is None:
            return None
        t, q = picked
        n = t.chunks[0]
        if self._tokens < min(n, self.burst):
            return None
        self._tokens -= n
        self.last_class = t.cls   # (asked after the call, the last chunk's transfer is gone already)
        t.chunks.popleft()
        t.deficit -= n
        t.sent_bytes += n
        if not t.chunks:
            self._transfers.pop(t.tid)
            self._unqueue(t)
        return t.tid, n

    def ready_in(self, now: float) -> float | None:
        """Seconds from ``now`` until ``next_chunk`` can send (0 if now), None when idle."""
        self._refill(now)
        picked = self._pick()
        if picked is None:
            return None
        need = min(picked[0].chunks[0], self.burst) - self._tokens
        return max(0.0, need / self.budget)

    # -- introspection -------------------------------------------------------------------

    def pending(self, cls: LinkClass | str | int | None = None) -> dict[Hashable, list[int]]:
        """Unsent chunks per transfer, of one class or of all."""
        c = None if cls is None else LinkClass.parse(cls)
        return {t.tid: list(t.chunks) for t in self._transfers.values() if c is None or t.cls == c}

    def class_of(self, transfer_id: Hashable) -> LinkClass:
        return self._transfers[transfer_id].cls

    def weight_of(self, transfer_id: Hashable) -> float:
        return self._transfers[transfer_id].weight

    def __len__(self) -> int:
        return len(self._transfers)

    # -- internals -----------------------------------------------------------------------

    def _refill(self, now: float) -> None:
        if not math.isfinite(now):
            raise ValueError("now must be finite")
        if self._last is None:
            self._last = now
            return
        if now < self._last:
            raise ValueError(f"time went backwards: {now} < {self._last}")
        self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.budget)
        self._last = now

    def _place(self, t: _Transfer) -> None:
        if t.job is not None and t.job in self._signals:
            t.cls = LinkClass.ANOMALY
            t.weight = min(MAX_WEIGHT, t.base_weight * severity_factor(self._signals[t.job]))
        else:
            t.cls = t.base_cls
            t.weight = t.base_weight
        t.deficit = 0.0
        self._classes[t.cls].queue.append(t.tid)

    def _unqueue(self, t: _Transfer) -> None:
        q = self._classes[t.cls]
        if q.queue and q.queue[0] == t.tid:
            q.queue.popleft()
            q.head_topped = False
        else:
            try:
                q.queue.remove(t.tid)
            except ValueError:
                pass
        t.deficit = 0.0

    def _pick(self) -> tuple[_Transfer, _ClassQueue] | None:
        """Strict priority across classes, DRR inside the first class with pending transfers.
        Moves the round-robin state (turns, deficits) but sends nothing."""
        for cls in LinkClass:
            q = self._classes[cls]
            if q.queue:
                return self._drr(q), q
        return None

    def _drr(self, q: _ClassQueue) -> _Transfer:
        tr = self._transfers
        n = len(q.queue)
        for _ in range(2):
            # one pass: every transfer gets (at most) one turn
            for _ in range(n):
                t = tr[q.queue[0]]
                if not q.head_topped:
                    t.deficit += self.quantum * t.weight
                    q.head_topped = True
                if t.deficit >= t.chunks[0]:
                    return t
                q.queue.rotate(-1)
                q.head_topped = False
            # nobody could send in a whole round (quantum * weight << chunk): skip the empty
            # rounds at once instead of spinning through them.
            rounds = min(math.ceil((tr[i].chunks[0] - tr[i].deficit) / (self.quantum * tr[i].weight))
                         for i in q.queue)
            if rounds > 1:
                for i in q.queue:
                    tr[i].deficit += (rounds - 1) * self.quantum * tr[i].weight
        # float rounding: give the head what it lacks (at most a hair)
        t = tr[q.queue[0]]
        t.deficit = max(t.deficit, float(t.chunks[0]))
        return t

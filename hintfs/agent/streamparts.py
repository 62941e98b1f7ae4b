"""A write-time stream as the eval tier holds it (hintfs/agent/streams.py holds them all): its record,
the errors its calls raise (each with the errno its caller gets), where its bytes are counted
(`StreamBudget`: the agent's catalog), and what each sender's streams may hold (`SenderBounds`,
issue 34; docs/cross_dc.md, "What one sender may hold")."""
from __future__ import annotations

import errno
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol
from collections.abc import Callable, Sequence

from hintfs.common.refusals import RefusalLog
from policy.stream import RangeMap, Sender, StreamLimits

log = logging.getLogger("hintfs.streams")

REFUSAL_LOG_S = 10.0   # a refusal is logged once per sender and bound in this long (with a count)
ANYONE = Sender("-", "-")   # the sender of calls that name none (in-process callers, tests)


class StreamError(ValueError):
    pass


class StreamFinished(StreamError):
    """The stream became a replica already (its publish, or the put that completed it after its
    publish): a late call for it is answered "ready", not refused."""


class StreamRefused(StreamError):
    """A call refused by a bound or a rule, with the errno the caller gets (EAGAIN: too many
    streams; ENOSPC: no room for its bytes; EACCES: another sender's stream; EINVAL: a publish
    whose CRC list is not one per chunk)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.errno = code


class StreamBudget(Protocol):
    """Where a stream's bytes are counted: the agent's replica budget (`hintfs.agent.catalog.Catalog`)."""

    def reserve(self, nbytes: int, path: str) -> None:
        """Count `nbytes` more (evicting replicas as a copy would), or raise OSError(ENOSPC)."""

    def release(self, nbytes: int) -> None: ...


@dataclass
class Stream:
    sid: str
    gen: int
    path: str
    job: str | None
    ranges: RangeMap
    fd: int
    last_call: float
    saved_at: float = 0.0
    version: tuple[int, int] | None = None   # published as (size, mtime_ns), chunks still missing
    final: Sequence[int] | None = None           # the published file's chunk CRCs (with `version`)
    seen: int | None = None                  # the sender's file size at its last put (unpublished)
    unsaved: bool = False                       # chunks arrived since the last progress file
    meta: Any = None                            # the caller's, given at publish (its record, TTL)
    finishing: bool = False                     # complete: being made a replica (no more writes)
    sender: Sender = ANYONE                     # who opened it: only they may call it
    confirmed: bool = False                     # the store's word says it has `version`
    published_at: float = 0.0                   # when the version was published (clock)
    extents: dict[int, int] = field(default_factory=dict)   # chunk -> bytes counted in the budget
    reserved: int = 0                           # sum of `extents`
    lock: threading.RLock = field(default_factory=threading.RLock)
    io_lock: threading.Lock = field(default_factory=threading.Lock)   # see the module's docstring


@dataclass
class SenderUsage:
    """What one sender holds and was refused (the agent's status, `by_sender`)."""
    open: int = 0
    bytes: int = 0
    refused: int = 0


class SenderBounds:
    """What each sender's streams hold beyond their count (which `StreamTier.open` bounds by
    `limits`): the bytes of each peer host's streams not yet replicas (at most
    `limits.peer_bytes`), within the tier's `budget`; and the refusals, counted per sender and
    logged once per sender and bound every REFUSAL_LOG_S (with how many there were since).
    Thread-safe (a lock of its own, taken after the tier's, never before it)."""

    def __init__(self, limits: StreamLimits, budget: StreamBudget | None, clock: Callable[[], float]):
        self.limits = limits
        self.budget = budget
        self.bytes_by_peer: dict[str, int] = {}      # stream bytes counted, per peer host
        self.refused: dict[str, int] = {}            # refusals per sender (key)
        self._refusals = RefusalLog(REFUSAL_LOG_S, clock)   # one line per (sender, bound) and period
        self._lock = threading.Lock()

    def refuse(self, sender: Sender, bound: str, code: int, message: str) -> StreamRefused:
        """Count a refusal and log it (once per sender and bound and period); the error to raise."""
        key = sender.key()
        with self._lock:
            self.refused[key] = self.refused.get(key, 0) + 1
        since = self._refusals.note((key, bound))
        if since is not None:
            log.warning("%s: sender %s (%s)%s", message, key, errno.errorcode.get(code, code), RefusalLog.more(since))
        return StreamRefused(code, message)

    def refusals(self) -> dict[str, int]:
        with self._lock:
            return dict(self.refused)

    def reserve(self, s: Stream, nbytes: int) -> None:
        """Count `nbytes` more of stream `s` against its peer's bound and the tier's budget, or
        StreamRefused (ENOSPC). Called without `s.lock` (the budget may evict replicas)."""
        peer = s.sender.peer
        with self._lock:
            held = self.bytes_by_peer.get(peer, 0)
            cap = self.limits.peer_bytes
            over = cap is not None and held + nbytes > cap
            if not over:
                self.bytes_by_peer[peer] = held + nbytes
        if over:
            raise self.refuse(s.sender, "peer bytes", errno.ENOSPC,
                              f"chunk of stream {s.sid} refused: peer {peer} holds {held} bytes of "
                              f"streams not yet replicas (at most {cap})")
        if self.budget is None:
            return
        try:
            self.budget.reserve(nbytes, s.path)
        except OSError as err:
            self._unpeer(peer, nbytes)
            raise self.refuse(s.sender, "budget", err.errno or errno.ENOSPC,
                              f"chunk of stream {s.sid} refused: {err.strerror or err}") from None

    def _unpeer(self, peer: str, nbytes: int) -> None:
        with self._lock:
            left = self.bytes_by_peer.get(peer, 0) - nbytes
            if left > 0:
                self.bytes_by_peer[peer] = left
            else:
                self.bytes_by_peer.pop(peer, None)

    def release(self, s: Stream, nbytes: int) -> None:
        if nbytes <= 0:
            return
        self._unpeer(s.sender.peer, nbytes)
        if self.budget is not None:
            self.budget.release(nbytes)

    def release_all(self, s: Stream) -> None:
        """What stream `s` holds leaves the budget (it was dropped, or its part is handed over)."""
        with s.lock:
            n, s.reserved = s.reserved, 0
            s.extents.clear()
        self.release(s, n)


__all__ = ["ANYONE", "REFUSAL_LOG_S", "SenderBounds", "SenderUsage", "Stream", "StreamBudget", "StreamError",
           "StreamFinished", "StreamRefused"]

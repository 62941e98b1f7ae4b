"""Time as a collaborator: the clock a daemon part reads, passed to its constructor.

A part that decides by time (a TTL, a deadline, a rate, an age) reads `clock.monotonic()` for
intervals and `clock.time()` / `clock.time_ns()` for wall-clock instants (expiry dates written to
disk, journal slices), and `clock.sleep()` where it paces itself. Production code passes
`SYSTEM_CLOCK`; tests pass a `FakeClock` and move it by hand, so timing logic is tested without
sleeping and without wall-clock bounds.

Waits on a lock's condition or an event stay real (`Condition.wait(timeout)`): a part loops on
short real waits and decides by its clock, so a test that advances a `FakeClock` sees the
decision at the next loop.
"""
from __future__ import annotations

import threading
import time as _time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds of a clock that never goes back (intervals, deadlines)."""
        ...

    def time(self) -> float:
        """Seconds since the epoch (instants kept on disk or compared across hosts)."""
        ...

    def time_ns(self) -> int:
        """`time()` in nanoseconds."""
        ...

    def sleep(self, seconds: float) -> None:
        """Pause the caller this long (a `FakeClock` moves instead)."""
        ...


class SystemClock:
    """The host's clocks (`time.monotonic`, `time.time`, `time.time_ns`, `time.sleep`)."""

    monotonic = staticmethod(_time.monotonic)
    time = staticmethod(_time.time)
    time_ns = staticmethod(_time.time_ns)
    sleep = staticmethod(_time.sleep)


SYSTEM_CLOCK: Clock = SystemClock()


class FakeClock:
    """A clock for tests: it stands still until `advance` (or `sleep`, which advances it instead
    of waiting). Its monotonic and wall clocks move together. Thread-safe."""

    def __init__(self, start: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self._lock = threading.Lock()
        self._mono = float(start)
        self._wall_offset = float(wall) - float(start)
        self.slept = 0.0               # seconds `sleep` was asked for, in all

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def time(self) -> float:
        with self._lock:
            return self._mono + self._wall_offset

    def time_ns(self) -> int:
        return int(round(self.time() * 1e9))

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock never goes back")
        with self._lock:
            self._mono += seconds

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.slept += max(0.0, seconds)
        self.advance(max(0.0, seconds))

    def __call__(self) -> float:
        """The monotonic time: a `FakeClock` also serves where a part takes `Callable[[], float]`."""
        return self.monotonic()


__all__ = ["Clock", "SystemClock", "SYSTEM_CLOCK", "FakeClock"]

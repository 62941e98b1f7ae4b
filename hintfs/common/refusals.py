"""One log line per kind of refusal and period: a caller repeating a refused call cannot fill the
log. Used by every part of the agent that refuses callers (a copy's source, a stream's path, a
sender's bounds), by the mount's side of the fd socket, and by the mount's errno lines
(`fusefs.stats.ErrnoLog`: one line per errno and operation and period)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable


class RefusalLog:
    """`note(key)` for each refusal: how many more there were since the last line of `key` when it
    is time for a line (once every `every_s` per key), else None (counted for the next line).
    At most about `keep` keys are remembered (those older than `every_s` go first). Thread-safe."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic, keep: int = 4096):
        self.every_s = every_s
        self.clock = clock
        self.keep = keep
        self._logged: dict[Hashable, tuple[float, int]] = {}   # key -> (logged at, refused since)
        self._lock = threading.Lock()

    def note(self, key: Hashable) -> int | None:
        now = self.clock()
        with self._lock:
            at, since = self._logged.get(key, (float("-inf"), 0))
            if now - at < self.every_s:
                self._logged[key] = (at, since + 1)
                return None
            self._logged[key] = (now, 0)
            if len(self._logged) > self.keep:
                self._logged = {k: v for k, v in self._logged.items() if now - v[0] < self.every_s}
            return since

    @staticmethod
    def more(since: int) -> str:
        """The end of a line that follows refusals not logged."""
        return f" ({since} more refused since the last line)" if since else ""


__all__ = ["RefusalLog"]

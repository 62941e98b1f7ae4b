"""Keep-alive of an idle inference model, from the history of its idle gaps.

Keeping a model resident costs its bytes (taken from training); evicting it costs a cold start
when the next request comes. We keep it for the `quantile` of its observed idle gaps, so that
most returns find it warm, clamped to [min_s, max_s]. With too little history, the maximum.
"""

from __future__ import annotations

from collections import deque


def keepalive_s(idle_gaps_s: list[float], quantile: float, min_s: float, max_s: float,
                min_samples: int = 3) -> float:
    if min_s > max_s:
        raise ValueError("min_s must not exceed max_s")
    if len(idle_gaps_s) < min_samples:
        return max_s
    s = sorted(idle_gaps_s)
    # Nearest-rank quantile; a small margin so a return exactly at the quantile still hits.
    q = s[min(len(s) - 1, int(quantile * len(s)))] * 1.1
    return min(max_s, max(min_s, q))


class IdleHistory:
    """Per-model idle gaps: the time between the end of one use and the start of the next."""

    def __init__(self, maxlen: int = 64) -> None:
        self._gaps: deque[float] = deque(maxlen=maxlen)
        self._last_end: float | None = None

    def started(self, now: float) -> None:
        if self._last_end is not None:
            self._gaps.append(max(0.0, now - self._last_end))
        self._last_end = None

    def ended(self, now: float) -> None:
        self._last_end = now

    @property
    def gaps(self) -> list[float]:
        return list(self._gaps)

    def idle_since(self) -> float | None:
        return self._last_end

"""Headroom: free memory kept back from training for inference that may arrive before a reclaim.

Pure: numbers in, numbers out. Within one reclaim time T, reservations arrive as a Poisson
process of rate `rate_per_s`; we keep enough bytes for the `quantile` of the arrival count,
each arrival asking for `bytes_per_arrival` (a high percentile of observed reservation sizes).
A millisecond reclaim makes λT tiny, so the headroom collapses to the floor: that is the point
of fast reclaim.
"""

from __future__ import annotations

import math
from collections import deque


def poisson_quantile(mean: float, quantile: float) -> int:
    """Smallest k with P[N <= k] >= quantile for N ~ Poisson(mean)."""
    if mean <= 0:
        return 0
    if not 0 < quantile < 1:
        raise ValueError("quantile must be in (0, 1)")
    if mean > 500:  # normal approximation; the exact sum underflows
        z = _normal_ppf(quantile)
        return max(0, math.ceil(mean + z * math.sqrt(mean) + 0.5))
    term = math.exp(-mean)
    cdf = term
    k = 0
    while cdf < quantile:
        k += 1
        term *= mean / k
        cdf += term
    return k


def _normal_ppf(q: float) -> float:
    # Acklam-free bisection on erf: precise enough for sizing headroom.
    lo, hi = -10.0, 10.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def headroom_bytes(
    rate_per_s: float,
    reclaim_s: float,
    bytes_per_arrival: float,
    quantile: float,
    floor_bytes: int,
    cap_bytes: int,
) -> int:
    """Bytes to keep free: max(floor, quantile of arrivals within reclaim time × size), ≤ cap."""
    if rate_per_s < 0 or reclaim_s < 0 or bytes_per_arrival < 0:
        raise ValueError("rates, times and sizes must be non-negative")
    k = poisson_quantile(rate_per_s * reclaim_s, quantile)
    need = int(math.ceil(k * bytes_per_arrival))
    return int(min(max(floor_bytes, need), max(cap_bytes, floor_bytes)))


class ArrivalRate:
    """Observed arrival rate over a sliding window (timestamps passed in; no clock of its own)."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._times: deque[float] = deque()
        self._sizes: deque[int] = deque()

    def observe(self, now: float, size_bytes: int) -> None:
        self._times.append(now)
        self._sizes.append(size_bytes)
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._times and self._times[0] < now - self.window_s:
            self._times.popleft()
            self._sizes.popleft()

    def rate(self, now: float) -> float:
        self._trim(now)
        return len(self._times) / self.window_s

    def size_quantile(self, q: float) -> float:
        if not self._sizes:
            return 0.0
        s = sorted(self._sizes)
        return float(s[min(len(s) - 1, int(q * len(s)))])


class Ewma:
    """Exponentially weighted mean, e.g. of measured reclaim times."""

    def __init__(self, initial: float, alpha: float = 0.2) -> None:
        self.value = initial
        self.alpha = alpha

    def update(self, sample: float) -> float:
        self.value += self.alpha * (sample - self.value)
        return self.value

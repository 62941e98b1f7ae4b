"""Memory per sample, fitted online, and the micro-batch size that fits a quota.

Peak bytes of one micro-batch ≈ fixed + per_sample × samples (weights, grads and optimizer
state are in `fixed`; activations scale with samples). A least-squares fit over recent
observations with exponential forgetting tracks changes (e.g. sequence length drift).
"""

from __future__ import annotations

import math

from policy.linefit import ForgettingLine


class MemoryPerSample:
    def __init__(self, forget: float = 0.95, margin: float = 1.1) -> None:
        self.forget = forget
        self.margin = margin
        self._line = ForgettingLine(forget)

    def observe(self, samples: int, peak_bytes: int) -> None:
        self._line.add(samples, peak_bytes)

    @property
    def fitted(self) -> bool:
        return self._line.weight > 0

    def coefficients(self) -> tuple[float, float]:
        """(fixed_bytes, bytes_per_sample)."""
        mx, my = self._line.means()
        b = self._line.slope(1e-9)
        if b is None:
            # One distinct batch size seen: attribute everything to samples (conservative).
            return 0.0, my / max(mx, 1.0)
        b = max(b, 1.0)
        a = my - b * mx
        return max(a, 0.0), b

    def estimate(self, samples: int) -> float:
        """Fitted peak bytes of a micro-batch of `samples`, without the sizing margin."""
        a, b = self.coefficients()
        return a + b * samples

    def predict(self, samples: int) -> float:
        return self.estimate(samples) * self.margin

    def max_samples(self, quota_bytes: int, upper: int) -> int:
        """Largest micro-batch (0..upper) whose predicted peak fits in quota_bytes."""
        if upper <= 0:
            return 0
        a, b = self.coefficients()
        n = math.floor((quota_bytes / self.margin - a) / b)
        return int(min(upper, max(0, n)))

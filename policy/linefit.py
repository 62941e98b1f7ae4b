"""y = a + b x by least squares over observations weighted by forget ** age: the one online line
fit of the policies (a micro-batch's memory per sample, a transform's cost per MiB). Pure."""
from __future__ import annotations


class ForgettingLine:
    """Weighted sums of a simple linear regression, each older observation weighted by `forget`
    once more than the next."""

    def __init__(self, forget: float) -> None:
        self.forget = forget
        self.weight = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def add(self, x: float, y: float) -> None:
        f = self.forget
        self.weight = self.weight * f + 1
        self._sx = self._sx * f + x
        self._sy = self._sy * f + y
        self._sxx = self._sxx * f + x * x
        self._sxy = self._sxy * f + x * y

    def means(self) -> tuple[float, float]:
        """(mean x, mean y); ValueError before any observation."""
        if self.weight == 0:
            raise ValueError("no observations")
        return self._sx / self.weight, self._sy / self.weight

    def slope(self, tolerance: float) -> float | None:
        """b, or None when the x seen have (nearly) no spread: variance <= tolerance x max(1, mean x ** 2)."""
        mx, my = self.means()
        var = self._sxx / self.weight - mx * mx
        if var <= tolerance * max(1.0, mx * mx):
            return None
        return (self._sxy / self.weight - mx * my) / var

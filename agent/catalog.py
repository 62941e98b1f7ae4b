"""The agent's catalog of replicas, with the bytes they hold kept as a running sum.

Every copy asks how much of the budget is used (`_make_room`). Summing the catalog each time
made a copy cost more the more replicas the tier held, under the agent's lock: quadratic over a
checkpoint of thousands of files (bench/follower_queue.py).

Bytes on the agent's disk that are not replicas yet, the chunks of write-time streams, count in
the same budget (`reserved_bytes`, `reserve`/`release`; issue 34: unpublished streams filled the
data folder past `budget_bytes`). `counted_bytes` is what the budget compares.
"""
from __future__ import annotations

from typing import Any, Generic, NoReturn, Protocol, TypeVar


class _Sized(Protocol):
    size: int


R = TypeVar("R", bound=_Sized)


class ReplicaCatalog(dict[str, R], Generic[R]):
    """path -> replica; `used_bytes` is the sum of their sizes. Changed only by item assignment,
    `del`, `pop` and `clear` (the others would bypass the sum: they raise). Not thread-safe: the
    agent's lock guards it."""

    def __init__(self) -> None:
        super().__init__()
        self.used_bytes = 0
        self.reserved_bytes = 0     # counted for what is not a replica (yet): stream chunks

    @property
    def counted_bytes(self) -> int:
        """Replicas and reservations: what the budget holds."""
        return self.used_bytes + self.reserved_bytes

    def reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes

    def release(self, nbytes: int) -> None:
        self.reserved_bytes = max(0, self.reserved_bytes - nbytes)

    def __setitem__(self, path: str, rep: R) -> None:
        old = self.get(path)
        if old is not None:
            self.used_bytes -= old.size
        super().__setitem__(path, rep)
        self.used_bytes += rep.size

    def __delitem__(self, path: str) -> None:
        self.used_bytes -= self[path].size
        super().__delitem__(path)

    def pop(self, path: str, *default: Any) -> Any:   # type: ignore[override]
        if path in self:
            rep = super().pop(path)
            self.used_bytes -= rep.size
            return rep
        return super().pop(path, *default)

    def clear(self) -> None:
        super().clear()
        self.used_bytes = 0

    def _bypass(self, *_args: Any, **_kwargs: Any) -> NoReturn:
        raise TypeError("ReplicaCatalog changes only by [], del, pop and clear (used_bytes is kept by them)")

    update = setdefault = popitem = __ior__ = _bypass   # type: ignore[assignment]


__all__ = ["ReplicaCatalog"]

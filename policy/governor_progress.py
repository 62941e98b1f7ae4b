"""Training's share: a guaranteed minimum (its progress), when to grow back and by how much."""

from __future__ import annotations


def training_floor_bytes(usable_bytes: int, min_training_fraction: float) -> int:
    """Bytes training keeps whatever inference asks: its guaranteed minimum progress."""
    if not 0 <= min_training_fraction <= 1:
        raise ValueError("min_training_fraction must be in [0, 1]")
    return int(usable_bytes * min_training_fraction)


def inference_limit_bytes(usable_bytes: int, min_training_fraction: float) -> int:
    """Most bytes inference may hold in total; beyond this a request is rejected, not reclaimed."""
    return usable_bytes - training_floor_bytes(usable_bytes, min_training_fraction)


def training_target_bytes(usable_bytes: int, inference_bytes: int, headroom: int,
                          min_training_fraction: float) -> int:
    """What training may use now: everything inference does not hold, minus headroom,
    never below the floor."""
    floor = training_floor_bytes(usable_bytes, min_training_fraction)
    return max(floor, usable_bytes - inference_bytes - headroom)


def grow_decision(current_quota: int, target: int, free_since: float | None, now: float,
                  grow_after_s: float, step_fraction: float) -> int | None:
    """New training quota if training should grow, else None.

    Grow only once the spare memory has stayed free for `grow_after_s` (hysteresis against
    bursts), and by `step_fraction` of the spare each time, so a new burst finds part free.
    """
    if target <= current_quota or free_since is None:
        return None
    if now - free_since < grow_after_s:
        return None
    spare = target - current_quota
    step = max(1, int(spare * step_fraction))
    return current_quota + step

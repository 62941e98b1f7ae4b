"""What happens when training does not reach a safe point before the reclaim deadline."""

from __future__ import annotations

from enum import Enum


class ReclaimOutcome(str, Enum):
    GRANT = "grant"            # enough memory is free: give it to inference
    WAIT = "wait"              # still within the deadline: keep waiting for acks
    REJECT = "reject"          # deadline missed, action 'reject': fail the request
    STOP_TRAINING = "stop_training"  # deadline missed, action 'stop_training': kill laggards


def reclaim_outcome(free_bytes: int, needed_bytes: int, elapsed_s: float, deadline_s: float,
                    action: str) -> ReclaimOutcome:
    if free_bytes >= needed_bytes:
        return ReclaimOutcome.GRANT
    if elapsed_s < deadline_s:
        return ReclaimOutcome.WAIT
    if action == "reject":
        return ReclaimOutcome.REJECT
    if action == "stop_training":
        return ReclaimOutcome.STOP_TRAINING
    raise ValueError(f"unknown deadline action {action!r}")

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


class Commands:
    """The commands issued to one training client that it has not acknowledged yet. Pure
    bookkeeping (no clock): the daemon keeps one per trainer.

    The client acknowledges the newest command it has read (a newer one overwrites an older one
    that is still pending), so an ack of seq s settles every command up to s. A late ack still
    counts: a reservation that missed its deadline and is asked again waits for the shrink that is
    already out (`wait_for`) instead of issuing a new one, whose ack would come one safe point
    later again, and so on without end."""

    def __init__(self) -> None:
        self.outstanding: dict[int, tuple[int, int]] = {}   # seq -> (command, target)
        self.last_acked = 0

    def issue(self, seq: int, cmd: int, target: int) -> None:
        self.outstanding[seq] = (cmd, target)

    def newest(self) -> tuple[int, int, int] | None:
        if not self.outstanding:
            return None
        seq = max(self.outstanding)
        return (seq,) + self.outstanding[seq]

    def wait_for(self, shrink_cmd: int, target: int) -> int | None:
        """The seq of the newest command if it is a shrink to at most `target` bytes (waiting
        for it frees what a shrink to `target` would), else None: issue a new one."""
        n = self.newest()
        if n is not None and n[1] == shrink_cmd and n[2] <= target:
            return n[0]
        return None

    def on_ack(self, ack: int) -> tuple[int, int, bool] | None:
        """The client's ACK word reads `ack`. If it is a command of ours: (command, target,
        whether it was the newest issued), and every command up to it is settled. Anything else
        (an old block's seq, a forged value) is no ack at all."""
        if ack not in self.outstanding:
            return None
        newest = max(self.outstanding)
        cmd, target = self.outstanding[ack]
        for seq in [s for s in self.outstanding if s <= ack]:
            del self.outstanding[seq]
        self.last_acked = max(self.last_acked, ack)
        return cmd, target, ack == newest

    def settled(self, seq: int) -> bool:
        return seq not in self.outstanding and seq <= self.last_acked

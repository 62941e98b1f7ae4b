"""A simulated GPU training process for CPU tests: holds `used` bytes, reaches a safe point
every `step_s`, and on a shrink releases down to the target after `release_s`, then acks
through the same shared-memory words and socket notification as the real client."""

from __future__ import annotations

import threading
import time

from governor.client import GovernorClient
from governor.protocol import CMD_GROW, CMD_SHRINK, now_ns


class SimulatedTrainer:
    def __init__(self, socket_path: str, step_s: float = 0.001, release_s: float = 0.0005,
                 stuck: bool = False) -> None:
        self.client = GovernorClient(socket_path, "training", name="sim")
        self.used = self.client.initial_quota
        self.step_s, self.release_s, self.stuck = step_s, release_s, stuck
        self.acks: list[int] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        slot = self.client.slot
        while not self._stop.is_set():
            time.sleep(self.step_s)  # one "layer" of work until the next safe point
            cmd = slot.pending()
            if cmd is None or self.stuck:
                continue
            slot.stamp_detect()
            drained = now_ns()
            if cmd.cmd == CMD_SHRINK:
                time.sleep(self.release_s)
                self.used = min(self.used, cmd.target)
            elif cmd.cmd == CMD_GROW:
                self.used = cmd.target
            slot.ack(cmd.seq, self.used, drained, now_ns())
            self.acks.append(cmd.seq)
            if cmd.cmd == CMD_SHRINK:
                self.client.notify_ack(cmd.seq)

    def close(self) -> None:
        self._stop.set()
        self._t.join(2)
        self.client.close()

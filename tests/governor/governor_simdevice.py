"""A simulated GPU training process for CPU tests: holds `used` bytes, reaches a safe point
every `step_s`, and on a shrink releases down to the target after `release_s`, then acks
through the same shared-memory words and socket notification as the real client."""

from __future__ import annotations

import threading
import time

from hintfs.governor.client import GovernorClient
from hintfs.governor.protocol import ACK_RELEASED, CMD_GROW, CMD_SHRINK, W_T_DETECT, now_ns


class SimulatedTrainer:
    def __init__(self, socket_path: str, step_s: float = 0.001, release_s: float = 0.0005,
                 stuck: bool = False, used: int | None = None) -> None:
        self.client = GovernorClient(socket_path, "training", name="sim")
        # physically held bytes; below the quota, a shrink that stays above them is free
        self.used = self.client.initial_quota if used is None else used
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
            detected = int(slot.slot[W_T_DETECT])
            drained = released = detected
            flags = 0
            if cmd.cmd == CMD_SHRINK and self.used > cmd.target:
                drained = now_ns()
                time.sleep(self.release_s)
                self.used = cmd.target
                released = now_ns()
                flags = ACK_RELEASED
            elif cmd.cmd == CMD_GROW:
                self.used = cmd.target
            slot.ack(cmd.seq, self.used, drained, released, flags)
            self.acks.append(cmd.seq)
            if cmd.cmd == CMD_SHRINK:
                self.client.notify_ack(cmd.seq)

    def close(self) -> None:
        self._stop.set()
        self._t.join(2)
        self.client.close()


class SimulatedMemory:
    """MemoryProbe of a simulated device: fixed bytes plus per-sample activation bytes that
    stay cached (like the caching allocator) until release()."""

    def __init__(self, fixed: int, per_sample: int) -> None:
        self.fixed, self.per_sample = fixed, per_sample
        self.cached_samples = 0
        self.peak_samples = 0
        self.releases = 0
        self.release_targets: list[int] = []

    def begin_micro(self, samples: int) -> None:
        self.cached_samples = max(self.cached_samples, samples)
        self.peak_samples = samples

    def reserved(self) -> int:
        return self.fixed + self.per_sample * self.cached_samples

    def peak(self) -> int:
        return self.fixed + self.per_sample * self.peak_samples

    def drain(self) -> None:
        pass

    def release(self, keep_bytes: int) -> None:
        self.cached_samples = 0
        self.releases += 1
        self.release_targets.append(keep_bytes)

    def record_event(self):
        return None


class ScriptedControl:
    """A real slot (SlotReader over a ControlBlock) whose daemon side posts commands from a
    script: `script[k] = (cmd, target)` is posted just before the k-th safe-point check."""

    def __init__(self, block_path, script: dict[int, tuple[int, int]], quota: int) -> None:
        from hintfs.governor.protocol import W_QUOTA, ControlBlock, SlotReader, SlotWriter
        self.block = ControlBlock(block_path, create=True, max_clients=2)
        self.writer = SlotWriter(self.block.slot(0))
        self.reader = SlotReader(self.block.slot(0))
        self.block.slot(0)[W_QUOTA] = quota
        self.script = dict(script)
        self.calls = 0
        self.slot = self.reader.slot

    def pending(self):
        k = self.calls
        self.calls += 1
        if k in self.script:
            self.writer.command(*self.script.pop(k))
        return self.reader.pending()

    def __getattr__(self, name):
        return getattr(self.reader, name)

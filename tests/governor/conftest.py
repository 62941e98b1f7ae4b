"""Fixtures: a governor daemon on a temp socket (trio in a background thread) and a simulated
training device that acknowledges shrinks like a real client, without CUDA."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
import trio

from mountconfig.governor import GiB, GovernorConfig, GpuConfig
from hintfs.governor.daemon import GovernorDaemon


class RunningDaemon:
    def __init__(self, cfg: GovernorConfig) -> None:
        self.cfg = cfg
        self.daemon = GovernorDaemon(cfg)
        self.daemon.open()
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancel: trio.CancelScope | None = None
        started = threading.Event()

        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as cs:
                self._cancel = cs
                async with trio.open_nursery() as n:
                    await n.start(self.daemon.serve)
                    started.set()
        self._thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
        self._thread.start()
        assert started.wait(10), "daemon did not start"

    def call(self, fn, *args):
        """Run a sync function on the daemon's trio thread (to read the ledger safely)."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def ledger(self, gpu: int = 0):
        return self.daemon.gpus[gpu].ledger

    def alive(self) -> bool:
        """The daemon's trio run is still going (an exception out of a task would have ended it)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        if self._token is not None:
            try:
                trio.from_thread.run_sync(self._cancel.cancel, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(10)
        self.daemon.close()


@pytest.fixture
def make_daemon(tmp_path):
    """make(**config) -> a running daemon. `world=True`: its socket in a folder every user may
    traverse (the attack tests, whose clients run as uid 65534)."""
    running: list[RunningDaemon] = []
    worlds: list = []

    def make(world: bool = False, **overrides) -> RunningDaemon:
        folder = tmp_path
        if world:
            from tests.helpers.security import WorldDir
            worlds.append(WorldDir())
            folder = worlds[-1].path
        base = dict(socket_path=str(folder / "gov.sock"),
                    shm_name=f"hintfs-test-{uuid.uuid4().hex[:8]}",
                    gpus=[GpuConfig(index=0, total_bytes=16 * GiB, reserve_bytes=1 * GiB)],
                    min_headroom_bytes=0, grow_after_free_s=0.2, liveness_interval_s=0.1,
                    reclaim_deadline_ms=500)
        base.update(overrides)
        d = RunningDaemon(GovernorConfig(**base))
        running.append(d)
        return d

    yield make
    for d in running:
        d.stop()
    for w in worlds:
        w.close()


@pytest.fixture
def keep_logging():
    """`hintfs.governor.cli.main` sets up the process's logging (as the daemon must): put back
    pytest's handlers and levels afterwards."""
    root, ours = logging.getLogger(), logging.getLogger("hintfs")
    saved = (root.handlers[:], root.level, ours.level)
    yield
    root.handlers[:], root.level = saved[0], saved[1]
    ours.setLevel(saved[2])


def wait_until(pred, timeout=5.0, interval=0.005):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return pred()

"""`.hintfs/signals/<job>`: anomaly signals that give an eval's checkpoint the link first.

A job (or its monitor) writes `{"path": "ckpt/run7", "kind": "loss_spike"|"grad_norm_spike"|"clear",
"severity": s}` when its loss or gradient norm spikes; the mount forwards it to the agents of its
routes, whose link schedulers move that job folder's copies into the anomaly class (weighted by
severity) until a `clear`. Forwarding runs in a background task, never in the write itself."""
from __future__ import annotations

import json
import logging
import time

import trio

from hintfs.common.documents import Signal, parse_signal

from fusefs.control import ControlDir, ControlFile, ControlInputError

log = logging.getLogger("hintfs.signals")


class SignalForwarder:
    def __init__(self, agents: list[str], clients, stats):
        self.agents = agents
        self.clients = clients
        self.stats = stats
        self.last: dict[str, dict] = {}
        self._send, self._recv = trio.open_memory_channel(256)

    def control_dir(self) -> ControlDir:
        d = ControlDir("signals", on_remove=lambda job: self.last.pop(job, None))
        d.make_file = lambda job: ControlFile(job, render=lambda: self._render(job), parse=parse_signal,
                                              names=lambda sig: [sig.path],
                                              apply=lambda sig: self.submit(job, sig))
        return d

    def _render(self, job: str) -> bytes:
        return (json.dumps(self.last[job]) + "\n").encode() if job in self.last else b""

    def submit(self, job: str, sig: Signal) -> None:
        if not self.agents:
            raise ControlInputError("no [[routes]] agents to signal: signals steer the cross-DC link")
        self.last[job] = {**sig.model_dump(), "at": time.time(), "forwarded": False}
        try:
            self._send.send_nowait((job, sig))
        except trio.WouldBlock:
            raise ControlInputError("too many signals queued; try again") from None
        self.stats.add("signals")

    async def run(self) -> None:
        async for job, sig in self._recv:
            ok = True
            for loc in self.agents:
                try:
                    await trio.to_thread.run_sync(self.clients[loc].signal, sig.path, sig.severity,
                                                  sig.kind == "clear")
                except OSError as err:
                    ok = False
                    log.warning("signal %s for %s to %s failed: %s", sig.kind, sig.path, loc, err)
            self.last[job]["forwarded"] = ok

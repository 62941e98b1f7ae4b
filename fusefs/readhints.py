"""`.hintfs/reads/<job>`: byte ranges an eval job is about to read, fetched first by the tier.

A job writes `{"ranges": [[path, offset, length], ...]}` (e.g. `hintfs.client.hint_dcp_reads`:
the tensors its DCP load takes, from the `.metadata` it reads anyway). For each routed file the
local tier is still receiving (a stream filling, a copy in flight), the mount asks the tier to
fetch those ranges at once, in parallel (hintfs/agent/demand.py): the reads that follow wait one round
trip in all, not one per tensor. Files the tier holds whole, or that are not routed, need nothing.
Forwarding runs in a background task, never in the write itself; who may write which paths is
the control files' rule (docs/security.md): only paths the writer may read."""
from __future__ import annotations

import json
import logging
import time

import trio

from hintfs.common.documents import ReadHint, parse_read_hint

from fusefs.control import ControlDir, ControlFile, ControlInputError

log = logging.getLogger("hintfs.readhints")


class ReadHints:
    def __init__(self, view, stats):
        self.view = view              # the RoutedStore of an eval mount, or None (no routes)
        self.stats = stats
        self.last: dict[str, dict] = {}
        self._send, self._recv = trio.open_memory_channel(64)

    def control_dir(self) -> ControlDir:
        d = ControlDir("reads", on_remove=lambda job: self.last.pop(job, None))
        d.make_file = lambda job: ControlFile(job, render=lambda: self._render(job), parse=parse_read_hint,
                                              names=lambda hint: sorted(hint.by_file()),
                                              apply=lambda hint: self.submit(job, hint))
        return d

    def _render(self, job: str) -> bytes:
        return (json.dumps(self.last[job]) + "\n").encode() if job in self.last else b""

    def submit(self, job: str, hint: ReadHint) -> None:
        if self.view is None:
            raise ControlInputError("no [[routes]]: read hints steer the eval tier's fetches")
        self.last[job] = {"ranges": len(hint.ranges), "at": time.time(), "pieces_fetching": None}
        try:
            self._send.send_nowait((job, hint))
        except trio.WouldBlock:
            raise ControlInputError("too many read hints queued; try again") from None
        self.stats.add("read_hints")

    async def run(self) -> None:
        async for job, hint in self._recv:
            n = await trio.to_thread.run_sync(self.view.prefetch, hint.by_file())
            self.last[job]["pieces_fetching"] = n
            self.stats.add("read_hint_pieces", n)

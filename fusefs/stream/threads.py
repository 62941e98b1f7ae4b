"""Write-time streaming in threads (`[stream]`, docs/cross_dc.md "Write-time streaming"): the
sink that sends each streamed file to the eval tiers, in the mount's own threads
(`sender = "threads"`) or in the sender child's (`fusefs.stream.sender`).

Its commands (`fusefs.stream.hooks.Sink`: what the hooks decided) only record an event and wake
the pump. The pump thread applies the events to a stream only between its steps (a stream is
stepped by one worker at a time), so `fusefs.stream.streamer.Streamer` never sees its state
change under it; a restart or a drop also waits for the stream's chunks in flight to land (a
publish does not: the tier must learn of it at once, see `Streamer.step`). A stream whose calls
keep failing for `idle_s` is given up (the follower copies the file after close); published
streams keep their staging fd until the tier acknowledges, at most `max_held_bytes`.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fusefs.stream.hooks import Counters, Finished, Version
from fusefs.stream.streamer import FileStream, Streamer, background_thread
from mountconfig.schema import StreamConfig

log = logging.getLogger("hintfs.stream")


@dataclass
class _Entry:
    """One streamed file: one FileStream per tier agent, and the events not applied yet."""
    path: str
    streams: list[FileStream]
    seq: int | None = None            # the hooks' start of it (None: a renamed file's copy)
    events: list = field(default_factory=list)
    busy: bool = False
    final: bool = False                  # published for good, or dropped: only sending is left
    failing_since: float | None = None
    errors_seen: int = 0
    next_try: float = 0.0
    held_since: float = 0.0


def job_of(path: str) -> str | None:
    """The job a checkpoint file belongs to: its path without the step folder and the name
    (`ckpt/run-7/step_100/__0_0.distcp` -> `ckpt/run-7`), as the eval side names it."""
    parts = path.split("/")
    return "/".join(parts[:-2]) or None


class ThreadSink:
    """`fusefs.stream.hooks.Sink` whose sends run in threads of this process."""

    alive = True

    def __init__(self, sc: StreamConfig, streamers: list[Streamer], stats: Counters,
                 on_finished: Finished | None = None):
        self.cfg = sc
        self.streamers = streamers
        self.stats = stats
        self.on_finished = on_finished   # (key, seq): the stream started so is gone (finished or given up)
        self.entries: dict = {}          # inode number (or a renamed file's own key) -> _Entry
        self.cond = threading.Condition()
        # steps of different files run at once (each step's chunks have the streamer's own pool)
        self.nice = sc.sender_nice
        self.workers = ThreadPoolExecutor(8, thread_name_prefix="hintfs-stream",
                                          initializer=functools.partial(background_thread, self.nice))
        self._stop = False
        for s in streamers:
            s.on_landed = self._chunk_landed
        self.thread = threading.Thread(target=self._pump, name="hintfs-stream-pump", daemon=True)
        self.thread.start()
        # Connect to each tier now: a first call on a new channel costs several round trips
        # (TCP, HTTP/2 settings), which the first checkpoint's stream would otherwise pay.
        for s in streamers:
            self.workers.submit(self._warm_up, s)

    @staticmethod
    def _warm_up(streamer: Streamer) -> None:
        streamer.warm()                  # its threads and their buffers, before the first file
        transport: Any = streamer.transport     # (a FlightTransport: its connections)
        for client in dict.fromkeys((transport.client, getattr(transport, "control", transport.client),
                                     getattr(transport, "urgent", transport.client))):
            try:
                client.ping()        # the bulk connection and the publishes' own
            except OSError as err:
                log.warning("tier agent %s does not answer yet: %s", client.location, err)

    # -- commands (record and wake, nothing more) ---------------------------------------------------
    def start(self, key: int, seq: int, path: str, fd: int) -> None:
        with self.cond:
            entry = self.entries.get(key)
            if entry is None:
                self.entries[key] = _Entry(path, [s.start(path, fd, job_of(path)) for s in self.streamers], seq)
                self.stats.add("streams_started")
            else:                          # truncated or staged anew: a new generation
                entry.events.append(("restart", os.dup(fd)))
                entry.seq, entry.final = seq, False
            self.cond.notify_all()

    def moved(self, key: int, path: str) -> None:
        with self.cond:
            entry = self.entries.get(key)
            if entry is not None:
                entry.path = path          # still written: its publish will name the new path

    def publish(self, key: int, path: str, version: Version) -> None:
        with self.cond:
            entry = self.entries.get(key)
            if entry is None:
                return
            entry.path = path
            entry.events.append(("published", path, *version))
            entry.final = True
            entry.held_since = time.monotonic()
            self.cond.notify_all()

    def drop(self, key: int) -> None:
        with self.cond:
            entry = self.entries.get(key)
            if entry is None:
                return
            entry.events.append(("drop",))
            entry.final = True
            self.cond.notify_all()

    def add_published(self, path: str, fd: int, version: Version) -> None:
        """Stream a published file (`version.size` bytes at `fd`, a renamed file's copy) under `path`."""
        with self.cond:
            if self._stop:
                return
            key = ("renamed", path, version.mtime_ns)
            entry = _Entry(path, [s.start(path, fd, job_of(path)) for s in self.streamers])
            entry.events.append(("published", path, *version))
            entry.final, entry.held_since = True, time.monotonic()
            self.entries[key] = entry
            self.stats.add("streams_renamed")
            self.cond.notify_all()

    # -- the pump -----------------------------------------------------------------------------------
    def _apply(self, entry: _Entry) -> None:
        """Events recorded by the hooks, applied while no worker steps this entry."""
        events, entry.events = entry.events, []
        for ev in events:
            for streamer, fs in zip(self.streamers, entry.streams):
                if ev[0] == "restart":
                    streamer.restart(fs, ev[1])
                elif ev[0] == "published":
                    fs.path = ev[1]
                    streamer.published(fs, ev[2], ev[3], ev[4])
                elif ev[0] == "drop":
                    streamer.drop(fs)
            if ev[0] == "restart":
                os.close(ev[1])

    def _pump(self) -> None:
        background_thread(self.nice)   # (its steps are the stream's work too: after the job's)
        poll = self.cfg.poll_interval_s
        while True:
            with self.cond:
                if self._stop:
                    return
                now = time.monotonic()
                self._give_up_over_budget(now)
                for key, entry in list(self.entries.items()):
                    if entry.busy or now < entry.next_try:
                        continue
                    if (any(ev[0] != "published" for ev in entry.events)
                            and not all(s.idle(fs) for s, fs in zip(self.streamers, entry.streams))):
                        continue   # a restart or a drop waits for the chunks in flight to land
                    try:
                        self._apply(entry)
                    except OSError as err:   # never stop the pump: give this stream up
                        log.warning("stream of %s given up: %s", entry.path, err)
                        self._give_up(key, entry)
                        continue
                    entry.busy = True
                    self.workers.submit(self._work, key, entry)
                self.cond.wait(poll if self.entries else None)   # idle: the hooks wake it

    def _chunk_landed(self) -> None:
        """A call landed (a send-pool thread): a published stream waiting for it can go on."""
        with self.cond:
            if any(e.final for e in self.entries.values()):
                self.cond.notify_all()

    def _landings(self) -> int:
        return sum(s.landings for s in self.streamers)

    def _work(self, key: int, entry: _Entry) -> None:
        finished = True
        landed = self._landings()
        try:
            for streamer, fs in zip(self.streamers, entry.streams):
                finished = streamer.step(fs) and finished
        except Exception:   # a bug must not stop the pump: give the stream up
            log.exception("stream of %s failed; the follower will copy it after close", entry.path)
            for streamer, fs in zip(self.streamers, entry.streams):
                streamer.close(fs)
            finished = True
        now = time.monotonic()
        total = sum(fs.errors for fs in entry.streams)   # (chunks in flight fail between steps too)
        errors, entry.errors_seen = total - entry.errors_seen, total
        with self.cond:
            entry.busy = False
            if finished and any(ev[0] == "restart" for ev in entry.events):
                finished = False            # written again as it finished: a new generation
                for fs in entry.streams:
                    fs.state = "writing"
            if finished:
                if all(fs.state == "done" for fs in entry.streams):
                    self.stats.add("streams_published")
                self.stats.add("stream_bytes_sent", sum(fs.bytes_sent for fs in entry.streams))
                # chunks the tier named to send first (eval jobs read them of the last checkpoint's file)
                self.stats.add("stream_chunks_first", sum(len(fs.first) for fs in entry.streams))
                self._forget(key)              # (last: a sender process reports its counters first)
            elif errors:
                entry.failing_since = entry.failing_since or now
                if now - entry.failing_since > self.cfg.idle_s:
                    log.warning("stream of %s given up after %.0f s of failed calls; the eval side copies "
                                "it after close", entry.path, now - entry.failing_since)
                    self._give_up(key, entry)
                else:
                    entry.next_try = now + min(0.05 * 2 ** min(max(fs.errors for fs in entry.streams), 6), 2.0)
            else:
                entry.failing_since = None
                # Published: go on at once, not at the next poll; unless all that is left is to
                # wait for chunks to land (and none landed during the step: its wake found this
                # entry busy). A landing wakes the pump (`_chunk_landed`); stepping before that
                # only spins (it did: thousands of steps per checkpoint, on the writer's CPU).
                # (A stream already done at its tier waits for nothing: another tier's may.)
                waiting = (all(fs.waiting or fs.state == "done" for fs in entry.streams)
                           and self._landings() == landed)
                if entry.events or (entry.final and not waiting):
                    self.cond.notify_all()

    def _give_up(self, key: int, entry: _Entry) -> None:
        for streamer, fs in zip(self.streamers, entry.streams):
            streamer.close(fs)
        self._forget(key)
        self.stats.add("streams_given_up")

    def _forget(self, key) -> None:
        """(under `cond`)"""
        entry = self.entries.pop(key, None)
        if entry is not None and entry.seq is not None and self.on_finished is not None:
            self.on_finished(key, entry.seq)

    def _give_up_over_budget(self, now: float) -> None:
        """Published streams keep their staging file open until the tier has it: at most
        `max_held_bytes` of them, the oldest given up first."""
        held = sorted((e.held_since, k, e) for k, e in self.entries.items()
                      if e.final and not e.busy and e.streams and e.streams[0].version is not None)
        total = sum(e.streams[0].version[0] for _t, _k, e in held)
        for _t, key, entry in held:
            if total <= self.cfg.max_held_bytes:
                break
            total -= entry.streams[0].version[0]
            log.warning("stream of %s given up: more than %d bytes held for the tier", entry.path,
                        self.cfg.max_held_bytes)
            self._give_up(key, entry)

    # -- shutdown ---------------------------------------------------------------------------------------
    def close(self, timeout_s: float = 10.0) -> None:
        """At unmount: give published streams up to `timeout_s` to finish, then stop."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while any(e.final for e in self.entries.values()) and time.monotonic() < deadline:
                self.cond.wait(0.05)
            self._stop = True
            self.cond.notify_all()
        self.thread.join(5)
        self.workers.shutdown(wait=True)
        with self.cond:
            for entry in self.entries.values():
                for streamer, fs in zip(self.streamers, entry.streams):
                    streamer.close(fs)
            self.entries.clear()
        for s in self.streamers:
            s.shutdown()


__all__ = ["ThreadSink", "job_of"]

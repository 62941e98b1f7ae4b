"""Write-time streaming in the mount (`[stream]`, docs/cross_dc.md "Write-time streaming"): the
filesystem's hooks, and the threads that send each streamed file to the eval tiers.

The filesystem calls four hooks from the trio loop (`StreamHooks` in `fusefs/interfaces.py`); each
only records an event and wakes the pump, never waits on the link:

- `started(key, path, fd)`: a staging file was created or replaced for inode `key` (create, an
  open with O_TRUNC, a fresh copy after a publish): a new stream, or a new generation of it.
- `published(key, path, st, record, final)`: the store committed the file. `final` when no other
  write handle is left (the close of the last writer): the stream is published with that version.
  Otherwise (fsync, a rename of an open file) the version is only remembered: more writes may come.
- `released(key)`: the last writer is gone. A remembered version with no write since (an fsync,
  then a close with nothing new) is published now; a stream never published is dropped.
- `dropped(key)`: unlinked while open, or abandoned at unmount: the tier drops what it holds.
- `renamed(key, path, st, record)`: a published file got a new name (DCP renames `.metadata.tmp`
  to `.metadata`, the commit marker). A stream still being written follows the inode and
  publishes under the new name; otherwise a file of at most one chunk is read back from the store and streamed
  under its new name (one round trip), a larger one is left to the follower's copy.

The pump thread applies the events to a stream only between its steps (a stream is stepped by one
worker at a time), so `fusefs.streamer.Streamer` never sees its state change under it; a restart
or a drop also waits for the stream's chunks in flight to land (a publish does not: the tier must
learn of it at once, see `Streamer.step`). A stream
whose calls keep failing for `idle_s` is given up (the follower copies the file after close);
published streams keep their staging fd until the tier acknowledges, at most `max_held_bytes`.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from agent.client import AgentClient
from agent.linkgate import LinkGate
from fusefs.stats import Stats
from fusefs.streamer import FileStream, PublishAnswer, PutAnswer, Streamer, background_thread
from stores.base import Stat

log = logging.getLogger("hintfs.stream")


class FlightTransport:
    """`fusefs.streamer.Transport` over an eval tier agent's Flight calls (`agent.client`)."""

    SMALL = 256 << 10    # a publish carrying at most this many bytes goes by the control connection

    def __init__(self, client, ttl_s: float = 86400.0, control=None, urgent=None):
        self.client = client
        # Opens, publishes and aborts on a connection of their own: on a long link, a publish
        # sent behind the chunks in flight on the bulk connection waits for all of them (the
        # eval side then waits for the file's version, or copies it a second time).
        self.control = control if control is not None else client
        # Chunks eval reads want first on a third: they share the link with the bulk at once.
        self.urgent = urgent if urgent is not None else client
        self.ttl_s = ttl_s

    def open(self, sid, gen, path, chunk, job=None):
        return self.control.stream_open(sid, gen, path, chunk, job)

    def put(self, sid, gen, chunks, opening=None, seen=None, urgent=False):
        doc = (self.urgent if urgent else self.client).stream_put(
            sid, gen, list(chunks),
            opening=None if opening is None else {"path": opening[0], "chunk": opening[1], "job": opening[2]},
            seen=seen)
        return PutAnswer(doc.get("first", []) if opening is not None else None, doc.get("state") == "ready")

    def publish(self, sid, gen, path, size, mtime_ns, crcs, record=None, chunks=(), opening=None):
        small = sum(len(c[1]) for c in chunks) <= self.SMALL
        doc = (self.control if small else self.client).stream_put(
            sid, gen, list(chunks),
            opening=None if opening is None else {"path": opening[0], "chunk": opening[1], "job": opening[2]},
            publish={"path": path, "size": size, "mtime_ns": mtime_ns, "crcs": list(crcs), "record": record,
                     "ttl_s": self.ttl_s})
        return PublishAnswer(doc.get("state", "fill"), tuple(int(i) for i in doc.get("fetch", ())),
                             doc.get("first", []) if opening is not None else None)

    def abort(self, sid):
        self.control.stream_abort(sid)


@dataclass
class _Entry:
    """One streamed file: one FileStream per tier agent, and the events not applied yet."""
    path: str
    streams: list[FileStream]
    events: list = field(default_factory=list)
    busy: bool = False
    pending: Optional[tuple] = None      # (size, mtime_ns, record) of a non-final publish
    final: bool = False                  # published for good: only sending is left
    failing_since: Optional[float] = None
    errors_seen: int = 0
    next_try: float = 0.0
    held_since: float = 0.0


def renamed_copy(read_store: Callable[[str], tuple[bytes, Stat]], path: str, st: Stat) -> Optional[int]:
    """A renamed file's bytes at version `st`, read back from the store, in a memory file (its
    stream's source; the caller closes it); None when the store no longer has that version."""
    try:
        data, now = read_store(path)
    except OSError as err:
        log.info("not streaming renamed %s: %s", path, err)
        return None
    if now.identity() != st.identity() or len(data) != st.size:
        return None                        # changed again meanwhile: its own publish will tell
    fd = os.memfd_create("hintfs-renamed", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
    except OSError:
        os.close(fd)
        raise
    return fd


def job_of(path: str) -> Optional[str]:
    """The job a checkpoint file belongs to: its path without the step folder and the name
    (`ckpt/run-7/step_100/__0_0.distcp` -> `ckpt/run-7`), as the eval side names it."""
    parts = path.split("/")
    return "/".join(parts[:-2]) or None


def build_streamers(sc, token: Optional[str], tls_root: Optional[bytes]) -> list[Streamer]:
    """`[stream]`: one streamer per eval tier agent, behind one link gate for this mount."""
    link = LinkGate(sc.link_bytes_s, sc.chunk_bytes) if sc.link_bytes_s else None

    def transport(loc: str) -> FlightTransport:
        def own() -> AgentClient:
            return AgentClient(loc, token=token, tls_root=tls_root, timeout_s=sc.timeout_s, own_connection=True)
        return FlightTransport(AgentClient(loc, token=token, tls_root=tls_root, timeout_s=sc.timeout_s),
                               control=own(), urgent=own() if sc.first_by_reads else None)
    return [Streamer(transport(loc), sc.chunk_bytes, parallel=sc.parallel, link=link, call_bytes=sc.call_bytes,
                     first_by_reads=sc.first_by_reads, others_in_flight=sc.others_in_flight, nice=sc.sender_nice,
                     others_while_writing=sc.others_while_writing)
            for loc in sc.agents]


def restreams(sc, size: int) -> bool:
    """A published file renamed into a streamed prefix is sent again from the store: small ones."""
    return size <= sc.chunk_bytes


class StreamTap:
    def __init__(self, cfg, streamers: list[Streamer], stats: Stats,
                 read_store: Optional[Callable[[str], tuple[bytes, Stat]]] = None,
                 on_finished: Optional[Callable[[Any], None]] = None):
        self.cfg = cfg
        self.prefixes = [p.rstrip("/") for p in cfg.prefixes]
        self.streamers = streamers
        self.stats = stats
        self.read_store = read_store     # (path) -> (bytes, stat), for renamed small files
        self.on_finished = on_finished   # (key): the entry of `key` is gone (finished or given up)
        self.entries: dict = {}          # inode number (or a rename's own key) -> _Entry
        self.cond = threading.Condition()
        # steps of different files run at once (each step's chunks have the streamer's own pool)
        self.nice = cfg.sender_nice
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
        transport = streamer.transport
        for client in dict.fromkeys((transport.client, getattr(transport, "control", transport.client),
                                     getattr(transport, "urgent", transport.client))):
            try:
                client.ping()        # the bulk connection and the publishes' own
            except OSError as err:
                log.warning("tier agent %s does not answer yet: %s", client.location, err)

    # -- hooks (trio loop: record and wake, nothing more) -----------------------------------------
    def wants(self, path: str) -> bool:
        return any(path == p or path.startswith(p + "/") for p in self.prefixes)

    def started(self, key: int, path: str, fd: int) -> None:
        if not self.wants(path):
            return
        with self.cond:
            entry = self.entries.get(key)
            if entry is None:
                job = job_of(path)
                self.entries[key] = _Entry(path, [s.start(path, fd, job) for s in self.streamers])
                self.stats.add("streams_started")
            else:
                entry.events.append(("restart", os.dup(fd)))
                entry.final, entry.pending = False, None
            self.cond.notify_all()

    def published(self, key: int, path: str, st: Stat, record: Optional[str], final: bool) -> None:
        with self.cond:
            entry = self.entries.get(key)
            if entry is None:
                return
            entry.path = path
            if final:
                entry.events.append(("published", path, st.size, st.mtime_ns, record))
                entry.final, entry.pending = True, None
                entry.held_since = time.monotonic()
            else:
                entry.pending = (st.size, st.mtime_ns, record)
            self.cond.notify_all()

    def released(self, key: int) -> None:
        with self.cond:
            entry = self.entries.get(key)
            if entry is None or entry.final:
                return
            if entry.pending is not None:
                size, mtime_ns, record = entry.pending
                entry.events.append(("published", entry.path, size, mtime_ns, record))
                entry.final, entry.pending = True, None
                entry.held_since = time.monotonic()
            else:
                entry.events.append(("drop",))
            self.cond.notify_all()

    def dropped(self, key: int) -> None:
        with self.cond:
            entry = self.entries.get(key)
            if entry is None:
                return
            entry.events.append(("drop",))
            entry.final = True
            self.cond.notify_all()

    def will_stream_renamed(self, key: Optional[int], path: str, size: int) -> bool:
        """A file renamed to `path` will reach the tiers by stream (see `renamed`)."""
        if not self.wants(path):
            return False
        with self.cond:
            entry = self.entries.get(key) if key is not None else None
            if entry is not None and not entry.final:
                return True
        return self._restreams(size)

    def _restreams(self, size: int) -> bool:
        return self.read_store is not None and restreams(self.cfg, size)

    def renamed(self, key: Optional[int], path: str, st: Stat, record: Optional[str]) -> None:
        if not self.wants(path):
            return
        with self.cond:
            entry = self.entries.get(key) if key is not None else None
            if entry is not None and not entry.final:
                entry.path = path          # still written: its publish will name the new path
                return
        if self._restreams(st.size):
            self.workers.submit(self._restream, path, st, record)

    def _restream(self, path: str, st: Stat, record: Optional[str]) -> None:
        """Stream a small published file from the store under its new name."""
        assert self.read_store is not None
        fd = renamed_copy(self.read_store, path, st)
        if fd is None:
            return
        try:
            self.add_published(path, fd, st.size, st.mtime_ns, record)
        finally:
            os.close(fd)                   # each stream keeps its own dup

    def add_published(self, path: str, fd: int, size: int, mtime_ns: int, record: Optional[str]) -> None:
        """Stream a published file (of `size` bytes at `fd`, a renamed file's copy) under `path`."""
        with self.cond:
            key = ("renamed", path, mtime_ns)
            entry = _Entry(path, [s.start(path, fd, job_of(path)) for s in self.streamers])
            entry.events.append(("published", path, size, mtime_ns, record))
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
        self.entries.pop(key, None)
        if self.on_finished is not None:
            self.on_finished(key)

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


__all__ = ["StreamTap", "FlightTransport", "build_streamers", "restreams", "renamed_copy", "job_of"]

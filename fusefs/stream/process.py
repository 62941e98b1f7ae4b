"""Write-time streaming from a child process (`[stream] sender = "process"`, the default;
docs/cross_dc.md "The sender process"): the mount's `StreamHooks`, forwarded to
`fusefs.streamchild`, which runs the sends.

Why a process: the sends are Python too (reads, CRCs, Arrow batches, gRPC's callbacks). As
threads of the mount they hold its Python lock, and the FUSE loop that serves the job's writes
waits for it; a thread's CPU niceness does not help a thread that holds the lock. As a process
at `sender_nice` they only take CPU the job's writes and uploads leave.

- Each hook records what it learned in `live` (one `_Live` per streamed inode) and queues a
  message; one thread sends them in order (the trio loop never waits on the socket), a staging
  file's descriptor beside a `start`. Another thread reads the child's counters and the streams
  it is done with.
- If the child dies, it is started again and every live stream announced anew from `live` (a
  fresh stream at the tiers: the dead child's unpublished ones expire there). Messages queued
  before that are dropped: `live` already holds what they said. More than `RESTARTS` deaths in
  `RESTART_WINDOW_S` turn streaming off for this mount (`wants` says no: the journal then tells
  the eval side to copy after close).
"""
from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import queue
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

from common.procs import daemon_python
from fusefs.stats import Stats
from fusefs.streamtap import renamed_copy, restreams
from fusefs.streamwire import next_message, send, socketpair
from stores.base import Stat

log = logging.getLogger("hintfs.stream")

RESTARTS = 5              # deaths of the child within RESTART_WINDOW_S before streaming stops
RESTART_WINDOW_S = 60.0


@dataclass
class _Live:
    """One streamed inode, as the child was told about it: enough to tell a new child again."""
    n: int                # the stream's number in messages (inode numbers are reused)
    path: str
    fd: int               # our own dup of the staging file (a new child starts from it)
    seq: int = 1          # `start`s sent: a `finished` of an older one does not end this one
    dropped: bool = False
    pending: Optional[tuple[int, int, Optional[str]]] = None    # (size, mtime_ns, record) of an fsync's publish
    version: Optional[tuple[int, int, Optional[str]]] = None    # the same, of the final publish

    @property
    def final(self) -> bool:
        """Published for good, or dropped: no more writes will come."""
        return self.version is not None or self.dropped


class StreamProcess:
    """`StreamHooks` (fusefs/interfaces.py) whose work runs in a child process."""

    def __init__(self, sc, token: Optional[str], tls_root: Optional[bytes], stats: Stats,
                 read_store: Optional[Callable[[str], tuple[bytes, Stat]]] = None,
                 log_level: str = "INFO", log_file: Optional[str] = None):
        self.cfg = sc
        self.prefixes = [p.rstrip("/") for p in sc.prefixes]
        self.stats = stats
        self.read_store = read_store
        self._setup = json.dumps({"stream": sc.model_dump(mode="json"), "token": token,
                                  "tls_root": base64.b64encode(tls_root).decode() if tls_root else None,
                                  "log_level": log_level, "log_file": log_file}).encode()
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.live: dict[int, _Live] = {}      # inode -> stream
        self.numbers: dict[int, int] = {}     # stream number -> inode
        self._ids = itertools.count(1)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()   # (child generation, doc, fd) or None
        self.gen = 0                          # children started so far, minus one
        self.failed = False                   # streaming given up (the child kept dying)
        self.closing = False
        self.deaths: list[float] = []
        self.proc, self.sock = self._spawn()
        self.restreamer = ThreadPoolExecutor(1, thread_name_prefix="hintfs-restream")
        self.sender = threading.Thread(target=self._send_loop, name="hintfs-stream-out", daemon=True)
        self.reader = threading.Thread(target=self._read_loop, name="hintfs-stream-in", daemon=True)
        self.sender.start()
        self.reader.start()

    def _spawn(self):
        mine, theirs = socketpair()
        try:
            proc = subprocess.Popen([*daemon_python(), "-m", "fusefs.streamchild", str(theirs.fileno())], cwd="/",
                                    stdin=subprocess.PIPE, pass_fds=[theirs.fileno()])
        except OSError:
            mine.close()
            raise
        finally:
            theirs.close()
        assert proc.stdin is not None
        try:
            proc.stdin.write(self._setup)
            proc.stdin.close()
        except OSError as err:         # died at once: the reader sees its end closed
            log.warning("stream sender %d did not take its setup: %s", proc.pid, err)
        log.info("stream sender process %d started", proc.pid)
        return proc, mine

    # -- hooks (trio loop: record, queue, return) -------------------------------------------------
    def wants(self, path: str) -> bool:
        return not self.failed and any(path == p or path.startswith(p + "/") for p in self.prefixes)

    def _put(self, doc: dict, fd: Optional[int] = None) -> None:
        """(under `lock`)"""
        if self.failed:
            if fd is not None:
                os.close(fd)
            return
        self.outbox.put((self.gen, doc, fd))

    def _start(self, live: _Live) -> None:
        """(under `lock`) Tell the child about this stream; what it was told before is past."""
        self._put({"op": "start", "n": live.n, "seq": live.seq, "path": live.path}, os.dup(live.fd))

    def started(self, key: int, path: str, fd: int) -> None:
        if not self.wants(path):
            return
        with self.lock:
            live = self.live.get(key)
            if live is None:
                live = self.live[key] = _Live(next(self._ids), path, os.dup(fd))
                self.numbers[live.n] = key
            else:                       # truncated or staged anew: a new generation of it
                os.close(live.fd)
                live.fd, live.seq = os.dup(fd), live.seq + 1
                live.dropped = False
                live.pending = live.version = None
            self._start(live)

    def published(self, key: int, path: str, st: Stat, record: Optional[str], final: bool) -> None:
        with self.lock:
            live = self.live.get(key)
            if live is None:
                return
            live.path = path
            if final:
                live.version, live.pending = (st.size, st.mtime_ns, record), None
            else:
                live.pending = (st.size, st.mtime_ns, record)
            self._put_published(live)

    def _put_published(self, live: _Live) -> None:
        """(under `lock`) The version `live` was published as: final, or an fsync's for now."""
        final = live.version is not None
        size, mtime_ns, record = live.version if final else live.pending   # type: ignore[misc]
        self._put({"op": "published", "n": live.n, "path": live.path, "size": size, "mtime_ns": mtime_ns,
                   "record": record, "final": final})

    def released(self, key: int) -> None:
        with self.lock:
            live = self.live.get(key)
            if live is None or live.final:
                return
            if live.pending is not None:
                live.version, live.pending = live.pending, None
            else:
                live.dropped = True
            self._put({"op": "released", "n": live.n})

    def dropped(self, key: int) -> None:
        with self.lock:
            live = self.live.get(key)
            if live is None:
                return
            live.dropped = True
            self._put({"op": "dropped", "n": live.n})

    def will_stream_renamed(self, key: Optional[int], path: str, size: int) -> bool:
        if not self.wants(path):
            return False
        with self.lock:
            live = self.live.get(key) if key is not None else None
            if live is not None and not live.final:
                return True
        return self.read_store is not None and restreams(self.cfg, size)

    def renamed(self, key: Optional[int], path: str, st: Stat, record: Optional[str]) -> None:
        if not self.wants(path):
            return
        with self.lock:
            live = self.live.get(key) if key is not None else None
            if live is not None and not live.final:
                live.path = path        # still written: its publish will name the new path
                self._put({"op": "renamed", "n": live.n, "path": path, "size": st.size, "mtime_ns": st.mtime_ns,
                           "record": record})
                return
        if self.read_store is not None and restreams(self.cfg, st.size):
            self.restreamer.submit(self._restream, path, st, record)

    def _restream(self, path: str, st: Stat, record: Optional[str]) -> None:
        assert self.read_store is not None
        fd = renamed_copy(self.read_store, path, st)
        if fd is not None:
            with self.lock:
                self._put({"op": "restream", "path": path, "size": st.size, "mtime_ns": st.mtime_ns,
                           "record": record}, fd)

    # -- the two threads ----------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            gen, doc, fd = item
            try:
                with self.send_lock:    # (a dead child's socket is closed only between sends)
                    with self.lock:
                        sock = self.sock if gen == self.gen else None
                    if sock is not None:    # (else meant for a child that died: `live` says it again)
                        send(sock, doc, fd)
            except OSError as err:      # the child died: the reader starts another
                log.debug("stream sender: %s not sent: %s", doc.get("op"), err)
            finally:
                if fd is not None:
                    os.close(fd)

    def _read_loop(self) -> None:
        while True:
            with self.lock:
                sock = self.sock
            msg = next_message(sock)
            if msg is None:
                if self.closing or not self._restart():
                    return
                continue
            doc, fd = msg
            if fd is not None:
                os.close(fd)
            try:
                if doc["op"] == "stat":
                    self.stats.add(str(doc["name"]), int(doc["n"]))
                elif doc["op"] == "finished":
                    self._finished(int(doc["n"]), int(doc["seq"]))
            except (KeyError, TypeError, ValueError) as err:
                log.error("stream sender: message %s refused: %s", doc.get("op"), err)

    def _finished(self, n: int, seq: int) -> None:
        with self.lock:
            key = self.numbers.get(n)
            live = self.live.get(key) if key is not None else None
            if live is None or live.seq != seq:
                return                  # started again since: the child has a new stream of it
            del self.live[key], self.numbers[n]
            os.close(live.fd)

    def _restart(self) -> bool:
        """The child is gone: start another and tell it every live stream (False: given up)."""
        old = self.proc
        try:
            rc = old.wait(5)
        except subprocess.TimeoutExpired:
            old.kill()
            rc = old.wait()
        now = time.monotonic()
        self.deaths = [t for t in self.deaths if now - t < RESTART_WINDOW_S] + [now]
        self.stats.add("stream_sender_restarts")
        if len(self.deaths) > RESTARTS:
            log.error("stream sender died %d times within %.0f s: streaming off for this mount; the eval side "
                      "copies files after close", len(self.deaths), RESTART_WINDOW_S)
            self._give_up()
            return False
        log.warning("stream sender %d exited (status %s); starting another, %d files sent again",
                    old.pid, rc, len(self.live))
        try:
            proc, sock = self._spawn()
        except OSError as err:
            log.error("stream sender cannot be started again (%s): streaming off for this mount", err)
            self._give_up()
            return False
        with self.lock:
            if self.closing:            # unmounting meanwhile: nothing more to send
                proc.kill()
                proc.wait()
                sock.close()
                return False
            self.gen += 1
            old_sock, self.proc, self.sock = self.sock, proc, sock
            self._drain()
            for key, live in list(self.live.items()):
                if live.dropped:        # the dead child's stream expires at the tiers
                    del self.live[key], self.numbers[live.n]
                    os.close(live.fd)
                    continue
                self._start(live)
                if live.pending is not None or live.version is not None:
                    self._put_published(live)
        with self.send_lock:
            old_sock.close()
        return True

    def _give_up(self) -> None:
        """Streaming off for this mount: `wants` says no from now on (the journal then tells the
        eval side to copy after close); the live streams are given up."""
        with self.lock:
            self.failed = True
            self._drain()
            self.stats.add("streams_given_up", len(self.live))
            for live in self.live.values():
                os.close(live.fd)
            self.live.clear()
            self.numbers.clear()

    def _drain(self) -> None:
        """(under `lock`) Drop the queued messages (they were for the dead child)."""
        while True:
            try:
                item = self.outbox.get_nowait()
            except queue.Empty:
                return
            if item is None:            # (close asked for: keep it last)
                self.outbox.put(None)
                return
            if item[2] is not None:
                os.close(item[2])

    # -- shutdown ----------------------------------------------------------------------------------
    def close(self, timeout_s: float = 10.0) -> None:
        """At unmount: the child gives published streams up to `timeout_s`, then exits."""
        with self.lock:
            self.closing = True
            self._put({"op": "close", "timeout_s": timeout_s})
        self.outbox.put(None)
        self.sender.join(timeout_s)
        try:
            self.proc.wait(timeout_s + 15)
        except subprocess.TimeoutExpired:
            log.warning("stream sender %d did not exit; killing it", self.proc.pid)
            self.proc.kill()
            self.proc.wait()
        self.reader.join(5)
        self.restreamer.shutdown(wait=False)
        with self.lock:
            self.sock.close()
            for live in self.live.values():
                os.close(live.fd)
            self.live.clear()
            self.numbers.clear()


__all__ = ["StreamProcess"]

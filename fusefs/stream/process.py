"""Write-time streaming from a child process (`[stream] sender = "process"`, the default;
docs/cross_dc.md "The sender process"): the sink that forwards the hooks' commands to the sender
child (`fusefs.stream.sender`), which runs the sends.

Why a process: the sends are Python too (reads, CRCs, Arrow batches, gRPC's callbacks). As
threads of the mount they hold its Python lock, and the FUSE loop that serves the job's writes
waits for it; a thread's CPU niceness does not help a thread that holds the lock. As a process
at `sender_nice` they only take CPU the job's writes and uploads leave.

- Each command records what the child must know again should it die in `live` (one `_Live` per
  streamed inode) and queues a message (`fusefs.stream.wire`); one thread sends them in order
  (the trio loop never waits on the socket), a staging file's descriptor beside a `start`.
  Another thread reads the child's counters and the streams it is done with.
- If the child dies, it is started again and every live stream announced anew from `live` (a
  fresh stream at the tiers: the dead child's unpublished ones expire there). Messages queued
  before that are dropped: `live` already holds what they said. More than `RESTARTS` deaths in
  `RESTART_WINDOW_S` turn streaming off for this mount (`alive` says no, and so does the hooks'
  `wants`: the journal then tells the eval side to copy after close).
"""
from __future__ import annotations

import base64
import json
import logging
import os
import queue
import subprocess
import threading
import time
from dataclasses import dataclass

from hintfs.common.procs import DAEMON_CWD, isolated_command
from fusefs.stream.hooks import Counters, Finished, Version
from fusefs.stream.wire import WIRE_VERSION, next_message, send, socketpair
from mountconfig.schema import StreamConfig

log = logging.getLogger("hintfs.stream")

SENDER = "fusefs.stream.sender"     # the child's module: `python -I -m fusefs.stream.sender FD`, in /
RESTARTS = 5              # deaths of the child within RESTART_WINDOW_S before streaming stops
RESTART_WINDOW_S = 60.0


@dataclass
class _Live:
    """One streamed inode, as the child was told about it: enough to tell a new child again."""
    seq: int              # the hooks' start of it: a `finished` of an older one does not end this one
    path: str
    fd: int               # our own dup of the staging file (a new child starts from it)
    dropped: bool = False
    version: Version | None = None     # its publish for good

    @property
    def final(self) -> bool:
        """Published for good, or dropped: no more writes will come."""
        return self.version is not None or self.dropped


class ProcessSink:
    """`fusefs.stream.hooks.Sink` whose sends run in a child process."""

    def __init__(self, sc: StreamConfig, token: str | None, tls_root: bytes | None, stats: Counters,
                 on_finished: Finished | None = None, log_level: str = "INFO", log_file: str | None = None):
        self.stats = stats
        self.on_finished = on_finished
        self._setup = json.dumps({"stream": sc.model_dump(mode="json"), "token": token,
                                  "tls_root": base64.b64encode(tls_root).decode() if tls_root else None,
                                  "log_level": log_level, "log_file": log_file,
                                  "wire": WIRE_VERSION}).encode()   # (docs/versions.md)
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.live: dict[int, _Live] = {}      # inode -> stream
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()   # (child generation, doc, fd) or None
        self.gen = 0                          # children started so far, minus one
        self.failed = False                   # streaming given up (the child kept dying)
        self.closing = False
        self.deaths: list[float] = []
        self.proc, self.sock = self._spawn()
        self.sender = threading.Thread(target=self._send_loop, name="hintfs-stream-out", daemon=True)
        self.reader = threading.Thread(target=self._read_loop, name="hintfs-stream-in", daemon=True)
        self.sender.start()
        self.reader.start()

    def _spawn(self):
        mine, theirs = socketpair()
        try:
            proc = subprocess.Popen(isolated_command(SENDER, [str(theirs.fileno())]), cwd=DAEMON_CWD,
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

    # -- commands (trio loop: record, queue, return) ------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self.failed

    def _put(self, doc: dict, fd: int | None = None) -> None:
        """(under `lock`)"""
        if self.failed:
            if fd is not None:
                os.close(fd)
            return
        self.outbox.put((self.gen, doc, fd))

    def _start(self, key: int, live: _Live) -> None:
        """(under `lock`) Tell the child about this stream; what it was told before is past."""
        self._put({"op": "start", "n": key, "seq": live.seq, "path": live.path}, os.dup(live.fd))

    def _publish(self, key: int, live: _Live) -> None:
        """(under `lock`)"""
        assert live.version is not None
        size, mtime_ns, record = live.version
        self._put({"op": "publish", "n": key, "path": live.path, "size": size, "mtime_ns": mtime_ns,
                   "record": record})

    def start(self, key: int, seq: int, path: str, fd: int) -> None:
        with self.lock:
            if self.failed:
                return
            old = self.live.get(key)
            if old is not None:             # truncated or staged anew: a new generation of it
                os.close(old.fd)
            live = self.live[key] = _Live(seq, path, os.dup(fd))
            self._start(key, live)

    def moved(self, key: int, path: str) -> None:
        with self.lock:
            live = self.live.get(key)
            if live is None:
                return
            live.path = path
            self._put({"op": "moved", "n": key, "path": path})

    def publish(self, key: int, path: str, version: Version) -> None:
        with self.lock:
            live = self.live.get(key)
            if live is None:
                return
            live.path, live.version = path, version
            self._publish(key, live)

    def drop(self, key: int) -> None:
        with self.lock:
            live = self.live.get(key)
            if live is None:
                return
            live.dropped = True
            self._put({"op": "drop", "n": key})

    def add_published(self, path: str, fd: int, version: Version) -> None:
        size, mtime_ns, record = version
        with self.lock:
            self._put({"op": "restream", "path": path, "size": size, "mtime_ns": mtime_ns, "record": record},
                      os.dup(fd))

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
                elif doc["op"] == "refused":     # a child of another wire version: no restarts
                    log.error("stream sender refused this mount: %s", str(doc.get("why"))[:400])
                    self.stats.add("stream_sender_refused")
                    self._give_up()
                    return
            except (KeyError, TypeError, ValueError) as err:
                log.error("stream sender: message %s refused: %s", doc.get("op"), err)

    def _finished(self, key: int, seq: int) -> None:
        with self.lock:
            live = self.live.get(key)
            if live is None or live.seq != seq:
                return                  # started again since: the child has a new stream of it
            del self.live[key]
            os.close(live.fd)
        self._forgotten([(key, seq)])

    def _forgotten(self, streams: list[tuple[int, int]]) -> None:
        """(not under `lock`) Tell the hooks: these streams are gone."""
        if self.on_finished is not None:
            for key, seq in streams:
                self.on_finished(key, seq)

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
        gone = []
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
                    del self.live[key]
                    os.close(live.fd)
                    gone.append((key, live.seq))
                    continue
                self._start(key, live)
                if live.version is not None:
                    self._publish(key, live)
        self._forgotten(gone)
        with self.send_lock:
            old_sock.close()
        return True

    def _give_up(self) -> None:
        """Streaming off for this mount: `alive` says no from now on (the journal then tells the
        eval side to copy after close); the live streams are given up."""
        with self.lock:
            self.failed = True
            self._drain()
            self.stats.add("streams_given_up", len(self.live))
            gone = [(key, live.seq) for key, live in self.live.items()]
            for live in self.live.values():
                os.close(live.fd)
            self.live.clear()
        self._forgotten(gone)

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
        with self.lock:
            self.sock.close()
            for live in self.live.values():
                os.close(live.fd)
            self.live.clear()


__all__ = ["ProcessSink", "SENDER", "RESTARTS", "RESTART_WINDOW_S"]

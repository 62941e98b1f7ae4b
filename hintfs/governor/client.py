"""Blocking client of the governor socket, shared by the training and inference clients.

No torch here. One connection per client: the daemon treats its closing as the client's death.
The client's control words are a block of its own (a memfd the daemon passes with the register
reply); `slot` reads and writes them at safe points without a system call.

A restart of the daemon (or its death) closes the connection. A watcher thread notices at once
(poll for the hang-up; it costs nothing meanwhile), connects again and registers again with what
the client holds (a trainer its last quota, an inference client its reservations); the slot then
points at the new block. A request that finds the connection broken does the same first. When the
governor does not come back within `reconnect_timeout_s`, or refuses the client, every request
raises GovernorError (never a raw OSError).
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import threading
import time
from pathlib import Path

from hintfs.governor.messages import MAX_FDS_PER_MESSAGE, PROTOCOL, LineBuffer, daemon_refusal, encode
from hintfs.governor.protocol import W_QUOTA, ControlBlock, SlotReader

log = logging.getLogger("hintfs.governor.client")

FDS_PER_RECV = 253
POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)


class GovernorError(RuntimeError):
    pass


class _Broken(Exception):
    """The connection ended (EOF, reset)."""


class _Refused(GovernorError):
    """The daemon answered a registration, and refused it."""


class GovernorClient:
    def __init__(self, socket_path: str | Path, role: str, gpu: int = 0, name: str = "",
                 want_bytes: int | None = None, accept_pages: bool = False,
                 reconnect_timeout_s: float = 10.0, watch: bool = True) -> None:
        self.socket_path = str(socket_path)
        self.role, self.gpu, self.name = role, gpu, name
        self.want_bytes, self.accept_pages = want_bytes, accept_pages
        self.reconnect_timeout_s = reconnect_timeout_s
        self._lock = threading.RLock()        # one request in flight per connection
        self._send_lock = threading.Lock()    # notifications (ack, pages, busy) never wait on a reply
        self._sock: socket.socket | None = None
        self._lines = LineBuffer(max_line=1 << 24)
        self._pending: list[bytes] = []
        self._fds: list[int] = []
        self._old_blocks: list[ControlBlock] = []
        self._closed = False
        self.broken: str | None = None        # why requests fail for good
        self.restarts = 0                     # times registered again with a new instance
        self.held: dict[str, int] = {}        # inference: reservations by kind, as granted
        self.block: ControlBlock = None       # type: ignore[assignment]
        self.slot = SlotReader(None)          # type: ignore[arg-type]
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            with self._lock:
                self._register(resume=None)
        except BaseException:
            self._close_sock()
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        self.initial_quota: int = self.quota_granted
        self._watcher = None
        if watch:
            self._watcher = threading.Thread(target=self._watch, daemon=True,
                                             name=f"governor-watch-{self.client_id}")
            self._watcher.start()

    # --- connection -------------------------------------------------------------------------
    def _register(self, resume: dict | None) -> None:
        """Connect and register (again, with `resume`); the lock is held. GovernorError if not."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.socket_path)
        except OSError as e:
            sock.close()
            raise GovernorError(f"cannot reach governor at {self.socket_path}: {e.strerror or e}") from None
        self._close_sock()
        self._sock = sock
        self._lines = LineBuffer(max_line=1 << 24)
        self._pending = []
        msg = {"op": "register", "role": self.role, "gpu": self.gpu, "pid": os.getpid(), "name": self.name}
        if self.want_bytes is not None:
            msg["want_bytes"] = int(self.want_bytes)
        if self.accept_pages:
            msg["accept_pages"] = True
        if resume is not None:
            msg["resume"] = resume
        if PROTOCOL != 1:                    # (version 1 unsaid: a daemon from before versions refuses the key)
            msg["protocol"] = PROTOCOL
        try:
            reply = self._exchange(msg)
        except (OSError, _Broken, ValueError) as e:
            raise GovernorError(f"governor at {self.socket_path}: {e}") from None
        fds = reply.get("fds") or []
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise _Refused(reply.get("error", "register refused"))
        why = daemon_refusal(reply.get("protocol", 1))
        if why:                              # a governor of another version (docs/versions.md)
            for fd in fds:
                os.close(fd)
            self._close_sock()
            raise _Refused(f"governor at {self.socket_path}: {why}")
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise GovernorError("register: the governor sent no control block")
        try:
            block = ControlBlock.from_fd(fds[0])
        except (OSError, ValueError) as e:
            raise GovernorError(f"register: bad control block: {e}") from None
        finally:
            os.close(fds[0])
        if self.block is not None:
            self._old_blocks.append(self.block)    # kept mapped: another thread may read it now
        self.block = block
        self.slot.slot = block.slot(0)             # the same SlotReader the trainer holds
        self.client_id: int = reply["client"]
        self.slot_index: int = 0
        self.instance: str = reply.get("instance", "")
        self.usable_bytes: int = reply["usable_bytes"]
        self.quota_granted: int = reply["quota"]
        self.keepalive: dict = reply["keepalive"]
        self.held = {k: int(v) for k, v in (reply.get("held") or {}).items()}

    def _resume(self) -> dict:
        r: dict = {"client": self.client_id}
        if self.role == "training":
            r["quota"] = int(self.block.slots[0][W_QUOTA])    # the last quota the daemon committed
        elif self.role == "inference":
            r["held"] = {k: v for k, v in self.held.items() if v}
        return r

    def _reconnect(self, why: str) -> None:
        """Register again (the lock is held): the daemon restarted. GovernorError for good if it
        does not come back within reconnect_timeout_s or refuses."""
        if self._closed:
            raise GovernorError("client closed")
        if self.broken:
            raise GovernorError(self.broken)
        resume = self._resume()
        self._close_sock()
        end = time.monotonic() + self.reconnect_timeout_s
        last = why
        while True:
            try:
                self._register(resume)
                self.restarts += 1
                log.info("governor client %r registered again with instance %s (client %d)",
                         self.name, self.instance, self.client_id)
                return
            except _Refused as e:
                last = str(e)
                break                  # the daemon answered, and refused: no use in retrying
            except GovernorError as e:
                last = str(e)
            if time.monotonic() >= end or self._closed:
                break
            time.sleep(0.05)
        self.broken = f"governor at {self.socket_path} lost this client: {last}"
        self._close_sock()
        raise GovernorError(self.broken)

    def _watch(self) -> None:
        """Wait for the daemon to hang up (poll, no reading), then register again."""
        while not self._closed:
            sock = self._sock
            if sock is None or self.broken:
                return
            p = select.poll()
            try:
                p.register(sock.fileno(), POLLRDHUP)
            except (ValueError, OSError):
                return
            p.register(self._wake_r, select.POLLIN)
            events = p.poll()
            if self._closed:
                return
            if any(fd == self._wake_r for fd, _ in events):
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
                continue
            with self._lock:
                if self._closed or self._sock is not sock:
                    continue                 # a request reconnected meanwhile
                if self._dropped_note(sock):
                    return                   # the daemon dropped this client: no coming back
                try:
                    self._reconnect("governor closed the connection")
                except GovernorError:
                    return

    def _dropped_note(self, sock: socket.socket) -> bool:
        """Read what the daemon sent before it hung up: a line saying it dropped this client
        (a message it refused) makes the client broken for good."""
        try:
            while True:
                data, fds, _, _ = socket.recv_fds(sock, 1 << 16, FDS_PER_RECV, socket.MSG_DONTWAIT)
                for fd in fds:
                    os.close(fd)
                if not data:
                    break
                for line in self._lines.feed(data):
                    if line and b'"dropped"' in line:
                        reply = json.loads(line)
                        if reply.get("dropped"):
                            self.broken = f"dropped by the governor: {reply.get('error')}"
        except (OSError, ValueError):
            pass
        return self.broken is not None

    def _close_sock(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
            try:
                os.write(self._wake_w, b"x")   # the watcher polls the new socket
            except (BlockingIOError, OSError):
                pass
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    # --- requests ---------------------------------------------------------------------------
    def _exchange(self, msg: dict) -> dict:
        """Send one request, read its reply line and the fds it announces (the lock is held)."""
        sock = self._sock
        if sock is None:
            raise _Broken("not connected")
        with self._send_lock:
            sock.sendall(encode(msg))
        while not self._pending:
            self._recv(sock)
        reply: dict = json.loads(self._pending.pop(0))
        if reply.get("dropped"):
            self.broken = f"dropped by the governor: {reply.get('error')}"
        n = int(reply.pop("nfds", 0) or 0)
        while len(self._fds) < n:
            self._recv(sock)
        if n:
            reply["fds"], self._fds = self._fds[:n], self._fds[n:]
        for fd in self._fds:          # fds nobody announced: not ours to keep
            os.close(fd)
        self._fds = []
        return reply

    def _recv(self, sock: socket.socket) -> None:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, FDS_PER_RECV)
        self._fds.extend(fds)
        if not data:
            raise _Broken("governor closed the connection")
        self._pending.extend(line for line in self._lines.feed(data) if line)

    def request(self, msg: dict) -> dict:
        if msg.get("op") in ("reserve", "release") and int(msg.get("bytes", 0)) > self.usable_bytes:
            # never sent: a byte count beyond the card is a message the daemon drops its sender for
            raise GovernorError(f"{msg['op']}: {msg['bytes']} bytes exceed the card's "
                                f"{self.usable_bytes} usable (inference's limit)")
        with self._lock:
            if self.broken:
                raise GovernorError(self.broken)
            if self._closed:
                raise GovernorError("client closed")
            try:
                reply = self._exchange(msg)
            except (OSError, _Broken, ValueError) as e:
                self._reconnect(str(e))              # GovernorError if it cannot
                try:
                    reply = self._exchange(msg)
                except (OSError, _Broken, ValueError) as e2:
                    raise GovernorError(f"governor at {self.socket_path}: {e2}") from None
            if reply.get("ok") and msg.get("op") == "reserve":
                self.held[msg.get("kind", "workspace")] = self.held.get(msg.get("kind", "workspace"), 0) + int(msg["bytes"])
            elif reply.get("ok") and msg.get("op") == "release":
                k = msg.get("kind", "workspace")
                self.held[k] = max(0, self.held.get(k, 0) - int(reply.get("released", 0)))
        if not reply.get("ok"):
            for fd in reply.get("fds") or []:
                os.close(fd)
            raise GovernorError(reply.get("error", "request failed"))
        return reply

    def _notify(self, msg: dict, fds: list[int] | None = None) -> bool:
        """A notification (no reply): False if the connection is broken (the watcher registers
        again; a notification meant for the old instance means nothing to the new one)."""
        sock = self._sock
        if sock is None:
            return False
        try:
            with self._send_lock:
                if fds:
                    socket.send_fds(sock, [encode(msg)], fds)
                else:
                    sock.sendall(encode(msg))
            return True
        except OSError:
            return False

    def give_pages(self, fds: list[int], page_bytes: int, seq: int) -> None:
        """Send pages released for command `seq` to the daemon (before writing the ACK word),
        at most MAX_FDS_PER_MESSAGE per message; the caller still closes its own copies."""
        for i in range(0, len(fds), MAX_FDS_PER_MESSAGE):
            part = fds[i:i + MAX_FDS_PER_MESSAGE]
            if not self._notify({"op": "pages", "seq": int(seq), "n": len(part), "total": len(fds),
                                 "page_bytes": int(page_bytes)}, part):
                return

    def notify_ack(self, seq: int) -> None:
        """Wake the daemon after the ACK word was written (no reply)."""
        self._notify({"op": "ack", "seq": int(seq)})

    def set_busy(self, busy: bool) -> None:
        """Inference: a request runs (training yields compute at its safe points meanwhile)."""
        self.slot.set_busy(busy)
        self._notify({"op": "busy", "on": bool(busy)})

    def inference_busy(self) -> bool:
        """An inference client of this GPU runs a request (the daemon's count, in our block)."""
        return self.block.inference_busy()

    def report_usage(self, kinds: dict[str, int], drain_ms: float | None = None) -> None:
        """Memory held by kind; a trainer adds `drain_ms`, how long its stop can take (its
        bounded drain), which the daemon's reclaim estimate (and so the headroom) never goes under."""
        cap = self.usable_bytes    # the daemon counts at most the card; beyond 2^50 it refuses
        msg: dict = {"op": "usage", "kinds": {k: min(max(0, int(v)), cap) for k, v in kinds.items()}}
        if drain_ms is not None:
            d = float(drain_ms)
            msg["drain_ms"] = min(d, 1e6) if d >= 0 else 0.0     # (NaN: 0)
        self.request(msg)

    def stats(self) -> dict:
        return self.request({"op": "stats"})

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._close_sock()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(5)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1
        if self.block is not None:
            self.slot.slot = None  # type: ignore[assignment]
            for b in self._old_blocks + [self.block]:
                b.close()
            self._old_blocks = []
            self.block = None  # type: ignore[assignment]

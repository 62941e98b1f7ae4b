"""Blocking client of the governor socket, shared by the training and inference clients.

No torch here. One connection per client: the daemon treats its closing as the client's death.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

from governor.protocol import MAX_FDS_PER_MESSAGE, ControlBlock, LineBuffer, SlotReader, encode


class GovernorError(RuntimeError):
    pass


class GovernorClient:
    def __init__(self, socket_path: str | Path, role: str, gpu: int = 0, name: str = "",
                 want_bytes: int | None = None, accept_pages: bool = False) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(str(socket_path))
        except OSError as e:
            self._sock.close()
            raise GovernorError(f"cannot reach governor at {socket_path}: {e.strerror or e}") from None
        self._lines = LineBuffer()
        self._pending: list[bytes] = []
        self._fds: list[int] = []     # received with SCM_RIGHTS, claimed by the reply that names them
        self._lock = threading.Lock()  # one request in flight per connection
        msg = {"op": "register", "role": role, "gpu": gpu, "pid": os.getpid(), "name": name}
        if want_bytes is not None:
            msg["want_bytes"] = int(want_bytes)
        if accept_pages:
            msg["accept_pages"] = True
        reply = self.request(msg)
        self.client_id: int = reply["client"]
        self.slot_index: int = reply["slot"]
        self.usable_bytes: int = reply["usable_bytes"]
        self.initial_quota: int = reply["quota"]
        self.keepalive: dict = reply["keepalive"]
        self.block = ControlBlock(Path(reply["shm"]))
        self.slot = SlotReader(self.block.slot(self.slot_index))

    def request(self, msg: dict) -> dict:
        with self._lock:
            self._sock.sendall(encode(msg))
            while not self._pending:
                data, fds, _, _ = socket.recv_fds(self._sock, 65536, MAX_FDS_PER_MESSAGE)
                self._fds.extend(fds)
                if not data:
                    raise GovernorError("governor closed the connection")
                self._pending.extend(self._lines.feed(data))
            raw = self._pending.pop(0)
            reply = json.loads(raw)
            if reply.get("pages"):   # lent pages: their fds came with this line
                n = int(reply["pages"])
                reply["fds"], self._fds = self._fds[:n], self._fds[n:]
        if not reply.get("ok"):
            raise GovernorError(reply.get("error", "request failed"))
        return reply

    def give_pages(self, fds: list[int], page_bytes: int, seq: int) -> None:
        """Send pages released for command `seq` to the daemon (before writing the ACK word);
        the caller still closes its own copies of the fds."""
        with self._lock:
            for i in range(0, len(fds), MAX_FDS_PER_MESSAGE):
                part = fds[i:i + MAX_FDS_PER_MESSAGE]
                msg = encode({"op": "pages", "seq": int(seq), "n": len(part), "page_bytes": int(page_bytes)})
                socket.send_fds(self._sock, [msg], part)

    def notify_ack(self, seq: int) -> None:
        """Wake the daemon after the ACK word was written (no reply)."""
        with self._lock:
            self._sock.sendall(encode({"op": "ack", "seq": seq}))

    def report_usage(self, kinds: dict[str, int], drain_ms: float | None = None) -> None:
        """Memory held by kind; a trainer adds `drain_ms`, how long its stop can take (its
        bounded drain), which the daemon's reclaim estimate (and so the headroom) never goes under."""
        msg = {"op": "usage", "kinds": {k: int(v) for k, v in kinds.items()}}
        if drain_ms is not None:
            msg["drain_ms"] = float(drain_ms)
        self.request(msg)

    def stats(self) -> dict:
        return self.request({"op": "stats"})

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        try:
            self._sock.close()
        finally:
            if self.block is not None:
                self.slot = None  # type: ignore[assignment]
                self.block.close()
                self.block = None  # type: ignore[assignment]

"""Blocking client of the governor socket, shared by the training and inference clients.

No torch here. One connection per client: the daemon treats its closing as the client's death.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

from governor.protocol import ControlBlock, LineBuffer, SlotReader, encode


class GovernorError(RuntimeError):
    pass


class GovernorClient:
    def __init__(self, socket_path: str | Path, role: str, gpu: int = 0, name: str = "",
                 want_bytes: int | None = None) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(str(socket_path))
        except OSError as e:
            self._sock.close()
            raise GovernorError(f"cannot reach governor at {socket_path}: {e.strerror or e}") from None
        self._lines = LineBuffer()
        self._pending: list[bytes] = []
        self._lock = threading.Lock()  # one request in flight per connection
        msg = {"op": "register", "role": role, "gpu": gpu, "pid": os.getpid(), "name": name}
        if want_bytes is not None:
            msg["want_bytes"] = int(want_bytes)
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
                data = self._sock.recv(65536)
                if not data:
                    raise GovernorError("governor closed the connection")
                self._pending.extend(self._lines.feed(data))
            raw = self._pending.pop(0)
        reply = json.loads(raw)
        if not reply.get("ok"):
            raise GovernorError(reply.get("error", "request failed"))
        return reply

    def notify_ack(self, seq: int) -> None:
        """Wake the daemon after the ACK word was written (no reply)."""
        with self._lock:
            self._sock.sendall(encode({"op": "ack", "seq": seq}))

    def report_usage(self, kinds: dict[str, int]) -> None:
        self.request({"op": "usage", "kinds": {k: int(v) for k, v in kinds.items()}})

    def stats(self) -> dict:
        return self.request({"op": "stats"})

    def close(self) -> None:
        try:
            self._sock.close()
        finally:
            if self.block is not None:
                self.slot = None  # type: ignore[assignment]
                self.block.close()
                self.block = None  # type: ignore[assignment]

"""Loopback ports: a free one for a daemon to listen on, and waiting until one listens."""
from __future__ import annotations

import socket
import time


def free_port() -> int:
    """A loopback TCP port nobody listens on now (bound, then closed): for a daemon about to be
    started on it, or as an address where nothing answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20.0) -> None:
    """Return once something accepts connections on 127.0.0.1:`port`; TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"port {port} did not open")

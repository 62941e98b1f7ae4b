"""systemd's readiness protocol (Type=notify), for every hintfs daemon."""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("hintfs")


def sd_notify(message: str) -> None:
    """Tell systemd (Type=notify) about our state; a no-op outside systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(message.encode())
    except OSError as err:
        log.warning("sd_notify failed: %s", err)

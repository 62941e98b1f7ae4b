"""The messages between the mount and its stream sender child (`fusefs.stream.process` and
`fusefs.stream.sender`): one JSON document per SOCK_SEQPACKET message (the kernel keeps their
boundaries and their order), with at most one file descriptor beside it (a staging file, or a
renamed file's copy).

mount -> child: `start` (n, seq, path; the staging fd), `moved` (n, path), `publish` (n, path,
size, mtime_ns, record), `drop` (n), `restream` (path, size, mtime_ns, record; the copy's fd),
`close` (timeout_s). child -> mount: `stat` (name, n), `finished` (n, seq), `closed`. `n` is the
inode number, `seq` the hooks' start of it (`fusefs.stream.hooks`).

Both ends are processes of the mount's own user, started by the mount; a message that does not
parse, is too long or carries more than one descriptor is still refused here, in one place.

Versions (docs/versions.md): the mount's setup document carries its wire version (`"wire"`; none:
version 1, a mount from before versions). A child restarted after the package was upgraded under
a running mount may speak another: it checks once, at its start (`mount_refusal`), and a child
that does not speak the mount's version sends `refused` (why, its own version) and exits; the
mount logs that one line and turns streaming off (no restarts: each would be refused the same).
Once accepted, the messages carry no version: the pair's is fixed for its life.
"""
from __future__ import annotations

import json
import logging
import os
import socket

from hintfs.common.formatversion import placed

log = logging.getLogger("hintfs.stream")

MAX_MESSAGE = 64 << 10      # a path is at most 4 KiB: every message fits many times over
WIRE_VERSION = 1            # the version of these messages this code speaks
WIRE_READS = (1, 1)         # the mount versions a child of this code serves


def mount_refusal(setup: dict) -> str | None:
    """(the child) Why it cannot serve the mount whose setup this is; None when it can."""
    version = setup.get("wire", 1)
    where = placed(version, WIRE_READS)
    if where is None:
        return None
    lo, hi = WIRE_READS
    side = ("the mount runs a newer hintfs than the one installed: reinstall it" if where == "newer"
            else "restart the mount to run the installed hintfs")
    return (f"the stream sender speaks stream wire version {WIRE_VERSION} (serves {lo}..{hi}), the mount "
            f"{version!r}: {side}; streaming is off for this mount meanwhile")


class WireError(OSError):
    pass


def socketpair() -> tuple[socket.socket, socket.socket]:
    """(the mount's end, the child's end); neither is inherited by other children."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send(sock: socket.socket, doc: dict, fd: int | None = None) -> None:
    data = json.dumps(doc, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise WireError(7, f"stream sender message of {len(data)} bytes (at most {MAX_MESSAGE})")   # E2BIG
    socket.send_fds(sock, [data], [fd] if fd is not None else [])


def receive(sock: socket.socket) -> tuple[dict, int | None] | None:
    """The next message and its descriptor (the caller owns it), or None: the other end is gone."""
    data, fds, flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 1)
    if not data and not fds:
        return None
    fd = fds[0] if fds else None
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise WireError(5, "stream sender message truncated")   # EIO
        doc = json.loads(data)
        if not isinstance(doc, dict) or not isinstance(doc.get("op"), str):
            raise WireError(5, "stream sender message without an op")
    except (ValueError, WireError):
        if fd is not None:
            os.close(fd)
        raise WireError(5, "stream sender message does not parse") from None
    return doc, fd


def next_message(sock: socket.socket) -> tuple[dict, int | None] | None:
    """The next message that parses (a refused one is logged and skipped), or None: the other
    end is gone or the socket failed."""
    while True:
        try:
            return receive(sock)
        except WireError as err:
            log.error("%s", err)
        except OSError:
            return None


__all__ = ["MAX_MESSAGE", "WIRE_VERSION", "WIRE_READS", "mount_refusal", "WireError", "socketpair", "send", "receive", "next_message"]

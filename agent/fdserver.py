"""Replica file descriptors for mounts on the same host (`[agent] local_socket`).

An eval host's tier agent keeps verified replicas in its own files; an eval mount on that host
serves them fastest by FUSE passthrough, where the kernel reads the file itself. The mount
cannot open the agent's private files (a 0700 folder), and Flight cannot carry a descriptor, so
the agent answers on a unix socket with the descriptor itself (SCM_RIGHTS): one request, one
read-only fd of a complete, unexpired replica of exactly the version asked for, or a refusal.

Who may ask: the socket file is 0600 and owned by the agent's user, and each connection's peer
credentials (SO_PEERCRED) must be that user or root. The request is bounded (one datagram of at
most 8 KiB, a path by the one path rule, two numbers) and parsed like any RPC (`agent.rpc`).
The fd is opened O_RDONLY by the agent, so the receiver can read the replica, never change it.

A request with `partial` (an eval mount reading a file the tier is still receiving) is answered
with the complete replica's fd (`"whole": true`) when there is one, else with the fd of the part
of a published stream of that version still filling and the runs of it verified so far
(`"ranges"`, at most `MAX_RUNS`): the mount reads those itself instead of through a Flight call
each (`agent.streams.StreamTier.verified_view` says why they cannot change under it).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat as stat_mod
import struct
import threading
from typing import Callable, Optional

from agent import rpc

log = logging.getLogger("hintfs.agent")

MAX_REQUEST = 8192
MAX_ANSWER = 65536
MAX_RUNS = 2048       # verified runs in one answer (the first ones; the mount asks again later)
_TIMEOUT_S = 2.0


class ReplicaFdServer:
    def __init__(self, path: str, lookup: Callable[[str, int, int], int],
                 partial: Optional[Callable[[str, tuple[int, int]], tuple[int, list[tuple[int, int]]]]] = None):
        self.path = path
        self.lookup = lookup            # AgentServer.local_replica_fd: a new fd, or -1
        self.partial = partial          # StreamTier.verified_view: (a new fd, runs), or (-1, [])
        self._stop = threading.Event()
        folder = os.path.dirname(os.path.abspath(path)) or "."
        os.makedirs(folder, mode=0o700, exist_ok=True)
        try:
            st = os.lstat(path)
            if not stat_mod.S_ISSOCK(st.st_mode):
                raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
            os.unlink(path)               # a socket left by an agent that died
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)             # created 0600: no window where others may connect
        try:
            self.sock.bind(path)
        finally:
            os.umask(old)
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.thread = threading.Thread(target=self._serve, name="hintfs-agent-fds", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, TimeoutError):
                continue
            except OSError:
                if self._stop.is_set():
                    return
                raise
            with conn:
                try:
                    self._answer(conn)
                except OSError as err:
                    log.debug("replica fd request failed: %s", err)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(_TIMEOUT_S)
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid not in (0, os.geteuid()):
            conn.send(json.dumps({"errno": errno.EACCES}).encode())
            return
        body = conn.recv(MAX_REQUEST)
        try:
            req = rpc.parse_local_fd(body)
        except Exception as err:          # a FlightServerError with the reason
            conn.send(json.dumps({"errno": errno.EINVAL, "message": str(err)[:200]}).encode())
            return
        answer: dict = {"ok": True, "whole": True}
        fd = self.lookup(req.path, req.size, req.mtime_ns)
        if fd < 0 and req.partial and self.partial is not None:
            fd, runs = self.partial(req.path, (req.size, req.mtime_ns))
            answer = {"ok": True, "ranges": [list(r) for r in runs[:MAX_RUNS]]}
        if fd < 0:
            conn.send(json.dumps({"errno": errno.ENOENT}).encode())
            return
        try:
            socket.send_fds(conn, [json.dumps(answer).encode()], [fd])
        finally:
            os.close(fd)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(2)
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def receive_replica_fd(socket_path: str, path: str, size: int, mtime_ns: int) -> int:
    """The mount's side: an fd of the agent's replica of exactly this version, or -1 (none, or
    the agent does not answer). Blocking (a few syscalls): call it from a worker thread."""
    fd, _doc = _ask(socket_path, {"path": path, "size": size, "mtime_ns": mtime_ns})
    return fd


def receive_tier_bytes(socket_path: str, path: str, size: int,
                       mtime_ns: int) -> tuple[int, Optional[list[tuple[int, int]]]]:
    """The mount's side for a file the tier is still receiving: (fd, None) of the complete
    replica of exactly this version, (fd, runs verified so far) of its stream still filling, or
    (-1, None). Blocking: call it from a worker thread."""
    fd, doc = _ask(socket_path, {"path": path, "size": size, "mtime_ns": mtime_ns, "partial": True})
    if fd < 0 or doc.get("whole"):
        return fd, None
    try:
        runs = [(int(o), int(n)) for o, n in doc.get("ranges", [])[:MAX_RUNS]]
    except (TypeError, ValueError):
        os.close(fd)
        return -1, None
    if any(o < 0 or n <= 0 or o + n > size for o, n in runs):
        os.close(fd)                      # not this version's: never read
        return -1, None
    return fd, runs


def _ask(socket_path: str, doc: dict) -> tuple[int, dict]:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
            s.settimeout(_TIMEOUT_S)
            s.connect(socket_path)
            s.send(json.dumps(doc).encode())
            msg, fds, _flags, _addr = socket.recv_fds(s, MAX_ANSWER, 1)
    except OSError as err:
        log.debug("no replica fd from %s for %s: %s", socket_path, doc.get("path"), err)
        return -1, {}
    try:
        answer = json.loads(msg or b"{}")
    except ValueError:
        answer = {}
    if not isinstance(answer, dict) or not answer.get("ok") or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        return -1, {}
    return fds[0], answer


__all__ = ["ReplicaFdServer", "receive_replica_fd", "receive_tier_bytes"]

"""Replica file descriptors for mounts on the same host (`[agent] local_socket`).

An eval host's tier agent keeps verified replicas in its own files; an eval mount on that host
serves them fastest by FUSE passthrough, where the kernel reads the file itself. The mount
cannot open the agent's private files (a 0700 folder), and Flight cannot carry a descriptor, so
the agent answers on a unix socket with the descriptor itself (SCM_RIGHTS): one request, one
read-only fd of a complete, unexpired replica of exactly the version asked for, or a refusal.

Who may ask: the socket file is 0600 and owned by the agent's user, and each connection's peer
credentials (SO_PEERCRED) must be that user or root. The request is bounded (one datagram of at
most 8 KiB, a path by the one path rule, two numbers) and parsed like any RPC (`hintfs.agent.rpc`).
The fd is opened O_RDONLY by the agent, so the receiver can read the replica, never change it.

The mount's side (`receive_replica_fd`, `receive_tier_bytes`) trusts the socket no more than the
agent trusts its peers (issue 34, finding 10: a socket bound by another user in a 1777 folder
handed root's eval mount an fd of that user's file, served as the tier's replica). Before it
connects, every folder from / to the socket must be owned by root or the tier agent's user
(`[[routes]] local_socket_uid`, default 0) and writable by nobody else (a sticky folder such as
/tmp aside: others may add names to it, never replace one of those owners'), and so must the
socket; after, the peer's SO_PEERCRED uid must be that user; the fd it passes must be a regular
file. Anything else: no fd (the read goes the normal way) and one log line per socket and reason
(`REFUSAL_LOG_S`).

A request with `partial` (an eval mount reading a file the tier is still receiving) is answered
with the complete replica's fd (`"whole": true`) when there is one, else with the fd of the part
of a published stream of that version still filling and the runs of it verified so far
(`"ranges"`, at most `MAX_RUNS`): the mount reads those itself instead of through a Flight call
each (`hintfs.agent.streams.StreamTier.verified_view` says why they cannot change under it).
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
from typing import NamedTuple
from collections.abc import Callable

from hintfs.agent import rpc
from hintfs.common.refusals import RefusalLog

log = logging.getLogger("hintfs.agent")

MAX_REQUEST = 8192
MAX_ANSWER = 65536
MAX_RUNS = 2048       # verified runs in one answer (the first ones; the mount asks again later)
_TIMEOUT_S = 2.0
REFUSAL_LOG_S = 600.0  # a refused socket is logged again (same reason) after this


class TierSocket(NamedTuple):
    """A route's `local_socket` and the uid its tier agent runs as (`local_socket_uid`)."""
    path: str
    uid: int = 0


_refusals = RefusalLog(REFUSAL_LOG_S, keep=1024)


def _refused(sock: TierSocket, why: str) -> None:
    """One log line per socket and reason (again after REFUSAL_LOG_S): no fd is taken from it."""
    if _refusals.note((sock.path, why)) is not None:
        log.warning("not taking replica fds from %s (the read goes to the tier or store instead): %s", sock.path, why)


def socket_problem(sock: TierSocket) -> str | None:
    """Why the socket `sock.path` may have been put there by someone other than root or the tier
    agent's user `sock.uid`: a folder from / to it (symlinks resolved) or the socket itself owned
    by another user, or a folder others may write that is not sticky. None if it is fit."""
    real = os.path.realpath(sock.path)
    trusted = {0, sock.uid}
    folders = [real]
    while folders[-1] != "/":
        folders.append(os.path.dirname(folders[-1]))
    for d in reversed(folders[1:]):
        try:
            st = os.lstat(d)
        except OSError as err:
            return f"folder {d}: {err.strerror}"
        if st.st_uid not in trusted:
            return f"folder {d} is owned by uid {st.st_uid}, not root or uid {sock.uid} (local_socket_uid)"
        if st.st_mode & 0o022 and not st.st_mode & stat_mod.S_ISVTX:
            return f"folder {d} is writable by other users (mode {stat_mod.S_IMODE(st.st_mode):o}, not sticky)"
    try:
        st = os.lstat(real)
    except OSError as err:
        return err.strerror
    if not stat_mod.S_ISSOCK(st.st_mode):
        return "not a socket"
    if st.st_uid not in trusted:
        return f"the socket is owned by uid {st.st_uid}, not root or uid {sock.uid} (local_socket_uid)"
    return None


class ReplicaFdServer:
    def __init__(self, path: str, lookup: Callable[[str, int, int], int],
                 partial: Callable[[str, tuple[int, int]], tuple[int, list[tuple[int, int]]]] | None = None):
        self.path = path
        self.lookup = lookup            # Catalog.local_fd: a new fd, or -1
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
            except TimeoutError:
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
        except Exception as err:          # a FlightServerError with the reason (EPROTONOSUPPORT: a version)
            code = rpc.errno_of_flight_error(err)
            conn.send(json.dumps({"errno": code if code == errno.EPROTONOSUPPORT else errno.EINVAL,
                                  "message": rpc.error_message(err)[:300]}).encode())
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


def receive_replica_fd(socket_path: str | TierSocket, path: str, size: int, mtime_ns: int) -> int:
    """The mount's side: an fd of the agent's replica of exactly this version, or -1 (none, the
    agent does not answer, or the socket is not the agent's: `TierSocket`; a plain path is
    expected to be root's). Blocking (a few syscalls): call it from a worker thread."""
    fd, _doc = _ask(socket_path, {"path": path, "size": size, "mtime_ns": mtime_ns})
    return fd


def receive_tier_bytes(socket_path: str | TierSocket, path: str, size: int,
                       mtime_ns: int) -> tuple[int, list[tuple[int, int]] | None]:
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


def _ask(socket_path: str | TierSocket, doc: dict) -> tuple[int, dict]:
    sock = socket_path if isinstance(socket_path, TierSocket) else TierSocket(socket_path)
    why = socket_problem(sock)
    if why:
        _refused(sock, why)
        return -1, {}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
            s.settimeout(_TIMEOUT_S)
            s.connect(sock.path)
            peer = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if peer != sock.uid:
                _refused(sock, f"its peer is uid {peer}, not uid {sock.uid} (local_socket_uid)")
                return -1, {}
            s.send(json.dumps(rpc.local_fd_request(doc)).encode())
            msg, fds, _flags, _addr = socket.recv_fds(s, MAX_ANSWER, 1)
    except OSError as err:
        log.debug("no replica fd from %s for %s: %s", sock.path, doc.get("path"), err)
        return -1, {}
    for fd in fds[1:]:
        os.close(fd)
    if fds:
        try:
            regular = stat_mod.S_ISREG(os.fstat(fds[0]).st_mode)
        except OSError:
            regular = False
        if not regular:
            os.close(fds[0])
            _refused(sock, "it passed an fd that is not a regular file")
            return -1, {}
        fds = fds[:1]
    try:
        answer = json.loads(msg or b"{}")
    except ValueError:
        answer = {}
    if isinstance(answer, dict) and answer.get("errno") == errno.EPROTONOSUPPORT:
        _refused(sock, str(answer.get("message"))[:300])   # a version mismatch: one line per socket
    if not isinstance(answer, dict) or not answer.get("ok") or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        return -1, {}
    return fds[0], answer


__all__ = ["ReplicaFdServer", "TierSocket", "receive_replica_fd", "receive_tier_bytes", "socket_problem"]

"""Issue 34, finding 10: eval mounts trusted whoever answered on a route's `local_socket`. A socket
path in a 1777 folder, bound by uid 65534 before the tier agent, handed root's eval mount an fd of
that user's file, and the mount served its bytes as the tier's replica.

Now the mount checks the socket before it connects (every folder from / to it writable only by
root or the tier agent's user, sticky folders aside; the socket owned by one of them), the peer
after (SO_PEERCRED: the route's `local_socket_uid`, default root), and the fd it receives (a
regular file); a refusal is one log line and the read goes the normal way.
"""
from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from hintfs.agent.fdserver import receive_replica_fd, receive_tier_bytes
from tests.conftest import needs_fuse, wait_for
from tests.helpers.security import NOBODY, SETPRIV, WorldDir, can_run_as_nobody
from tests.system.test_stream_mount import Tier

needs_nobody = pytest.mark.skipif(not can_run_as_nobody(), reason="needs root, setpriv and a Python uid 65534 can run")
pytestmark = pytest.mark.timeout(120)

# uid 65534's fd server: it answers every request with an fd of its own file
IMPOSTOR = textwrap.dedent("""
    import json, os, socket, sys
    path, evil = sys.argv[1], sys.argv[2]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(path)
    os.chmod(path, 0o777)
    s.listen(16)
    print("ready", flush=True)
    while True:
        c, _ = s.accept()
        with c:
            c.recv(8192)
            fd = os.open(evil, os.O_RDONLY)
            socket.send_fds(c, [json.dumps({"ok": True, "whole": True}).encode()], [fd])
            os.close(fd)
""")


class Impostor:
    """uid 65534 binds `sock` (in a folder it may write) and hands out fds of `evil`; stopped by pid."""

    def __init__(self, world: Path, sock: Path, evil: Path) -> None:
        script = world / "impostor.py"
        script.write_text(IMPOSTOR)
        script.chmod(0o644)
        self.p = subprocess.Popen([SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                   sys.executable, "-I", str(script), str(sock), str(evil)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
                                  env={"PATH": "/usr/bin:/bin"})
        assert self.p.stdout is not None and self.p.stdout.readline().strip() == "ready", self.p.stderr
        assert os.stat(sock).st_uid == NOBODY

    def close(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(10)
        for f in (self.p.stdout, self.p.stderr):
            if f is not None:
                f.close()


def _world_socket_folder(world: WorldDir) -> Path:
    shared = world.path / "run"
    shared.mkdir()
    shared.chmod(0o1777)                # like /tmp: anyone may bind a socket there
    return shared


def _evil_file(world: WorldDir, size: int) -> Path:
    evil = world.path / "evil.bin"
    evil.write_bytes(b"E" * size)
    os.chown(evil, NOBODY, NOBODY)
    evil.chmod(0o600)
    return evil


@needs_nobody
def test_an_fd_from_another_users_socket_is_refused(tmp_path, caplog):
    world = WorldDir()
    try:
        shared = _world_socket_folder(world)
        evil = _evil_file(world, 1000)
        sock = shared / "tier.sock"
        imp = Impostor(world.path, sock, evil)
        try:
            with caplog.at_level("WARNING", logger="hintfs.agent"):
                assert receive_replica_fd(str(sock), "ckpt/w.bin", 1000, 1) == -1
                assert receive_tier_bytes(str(sock), "ckpt/w.bin", 1000, 1) == (-1, None)
            assert any(f"uid {NOBODY}" in r.getMessage() for r in caplog.records), caplog.text
        finally:
            imp.close()
    finally:
        world.close()


def _root_fd_server(sock: Path, make_fd) -> threading.Thread:
    """A root fd server on `sock` that answers one request with `make_fd()` (closed after)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(str(sock))
    s.listen(4)
    s.settimeout(10)

    def serve():
        try:
            c, _ = s.accept()
        except OSError:
            return
        finally:
            s.close()
        with c:
            fd = make_fd()
            try:
                if c.recv(8192):
                    socket.send_fds(c, [b'{"ok": true, "whole": true}'], [fd])
            except OSError:
                pass
            finally:
                os.close(fd)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def test_an_fd_that_is_not_a_regular_file_is_refused(tmp_path, caplog):
    sock = tmp_path / "tier.sock"
    r, w = os.pipe()
    try:
        t = _root_fd_server(sock, lambda: os.dup(r))
        with caplog.at_level("WARNING", logger="hintfs.agent"):
            assert receive_replica_fd(str(sock), "ckpt/w.bin", 1000, 1) == -1
        t.join(10)
        assert any("not a regular file" in rec.getMessage() for rec in caplog.records), caplog.text
    finally:
        os.close(r)
        os.close(w)


def test_a_socket_in_a_folder_others_may_write_is_refused_and_root_folders_are_not(tmp_path, caplog):
    good = tmp_path / "good"
    good.mkdir()
    data = tmp_path / "replica.bin"
    data.write_bytes(b"r" * 1000)
    t = _root_fd_server(good / "tier.sock", lambda: os.open(data, os.O_RDONLY))
    fd = receive_replica_fd(str(good / "tier.sock"), "ckpt/w.bin", 1000, 1)
    t.join(10)
    assert fd >= 0
    os.close(fd)
    bad = tmp_path / "open"
    bad.mkdir()
    bad.chmod(0o777)                    # not sticky: anyone may replace the socket
    t = _root_fd_server(bad / "tier.sock", lambda: os.open(data, os.O_RDONLY))
    with caplog.at_level("WARNING", logger="hintfs.agent"):
        assert receive_replica_fd(str(bad / "tier.sock"), "ckpt/w.bin", 1000, 1) == -1
    assert any("writable" in rec.getMessage() for rec in caplog.records), caplog.text
    socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET).connect(str(bad / "tier.sock"))   # (ends the server)
    t.join(10)


@needs_fuse
@needs_nobody
def test_an_eval_mount_does_not_serve_another_users_file_handed_out_on_its_routes_socket(mount_factory, tmp_path):
    store = tmp_path / "store"
    (store / "ckpt/run/step_1").mkdir(parents=True)
    data = os.urandom(200_000)
    (store / "ckpt/run/step_1/w.distcp").write_bytes(data)
    world = WorldDir()
    tier = Tier(tmp_path, store, follow=False)       # its own fd socket is not where the route says
    imp = None
    try:
        tier.client.replicate("ckpt/run/step_1/w.distcp", 600)
        shared = _world_socket_folder(world)
        sock = shared / "tier.sock"
        imp = Impostor(world.path, sock, _evil_file(world, len(data)))
        ev = mount_factory(name="eval", store_uri=f"file://{store}",
                           extra=f'\n[mount]\npassthrough = "auto"\n[[routes]]\nprefix = "ckpt"\n'
                                 f'local_agent = "{tier.loc}"\nlocal_socket = "{sock}"\n')
        if ev.stats()["passthrough"]["state"] != "on":
            pytest.skip(f"FUSE passthrough not available here: {ev.stats()['passthrough']['state']}")
        assert (ev.mnt / "ckpt/run/step_1/w.distcp").read_bytes() == data      # not b"EEEE..."
        assert ev.stats()["counters"].get("tier_fd_opens", 0) == 0
        assert wait_for(lambda: f"uid {NOBODY}" in ev.log.read_text(), timeout=5)
        assert stat.S_ISSOCK(os.stat(sock).st_mode)
    finally:
        if imp is not None:
            imp.close()
        tier.close()
        world.close()

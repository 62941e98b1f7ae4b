"""Attack clients of the governor's socket, run as uid 65534 (`setpriv`, `python -I`): they speak
the wire protocol with the standard library only (nothing of the repository is importable), so
what reaches the daemon is exactly the bytes written here. Every process is bounded in time and
stopped by its pid."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.security import NOBODY, SETPRIV, WorldDir, can_run_as_nobody

needs_nobody = pytest.mark.skipif(not can_run_as_nobody(),
                                  reason="needs root, setpriv and a Python uid 65534 can run")

# Prepended to every attack script: a line-based client, with fds both ways.
LIB = r'''
import array, json, os, socket, sys, time

def conn(path, timeout=5.0):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s

def enc(msg):
    return (json.dumps(msg) + "\n").encode()

_bufs = {}

def recv_line(s):
    """One reply line (dict, or the raw text if it is no JSON); None at EOF. fds that come
    along are kept in FDS."""
    buf = _bufs.setdefault(s.fileno(), bytearray())
    while b"\n" not in buf:
        try:
            data, fds, _, _ = socket.recv_fds(s, 65536, 253)
        except (ConnectionResetError, socket.timeout, OSError):
            return None
        FDS.extend(fds)
        if not data:
            return None
        buf += data
    i = buf.index(b"\n")
    line = bytes(buf[:i])
    del buf[:i + 1]
    try:
        return json.loads(line)
    except ValueError:
        return line.decode("latin-1")

FDS = []

def request(s, msg):
    """Send a message; its reply, or None if the daemon closed the connection."""
    try:
        s.sendall(enc(msg) if isinstance(msg, dict) else msg)
    except OSError:
        return None
    return recv_line(s)

def closed(s, wait=3.0):
    """True when the daemon closed this connection (EOF) within `wait` seconds."""
    s.settimeout(wait)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (socket.timeout, OSError):
        return False

def register(s, role="inference", **kw):
    return request(s, {"op": "register", "role": role, "gpu": 0, "pid": os.getpid(),
                       "name": "nobody", **kw})

def out(doc):
    print(json.dumps(doc), flush=True)
'''


def nobody_script(code: str, timeout: float = 30) -> dict:
    """Run LIB + `code` as uid 65534; `code` prints one JSON document with out(), returned."""
    d = WorldDir()
    try:
        script = d.path / "attack.py"
        script.write_text(LIB + textwrap.dedent(code))
        script.chmod(0o644)
        r = subprocess.run([SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                            sys.executable, "-I", str(script)], capture_output=True, text=True,
                           timeout=timeout, cwd=str(d.path), env={"PATH": "/usr/bin:/bin"})
        assert r.returncode == 0, f"attack script failed: {r.stderr[-3000:]}"
        return json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        d.close()


class NobodyProc:
    """LIB + `code` as uid 65534 in the background: it prints JSON lines (read with `line()`)
    and keeps its connections while it runs; `stop()` ends it by pid. `repo`: the repository is
    importable (a real client of the governor, run as another user)."""

    def __init__(self, code: str, repo: bool = False) -> None:
        self.dir = WorldDir()
        script = self.dir.path / "attack.py"
        head = f"import sys\nsys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n" if repo else ""
        script.write_text(head + LIB + textwrap.dedent(code))
        script.chmod(0o644)
        self.p = subprocess.Popen([SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                   sys.executable, "-I", str(script)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=str(self.dir.path), env={"PATH": "/usr/bin:/bin"})

    @property
    def pid(self) -> int:
        return self.p.pid

    def line(self, timeout: float = 20) -> dict:
        import select
        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        assert r, "attack process printed nothing"
        text = self.p.stdout.readline()
        assert text, f"attack process ended: {self.p.stderr.read()[-3000:]}"
        return json.loads(text)

    def stop(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(10)
        for f in (self.p.stdin, self.p.stdout, self.p.stderr):
            f.close()
        self.dir.close()

"""Helpers of the attack tests (tests/system/test_security_agent.py): another user's processes, real
`hintfs agent` processes, folders every user can reach. Everything is bounded in time and stopped
by pid."""
from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from tests.helpers.ports import free_port  # noqa: F401  (the security tests import it from here)
from tests.helpers.procs import REPO, wait_for

NOBODY = 65534
SETPRIV = shutil.which("setpriv")


class WorldDir:
    """A temp folder every user may traverse (pytest's tmp_path is 0700 under root's name)."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="hintfs-sec-"))
        self.path.chmod(0o755)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@functools.cache
def can_run_as_nobody() -> bool:
    if os.geteuid() != 0 or SETPRIV is None:
        return False
    r = subprocess.run([SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        sys.executable, "-I", "-c", "import pyarrow.flight"],
                       capture_output=True, timeout=30, cwd="/")
    return r.returncode == 0


def as_nobody(code: str, timeout: float = 30) -> dict:
    """Run `code` as uid/gid 65534 (no groups) with this interpreter, isolated (-I: nothing of
    the repository on its path, only pyarrow from site-packages), from a private copy in a
    world-readable folder; the script prints one JSON document, returned here."""
    d = WorldDir()
    try:
        script = d.path / "attack.py"
        script.write_text(textwrap.dedent(code))
        script.chmod(0o644)
        r = subprocess.run([SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                            sys.executable, "-I", str(script)],
                           capture_output=True, text=True, timeout=timeout, cwd=str(d.path),
                           env={"PATH": "/usr/bin:/bin", "HOME": str(d.path)})
        assert r.returncode == 0, f"attack script failed: {r.stderr[-2000:]}"
        return json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        d.close()


def nobody_flight_get(location: str, doc: dict, token: str | None = None, timeout: float = 20) -> dict:
    """A Flight do_get as uid 65534: {"data": bytes as latin-1} or {"error": "Type: text"}."""
    return as_nobody(f"""
        import json
        import pyarrow.flight as fl
        out = {{}}
        try:
            c = fl.FlightClient({location!r})
            headers = [(b"authorization", b"Bearer " + {token!r}.encode())] if {token!r} else []
            opts = fl.FlightCallOptions(headers=headers, timeout=5)
            t = c.do_get(fl.Ticket(json.dumps({doc!r}).encode()), opts).read_all()
            out["data"] = t.column(0)[0].as_py().decode("latin-1") if len(t.column(0)) else ""
        except Exception as err:
            out["error"] = type(err).__name__ + ": " + str(err)[:300]
        print(json.dumps(out))
    """, timeout=timeout)


def nobody_connect_unix(path: str) -> dict:
    """connect(2) to a unix socket as uid 65534: {"errno": N} or {"connected": True}."""
    return as_nobody(f"""
        import json, socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect({path!r})
            print(json.dumps({{"connected": True}}))
        except OSError as err:
            print(json.dumps({{"errno": err.errno}}))
    """)


def nobody_read_files(paths: list[str]) -> dict:
    """Try to read each file as uid 65534: {path: content (latin-1) | "errno N"}."""
    return as_nobody(f"""
        import json
        out = {{}}
        for p in {paths!r}:
            try:
                with open(p, "rb") as f:
                    out[p] = f.read().decode("latin-1")
            except OSError as err:
                out[p] = "errno %d" % err.errno
        print(json.dumps(out))
    """)


def agent_config(base: Path, store: Path, *, port: int, data_dir: Path, token_file: Path | None = None,
                 extra: str = "") -> Path:
    cfg = base / "agent.toml"
    text = (f'[store]\nuri = "file://{store}"\n[agent]\nlocation = "grpc://127.0.0.1:{port}"\n'
            f'data_dir = "{data_dir}"\n')
    if token_file is not None:
        text += f'token_file = "{token_file}"\n'
    text += extra + f'[logging]\nfile = "{base / "agent.log"}"\n'
    cfg.write_text(text)
    return cfg


class AgentProc:
    """A real `hintfs agent CONFIG` process; stopped by its pid."""

    def __init__(self, cfg: Path) -> None:
        self.cfg = cfg
        self.p = subprocess.Popen([sys.executable, "-m", "hintfs.cli", "agent", str(cfg)], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def exited(self, timeout: float) -> tuple[int | None, str]:
        """(exit status, stderr) if it exits within `timeout`, else (None, '') and it is stopped."""
        try:
            _out, err = self.p.communicate(timeout=timeout)
            return self.p.returncode, err
        except subprocess.TimeoutExpired:
            self.stop()
            return None, ""

    def wait_up(self, client, timeout: float = 30) -> None:
        from hintfs.agent.client import AgentError

        def up():
            if self.p.poll() is not None:
                return True
            try:
                client.ping()
                return True
            except AgentError:
                return False
        assert wait_for(up, timeout=timeout, interval=0.1), "agent did not come up"
        assert self.p.poll() is None, f"agent exited: {self.p.communicate()[1][-2000:]}"

    def stop(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.p.pid, signal.SIGKILL)
                self.p.wait(10)
        for f in (self.p.stdout, self.p.stderr):
            if f is not None:
                f.close()


def files_holding(folder: Path, needle: bytes) -> list[str]:
    """Files under `folder` whose content contains `needle`."""
    hits = []
    for root, _dirs, names in os.walk(folder):
        for n in names:
            p = os.path.join(root, n)
            try:
                with open(p, "rb") as f:
                    if needle in f.read():
                        hits.append(p)
            except OSError:
                pass
    return hits


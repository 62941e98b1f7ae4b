"""A real `hintfs agent` process for fault tests (SIGKILL and restart on the same port and data)."""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

from hintfs.agent.client import AgentClient, AgentError
from tests.helpers.ports import free_port
from tests.helpers.procs import REPO, wait_for


class AgentProcess:
    """A real `hintfs agent` on a free port over `store`; `start()` again after a kill."""

    def __init__(self, tmp_path, store, agent_extra: str = "", extra: str = "") -> None:
        self.port = free_port()
        self.log = tmp_path / "agent.log"
        self.cfg = tmp_path / "agent.toml"
        token = tmp_path / "agent.token"
        token.write_text("tier-secret\n")
        token.chmod(0o600)
        self.cfg.write_text(f'[store]\nuri = "file://{store}"\n[agent]\nlocation = "grpc://127.0.0.1:{self.port}"\n'
                            f'data_dir = "{tmp_path / "tier"}"\ntoken_file = "{token}"\n{agent_extra}'
                            f'{extra}[logging]\nfile = "{self.log}"\n')
        self.location = f"grpc://127.0.0.1:{self.port}"
        self.token_file = token
        self.p = None

    def start(self, soft_open_files: int | None = None) -> AgentClient:
        """Start it (`soft_open_files`: with that soft RLIMIT_NOFILE, as a shell may give it)."""
        def limit() -> None:
            if soft_open_files is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE,
                                   (soft_open_files, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        self.p = subprocess.Popen([sys.executable, "-m", "hintfs.cli", "agent", str(self.cfg)], cwd=REPO,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=limit)
        c = AgentClient(f"grpc://127.0.0.1:{self.port}", token="tier-secret")

        def up():
            try:
                return c.status() is not None
            except AgentError:
                return False
        assert wait_for(up, timeout=30), self.log.read_text()
        return c

    def kill(self) -> None:
        os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(10)

    def stop(self) -> None:
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(15)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()

"""`make setup` builds the passthrough libraries with patches/build-passthrough.sh; where a step
fails it must print one line, keep the stock pyfuse3, exit 0 (setup goes on) and not retry on
every setup. Shown here with a host that has no apt-get (the first step)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import REPO


def _fake_venv(tmp_path: Path) -> Path:
    # A venv of its own (never the test's: the failure path reinstalls pyfuse3 into the venv it
    # is given), without pip, so that reinstall fails at once and is only logged.
    venv = tmp_path / "venv"
    subprocess.run(["python3", "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    return venv


def _run(venv: Path, path_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": str(path_dir)}
    return subprocess.run(["/bin/bash", str(REPO / "patches" / "build-passthrough.sh"), str(venv)],
                          env=env, capture_output=True, text=True, timeout=120)


def test_a_failed_step_says_one_line_exits_0_and_is_not_retried(tmp_path):
    venv = _fake_venv(tmp_path)
    # A PATH with the tools the script itself needs, but no apt-get or dpkg-source.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("cat", "sha256sum", "cut", "head", "sed", "rm", "mkdir", "dirname", "printf", "python3"):
        for d in ("/usr/bin", "/bin"):
            if os.path.exists(f"{d}/{tool}"):
                (bin_dir / tool).symlink_to(f"{d}/{tool}")
                break
    first = _run(venv, bin_dir)
    assert first.returncode == 0, first.stderr
    lines = [line for line in first.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and "FUSE passthrough unavailable (no apt-get/dpkg-source" in lines[0], first.stdout
    stamp = (venv / ".passthrough-done").read_text().splitlines()
    assert stamp[1] == "failed" and "apt-get" in stamp[2]
    # the next setup says so again, at once, without building
    again = _run(venv, bin_dir)
    assert again.returncode == 0
    assert "rm " in again.stdout and "to retry" in again.stdout
    assert not (venv / "libfuse").exists()

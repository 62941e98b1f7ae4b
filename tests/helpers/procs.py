"""Running hintfs's own commands from a checkout, and waiting for a condition with a bound."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HINTFS = [sys.executable, "-m", "hintfs.cli"]


def run_hintfs(*args, timeout=60, check=False, **kw) -> subprocess.CompletedProcess:
    """`hintfs ARGS...` with this interpreter, from the repository's root."""
    return subprocess.run(HINTFS + [str(a) for a in args], capture_output=True, text=True,
                          timeout=timeout, check=check, cwd=REPO, **kw)


def wait_for(pred, timeout=10.0, interval=0.05):
    """Poll `pred` until it is true (True) or `timeout` s have passed (its last value)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def wait_mounted(mnt: str, proc: subprocess.Popen | None, name: str, timeout: float = 30.0) -> None:
    """Until `mnt` is a mount point; RuntimeError if `proc` (the FUSE daemon, when started here)
    exits first or `timeout` s pass (the benches' peers: bindfs, s3fs, rclone, passthrough_hp)."""
    import os
    deadline = time.monotonic() + timeout
    while not os.path.ismount(mnt):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not mount within {timeout:.0f} s")
        time.sleep(0.02)

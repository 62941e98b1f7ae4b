"""Running hintfs's own commands from a checkout, waiting for a condition with a bound, and a
process's CPU and memory as the benches read them."""
from __future__ import annotations

import os
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


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread, ended ones too) of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    """Resident memory (VmRSS) of process `pid`, MiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


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
    deadline = time.monotonic() + timeout
    while not os.path.ismount(mnt):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not mount within {timeout:.0f} s")
        time.sleep(0.02)

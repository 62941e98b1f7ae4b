"""Is a process still there? One answer for the mount's lock files, `hintfs umount`, the agent's
stale folders and the governor's liveness checks; and which processes did it start."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True while `pid` runs. A process we may not signal (EPERM) runs; a zombie (exited, not yet
    reaped by its parent) counts as gone: it holds no memory and will never answer."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True   # no /proc: kill(0) succeeded, so it runs


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started (any of its threads) that still run or await their reaping."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return out


def daemon_python() -> list[str]:
    """The interpreter command a hintfs daemon is started with: isolated (`-I`), so neither the
    caller's working directory nor PYTHONPATH/PYTHON* variables nor a user site-packages can put
    a module in front of ours in a process that runs as root."""
    return [sys.executable, "-I"]

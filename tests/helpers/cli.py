"""Running the installed `hintfs` console script as a user would, and reading its one-line errors."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HINTFS = Path(sys.executable).parent / "hintfs"


def hintfs(*args, timeout=30, **kw) -> subprocess.CompletedProcess:
    assert HINTFS.exists(), f"the console script {HINTFS} is not installed (pip install -e .)"
    return subprocess.run([str(HINTFS), *map(str, args)], capture_output=True, text=True, timeout=timeout, **kw)


def one_clean_line(r: subprocess.CompletedProcess) -> str:
    """The command failed with exactly one line on stderr and no traceback: that line."""
    assert r.returncode != 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]

"""A long-running process raises its soft open-file limit to the hard one (hintfs/common/fdlimit.py)."""
from __future__ import annotations

import os
import resource
import subprocess
import sys

PROBE = ("import resource; from hintfs.common.fdlimit import raise_open_file_limit; "
         "got = raise_open_file_limit(); print(got, *resource.getrlimit(resource.RLIMIT_NOFILE))")


def _run_with_limit(soft: int, hard: int) -> list[int]:
    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60,
                       preexec_fn=limit, cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 0, r.stderr
    return [int(x) for x in r.stdout.split()]


def test_a_shell_soft_limit_is_raised_to_the_hard_limit():
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = min(hard, 4096)
    assert _run_with_limit(256, top) == [top, top, top]


def test_a_limit_already_at_the_hard_limit_is_left_alone():
    assert _run_with_limit(300, 300) == [300, 300, 300]

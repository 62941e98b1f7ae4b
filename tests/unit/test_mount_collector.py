"""The mount daemon's garbage collector (docs/operations.md, "The mount daemon's garbage
collector"): set up once before serving. Run in a child process: freezing this test process's
objects would change every later test's collector."""
from __future__ import annotations

import subprocess
import sys


def test_the_daemon_freezes_its_setup_and_collects_the_young_generation_less_often():
    code = ("import gc; from fusefs.mount import GC_THRESHOLDS, quiet_collector; "
            "before = gc.get_threshold(); quiet_collector(); "
            "print(before[0], gc.get_threshold() == GC_THRESHOLDS, GC_THRESHOLDS[0], gc.get_freeze_count() > 10000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out == ["700", "True", "20000", "True"], out

"""pid_alive: one liveness check for lock files, umount, agent folders and the governor."""
import os
import subprocess
import sys

from common.procs import pid_alive


def test_running_exited_and_zombie_processes():
    assert pid_alive(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    # exited but not reaped yet: a zombie counts as gone
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
    assert not pid_alive(p.pid)
    p.wait()
    assert not pid_alive(p.pid)      # reaped: no such process
    assert pid_alive(1)              # init: running, maybe not ours to signal

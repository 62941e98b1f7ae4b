"""The stream sender's niceness against the job (`fusefs.stream.sender.nice_against_the_job`):
a sender with `sender_nice` leads a session of its own whose autogroup carries the niceness, so
that it counts against the job's processes and not only the mount's threads; nice 0 leaves it
in the mount's group. docs/cross_dc.md "The sender process" says why."""
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

import pytest

from fusefs.stream.sender import cpu_cgroup, nice_against_the_job

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUTOGROUP = os.path.exists("/proc/self/autogroup")

# prints: what the call returned; whether the process now leads its session; its autogroup line
PROBE = ("import os, sys; sys.path.insert(0, sys.argv[1]); from fusefs.stream.sender import nice_against_the_job; "
         "r = nice_against_the_job(int(sys.argv[2])); "
         "g = open('/proc/self/autogroup').read().strip() if os.path.exists('/proc/self/autogroup') else ''; "
         "print(r, os.getsid(0) == os.getpid(), g)")


def probe(nice: int, as_user: Sequence[str] = ()) -> list[str]:
    out = subprocess.run([*as_user, sys.executable, "-I", "-c", PROBE, REPO, str(nice)],
                         capture_output=True, text=True, timeout=30, cwd="/")
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_nice_0_leaves_the_process_in_its_session():
    before = os.getsid(0)
    assert nice_against_the_job(0) is False
    assert os.getsid(0) == before


@pytest.mark.skipif(not AUTOGROUP, reason="this kernel has no autogroups")
def test_a_niced_sender_leads_a_session_whose_autogroup_has_its_niceness():
    # empty where this process is in the boot-time default group (its session goes back to init
    # with no setsid on the way, as under some CI runners): the kernel prints no line for it
    mine = (open("/proc/self/autogroup").read().split() or [""])[0]
    ok, leads, group, _, nice = probe(13)
    assert leads == "True" and group != mine and nice == "13"
    # (True only where autogroups decide: this process's cgroup for the CPU is the root)
    with open("/proc/self/cgroup") as f:
        assert ok == str(cpu_cgroup(f.read()) in (None, "/"))


@pytest.mark.skipif(not AUTOGROUP or os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs autogroups, root and setpriv to run as another user")
def test_an_unprivileged_sender_may_lower_its_own_group():
    ok, leads, _, _, nice = probe(10, ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"])
    assert leads == "True" and nice == "10"


def test_the_cpu_cgroup_is_read_from_v1_or_v2():
    v1 = "12:memory:/job\n4:cpu,cpuacct:/system.slice/hintfs.service\n0::/system.slice/hintfs.service\n"
    assert cpu_cgroup(v1) == "/system.slice/hintfs.service"
    assert cpu_cgroup("9:name=systemd:/\n1:cpu:/\n0::/\n") == "/"
    assert cpu_cgroup("0::/user.slice/session-3.scope\n") == "/user.slice/session-3.scope"
    assert cpu_cgroup("3:memory:/x\n") is None

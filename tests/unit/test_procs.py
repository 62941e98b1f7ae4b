"""pid_alive: one liveness check for lock files, umount, agent folders and the governor; and
become_isolated_daemon, the first call of every daemon (tests/system/test_isolated_daemons.py
runs the attack through the real daemons)."""
import os
import subprocess
import sys
import types

import pytest

from hintfs.common import procs
from hintfs.common.procs import pid_alive
from hintfs.cli import runs_isolated


def test_running_exited_and_zombie_processes():
    assert pid_alive(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    # exited but not reaped yet: a zombie counts as gone
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
    assert not pid_alive(p.pid)
    p.wait()
    assert not pid_alive(p.pid)      # reaped: no such process
    assert pid_alive(1)              # init: running, maybe not ours to signal


class Exec(Exception):
    pass


@pytest.fixture
def no_exec(monkeypatch, tmp_path):
    """become_isolated_daemon's calls, recorded instead of made: [("chdir", path) | ("exec", argv)],
    in `tmp_path` (a caller's folder)."""
    calls: list = []
    monkeypatch.chdir(tmp_path)

    def execv(path, argv):
        calls.append(("exec", argv))
        raise Exec()
    monkeypatch.setattr(procs.os, "execv", execv)
    monkeypatch.setattr(procs.os, "chdir", lambda path: calls.append(("chdir", path)))
    monkeypatch.setattr(procs.sys, "argv", ["/x/hintfs/cli/__main__.py", "agent", "/etc/a.toml"])
    monkeypatch.setattr(procs, "tune_malloc", lambda: calls.append(("tune_malloc",)))   # (this process's own)
    return calls


def flags(isolated: int):
    return types.SimpleNamespace(isolated=isolated)


def test_a_daemon_not_isolated_runs_again_with_minus_I_in_root(no_exec, monkeypatch):
    monkeypatch.setattr(procs.sys, "flags", flags(0))
    with pytest.raises(Exec):
        procs.become_isolated_daemon("hintfs.cli", ["agent", "/etc/a.toml"])
    assert no_exec == [("chdir", "/"), ("exec", [sys.executable, "-I", "-m", "hintfs.cli", "agent", "/etc/a.toml"])]
    no_exec.clear()
    with pytest.raises(Exec):      # the first step of `hintfs`: paths not parsed yet, cwd kept
        procs.become_isolated_daemon("hintfs.cli", ["agent", "a.toml"], keep_cwd=True)
    assert no_exec == [("exec", [sys.executable, "-I", "-m", "hintfs.cli", "agent", "a.toml"])]


def test_an_isolated_daemon_moves_to_root_and_runs_again_only_for_other_words(no_exec, monkeypatch, tmp_path):
    monkeypatch.setattr(procs.sys, "flags", flags(1))
    procs.become_isolated_daemon("hintfs.cli", ["agent", "/etc/a.toml"])      # the same words: no exec
    assert no_exec == [("chdir", "/"), ("tune_malloc",)]
    no_exec.clear()
    procs.become_isolated_daemon("hintfs.cli", ["agent", "a.toml"], keep_cwd=True)
    assert no_exec == [("tune_malloc",)]
    with pytest.raises(Exec):      # started with a relative path: again, so that `ps` shows the real one
        procs.become_isolated_daemon("hintfs.cli", ["agent", str(tmp_path / "a.toml")])
    assert no_exec[-1] == ("exec", [sys.executable, "-I", "-m", "hintfs.cli", "agent", str(tmp_path / "a.toml")])


@pytest.mark.parametrize("argv, isolated", [
    (["agent", "a.toml"], True),
    (["--debug", "governor", "g.toml"], True),
    (["mount", "c.toml", "m", "--foreground"], True),
    (["mount", "c.toml", "m"], True),                     # root starts the daemon
    (["umount", "m"], True),
    (["plan", "show", "p.parquet"], False),               # the job's user: its PYTHONPATH may matter
    (["hints", "dcp", "m", "j", "ckpt"], False),
    (["status", "/mnt/foo"], False),
    (["--version"], False),
])
def test_which_command_lines_run_isolated_from_the_start(argv, isolated):
    assert runs_isolated(argv) is isolated


MALLOC_PROBE = """
import json, os, subprocess, sys
from hintfs.common import procs
tuned = procs.tune_malloc()
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('GLIBC_TUNABLES', ''))"],
                       capture_output=True, text=True).stdout.strip()
print(json.dumps({"tuned": tuned, "env": os.environ.get("GLIBC_TUNABLES", ""), "child": child}))
"""


def malloc_probe(env_tunables: str | None) -> dict:
    import json
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if env_tunables is not None:
        env["GLIBC_TUNABLES"] = env_tunables
    out = subprocess.run([sys.executable, "-c", MALLOC_PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_daemon_tunes_malloc_for_itself_and_what_it_starts():
    """Every daemon's buffers of MBs reuse the heap's pages (procs.tune_malloc, on glibc): mallopt
    in the daemon, GLIBC_TUNABLES for the processes it starts (a transform worker, the sender)."""
    ours = f"glibc.malloc.mmap_threshold={procs.MALLOC_MMAP_THRESHOLD}:glibc.malloc.trim_threshold={procs.MALLOC_TRIM_THRESHOLD}"
    r = malloc_probe(None)
    assert r == {"tuned": True, "env": ours, "child": ours}
    # another tunable of the operator's is kept, ours added after it
    r = malloc_probe("glibc.pthread.rseq=0")
    assert r["tuned"] and r["env"] == "glibc.pthread.rseq=0:" + ours == r["child"]


def test_an_operators_malloc_tunables_are_left_as_they_are():
    r = malloc_probe("glibc.malloc.arena_max=2")
    assert r == {"tuned": False, "env": "glibc.malloc.arena_max=2", "child": "glibc.malloc.arena_max=2"}

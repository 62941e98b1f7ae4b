"""Is a process still there? One answer for the mount's lock files, `hintfs umount`, the agent's
stale folders and the governor's liveness checks; which processes did it start; and how every
daemon runs: isolated (`python -I`), in `/` (`become_isolated_daemon`, docs/security.md
"Processes")."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn


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


# The folder every daemon runs in: nothing of its caller's working directory is on its path, and
# nothing it or its children open relative to the cwd lands in a folder another user may write.
DAEMON_CWD = "/"


def is_isolated_daemon() -> bool:
    """True in an isolated interpreter (`-I`: no cwd or script folder on sys.path, no PYTHON*
    variables, no user site-packages) whose working directory is `/`."""
    try:
        return bool(sys.flags.isolated) and os.getcwd() == DAEMON_CWD
    except OSError:          # the cwd was removed
        return False


def isolated_command(module: str, argv: list[str]) -> list[str]:
    """The command line that runs `python -m module argv...` isolated."""
    return [*daemon_python(), "-m", module, *argv]


def become_isolated_daemon(module: str, argv: list[str], *, keep_cwd: bool = False) -> None:
    """Make this process a daemon that imports nothing from its caller's folder: the first call
    of every daemon (the verbs of `hintfs` that run one, `python -m fusefs`, `python -m hintfs.governor.cli`).

    Unless this interpreter is isolated already, it replaces itself (`execv`: the same pid, open
    inheritable fds, environment and session, so systemd's main pid and its notify socket stay)
    with `python -I -m module argv...` in `/`; an isolated one run with these words only moves
    to `/`. Paths in `argv` must be absolute (`absolute_paths`): they are read again from `/`. Every interpreter the
    daemon starts later inherits both: `multiprocessing` passes `-I` on to its forkserver,
    resource tracker and workers (`_args_from_interpreter_flags`), and children start in the
    parent's cwd. Returns only in an isolated interpreter whose cwd is `/`; an exec that fails
    raises OSError.

    `keep_cwd`: re-execute isolated, but in the same folder and without moving to `/`: the first
    step of a command whose relative paths are not known yet (`hintfs.cli.main`); a second call,
    with absolute paths, moves it to `/`."""
    if not sys.flags.isolated or (not keep_cwd and sys.argv[1:] != list(argv)):
        # (isolated, but run with other words than `argv`, e.g. relative paths: run again, so
        # that `ps` and /proc/PID/cmdline show the absolute paths the daemon uses)
        if not sys.executable:
            raise OSError(2, "cannot re-execute the daemon isolated: no Python interpreter path (sys.executable)")
        cmd = isolated_command(module, argv)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        if not keep_cwd:
            os.chdir(DAEMON_CWD)
        os.execv(cmd[0], cmd)
    if not keep_cwd and not is_isolated_daemon():
        os.chdir(DAEMON_CWD)
    tune_malloc()


# glibc's malloc hands a block of 128 KiB or more to mmap and gives it back at its free, so every
# multi-MB buffer a daemon moves (a peer copy's range, a store GET, a stream chunk) lands in fresh
# pages the kernel must fault in and zero, and on these VMs a fresh page is slow. Its dynamic
# threshold does not hold that off: a freed block at the heap's top past the trim threshold is
# returned too. With both raised the buffers reuse the heap's pages: one peer copy of 3.9 MB cost
# its destination agent 11.2 and 7.5 ms of CPU against 12.5 and 14.4 with glibc's defaults on a quiet
# VM (12.5/11.3 against 16.2/18.1 beside a bench), its RSS 11-44 MB more (bench/peer_copy_cost.py,
# 16 copies a run, 2 runs each; docs/operations.md "Memory"). Cold S3 reads did not change.
MALLOC_MMAP_THRESHOLD = 32 << 20     # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
MALLOC_TRIM_THRESHOLD = 256 << 20    # free memory a heap may keep at its top
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3     # mallopt's parameters (malloc.h)


def tune_malloc() -> bool:
    """Raise glibc malloc's mmap and trim thresholds in this daemon, and (GLIBC_TUNABLES) in every
    process it starts. An operator who set any `glibc.malloc.*` tunable keeps glibc as they set
    it; another C library (no `mallopt`, or one that refuses) is left alone. True if tuned."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in tunables:
        return False
    import ctypes
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD) != 1:
        return False
    ours = (f"glibc.malloc.mmap_threshold={MALLOC_MMAP_THRESHOLD}:"
            f"glibc.malloc.trim_threshold={MALLOC_TRIM_THRESHOLD}")
    os.environ["GLIBC_TUNABLES"] = f"{tunables}:{ours}" if tunables else ours
    return True


def absolute_paths(*paths: str) -> list[str]:
    """`paths` made absolute against the current directory (before a daemon leaves it)."""
    return [os.path.abspath(p) for p in paths]


def exit_after_unmount(status: int) -> NoReturn:
    """End a mount daemon that is done (unmounted; every file published or reported) without the
    interpreter's teardown: its logs are flushed, its agent clients need no goodbye, and gRPC's
    teardown of a client whose TLS calls had failed kept a mount's process ~2 s past its unmount,
    which `hintfs umount` waits for (tests/system/test_tls_tier.py: 11.0 s -> 2.1 s)."""
    import logging
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)

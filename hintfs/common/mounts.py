"""What is mounted where, from /proc/self/mountinfo: so hintfs's own commands act only on hintfs
mounts, and recognise a dead one (its daemon gone: every access fails with ENOTCONN); and which
process serves a hintfs mount (`daemon_problem`), so `hintfs umount` signals only that one."""
from __future__ import annotations

import errno
import os
import re
import subprocess
from dataclasses import dataclass

HINTFS_FSTYPE = "fuse.hintfs"      # FUSE type + the subtype the mount daemon sets
DEAD_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)   # what a FUSE mount without its daemon answers


@dataclass(frozen=True)
class MountEntry:
    mountpoint: str
    fstype: str
    source: str
    user_id: int | None = None    # a FUSE mount's `user_id=` super option: the uid that mounted it

    @property
    def is_hintfs(self) -> bool:
        return self.fstype == HINTFS_FSTYPE


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_at(path: str, mountinfo: str = "/proc/self/mountinfo") -> MountEntry | None:
    """The topmost mount whose mount point is exactly `path` (made absolute, not resolved: a dead
    FUSE mount cannot be resolved), or None."""
    want = os.path.normpath(os.path.abspath(path))
    found = None
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) >= 5 and len(rest) >= 2 and _unescape(fields[4]) == want:
                found = MountEntry(want, rest[0], _unescape(rest[1]), _user_id(rest[2] if len(rest) > 2 else ""))
    return found


def _user_id(super_options: str) -> int | None:
    for opt in super_options.split(","):
        key, _, value = opt.partition("=")
        if key == "user_id" and value.isascii() and value.isdigit():
            return int(value)
    return None


def dead_mount_at(path: str, mountinfo: str = "/proc/self/mountinfo") -> MountEntry | None:
    """The mount at `path` if it is dead (its daemon gone: statfs fails with ENOTCONN or
    ECONNABORTED), else None. Any filesystem type: the caller decides what it may touch. statfs,
    not stat: the kernel answers a stat of the mount's root from its attribute cache for a while
    after the daemon died; statfs always asks the daemon."""
    entry = mount_at(path, mountinfo)
    if entry is None:
        return None
    try:
        os.statvfs(path)
        return None
    except OSError as err:
        return entry if err.errno in DEAD_ERRNOS else None


def detach_lazily(path: str) -> None:
    """`fusermount3 -u -z path`: detach a FUSE mount now, even if its daemon is gone or files
    are still open on it (they keep failing; the path is usable again at once). Raises OSError
    with fusermount3's message."""
    r = subprocess.run(["fusermount3", "-u", "-z", path], capture_output=True, text=True)
    if r.returncode != 0:
        raise OSError(errno.EBUSY, r.stderr.strip() or f"fusermount3 -u -z exited with {r.returncode}")


def unmount(path: str) -> None:
    """`fusermount3 -u path`: unmount a FUSE mount now (the kernel ends the connection and its
    daemon's loop). Not lazy: EBUSY while files on it are open. Raises OSError with the message."""
    r = subprocess.run(["fusermount3", "-u", path], capture_output=True, text=True)
    if r.returncode != 0:
        raise OSError(errno.EBUSY, r.stderr.strip() or f"fusermount3 -u exited with {r.returncode}")


# -- the process that serves a hintfs mount -----------------------------------------------------
# A hintfs mount daemon is `python -I -m fusefs CONFIG MOUNTPOINT [--ready-fd N]` (`hintfs mount`)
# or `python -I -m hintfs.cli mount CONFIG MOUNTPOINT --foreground [--ready-fd N]` (systemd),
# with absolute paths (hintfs.common.procs.become_isolated_daemon); daemons started before that may run
# the `hintfs` console script.
_PYTHON = re.compile(r"python[0-9.]*")
_VALUE_OPTIONS = {"-X", "-W"}                # interpreter options that take the next word
_DAEMON_VALUE_OPTIONS = {"--ready-fd"}       # the daemon's options that take the next word


def _proc(pid: int) -> tuple[tuple[int, int], str, list[str], str | None]:
    """((real uid, effective uid), executable, command line, cwd or None) of `pid`. OSError."""
    with open(f"/proc/{pid}/status") as f:
        uid_line = next(line for line in f if line.startswith("Uid:"))
    real, effective = (int(x) for x in uid_line.split()[1:3])
    exe = os.readlink(f"/proc/{pid}/exe")
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = [a.decode("utf-8", "surrogateescape") for a in f.read(1 << 16).split(b"\0")]
    if argv and argv[-1] == "":
        argv.pop()
    try:
        cwd: str | None = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        cwd = None
    return (real, effective), exe, argv, cwd


def _daemon_mountpoint(argv: list[str]) -> str | None:
    """The mountpoint a hintfs mount daemon's command line names, as written; None if the command
    line is not one of a hintfs mount daemon."""
    entry, rest = None, []
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "-m" and i + 1 < len(argv):
            entry, rest = argv[i + 1], argv[i + 2:]
            break
        if a.startswith("-m") and len(a) > 2:
            entry, rest = a[2:], argv[i + 1:]
            break
        if a.startswith("-c"):                          # a program given on the command line
            break
        if a in _VALUE_OPTIONS:
            i += 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        if os.path.basename(a) == "hintfs":            # the console script
            entry, rest = "hintfs.cli", argv[i + 1:]
        break
    verb = next((i for i, w in enumerate(rest) if not w.startswith("-")), len(rest))   # (after --debug)
    if entry == "fusefs":
        words = rest
    elif entry == "hintfs.cli" and rest[verb:verb + 1] == ["mount"] and ("--foreground" in rest or "-f" in rest):
        words = rest[verb + 1:]
    else:
        return None
    positional, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w in _DAEMON_VALUE_OPTIONS:
            skip = True
        elif not w.startswith("-"):
            positional.append(w)
    return positional[1] if len(positional) == 2 else None


def daemon_problem(pid: int, entry: MountEntry) -> str | None:
    """Why `pid` is not the hintfs daemon serving the mount `entry` (None if it is): it must run
    as the mount's user (real and effective uid = mountinfo's `user_id`), be a Python (its
    /proc/PID/exe) running hintfs's mount entry point (its command line), and serve that
    mountpoint (the command line names it, relative to the process's cwd, symlinks resolved).
    Read from /proc: call it with a pidfd of `pid` open, so that the pid cannot be another
    process's by the time it is signalled."""
    if entry.user_id is None:
        return "the mount table gives no user_id for the mount"
    try:
        (real, effective), exe, argv, cwd = _proc(pid)
    except (OSError, StopIteration, ValueError) as err:
        return f"process {pid} cannot be inspected: {getattr(err, 'strerror', None) or err}"
    if (real, effective) != (entry.user_id, entry.user_id):
        return f"process {pid} runs as uid {effective}; the mount's user is uid {entry.user_id}"
    if not _PYTHON.fullmatch(os.path.basename(exe.removesuffix(" (deleted)"))):
        return f"process {pid} runs {exe}, not a Python"
    mp = _daemon_mountpoint(argv)
    if mp is None:
        return f"process {pid} is not a hintfs mount daemon ({' '.join(argv)[:200]!r})"
    if not os.path.isabs(mp):
        if cwd is None:
            return f"process {pid} names a relative mountpoint {mp!r} and its cwd is unknown"
        mp = os.path.join(cwd, mp)
    mp = os.path.normpath(mp)
    if mp != entry.mountpoint and os.path.realpath(mp) != entry.mountpoint:
        return f"process {pid} serves {mp}, not {entry.mountpoint}"
    return None

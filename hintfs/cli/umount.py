"""`hintfs umount MOUNTPOINT [--timeout S]`: stop the mount's daemon and wait until it is gone.

The daemon keeps serving for up to its `mount.unmount_timeout_s` while files are open for writing
(a `cp` into the mount finishes and is published); what is still open then is abandoned, never
published, and named in the daemon's log: this command then prints those paths and exits 1. If the
daemon is gone (a dead mount: ENOTCONN) or does not stop in time, the mount is detached lazily so
the path works again. Only hintfs mounts (type fuse.hintfs in /proc/self/mountinfo) are touched.

The pid comes from the mount's own `.hintfs/stats`, which any FUSE filesystem of type
`fuse.hintfs` can answer (issue 34, finding 11: a fake one got a root process killed). So it is
signalled only if it is the hintfs daemon of that mount (`hintfs.common.mounts.daemon_problem`: its uid
is the mount's `user_id`, it is a Python running hintfs's mount entry point, its command line
names this mountpoint), through a pidfd opened before those checks; otherwise the mount is
unmounted without a signal (`fusermount3 -u`) and one line says why.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

from hintfs.common.logline import ABANDONED_MARK
from hintfs.common.mounts import MountEntry, daemon_problem, detach_lazily, mount_at, unmount
from hintfs.common.procs import pid_alive
from hintfs.cli.base import UserError
from hintfs.status import StatsUnavailable, read_stats

GRACE_S = 15.0          # beyond the daemon's own wait: uploads in flight at close, the agent's shutdown


def add_parser(subparsers) -> None:
    u = subparsers.add_parser("umount", help="unmount cleanly (waits for open writes and pending uploads)")
    u.add_argument("mountpoint", help="the mountpoint of a hintfs mount")
    u.add_argument("--timeout", type=float, default=None,
                   help="seconds to wait for the daemon (default: its mount.unmount_timeout_s + 15)")
    u.set_defaults(func=cmd_umount)


def _unmount_info(mp: str) -> dict:
    """`.hintfs/unmount` of a live daemon ({} from a daemon that does not have it)."""
    try:
        with open(os.path.join(mp, ".hintfs", "unmount")) as f:
            doc = json.loads(f.read(1 << 16))
    except (OSError, ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _unmount_without_signal(mp: str, pid: object, why: str) -> int:
    """The mount's stats name a pid that is not its daemon: unmount it without signalling any
    process (the kernel ends the connection; a real daemon then exits on its own)."""
    try:
        unmount(mp)
    except OSError as err:
        raise UserError(f"{mp}: not signalling pid {pid} ({why}); unmounting without a signal failed: "
                        f"{err.strerror}") from None
    print(f"{mp}: pid {pid} named by the mount is not its hintfs daemon ({why}): unmounted without "
          "signalling it", file=sys.stderr)
    return 0


def _open_daemon(entry: MountEntry, pid: object) -> tuple[int, str | None]:
    """(pidfd, None) of the mount's daemon `pid`, or (-1, why not)."""
    if type(pid) is not int or pid <= 0:
        return -1, "its stats name no pid"
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as err:
        return -1, f"process {pid}: {err.strerror}"
    why = daemon_problem(pid, entry)
    if why is not None:
        os.close(pidfd)
        return -1, why
    return pidfd, None


def _log_size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def _abandoned_in_log(path: str | None, offset: int) -> list[str] | None:
    """The paths of the daemon's `unmount abandoned` line written after `offset`, or None."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(text.splitlines()):
        if ABANDONED_MARK in line:
            try:
                return list(json.loads(line[line.index("[", line.index(ABANDONED_MARK)):]))
            except ValueError:
                return ["(see the daemon's log)"]
    return None


def cmd_umount(args) -> int:
    mp = os.path.abspath(args.mountpoint)
    entry = mount_at(mp)
    if entry is None:
        raise UserError(f"{mp} is not mounted")
    if not entry.is_hintfs:
        raise UserError(f"{mp} is a {entry.fstype} mount, not a hintfs mount: not touching it "
                        "(use umount for other filesystems)")
    try:
        stats = read_stats(mp)
    except StatsUnavailable:
        # The daemon is gone (ENOTCONN) or unresponsive: detach the mount so the path works again.
        try:
            detach_lazily(mp)
        except OSError as err:
            raise UserError(f"cannot unmount {mp}: {err.strerror}") from None
        print(f"{mp}: daemon not answering; mount detached", file=sys.stderr)
        return 0
    pid = stats.get("pid") if isinstance(stats, dict) else None
    pidfd, why = _open_daemon(entry, pid)
    if why is not None:
        return _unmount_without_signal(mp, pid, why)
    assert isinstance(pid, int)
    info = _unmount_info(mp)
    log_file = info.get("log_file")
    offset = _log_size(log_file)
    timeout = args.timeout if args.timeout is not None else float(info.get("timeout_s", 30.0)) + GRACE_S
    if info.get("open_writes"):
        print(f"{mp}: {info['open_writes']} files open for writing; waiting up to "
              f"{float(info.get('timeout_s', 0)):g}s for them to be closed", file=sys.stderr)
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
    except ProcessLookupError:
        pass                    # it exited since: the wait below sees the mount go
    finally:
        os.close(pidfd)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.ismount(mp) and not pid_alive(pid):
            break
        time.sleep(0.05)
    else:
        # The daemon did not finish in time: detach the mount so the path is usable again.
        try:
            detach_lazily(mp)
        except OSError:
            pass
        raise UserError(f"daemon {pid} did not stop within {timeout:.0f}s; mount detached lazily")
    abandoned = _abandoned_in_log(log_file, offset)
    if abandoned:
        raise UserError(f"{mp} unmounted, but {len(abandoned)} files still open for writing were abandoned "
                        f"(writes since their last close or fsync not published): {', '.join(abandoned)}")
    return 0

"""`hintfs umount MOUNTPOINT [--timeout S]`: stop the mount's daemon (it finishes pending uploads
first); if the daemon is gone or does not stop in time, detach the mount lazily so the path works
again. Only hintfs mounts (type fuse.hintfs in /proc/self/mountinfo) are touched."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from common.mounts import mount_at
from common.procs import pid_alive
from hintfs.cli.base import UserError
from hintfs.status import StatsUnavailable, read_stats


def add_parser(subparsers) -> None:
    u = subparsers.add_parser("umount", help="unmount cleanly (waits for pending uploads)")
    u.add_argument("mountpoint")
    u.add_argument("--timeout", type=float, default=30.0)
    u.set_defaults(func=cmd_umount)


def cmd_umount(args) -> int:
    mp = os.path.abspath(args.mountpoint)
    entry = mount_at(mp)
    if entry is None:
        raise UserError(f"{mp} is not mounted")
    if not entry.is_hintfs:
        raise UserError(f"{mp} is a {entry.fstype} mount, not a hintfs mount: not touching it "
                        "(use umount for other filesystems)")
    try:
        pid = read_stats(mp)["pid"]
    except StatsUnavailable:
        # The daemon is gone (ENOTCONN) or unresponsive: detach the mount so the path works again.
        r = subprocess.run(["fusermount3", "-u", "-z", mp], capture_output=True, text=True)
        if r.returncode != 0:
            raise UserError(f"cannot unmount {mp}: {r.stderr.strip()}") from None
        print(f"{mp}: daemon not answering; mount detached", file=sys.stderr)
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if not os.path.ismount(mp) and not pid_alive(pid):
            return 0
        time.sleep(0.05)
    # The daemon did not finish in time: detach the mount so the path is usable again.
    subprocess.run(["fusermount3", "-u", "-z", mp], check=False)
    raise UserError(f"daemon {pid} did not stop within {args.timeout:.0f}s; mount detached lazily")

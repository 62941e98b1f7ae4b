"""`hintfs mount CONFIG MOUNTPOINT [--foreground] [--nonempty]`.

In the background (the default) the mount daemon, `python -I -m fusefs` (fusefs/__main__.py), is
started in its own session; this waits until it says the mount answers, or relays its one-line
error. `--foreground` (systemd) runs the same daemon in this process, isolated too: hintfs.cli.main
re-executes it as `python -I -m hintfs.cli mount ... --foreground` in `/` first.

The daemon rooms are imported when the verb runs: `hintfs plan`, `hints`, ... work on a host
without libfuse3.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from hintfs.common.procs import daemon_python
from hintfs.cli.base import UserError, absolute_args, load_config
from mountconfig.load import allow_nonempty


def add_parser(subparsers) -> None:
    m = subparsers.add_parser("mount", help="mount a store (background unless --foreground)")
    m.add_argument("config", help="mount config (TOML): its [store] uri names the store")
    m.add_argument("mountpoint", help="an empty folder to mount on (a dead hintfs mount there is replaced)")
    m.add_argument("--foreground", "-f", action="store_true", help="stay in the foreground (systemd)")
    m.add_argument("--nonempty", action="store_true", help="mount even if MOUNTPOINT holds files (hidden "
                   "until the unmount; the config's [mount] nonempty = true does the same)")
    m.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    m.set_defaults(func=cmd_mount, daemon=daemon_argv)


def daemon_argv(args) -> list[str] | None:
    """With --foreground: the command line that runs this mount again from `/` (hintfs.cli.main:
    daemons run isolated); None in the background (the daemon is started isolated, in `/`)."""
    if not args.foreground:
        return None
    ready = ["--ready-fd", str(args.ready_fd)] if args.ready_fd is not None else []
    nonempty = ["--nonempty"] if args.nonempty else []
    return ["mount", *absolute_args(args, "config", "mountpoint"), "--foreground", *ready, *nonempty]


def default_log_file(mountpoint: str) -> str:
    name = os.path.abspath(mountpoint).strip("/").replace("/", "-") or "root"
    return f"/var/log/hintfs/mount-{name}.log"


def cmd_mount(args) -> int:
    from fusefs.mount import MountError

    cfg = load_config(args.config)
    nonempty = getattr(args, "nonempty", False)   # (tests call cmd_mount with a Namespace of their own)
    if nonempty:
        cfg = allow_nonempty(cfg)
    if args.foreground:
        from fusefs.__main__ import serve
        from hintfs.common.procs import exit_after_unmount
        try:
            status = serve(cfg, args.mountpoint, ready_fd=args.ready_fd)
        except MountError as err:
            raise UserError(str(err)) from None
        exit_after_unmount(status)   # (never returns: the process is the daemon)
    return _start_in_background(args.config, args.mountpoint, cfg, nonempty)


def _start_in_background(config: str, mountpoint: str, cfg, nonempty: bool) -> int:
    from fusefs.mount import MountError, check_fuse_device, check_mountpoint

    # Check what we can here (fast, clear errors; the daemon runs the same checks), then start
    # the daemon and wait until it says the mount answers, or relay its one-line error.
    log_file = cfg.logging.file
    try:
        check_mountpoint(mountpoint, cfg, on_replace=lambda note: print(f"hintfs mount: {note}", file=sys.stderr))
        check_fuse_device()
    except MountError as err:
        raise UserError(str(err)) from None
    log_file = log_file or default_log_file(mountpoint)
    os.makedirs(os.path.dirname(log_file), exist_ok=True)
    rfd, wfd = os.pipe()
    cmd = [*daemon_python(), "-m", "fusefs", os.path.abspath(config), os.path.abspath(mountpoint),
           "--ready-fd", str(wfd), *(["--nonempty"] if nonempty else [])]
    # 0600: the errno lines name paths only in a log that only the mount's user reads (docs/operations.md)
    with open(os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600), "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                pass_fds=(wfd,), start_new_session=True, cwd="/",
                                env={**os.environ, "HINTFS_LOG_FILE": log_file})
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        message = r.readline().decode().strip()
    if message == "ok":
        print(f"hintfs mounted at {os.path.abspath(mountpoint)} (pid {proc.pid}, log {log_file})")
        return 0
    proc.wait(timeout=30)
    if message.startswith("error: "):
        raise UserError(message[len("error: "):])
    raise UserError(f"mount daemon exited with status {proc.returncode}; see {log_file}")

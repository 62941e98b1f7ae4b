"""The mount daemon: `python -I -m fusefs CONFIG MOUNTPOINT [--ready-fd N] [--nonempty]`.

`hintfs mount` starts it in the background (its own session, cwd /, output to the log file) and
waits on the ready fd for one line: `ok` once the mount answers, or `error: <reason>`. Started
any other way (without `-I`, or elsewhere than in `/`), it re-executes itself so first
(hintfs.common.procs.become_isolated_daemon).
`hintfs mount --foreground` (systemd) calls `serve` in its own process. A refusal is one line on
stderr (and on the ready fd), exit 1.
"""
from __future__ import annotations

import argparse
import os
import sys

from hintfs.common.logsetup import setup_logging
from hintfs.common.procs import absolute_paths, become_isolated_daemon, exit_after_unmount
from fusefs.mount import MountError, run_mount
from mountconfig import ConfigError, MountConfig, load_config
from mountconfig.load import allow_nonempty


def serve(cfg: MountConfig, mountpoint: str, ready_fd: int | None = None) -> int:
    """Set up logging, mount and serve until unmounted. A MountError is reported on `ready_fd`
    (`error: ...`), then raised."""
    setup_logging(cfg.logging.level, cfg.logging.file)

    def on_ready() -> None:
        if ready_fd is not None:
            os.write(ready_fd, b"ok\n")
            os.close(ready_fd)

    try:
        return run_mount(cfg, mountpoint, on_ready=on_ready)
    except MountError as err:
        if ready_fd is not None:
            os.write(ready_fd, f"error: {err}\n".encode())
        raise


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusefs", description="the hintfs mount daemon "
                                "(started by `hintfs mount`)")
    p.add_argument("config", help="mount config (TOML)")
    p.add_argument("mountpoint", help="an empty folder (unless --nonempty)")
    p.add_argument("--ready-fd", type=int, default=None, help="write `ok` or `error: ...` here")
    p.add_argument("--nonempty", action="store_true", help="mount even if the folder holds files "
                   "([mount] nonempty = true)")
    args = p.parse_args(argv)
    if argv is None:      # this process's own command line: run isolated, in / (hintfs.common.procs)
        args.config, args.mountpoint = absolute_paths(args.config, args.mountpoint)
        ready = ["--ready-fd", str(args.ready_fd)] if args.ready_fd is not None else []
        nonempty = ["--nonempty"] if args.nonempty else []
        become_isolated_daemon("fusefs", [args.config, args.mountpoint, *ready, *nonempty])
    try:
        cfg = load_config(args.config)
        return serve(allow_nonempty(cfg) if args.nonempty else cfg, args.mountpoint, args.ready_fd)
    except (ConfigError, MountError) as err:
        print(f"hintfs mount: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    exit_after_unmount(main())

"""The `hintfs` command. User mistakes print one line and exit non-zero, never a traceback."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time

from common.secrets import read_token_file

from agent.rpc import MAX_READ_BYTES

from common.procs import daemon_python, pid_alive

log = logging.getLogger("hintfs")


class UserError(Exception):
    pass


def _setup_logging(level: str, file: str | None) -> None:
    handler = logging.FileHandler(file) if file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    logging.getLogger("hintfs").setLevel(level)
    root.setLevel(logging.WARNING)


def _load(path: str):
    from mountconfig import ConfigError, load_config
    try:
        return load_config(path)
    except ConfigError as err:
        raise UserError(str(err)) from None


def default_log_file(mountpoint: str) -> str:
    name = os.path.abspath(mountpoint).strip("/").replace("/", "-") or "root"
    return f"/var/log/hintfs/mount-{name}.log"


# -- mount ---------------------------------------------------------------------------------------
def cmd_mount(args) -> int:
    from fusefs.mount import MountError, check_fuse_device, check_mountpoint, run_mount

    cfg = _load(args.config)
    mountpoint = args.mountpoint
    if args.foreground:
        _setup_logging(cfg.logging.level, cfg.logging.file)
        ready_fd = args.ready_fd

        def on_ready():
            if ready_fd is not None:
                os.write(ready_fd, b"ok\n")
                os.close(ready_fd)

        try:
            return run_mount(cfg, mountpoint, on_ready=on_ready)
        except MountError as err:
            if ready_fd is not None:
                os.write(ready_fd, f"error: {err}\n".encode())
            raise UserError(str(err)) from None

    # Background: check what we can here (fast, clear errors), then start the daemon and wait
    # until it says the mount answers, or relay its one-line error.
    try:
        check_mountpoint(mountpoint)
        check_fuse_device()
    except MountError as err:
        raise UserError(str(err)) from None
    log_file = cfg.logging.file or default_log_file(mountpoint)
    os.makedirs(os.path.dirname(log_file), exist_ok=True)
    rfd, wfd = os.pipe()
    cmd = [*daemon_python(), "-m", "hintfs.cli", "mount", os.path.abspath(args.config),
           os.path.abspath(mountpoint), "--foreground", "--ready-fd", str(wfd)]
    with open(log_file, "ab") as logf:
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


# -- umount --------------------------------------------------------------------------------------
def _read_stats(mountpoint: str) -> dict:
    path = os.path.join(mountpoint, ".hintfs", "stats")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"{mountpoint} is not a hintfs mount") from None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror}") from None


def cmd_umount(args) -> int:
    mp = os.path.abspath(args.mountpoint)
    if not os.path.ismount(mp):
        raise UserError(f"{mp} is not mounted")
    try:
        pid = _read_stats(mp)["pid"]
    except UserError:
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


# -- status --------------------------------------------------------------------------------------
def format_status(snap: dict) -> str:
    lines = [f"hintfs pid {snap['pid']}, up {snap['uptime_s']:.0f}s",
             f"bytes read {snap['bytes']['read']:,}  written {snap['bytes']['written']:,}  "
             f"uploaded {snap['bytes']['uploaded']:,}",
             "cache: " + ", ".join(f"{k} {v:,}" for k, v in snap["cache"].items())]
    if snap.get("errors"):
        import errno as errno_mod
        lines.append("errors by errno: " + ", ".join(
            f"{errno_mod.errorcode.get(int(k), k)} {v:,}" for k, v in snap["errors"].items()))
        if str(errno_mod.ENOENT) in snap["errors"]:
            lines.append("  (ENOENT counts lookups of names that do not exist: normal for cp, shells, loaders)")
    lines.append(f"{'op':<12}{'count':>10}{'errors':>8}{'p50 µs':>10}{'p99 µs':>10}{'max µs':>12}")
    for name, o in snap["ops"].items():
        lines.append(f"{name:<12}{o['count']:>10,}{o['errors']:>8}{o['p50_us']:>10.1f}{o['p99_us']:>10.1f}"
                     f"{o['max_us']:>12.1f}")
    return "\n".join(lines)


def cmd_status(args) -> int:
    mp = os.path.abspath(args.mountpoint)
    snap = _read_stats(mp)
    print(json.dumps(snap, indent=2) if args.json else format_status(snap))
    return 0


# -- other verbs ---------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    from hintfs.demo import run_demo
    return run_demo(keep=args.keep)


def cmd_config_doc(args) -> int:
    from mountconfig.docs import render_config_doc
    sys.stdout.write(render_config_doc())
    return 0


def cmd_agent(args) -> int:
    cfg = _load(args.config)
    _setup_logging(cfg.logging.level, cfg.logging.file)
    from agent.server import run_agent
    from fusefs.mount import MountError
    try:
        return run_agent(cfg)
    except MountError as err:
        raise UserError(str(err)) from None
    except OSError as err:
        raise UserError(f"agent: {err.strerror or err}") from None


def cmd_hints(args) -> int:
    from hintfs import client
    mp = os.path.abspath(args.mountpoint)
    if args.action == "set":
        if args.from_dcp:
            files = client.hints_from_dcp(args.from_dcp, args.world_size)
            prefix = os.path.relpath(os.path.abspath(args.from_dcp), mp)
            if prefix.startswith(".."):
                raise UserError(f"{args.from_dcp} is not inside the mount {mp}")
            files = {os.path.normpath(os.path.join(prefix, p)): n for p, n in files.items()}
        elif args.file:
            with open(args.file) as f:
                files = json.load(f)
        else:
            raise UserError("hints set needs --from-dcp DIR --world-size N or --file FILES.json")
        try:
            client.set_replication_hints(mp, args.job, files, ttl_s=args.ttl, deadline_s=args.deadline)
        except ValueError as err:
            raise UserError(str(err)) from None
        print(f"hint {args.job}: {len(files)} files")
        return 0
    if args.action == "calibrate":   # the older spelling: hintfs hints calibrate - - --agent ...
        return cmd_calibrate(args)
    if args.action == "wait":
        try:
            status = client.wait_for_replicas(mp, args.job, timeout_s=args.timeout)
        except TimeoutError as err:
            raise UserError(str(err)) from None
        except KeyError as err:
            raise UserError(str(err.args[0])) from None
        print(f"hint {args.job}: all {len(status['files'])} files have their replicas")
        return 0
    print(json.dumps(client.replica_status(mp, args.job), indent=2))
    return 0


def cmd_calibrate(args) -> int:
    """Measure how many concurrent readers one replica serves (safe_readers_per_replica)."""
    from agent.client import AgentClient
    from hintfs.calibrate import calibrate
    if not args.agent or not args.path:
        raise UserError("calibrate needs --agent LOCATION --path RELPATH (a file in the store)")
    try:
        token = read_token_file(args.token_file) if args.token_file else None
    except OSError as err:
        raise UserError(err.strerror or str(err)) from None
    size = (len(AgentClient(args.agent, token=token).read(args.path, 0, MAX_READ_BYTES))
            if args.size is None else args.size)
    result = calibrate(args.agent, args.path, size, args.max_readers, args.seconds, args.block, token)
    for row in result["levels"]:
        print(f"{row['readers']:>5} readers: {row['reads_per_s']:>9.1f} reads/s  p50 {row['p50_ms']:.2f} ms"
              f"  p99 {row['p99_ms']:.2f} ms")
    print(f"safe_readers_per_replica = {result['safe_readers_per_replica']}")
    return 0


def cmd_governor(args) -> int:
    try:
        from governor.cli import main as governor_main
    except ImportError as err:
        raise UserError(f"the governor is not available: {err}") from None
    return governor_main(args.config)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hintfs", description="A FUSE view over an existing store, told ahead "
                                "of time what training jobs will read.")
    sub = p.add_subparsers(dest="verb", required=True)

    m = sub.add_parser("mount", help="mount a store (background unless --foreground)")
    m.add_argument("config", help="mount config (TOML)")
    m.add_argument("mountpoint")
    m.add_argument("--foreground", "-f", action="store_true", help="stay in the foreground (systemd)")
    m.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    m.set_defaults(func=cmd_mount)

    u = sub.add_parser("umount", help="unmount cleanly (waits for pending uploads)")
    u.add_argument("mountpoint")
    u.add_argument("--timeout", type=float, default=30.0)
    u.set_defaults(func=cmd_umount)

    s = sub.add_parser("status", help="live summary of a mount's stats")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    d = sub.add_parser("demo", help="mount a generated workspace, run a workload, print a summary")
    d.add_argument("--keep", action="store_true", help="keep the workspace afterwards")
    d.set_defaults(func=cmd_demo)

    c = sub.add_parser("config-doc", help="print the config reference (docs/config.md)")
    c.set_defaults(func=cmd_config_doc)

    a = sub.add_parser("agent", help="run a storage agent (Arrow Flight) on this node")
    a.add_argument("config")
    a.set_defaults(func=cmd_agent)

    def calibrate_options(parser) -> None:
        parser.add_argument("--agent", help="calibrate: the agent's Flight location")
        parser.add_argument("--path", help="calibrate: a store file to read")
        parser.add_argument("--size", type=int, default=None, help="calibrate: the file's size (read once if unset)")
        parser.add_argument("--token-file", default=None)
        parser.add_argument("--max-readers", type=int, default=256)
        parser.add_argument("--seconds", type=float, default=2.0)
        parser.add_argument("--block", type=int, default=1 << 20)

    h = sub.add_parser("hints", help="replication hints: set, wait, status")
    h.add_argument("action", choices=["set", "wait", "status", "calibrate"])
    h.add_argument("mountpoint", help="the mount")
    h.add_argument("job", help="the job's name")
    calibrate_options(h)
    h.add_argument("--from-dcp", help="derive the hint from a DCP checkpoint directory inside the mount")
    h.add_argument("--world-size", type=int, default=1)
    h.add_argument("--file", help="JSON {relpath: expected_readers}")
    h.add_argument("--ttl", type=float, default=600.0)
    h.add_argument("--deadline", type=float, default=300.0)
    h.add_argument("--timeout", type=float, default=None)
    h.set_defaults(func=cmd_hints)

    cal = sub.add_parser("calibrate", help="measure the concurrent readers one replica serves "
                         "(sets replicas.safe_readers_per_replica)")
    calibrate_options(cal)
    cal.set_defaults(func=cmd_calibrate)

    from hintfs.plan import add_plan_parser
    add_plan_parser(sub)

    g = sub.add_parser("governor", help="run the GPU-memory governor")
    g.add_argument("config")
    g.set_defaults(func=cmd_governor)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verb not in ("mount",):
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except UserError as err:
        print(f"hintfs {args.verb}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

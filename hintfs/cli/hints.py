"""`hintfs hints set|wait|status MOUNTPOINT JOB`: replication hints (hintfs.client);
`hintfs hints plan CHECKPOINT_DIR --world-size N`: how many replicas to ask for (hintfs/cli/hints_plan.py)."""
from __future__ import annotations

import json
import os

from hintfs.common import paths
from hintfs import client
from hintfs.cli.base import UserError, hintfs_mount, read_json_file
from hintfs.cli.calibrate import add_options as add_calibrate_options, cmd_calibrate
from hintfs.cli.hints_plan import add_options as add_plan_options, cmd_plan


def add_parser(subparsers) -> None:
    h = subparsers.add_parser("hints", help="replication hints: set, wait, status; plan how many replicas")
    h.add_argument("action", choices=["set", "wait", "status", "plan", "calibrate"],
                   help="set, wait, status: a job's hint on a mount; plan: how many replicas of which files "
                        "to ask for, with the load time predicted with and without them")
    h.add_argument("mountpoint", nargs="?", metavar="MOUNTPOINT|CHECKPOINT_DIR",
                   help="set, wait, status: the mount; plan: the DCP checkpoint folder")
    h.add_argument("job", nargs="?", metavar="JOB", help="set, wait, status: the job's name (plan takes none)")
    add_calibrate_options(h)
    h.add_argument("--from-dcp", help="set: derive the hint from a DCP checkpoint directory inside the mount")
    h.add_argument("--world-size", type=int, default=None,
                   help="set --from-dcp, plan: how many ranks load the checkpoint (set: 1 if not given)")
    h.add_argument("--file", help="set: a JSON file {relpath: expected_readers}")
    h.add_argument("--ttl", type=float, default=600.0, help="set: seconds the replicas are kept (default 600)")
    h.add_argument("--deadline", type=float, default=300.0,
                   help="set: seconds the replicas should be ready in (default 300)")
    h.add_argument("--timeout", type=float, default=None, help="wait: give up after this many seconds")
    add_plan_options(h)
    h.set_defaults(func=cmd_hints, hints_parser=h)


def _files_doc(args) -> dict:
    files = read_json_file(args.file, "--file")
    if not isinstance(files, dict):
        raise UserError(f"--file {args.file}: expected a JSON object {{relpath: expected_readers}}, "
                        f"not {type(files).__name__}")
    return files


def _unknown_job(mp: str, job: str) -> UserError:
    return UserError(f"no hint job {job!r} on {mp}: set one first (`hintfs hints set {mp} {job} ...`)")


def cmd_hints(args) -> int:
    if args.action == "calibrate":   # the older spelling: hintfs hints calibrate - - --agent ...
        return cmd_calibrate(args)
    if args.action == "plan":
        return cmd_plan(args)
    missing = [name for name in ("mountpoint", "job") if getattr(args, name) is None]
    if missing:   # a usage error, as argparse words it (the positionals are optional for `plan`)
        args.hints_parser.error(f"the following arguments are required: {', '.join(missing)}")
    if args.world_size is None:
        args.world_size = 1
    files = _files_doc(args) if args.action == "set" and args.file and not args.from_dcp else None
    mp = hintfs_mount(args.mountpoint)
    if args.action == "set":
        if args.from_dcp:
            files = client.hints_from_dcp(args.from_dcp, args.world_size)
            prefix = paths.inside(mp, args.from_dcp)
            if prefix is None:
                raise UserError(f"{args.from_dcp} is not inside the mount {mp}")
            files = {os.path.normpath(os.path.join(prefix, p)): n for p, n in files.items()}
        elif files is None:
            raise UserError("hints set needs --from-dcp DIR --world-size N or --file FILES.json")
        try:
            client.set_replication_hints(mp, args.job, files, ttl_s=args.ttl, deadline_s=args.deadline)
        except ValueError as err:
            raise UserError(f"{err} (the hint was not applied)") from None
        except OSError as err:
            raise UserError(f"cannot write the hint {args.job!r}: {err.strerror}") from None
        print(f"hint {args.job}: {len(files)} files")
        return 0
    if args.action == "wait":
        try:
            status = client.wait_for_replicas(mp, args.job, timeout_s=args.timeout)
        except TimeoutError as err:
            files = getattr(err, "status", {}).get("files", {})
            late = sum(1 for v in files.values() if v["ready"] < v["target"])
            raise UserError(f"replicas of job {args.job!r} not ready for {late} of {len(files)} files in time: "
                            f"`hintfs hints status {mp} {args.job}` shows which") from None
        except (KeyError, FileNotFoundError):
            raise _unknown_job(mp, args.job) from None
        print(f"hint {args.job}: all {len(status['files'])} files have their replicas")
        return 0
    try:
        status = client.replica_status(mp, args.job)
    except FileNotFoundError:
        raise _unknown_job(mp, args.job) from None
    if not status:
        raise _unknown_job(mp, args.job)
    print(json.dumps(status, indent=2))
    return 0

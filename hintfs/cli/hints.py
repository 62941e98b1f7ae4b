"""`hintfs hints set|wait|status MOUNTPOINT JOB`: replication hints (hintfs.client)."""
from __future__ import annotations

import json
import os

from hintfs.common import paths
from hintfs import client
from hintfs.cli.base import UserError, hintfs_mount, read_json_file
from hintfs.cli.calibrate import add_options as add_calibrate_options, cmd_calibrate


def add_parser(subparsers) -> None:
    h = subparsers.add_parser("hints", help="replication hints: set, wait, status")
    h.add_argument("action", choices=["set", "wait", "status", "calibrate"])
    h.add_argument("mountpoint", help="the mount")
    h.add_argument("job", help="the job's name")
    add_calibrate_options(h)
    h.add_argument("--from-dcp", help="derive the hint from a DCP checkpoint directory inside the mount")
    h.add_argument("--world-size", type=int, default=1)
    h.add_argument("--file", help="JSON {relpath: expected_readers}")
    h.add_argument("--ttl", type=float, default=600.0)
    h.add_argument("--deadline", type=float, default=300.0)
    h.add_argument("--timeout", type=float, default=None)
    h.set_defaults(func=cmd_hints)


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

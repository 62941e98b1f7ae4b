"""`hintfs hints set|wait|status MOUNTPOINT JOB`: replication hints (hintfs.client);
`hintfs hints plan CHECKPOINT_DIR --world-size N`: how many replicas to ask for (hintfs/cli/hints_plan.py).
Each action is a subparser of its own: its --help lists only its own options."""
from __future__ import annotations

import argparse
import json
import os

from hintfs.common import paths
from hintfs import client
from hintfs.cli.base import UserError, hintfs_mount, read_json_file
from hintfs.cli.calibrate import add_options as add_calibrate_options, cmd_calibrate
from hintfs.cli.hints_plan import add_options as add_plan_options, cmd_plan


def _mount_and_job(parser) -> None:
    parser.add_argument("mountpoint", help="the mountpoint of a running `hintfs mount`")
    parser.add_argument("job", help="the job's name (the hint's name on the mount)")


def add_parser(subparsers) -> None:
    """`hints ACTION ...`: one subparser per action, each with only its own options."""
    h = subparsers.add_parser("hints", help="replication hints: set, wait, status; plan how many replicas")
    sub = h.add_subparsers(dest="hints_action", required=True, metavar="ACTION")

    s = sub.add_parser("set", help="tell a mount which files JOB will read, and by how many readers")
    _mount_and_job(s)
    s.add_argument("--from-dcp", metavar="DIR",
                   help="derive the hint from a DCP checkpoint directory inside the mount")
    s.add_argument("--world-size", type=int, default=1, metavar="N",
                   help="with --from-dcp: how many ranks load the checkpoint (default 1)")
    s.add_argument("--file", metavar="FILES.json", help="a JSON file {relpath: expected_readers}")
    s.add_argument("--ttl", type=float, default=600.0, metavar="S",
                   help="seconds the replicas are kept (default 600)")
    s.add_argument("--deadline", type=float, default=300.0, metavar="S",
                   help="seconds the replicas should be ready in (default 300)")
    s.set_defaults(func=cmd_set)

    w = sub.add_parser("wait", help="block until JOB's replicas are ready")
    _mount_and_job(w)
    w.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="give up (exit 1) after this many seconds (default: wait for the hint's deadline)")
    w.set_defaults(func=cmd_wait)

    st = sub.add_parser("status", help="print JOB's replicas per file (JSON)")
    _mount_and_job(st)
    st.set_defaults(func=cmd_status)

    p = sub.add_parser("plan", help="how many replicas of which files to ask for, and the load time predicted "
                       "with and without them (no mount needed)")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="the DCP checkpoint folder (holding .metadata)")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="how many ranks load the checkpoint (required)")
    add_plan_options(p)
    p.set_defaults(func=cmd_plan)

    # The older spelling `hintfs hints calibrate - - --agent ...`: still accepted, not listed
    # (`hintfs calibrate` is the verb).
    c = sub.add_parser("calibrate")
    c.add_argument("placeholders", nargs="*", help=argparse.SUPPRESS)
    add_calibrate_options(c)
    c.set_defaults(func=cmd_calibrate)


def _files_doc(args) -> dict:
    files = read_json_file(args.file, "--file")
    if not isinstance(files, dict):
        raise UserError(f"--file {args.file}: expected a JSON object {{relpath: expected_readers}}, "
                        f"not {type(files).__name__}")
    return files


def _unknown_job(mp: str, job: str) -> UserError:
    return UserError(f"no hint job {job!r} on {mp}: set one first (`hintfs hints set {mp} {job} ...`)")


def cmd_set(args) -> int:
    files = _files_doc(args) if args.file and not args.from_dcp else None
    mp = hintfs_mount(args.mountpoint)
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


def cmd_wait(args) -> int:
    mp = hintfs_mount(args.mountpoint)
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


def cmd_status(args) -> int:
    mp = hintfs_mount(args.mountpoint)
    try:
        status = client.replica_status(mp, args.job)
    except FileNotFoundError:
        raise _unknown_job(mp, args.job) from None
    if not status:
        raise _unknown_job(mp, args.job)
    print(json.dumps(status, indent=2))
    return 0

"""`hintfs hints set|wait|status MOUNTPOINT JOB`: replication hints (hintfs.client)."""
from __future__ import annotations

import json
import os

from hintfs import client
from hintfs.cli.calibrate import add_options as add_calibrate_options, cmd_calibrate
from hintfs.cli.base import UserError


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


def cmd_hints(args) -> int:
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

"""`hintfs status MOUNTPOINT [--json]`: the mount's live stats."""
from __future__ import annotations

import json
import os

from hintfs.cli.base import UserError
from hintfs.status import StatsUnavailable, format_status, read_stats


def add_parser(subparsers) -> None:
    s = subparsers.add_parser("status", help="live summary of a mount's stats")
    s.add_argument("mountpoint", help="the mountpoint of a running `hintfs mount`")
    s.add_argument("--json", action="store_true", help="print the raw stats (JSON) instead of the summary")
    s.set_defaults(func=cmd_status)


def cmd_status(args) -> int:
    try:
        snap = read_stats(os.path.abspath(args.mountpoint))
    except StatsUnavailable as err:
        raise UserError(str(err)) from None
    print(json.dumps(snap, indent=2) if args.json else format_status(snap))
    return 0

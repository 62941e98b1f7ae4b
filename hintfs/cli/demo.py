"""`hintfs demo [--keep]`: mount a generated workspace, run a workload, print a summary."""
from __future__ import annotations

from hintfs.demo import run_demo


def add_parser(subparsers) -> None:
    d = subparsers.add_parser("demo", help="mount a generated workspace, run a workload, print a summary")
    d.add_argument("--keep", action="store_true", help="keep the workspace afterwards")
    d.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    return run_demo(keep=args.keep)

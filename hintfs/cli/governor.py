"""`hintfs governor CONFIG`: run the GPU-memory governor (governor.cli) in this process. The
governor is optional: without it, the verb says so in one line."""
from __future__ import annotations

from hintfs.cli.base import UserError


def add_parser(subparsers) -> None:
    g = subparsers.add_parser("governor", help="run the GPU-memory governor")
    g.add_argument("config")
    g.set_defaults(func=cmd_governor)


def cmd_governor(args) -> int:
    try:
        from governor.cli import main as governor_main
    except ImportError as err:
        raise UserError(f"the governor is not available: {err}") from None
    return governor_main(args.config)

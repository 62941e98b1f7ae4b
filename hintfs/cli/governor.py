"""`hintfs governor CONFIG`: run the GPU-memory governor (hintfs.governor.cli) in this process,
isolated (`python -I` in `/`: hintfs.cli.main re-executes it first). The governor is optional:
without it, the verb says so in one line."""
from __future__ import annotations

from hintfs.cli.base import UserError, absolute_args


def add_parser(subparsers) -> None:
    g = subparsers.add_parser("governor", help="run the GPU-memory governor")
    g.add_argument("config", help="TOML file whose [governor] table configures it (other tables are "
                   "ignored; none: the defaults, docs/config.md). It logs to stderr and runs until "
                   "SIGTERM or Ctrl-C")
    g.set_defaults(func=cmd_governor, daemon=daemon_argv)


def daemon_argv(args) -> list[str]:
    """The command line that runs this governor again from `/` (hintfs.cli.main: daemons run isolated)."""
    return ["governor", *absolute_args(args, "config")]


def cmd_governor(args) -> int:
    try:
        from hintfs.governor.cli import main as governor_main
    except ImportError as err:
        raise UserError(f"the governor is not available: {err}") from None
    return governor_main(args.config)

"""`hintfs agent CONFIG`: run the storage agent (Arrow Flight) in this process."""
from __future__ import annotations

from agent.server import run_agent
from common.logsetup import setup_logging
from hintfs.cli.base import UserError, load_config


def add_parser(subparsers) -> None:
    a = subparsers.add_parser("agent", help="run a storage agent (Arrow Flight) on this node")
    a.add_argument("config")
    a.set_defaults(func=cmd_agent)


def cmd_agent(args) -> int:
    cfg = load_config(args.config)
    setup_logging(cfg.logging.level, cfg.logging.file)
    try:
        return run_agent(cfg)
    except OSError as err:
        raise UserError(f"agent: {err.strerror or err}") from None

"""The `hintfs` command: one module per verb, each `add_parser(subparsers)` and its `cmd_*`
(parse, call, print). User mistakes print one line and exit non-zero, never a traceback."""
from __future__ import annotations

import argparse
import sys

from hintfs.cli import (agent, calibrate, config_doc, demo, governor, hints, mount, plan, status,
                        umount)
from hintfs.cli.base import UserError, basic_logging

__all__ = ["UserError", "build_parser", "main"]

VERBS = (mount, umount, status, demo, config_doc, agent, hints, calibrate, plan, governor)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hintfs", description="A FUSE view over an existing store, told ahead "
                                "of time what training jobs will read.")
    sub = p.add_subparsers(dest="verb", required=True)
    for verb in VERBS:
        verb.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verb not in ("mount",):
        basic_logging()
    try:
        return args.func(args)
    except UserError as err:
        print(f"hintfs {args.verb}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

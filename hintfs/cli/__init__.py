"""The `hintfs` command: one module per verb, each `add_parser(subparsers)` and its `cmd_*`
(parse, call, print).

Errors are handled here, in one place: whatever a verb raises becomes one line on stderr,
`hintfs VERB: what is wrong (what to do)`, and a non-zero exit (hintfs/cli/errors.py maps the
exception types); `--debug` (or HINTFS_DEBUG=1) shows the traceback instead. Usage mistakes are
one line too (exit 2)."""
from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import PackageNotFoundError, version

from hintfs.cli import (agent, calibrate, config_doc, demo, governor, hints, mount, plan, status,
                        umount)
from hintfs.cli.base import UserError, basic_logging
from hintfs.cli.errors import one_line
from hintfs.cli.helptext import HELP

__all__ = ["UserError", "build_parser", "main"]

VERBS = (mount, umount, status, demo, config_doc, agent, hints, calibrate, plan, governor)


def package_version() -> str:
    try:
        return version("hintfs")
    except PackageNotFoundError:   # running from a checkout that was never installed
        return "unknown (not installed)"


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: `hintfs VERB: problem (see hintfs VERB --help)`."""

    def error(self, message: str):   # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _finish(parser: argparse.ArgumentParser, name: str) -> None:
    """Description, examples and --debug on a verb's parser and on its own subcommands."""
    if name in HELP:
        parser.description, examples = HELP[name]
        parser.epilog = "examples:\n" + examples
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
    # SUPPRESS: the subcommand's default must not overwrite `hintfs --debug VERB`.
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show a traceback instead of a one-line error")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                _finish(sub, f"{name} {sub_name}")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="hintfs", description="A FUSE view over an existing store, told ahead of time what "
               "training jobs will read.", epilog="`hintfs VERB --help` describes a verb, with examples.")
    p.add_argument("--version", action="version", version=f"hintfs {package_version()}")
    p.add_argument("--debug", action="store_true", default=False,
                   help="show a traceback instead of a one-line error")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb in VERBS:
        verb.add_parser(sub)
    for name, parser in sub.choices.items():
        _finish(parser, name)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("HINTFS_DEBUG", "") not in ("", "0")
    if args.verb not in ("mount",):
        basic_logging()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except SystemExit:
        raise
    except Exception as err:
        if debug:
            raise
        print(f"hintfs {args.verb}: {one_line(err)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

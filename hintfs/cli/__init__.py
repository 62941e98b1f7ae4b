"""The `hintfs` command: one module per verb, each `add_parser(subparsers)` and its `cmd_*`
(parse, call, print).

Errors are handled here, in one place: whatever a verb raises becomes one line on stderr,
`hintfs VERB: what is wrong (what to do)`, and a non-zero exit (hintfs/cli/errors.py maps the
exception types); `--debug` (or HINTFS_DEBUG=1) shows the traceback instead. Usage mistakes are
one line too (exit 2).

A verb that runs a daemon in this process (`agent`, `governor`, `mount --foreground`: each sets
`daemon` in its parser's defaults) never runs it in the interpreter the command was started in,
nor in the caller's folder (hintfs.common.procs.become_isolated_daemon, docs/security.md "Processes"):
`main` first re-executes `python -I -m hintfs.cli ...` (ISOLATED_VERBS: also the verbs root runs
to start or stop a mount), before it imports any verb (this module imports only the standard
library and hintfs.common.procs up to there), so that neither the caller's folder nor PYTHONPATH
reaches the daemon or any interpreter it starts; once parsed, a daemon makes its paths absolute
and moves to `/`."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from hintfs.common.procs import become_isolated_daemon

__all__ = ["UserError", "build_parser", "main"]

VERBS = ("mount", "umount", "status", "demo", "config_doc", "agent", "hints", "calibrate", "plan", "governor")
# Verbs that run isolated (`python -I`) from their first import on: those that run a daemon in
# this process (`agent`, `governor`, `mount --foreground`) and those root runs to start or stop
# one. The others run as the job's user, whose PYTHONPATH or user site-packages may hold what
# they need (torch for `hintfs hints dcp`).
ISOLATED_VERBS = ("agent", "governor", "mount", "umount", "demo")


def __getattr__(name: str):
    if name == "UserError":            # (imported on use: it brings the config schema)
        from hintfs.cli.base import UserError
        return UserError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("hintfs")
    except PackageNotFoundError:   # running from a checkout that was never installed
        return "unknown (not installed)"


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: `hintfs VERB: problem (see hintfs VERB --help)`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        # A verb (or `hints set`, `plan show`) says itself which words it does not know, so the
        # line names it and its --help (argparse would leave that to the top parser: `hintfs: ...`).
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self.prog != "hintfs" and not any(
                isinstance(a, argparse._SubParsersAction) for a in self._actions):
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _finish(parser: argparse.ArgumentParser, name: str) -> None:
    """Description, examples and --debug on a verb's parser and on its own subcommands."""
    from hintfs.cli.helptext import HELP
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
    for name in VERBS:
        importlib.import_module(f"hintfs.cli.{name}").add_parser(sub)
    for name, parser in sub.choices.items():
        _finish(parser, name)
    return p


def runs_isolated(argv: list[str]) -> bool:
    """Whether the command line `argv` (not parsed yet) names one of ISOLATED_VERBS."""
    verb = next((a for a in argv if not a.startswith("-")), None)
    return verb in ISOLATED_VERBS


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
        if not sys.flags.isolated and runs_isolated(argv):
            # Not one module of a verb (pyarrow, trio, multiprocessing ...) imported yet: paths are
            # still relative to the caller's folder, which a daemon leaves below.
            become_isolated_daemon("hintfs.cli", argv, keep_cwd=True)
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("HINTFS_DEBUG", "") not in ("", "0")
    from hintfs.cli.base import basic_logging
    from hintfs.cli.errors import one_line
    if args.verb not in ("mount",):
        basic_logging()
    try:
        daemon = getattr(args, "daemon", None)
        daemon_argv = daemon(args) if daemon is not None else None
        if daemon_argv is not None:
            # paths made absolute in `args` and `daemon_argv`: now into `/` (re-executed if the
            # first step did not run, e.g. `main([...])` called from Python, or if the words
            # differ, so that `ps` shows the absolute paths)
            # (--debug after the verb's words: the command line reads `hintfs.cli VERB ...`, as
            # `hintfs umount` expects of a mount daemon's, hintfs.common.mounts)
            become_isolated_daemon("hintfs.cli", daemon_argv + (["--debug"] if args.debug else []))
        code: int = args.func(args)
        return code
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

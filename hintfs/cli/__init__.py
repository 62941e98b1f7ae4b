"""The `hintfs` command: one module per verb, each `add_parser(subparsers)` and its `cmd_*`
(parse, call, print).

Errors are handled here, in one place: whatever a verb raises becomes one line on stderr,
`hintfs VERB: what is wrong (what to do)`, and a non-zero exit (hintfs/cli/errors.py maps the
exception types); `--debug` (or HINTFS_DEBUG=1) shows the traceback instead. Usage mistakes are
one line too (exit 2).

A verb that runs a daemon in this process (`agent`, `governor`, `mount --foreground`: each sets
`daemon` in its parser's defaults) never runs it in the interpreter the command was started in:
`main` first re-executes `python -I -m hintfs.cli ...` in `/` (common.procs.become_isolated_daemon,
docs/security.md "Processes"), so that neither the caller's folder nor PYTHONPATH reaches the
daemon or any interpreter it starts. It does so before it imports the verbs (this module imports
only the standard library and common.procs up to there), and once more, with the paths made
absolute, after parsing."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from common.procs import become_isolated_daemon

__all__ = ["UserError", "build_parser", "main"]

VERBS = ("mount", "umount", "status", "demo", "config_doc", "agent", "hints", "calibrate", "plan", "governor")
DAEMON_VERBS = ("agent", "governor")      # and `mount` with --foreground


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

    def error(self, message: str):   # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


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


def may_run_a_daemon(argv: list[str]) -> bool:
    """Whether the command line `argv` may run a daemon in this process, before it is parsed:
    `agent`, `governor`, or `mount` with an option that may be --foreground (`-f`, in a group
    of short options, or an abbreviation). Errs on yes: a wrong yes costs one exec of the
    interpreter; a wrong no is still caught after parsing, only later."""
    verb_at = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if verb_at is None:
        return False
    verb, rest = argv[verb_at], argv[verb_at + 1:]
    if verb in DAEMON_VERBS:
        return True
    return verb == "mount" and any(a.startswith("--f") or (a[:1] == "-" and a[1:2] != "-" and "f" in a)
                                   for a in rest)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
        if not sys.flags.isolated and may_run_a_daemon(argv):
            # Not one module of a verb (pyarrow, trio, multiprocessing ...) imported yet: paths are
            # still relative to the caller's folder, which the second step below leaves.
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
            # first step did not run, e.g. `main([...])` called from Python)
            become_isolated_daemon("hintfs.cli", (["--debug"] if args.debug else []) + daemon_argv)
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

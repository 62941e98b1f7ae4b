"""What every verb shares: `UserError` (a user's mistake: one line, exit 1, never a traceback),
loading the config into a UserError, and the logging of the short-lived verbs."""
from __future__ import annotations

import json
import logging
import os

from hintfs.common.logline import one_line_logs
from mountconfig import ConfigError, MountConfig
from mountconfig import load_config as _load_config


class UserError(Exception):
    pass


def load_config(path: str) -> MountConfig:
    try:
        return _load_config(path)
    except ConfigError as err:
        raise UserError(str(err)) from None


def absolute_args(args, *names: str) -> list[str]:
    """Make the path arguments `names` of a daemon verb absolute in `args`, and return them: the
    daemon leaves the caller's folder before it reads them (`hintfs.cli.main`, hintfs.common.procs)."""
    for name in names:
        setattr(args, name, os.path.abspath(getattr(args, name)))
    return [getattr(args, name) for name in names]


def basic_logging() -> None:
    """Warnings and errors to stderr, for the verbs that do not run a daemon in this process."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    one_line_logs()


def hintfs_mount(path: str) -> str:
    """`path` as an absolute path, if it is a hintfs mount (its `.hintfs/` answers); else a
    UserError saying what to give instead."""
    mp = os.path.abspath(path)
    if not os.path.isdir(mp):
        raise UserError(f"{mp}: no such directory (give the mountpoint of a running `hintfs mount`)")
    try:
        os.stat(os.path.join(mp, ".hintfs"))
    except FileNotFoundError:
        raise UserError(f"{mp} is not a hintfs mount (no .hintfs/ control directory): give the "
                        "mountpoint of a running `hintfs mount`") from None
    except OSError as err:
        raise UserError(f"{mp}: {err.strerror} (is the mount's daemon running? `hintfs status {mp}`)") from None
    return mp


def read_json_file(path: str, what: str) -> object:
    """A JSON file given on the command line (`what` names the option), or a UserError."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as err:
        raise UserError(f"{what} {path}: {err.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        reason = (f"{err.msg} at line {err.lineno} column {err.colno}" if isinstance(err, json.JSONDecodeError)
                  else "not UTF-8")
        raise UserError(f"{what} {path}: invalid JSON: {reason}") from None

"""What every verb shares: `UserError` (a user's mistake: one line, exit 1, never a traceback),
loading the config into a UserError, and the logging of the short-lived verbs."""
from __future__ import annotations

import logging

from mountconfig import ConfigError, MountConfig
from mountconfig import load_config as _load_config


class UserError(Exception):
    pass


def load_config(path: str) -> MountConfig:
    try:
        return _load_config(path)
    except ConfigError as err:
        raise UserError(str(err)) from None


def basic_logging() -> None:
    """Warnings and errors to stderr, for the verbs that do not run a daemon in this process."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

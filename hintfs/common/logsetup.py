"""Logging of a daemon (the mount, the agent): one handler, to the configured file or stderr, the
`hintfs` loggers at the configured level and everything else at WARNING."""
from __future__ import annotations

import logging
import os
import sys

from hintfs.common.logline import OneLineFormatter


def setup_logging(level: str, file: str | None) -> None:
    if file:
        # A new log file is its owner's alone (0600): the lines name paths and jobs. An existing
        # one keeps the mode its owner gave it.
        os.close(os.open(file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600))
    handler = logging.FileHandler(file) if file else logging.StreamHandler(sys.stderr)
    # One event, one line: nothing a user named (a path, a job) can start a line of its own.
    handler.setFormatter(OneLineFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    logging.getLogger("hintfs").setLevel(level)
    root.setLevel(logging.WARNING)

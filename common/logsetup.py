"""Logging of a daemon (the mount, the agent): one handler, to the configured file or stderr, the
`hintfs` loggers at the configured level and everything else at WARNING."""
from __future__ import annotations

import logging
import sys


def setup_logging(level: str, file: str | None) -> None:
    handler = logging.FileHandler(file) if file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    logging.getLogger("hintfs").setLevel(level)
    root.setLevel(logging.WARNING)

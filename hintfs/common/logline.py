"""One event, one log line: whatever a user put in a name, a path, a symlink target or a job
name, no message a hintfs daemon logs can start a line of its own.

`OneLineFormatter` wraps a handler's formatter and escapes every unprintable character of the
message (`hintfs.common.paths.printable`: `\\n`, `\\r`, `\\x1b`, `\\u2028`, ...) before it is formatted,
whatever the call site wrote (`%s` or `%r`). A traceback (`log.exception`) keeps its lines: they
follow the message, and only they may span lines. `one_line_logs()` wraps every handler of the
root logger; each daemon calls it once its logging is set up (the mount, the agent, the stream
sender, the governor, and the short-lived verbs' stderr)."""
from __future__ import annotations

import logging

from hintfs.common.paths import printable

# Marks: words of a log line that another process looks for. The mount daemon logs this (with a
# JSON list of store paths) when it abandons files still open for writing at unmount; `hintfs
# umount` finds the line in the daemon's log and prints those paths.
ABANDONED_MARK = "unmount abandoned"


class OneLineFormatter(logging.Formatter):
    """`inner`'s format, with the message escaped to one printable line."""

    def __init__(self, inner: logging.Formatter | None = None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        msg, args = record.msg, record.args
        try:
            text = record.getMessage()
        except Exception:         # a call site whose arguments do not fit: let logging report it
            return self.inner.format(record)
        record.msg, record.args = printable(text), None
        try:
            return self.inner.format(record)
        finally:
            record.msg, record.args = msg, args


def one_line_logs(logger: logging.Logger | None = None) -> None:
    """Wrap the formatter of every handler of `logger` (the root logger) in `OneLineFormatter`
    (once: a handler wrapped already is left as it is)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not isinstance(handler.formatter, OneLineFormatter):
            handler.setFormatter(OneLineFormatter(handler.formatter))


__all__ = ["OneLineFormatter", "one_line_logs"]

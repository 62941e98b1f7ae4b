"""The one place where the `hintfs` command turns an exception into one line on stderr.

`main()` (hintfs/cli/__init__.py) calls `one_line(err)` for anything a verb raises; a traceback
is printed only with `--debug` (or HINTFS_DEBUG=1). Each known exception type maps to a message
that says what is wrong and, where it helps, what to do. Verbs raise `UserError` when only they
know the context (which option, which file); everything else is mapped here by type.
"""
from __future__ import annotations

import errno
import json

import pyarrow as pa
import pyarrow.flight as fl

from hintfs.agent.rpc import without_grpc_context
from hintfs.common.errors import HintfsError
from hintfs.cli.base import UserError
from mountconfig import ConfigError

MAX_LINE = 400


def squash(text: str) -> str:
    """One line, without gRPC's debug context (useful with --debug only), at most MAX_LINE characters."""
    text = " ".join(without_grpc_context(text).split())
    return text if len(text) <= MAX_LINE else text[:MAX_LINE - 3] + "..."


def _os_error(err: OSError) -> str:
    where = f"{err.filename}: " if getattr(err, "filename", None) else ""
    reason = err.strerror or str(err)
    advice = {
        errno.ENOENT: "",
        errno.EACCES: " (run as the file's owner or as root)",
        errno.EPERM: " (run as the file's owner or as root)",
        errno.ENOTCONN: " (the mount's daemon is gone: `hintfs umount` it, then mount again)",
        errno.EADDRINUSE: " (another process listens there: stop it or choose another port)",
        errno.ECONNREFUSED: " (nothing listens there: is the daemon running?)",
    }.get(err.errno or 0, "")
    return f"{where}{reason}{advice}"


def _flight_error(err: BaseException) -> str | None:
    """Arrow and Flight errors: the agent's transport. None if `err` is not one of them."""
    text = squash(str(err))
    if isinstance(err, fl.FlightUnavailableError):
        return f"{text} (is `hintfs agent` running there, and is the location grpc://HOST:PORT right?)"
    if isinstance(err, fl.FlightUnauthenticatedError):
        return f"{text} (give the agent's token with --token-file, or [agents] token_file)"
    if isinstance(err, pa.ArrowInvalid) and "Cannot parse URI" in text:
        return f"{text}: a location is scheme://host:port, e.g. grpc://node:8815"
    if isinstance(err, pa.ArrowException) and "did not start" in text:
        return (f"the Flight server could not listen ({text}): is the port in use? "
                "Stop the other process or set another [agent] location")
    if isinstance(err, (pa.ArrowException, fl.FlightError)):
        return text
    return None


def one_line(err: BaseException) -> str:
    """What `hintfs VERB: ...` says about `err`: one line, no traceback."""
    if isinstance(err, UserError):
        return squash(str(err))
    # Our own config and document errors already name the key and the problem.
    if isinstance(err, ConfigError):
        return squash(str(err))
    if isinstance(err, HintfsError):
        return squash(err.strerror or str(err))
    if isinstance(err, json.JSONDecodeError):
        return f"invalid JSON: {err.msg} at line {err.lineno} column {err.colno}"
    flight = _flight_error(err)
    if flight is not None:
        return flight
    if isinstance(err, OSError):
        # AgentError (hintfs.agent.client) is an OSError whose message names the agent and the call.
        if err.strerror is None and err.args:
            return squash(str(err.args[-1]))
        return squash(_os_error(err))
    if isinstance(err, MemoryError):
        return "out of memory"
    # A bug, not a user's mistake: still one line, with the way to the traceback.
    return squash(f"internal error: {type(err).__name__}: {err} (run with --debug for the traceback, "
                   "and report it)")

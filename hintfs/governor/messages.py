"""The socket messages a client may send, parsed with bounds and validated into typed models.

Nothing a client sends reaches the daemon's logic before it passed here: a line of at most
MAX_LINE bytes, UTF-8, JSON nested at most MAX_DEPTH deep, integers of at most MAX_DIGITS digits,
no NaN or infinity, then one pydantic model per op (unknown keys and ops refused, every number
bounded; byte counts within the card, checked against the GPU's usable bytes by the daemon).
Every refusal is a ProtocolError with a one-line reason; nothing else escapes `parse`.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from hintfs.common.errors import validation_message
from hintfs.common.jsontext import nests_within
from hintfs.common.formatversion import placed
from hintfs.governor.ledger import MemoryKind

MAX_LINE = 4096            # bytes of one message (the largest, a register, is ~300)
MAX_DEPTH = 4              # {"op": ..., "resume": {"held": {...}}} is 3 deep
MAX_DIGITS = 20            # 2^64 has 20 digits
MAX_BYTES = 1 << 50        # mountconfig.governor.MAX_CARD_BYTES: no card holds more
MAX_SEQ = 1 << 62
MAX_FDS_PER_MESSAGE = 250  # the kernel's SCM_RIGHTS limit is 253 per message
MAX_NAME = 100

# The socket protocol's version (docs/versions.md). A client says its version in `register`
# (`protocol`; none: version 1, the protocol as it was, written so by this code too: a daemon from
# before versions refuses unknown keys); the daemon refuses a register of a version outside
# CLIENTS with one line naming both versions and the side to upgrade, and answers with its own
# (`protocol` in the register's reply; none: 1), which the client checks against DAEMONS. One
# check per connection: the messages after the register carry none.
PROTOCOL = 1               # the version this code speaks
CLIENTS = (1, 1)           # the client versions a daemon of this code serves
DAEMONS = (1, 1)           # the daemon versions a client of this code works with
MAX_VERSION = 1 << 16


def client_refusal(version: object) -> str | None:
    """(the daemon) Why a register of protocol `version` is refused; None when it is served."""
    where = placed(version, CLIENTS)
    if where is None:
        return None
    if where == "unreadable" or not 1 <= version <= MAX_VERSION:  # type: ignore[operator]
        return f"register: protocol must be a version number (this governor speaks governor protocol {PROTOCOL})"
    lo, hi = CLIENTS
    side = ("upgrade the governor (hintfs governor) first: governors before jobs" if where == "newer"
            else "upgrade hintfs in the job (the governor client)")
    return (f"register: the client speaks governor protocol {version}, this governor {PROTOCOL} "
            f"(serves {lo}..{hi}): {side}")


def daemon_refusal(version: object) -> str | None:
    """(a client) Why a governor whose register reply says protocol `version` is not used."""
    where = placed(version, DAEMONS)
    if where is None:
        return None
    lo, hi = DAEMONS
    side = "upgrade the governor (hintfs governor)" if where == "older" else "upgrade hintfs in this job"
    return (f"the governor speaks governor protocol {version!r}, this client {PROTOCOL} (works with {lo}..{hi}): "
            f"{side}")


class ProtocolError(ValueError):
    """A message that is not accepted; the connection that sent it is answered and dropped."""


Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES, strict=True)]
Name = Annotated[str, Field(max_length=MAX_NAME, pattern=r"^[\x20-\x7e]*$")]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Resume(_Msg):
    """What a client of a previous instance holds, sent when it registers again after a restart:
    its client id there, and its quota (training) or reservations by kind (inference)."""
    client: int = Field(ge=1, le=MAX_SEQ, strict=True)
    quota: Bytes | None = None
    held: dict[MemoryKind, Bytes] = Field(default_factory=dict, max_length=len(MemoryKind))


class Register(_Msg):
    op: Literal["register"]
    role: Literal["training", "inference", "observer"]
    gpu: int = Field(ge=0, le=1 << 16, strict=True)
    pid: int | None = Field(None, strict=True)      # informational: the kernel's pid is used
    name: Name = ""
    want_bytes: Bytes | None = None
    accept_pages: bool = Field(False, strict=True)
    resume: Resume | None = None
    protocol: int = Field(1, ge=1, le=MAX_VERSION, strict=True)   # the client's (`client_refusal`)


class Reserve(_Msg):
    op: Literal["reserve", "release"]
    kind: MemoryKind = MemoryKind.WORKSPACE
    bytes: Bytes


class Usage(_Msg):
    op: Literal["usage"]
    kinds: dict[MemoryKind, Bytes] = Field(max_length=len(MemoryKind))
    drain_ms: float = Field(0.0, ge=0, le=1e6)


class Ack(_Msg):
    op: Literal["ack"]
    seq: int = Field(ge=0, le=MAX_SEQ, strict=True)


class Pages(_Msg):
    op: Literal["pages"]
    seq: int = Field(ge=0, le=MAX_SEQ, strict=True)
    n: int = Field(ge=1, le=MAX_FDS_PER_MESSAGE, strict=True)      # fds with this line
    total: int = Field(ge=1, le=1 << 24, strict=True)              # fds for this command in all
    page_bytes: int = Field(ge=1, le=MAX_BYTES, strict=True)


class Busy(_Msg):
    op: Literal["busy"]
    on: bool = Field(strict=True)


class Simple(_Msg):
    op: Literal["stats", "ping"]


AnyMessage = Register | Reserve | Usage | Ack | Pages | Busy | Simple
Message = Annotated[AnyMessage, Field(discriminator="op")]
_adapter: TypeAdapter[AnyMessage] = TypeAdapter(Message)
OPS = ("register", "reserve", "release", "usage", "ack", "pages", "busy", "stats", "ping")
NO_REPLY = ("ack", "pages", "busy")     # notifications: sent on the fast path, never answered


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ProtocolError(f"integer of more than {MAX_DIGITS} digits")
    return int(text)


def _float(text: str) -> float:
    if len(text) > 64:
        raise ProtocolError("number of more than 64 characters")
    v = float(text)
    if not math.isfinite(v):
        raise ProtocolError("number out of range")
    return v


def _constant(name: str) -> float:
    raise ProtocolError(f"{name} is not a number here")


def decode(line: bytes) -> dict:
    """One line → a JSON object with a string 'op', within the bounds above."""
    if len(line) > MAX_LINE:
        raise ProtocolError(f"message of {len(line)} bytes (at most {MAX_LINE})")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("message is not UTF-8") from None
    if not nests_within(text, MAX_DEPTH):
        raise ProtocolError(f"JSON nested deeper than {MAX_DEPTH} levels")
    try:
        msg = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except ProtocolError:
        raise
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"bad JSON: {str(e)[:200]}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("message must be an object with a string 'op'")
    return msg


def validate(msg: dict) -> AnyMessage:
    op = msg.get("op")
    if op not in OPS:
        raise ProtocolError(f"unknown op {str(op)[:40]!r}")
    if op == "register":       # before the model: a newer client's other keys would hide why
        why = client_refusal(msg.get("protocol", 1))
        if why:
            raise ProtocolError(why)
    try:
        return _adapter.validate_python(msg)
    except ValidationError as err:   # the first part of each key is the union's tag, the op
        message = f"{op}: {validation_message(err, first_only=True, skip_loc=1, root='(message)')}"
    raise ProtocolError(message[:300])


def parse(line: bytes) -> AnyMessage:
    """A line from a client → its typed message; ProtocolError (one line) for anything else."""
    return validate(decode(line))


class LineBuffer:
    """Splits a byte stream into lines; refuses a line longer than `max_line`."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self._buf = bytearray()
        self.max_line = max_line

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        lines = []
        while True:
            i = self._buf.find(b"\n")
            if i < 0:
                break
            if i > self.max_line:
                raise ProtocolError(f"line longer than {self.max_line} bytes")
            lines.append(bytes(self._buf[:i]))
            del self._buf[: i + 1]
        if len(self._buf) > self.max_line:
            raise ProtocolError(f"line longer than {self.max_line} bytes")
        return lines

    @property
    def partial(self) -> bool:
        """Bytes of an unfinished line are waiting."""
        return bool(self._buf)


def encode(msg: dict) -> bytes:
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()

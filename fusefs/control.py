"""Control files under `.hintfs/`: how jobs talk to the mount with plain file I/O.

Readable files render a snapshot at open (so a reader sees one consistent document).
Writable files take a JSON document: the mount collects the writes of one open and applies the
document on close; a bad document fails close() with EINVAL and the reason becomes readable in
the sibling `<name>.error` file (and is logged). Nothing is applied partly: `apply` validates
everything before it changes anything.

Later features add directories of writable files (`hints/<job>`, `signals/<job>`,
`plans/<job>`) by registering a `ControlDir` with a handler.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

log = logging.getLogger("hintfs.control")

MAX_CONTROL_WRITE = 16 << 20  # a control document larger than this is refused (EFBIG)


class ControlInputError(ValueError):
    """A control write that is not accepted; the message is what `<name>.error` shows."""


@dataclass
class ControlFile:
    name: str
    render: Optional[Callable[[], bytes]] = None          # read side
    apply: Optional[Callable[[object], None]] = None       # write side: takes parsed JSON
    # Optional blocking step before `apply` (reading a file the document names), run in a worker
    # thread; it gets the parsed JSON and returns what `apply` gets. Raises ControlInputError.
    prepare: Optional[Callable[[object], object]] = None
    last_error: str = ""
    _error_view: Optional["ErrorView"] = field(default=None, repr=False)

    @property
    def writable(self) -> bool:
        return self.apply is not None

    @property
    def error_view(self) -> "ErrorView":
        if self._error_view is None:
            self._error_view = ErrorView(self)
        return self._error_view


@dataclass
class ControlDir:
    """A directory of control files; `make_file(name)` creates entries written into it."""
    name: str
    files: dict[str, ControlFile] = field(default_factory=dict)
    dirs: dict[str, "ControlDir"] = field(default_factory=dict)
    make_file: Optional[Callable[[str], ControlFile]] = None

    def add(self, f: ControlFile) -> ControlFile:
        self.files[f.name] = f
        return f

    def add_dir(self, d: "ControlDir") -> "ControlDir":
        self.dirs[d.name] = d
        return d

    def entries(self) -> list[str]:
        names = list(self.dirs)
        for n, f in self.files.items():
            names.append(n)
            if f.writable:
                names.append(n + ".error")
        return sorted(names)

    def child(self, name: str):
        """A ControlDir, a ControlFile, or ('error', ControlFile) for `<name>.error`."""
        if name in self.dirs:
            return self.dirs[name]
        if name in self.files:
            return self.files[name]
        if name.endswith(".error") and name[:-6] in self.files and self.files[name[:-6]].writable:
            return self.files[name[:-6]].error_view
        return None


@dataclass
class ErrorView:
    """`<name>.error`: the reason the last write to `<name>` was refused (empty if it was not)."""
    target: ControlFile

    @property
    def name(self) -> str:
        return self.target.name + ".error"

    def render(self) -> bytes:
        return (self.target.last_error + "\n").encode() if self.target.last_error else b""


def validation_reason(err) -> str:
    """One line for a control document refused by pydantic: `key: reason` of the first error."""
    e = err.errors()[0]
    where = ".".join(str(p) for p in e["loc"]) or "(document)"
    msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return f"{where}: {msg}".replace("\n", " ")


def parse_json_document(data: bytes) -> object:
    if len(data) > MAX_CONTROL_WRITE:
        raise ControlInputError(f"document of {len(data)} bytes exceeds {MAX_CONTROL_WRITE}")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ControlInputError(f"not UTF-8: {err}") from None
    except json.JSONDecodeError as err:
        raise ControlInputError(f"invalid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None


async def apply_write(f: ControlFile, data: bytes) -> None:
    """Parse and apply one written document; record the reason on failure and re-raise.
    `prepare` runs in a thread (the trio loop never blocks on it); `apply` runs in the loop."""
    try:
        doc = parse_json_document(data)
        if f.prepare is not None:
            import trio
            doc = await trio.to_thread.run_sync(f.prepare, doc)
        f.apply(doc)
    except ControlInputError as err:
        f.last_error = str(err)
        log.warning("refused write to .hintfs/%s: %s", f.name, err)
        raise
    f.last_error = ""


def loglevel_file() -> ControlFile:
    """`.hintfs/loglevel`: read the level, write {"level": "DEBUG"} to change it live."""
    levels = ("DEBUG", "INFO", "WARNING", "ERROR")

    def render() -> bytes:
        return (json.dumps({"level": logging.getLevelName(logging.getLogger("hintfs").getEffectiveLevel())}) + "\n").encode()

    def apply(doc: object) -> None:
        if not isinstance(doc, dict) or set(doc) != {"level"}:
            raise ControlInputError('expected {"level": "DEBUG"|"INFO"|"WARNING"|"ERROR"}')
        level = str(doc["level"]).upper()
        if level not in levels:
            raise ControlInputError(f"level: {doc['level']!r} is not one of {', '.join(levels)}")
        logging.getLogger("hintfs").setLevel(level)
        log.warning("log level set to %s through .hintfs/loglevel", level)

    return ControlFile("loglevel", render=render, apply=apply)

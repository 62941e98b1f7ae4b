"""Control files under `.hintfs/`: how jobs talk to the mount with plain file I/O.

Readable files render a snapshot at open (so a reader sees one consistent document).
Writable files take a JSON document: the mount collects the writes of one open and applies the
document on close. The steps of a write, in order, each able to refuse it (EINVAL, the reason in
the sibling `<name>.error`, logged once), and nothing applied before the last:

1. the writes themselves: a document over `MAX_CONTROL_WRITE` fails `write()` with EFBIG and the
   whole document is then refused at close (a failed write applies nothing, not its prefix);
2. `parse_json_document`: UTF-8 JSON, bounded in size and depth;
3. `ControlFile.parse`: the typed, bounded schema of that file (pure, no I/O);
4. who may say it (`may_write`): the mount's owner and root may write any control file; another
   user may write a job file it created (files are owned by their creator, directories are
   sticky like /tmp) and only about store paths it may read itself (`names` lists them; their
   permissions are checked against the caller's uid, gid and groups in a worker thread);
5. `prepare` (blocking work such as reading a plan, in a worker thread), then `apply` (in the
   trio loop, bounded work only).

Who may write which file is documented in docs/security.md.
"""
from __future__ import annotations

import errno
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Generic, TypeVar
from collections.abc import Callable

from hintfs.common import access
from hintfs.common.access import Principal
from hintfs.common.errors import HintfsError
from hintfs.common.documents import DocumentError
from hintfs.common.jsontext import nests_within

log = logging.getLogger("hintfs.control")

MAX_CONTROL_WRITE = 16 << 20  # a control document larger than this is refused (EFBIG)
MAX_JSON_DEPTH = 64           # deeper nesting is refused before json.loads recurses
MAX_JOB_FILES = 1024          # job files in one control directory (hints/, plans/, signals/, reads/)
MAX_JOB_FILES_PER_UID = 64    # of which one user who is neither root nor the mount's owner may hold


# A refused control write: the message is what `<name>.error` shows (the documents' own error).
ControlInputError = DocumentError


# Who wrote a control document: the one principal type of `hintfs.common.access`.
Caller = Principal

D = TypeVar("D")   # a control file's parsed document
P = TypeVar("P")   # what its `apply` takes: the parsed document, or what `prepare` made of it


@dataclass
class ControlFile(Generic[D, P]):
    name: str
    render: Callable[[], bytes] | None = None          # read side
    apply: Callable[[P], None] | None = None            # write side: takes what parse/prepare gave
    parse: Callable[[object], D] | None = None          # JSON -> typed document; ControlInputError
    # Blocking step before `apply` (reading a file the document names), run in a worker thread;
    # it gets the parsed document and the writer, and returns what `apply` gets. Raises ControlInputError.
    prepare: Callable[[D, Caller], P] | None = None
    names: Callable[[D], list[str]] | None = None       # store paths the document names
    owner_only: bool = False        # only the mount's owner (and root) may write it at all
    uid: int = field(default_factory=os.getuid)            # who created it (owns its job)
    gid: int = field(default_factory=os.getgid)
    last_error: str = ""
    where: str = ".hintfs/"   # its folder, for log lines (set when it is added to a ControlDir)
    _error_view: ErrorView | None = field(default=None, repr=False)

    @property
    def writable(self) -> bool:
        return self.apply is not None

    @property
    def error_view(self) -> ErrorView:
        if self._error_view is None:
            self._error_view = ErrorView(self)
        return self._error_view

    def may_open_for_write(self, caller: Caller) -> bool:
        if not self.writable:
            return False
        if caller.privileged():
            return True
        return not self.owner_only and caller.uid == self.uid


@dataclass
class ControlDir:
    """A directory of control files; `make_file(name, caller)` creates entries written into it."""
    name: str
    files: dict[str, ControlFile] = field(default_factory=dict)
    dirs: dict[str, ControlDir] = field(default_factory=dict)
    make_file: Callable[[str], ControlFile] | None = None
    # A job file's owner (or root, or the mount's owner) removed it: forget what it registered.
    on_remove: Callable[[str], object] | None = None   # (what it returns is not used)

    def add(self, f: ControlFile) -> ControlFile:
        self.files[f.name] = f
        f.where = ".hintfs/" if self.name == ".hintfs" else f".hintfs/{self.name}/"
        return f

    def add_dir(self, d: ControlDir) -> ControlDir:
        self.dirs[d.name] = d
        return d

    def job_files(self, uid: int | None = None) -> int:
        """Job files in this folder (of `uid` alone, when given)."""
        return sum(1 for f in self.files.values() if f.writable and (uid is None or f.uid == uid))

    def usage(self) -> dict[int, int]:
        """Job files per owner uid."""
        out: dict[int, int] = {}
        for f in self.files.values():
            if f.writable:
                out[f.uid] = out.get(f.uid, 0) + 1
        return out

    def room_for(self, caller: Caller) -> str | None:
        """None if `caller` may create one more job file here, else why not (the bounds are per
        user, so one user cannot take every name from the others; root and the mount's owner
        are bounded only by what they themselves run)."""
        if caller.privileged():
            return None
        if self.job_files(caller.uid) >= MAX_JOB_FILES_PER_UID:
            return f"uid {caller.uid} has {MAX_JOB_FILES_PER_UID} job files here (remove some: rm works)"
        if self.job_files() >= MAX_JOB_FILES:
            return f"{MAX_JOB_FILES} job files exist here"
        return None

    def remove(self, name: str, caller: Caller) -> None:
        """Remove the job file `name` (and its `.status`): its owner, root or the mount's owner
        may; what it registered is forgotten (`on_remove`). HintfsError(EACCES/ENOENT/EPERM)."""
        f = self.files.get(name)
        if f is None or not f.writable or self.make_file is None:
            raise HintfsError(errno.EPERM if f is not None else errno.ENOENT, f"{name}: not a job file")
        if not caller.privileged() and caller.uid != f.uid:
            raise HintfsError(errno.EACCES, f"{name}: owned by uid {f.uid}")
        del self.files[name]
        status = self.files.get(name + ".status")
        if status is not None and not status.writable:
            del self.files[name + ".status"]
        if self.on_remove is not None:
            self.on_remove(name)

    def entries(self) -> list[str]:
        names = list(self.dirs)
        for n, f in self.files.items():
            names.append(n)
            if f.writable:
                names.append(n + ".error")
        return sorted(names)

    def child(self, name: str):
        """A ControlDir, a ControlFile, or an ErrorView for `<name>.error`."""
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


def parse_json_document(data: bytes) -> object:
    if len(data) > MAX_CONTROL_WRITE:
        raise ControlInputError(f"document of {len(data)} bytes exceeds {MAX_CONTROL_WRITE}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ControlInputError(f"not UTF-8: {err}") from None
    if not nests_within(text, MAX_JSON_DEPTH):
        raise ControlInputError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ControlInputError(f"invalid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    except (ValueError, RecursionError) as err:   # e.g. an integer over Python's digit limit
        raise ControlInputError(f"invalid JSON: {err}") from None


def check_readable(store, paths: list[str], caller: Caller) -> None:
    """Blocking (a worker thread): `caller` may read every named store path, by the one access rule
    (`hintfs.common.access`: search permission on every folder, read permission on the path); a refusal
    does not say whether the path exists."""
    try:
        access.check_readable(store, paths, caller)
    except OSError as err:
        raise ControlInputError(err.strerror or str(err)) from None


def refuse(f: ControlFile, reason: str, caller: Caller | None = None) -> None:
    """Record and log one refusal; the reason replaces whatever the previous write left.

    Every refusal of a written document goes through here, once: the writer learns of it only
    from close() failing with EINVAL, which shells ignore (`echo x > .hintfs/loglevel` exits 0),
    so the log line and `<name>.error` are what an operator sees."""
    f.last_error = reason
    who = f" by uid {caller.uid}" if caller is not None else ""
    log.warning("refused write to %s%s%s (close fails with EINVAL; the reason is also in %s.error): %s",
                f.where, f.name, who, f.name, reason)


async def apply_write(f: ControlFile, data: bytes, caller: Caller, store=None) -> None:
    """Parse, authorize, prepare and apply one written document; on refusal record the reason
    and raise ControlInputError. Blocking steps run in worker threads; nothing changes before
    `apply`."""
    import trio
    try:
        doc = parse_json_document(data)
        if f.parse is not None:
            doc = f.parse(doc)
        if f.names is not None and not caller.privileged():
            if store is None:
                raise ControlInputError("only the mount's owner may write this file")
            await trio.to_thread.run_sync(check_readable, store, f.names(doc), caller)
        if f.prepare is not None:
            doc = await trio.to_thread.run_sync(f.prepare, doc, caller)
        if f.apply is None:   # (never opened for writing: may_open_for_write)
            raise ControlInputError(f"{f.name} is read-only")
        f.apply(doc)
    except ControlInputError as err:
        refuse(f, str(err), caller)
        raise
    f.last_error = ""


def loglevel_file() -> ControlFile:
    """`.hintfs/loglevel`: read the level; the mount's owner writes {"level": "DEBUG"} to change it."""
    levels = ("DEBUG", "INFO", "WARNING", "ERROR")

    def render() -> bytes:
        return (json.dumps({"level": logging.getLevelName(logging.getLogger("hintfs").getEffectiveLevel())}) + "\n").encode()

    def parse(doc: object) -> str:
        if not isinstance(doc, dict) or set(doc) != {"level"}:
            raise ControlInputError('expected {"level": "DEBUG"|"INFO"|"WARNING"|"ERROR"}')
        level = str(doc["level"]).upper()
        if level not in levels:
            raise ControlInputError(f"level: {str(doc['level'])[:40]!r} is not one of {', '.join(levels)}")
        return level

    def apply(level: str) -> None:
        logging.getLogger("hintfs").setLevel(level)
        log.warning("log level set to %s through .hintfs/loglevel", level)

    return ControlFile("loglevel", render=render, parse=parse, apply=apply, owner_only=True)

"""The one path rule of hintfs: every path that comes from outside (a FUSE name, an agent RPC, a
hint, a plan, a signal, a route, a journal record) is checked here, and every file of a local
store is opened here, beneath the store root.

Two layers:
- `relpath` is the lexical rule, the same for every store: a store-relative path is relative,
  '/'-separated, has no NUL, no `..` component, names of at most 255 bytes and at most 4095 bytes
  in all; `.` and empty components are dropped. The root itself ('') is refused where a file is
  required. Object stores (S3, HDFS) have no symlinks, so for them this rule is the whole check.
- `open_beneath` opens a checked path relative to a directory fd of the store root without ever
  leaving it: `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` where the kernel has it (a
  symlink may point elsewhere inside the root; one that leads out fails), else a walk that opens
  each directory with O_NOFOLLOW (stricter: no symlinked directory is followed at all).
"""
from __future__ import annotations

import ctypes
import errno
import os
import posixpath
from collections.abc import Set as AbstractSet
from typing import Generic, Self, TypeVar

from hintfs.common.errors import HintfsError

CONTROL_DIR = ".hintfs"
JOURNAL_DIR = ".hintfs-journal"     # the journal's default folder: reserved on every mount
STAGING_PREFIX = ".hintfs-tmp."      # staged writes: hidden files next to their target
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4095
MAX_JOB_NAME_BYTES = 200             # leaves room for `.status` / `.error` siblings


def inside(root: str, path: str) -> str | None:
    """Where `path` lies under the folder `root`: a '/'-separated path relative to it ('' for
    `root` itself), or None when it is not inside. The one rule of "inside the mount": only a
    `..` component leaves (a folder named `..data` is inside). Lexical: both are made absolute
    (`os.path.abspath`); a caller that must see through symlinks passes `os.path.realpath`s."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    if rel == os.curdir:
        return ""
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        return None
    return rel.replace(os.sep, "/")


def refuse(what: str, value: object, reason: str) -> HintfsError:
    return HintfsError(errno.EINVAL, f"{what} {value!r} {reason}")


def relpath(path: object, *, what: str = "path", allow_root: bool = False) -> str:
    """`path` as a normalized store-relative path, or HintfsError(EINVAL) saying why not."""
    if not isinstance(path, str):
        raise refuse(what, path, "must be a string")
    if "\0" in path:
        raise refuse(what, path, "contains a NUL byte")
    if path.startswith("/"):
        raise refuse(what, path, "must be relative to the store root, not absolute")
    parts = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise refuse(what, path, "contains '..'")
        if len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            raise HintfsError(errno.ENAMETOOLONG, f"{what} {path!r}: a name is longer than {MAX_NAME_BYTES} bytes")
        parts.append(part)
    out = "/".join(parts)
    if len(out.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise HintfsError(errno.ENAMETOOLONG, f"{what} is longer than {MAX_PATH_BYTES} bytes")
    if not out and not allow_root:
        raise refuse(what, path, "names the store root, not a file")
    return out


def user_relpath(path: object, *, what: str = "path") -> str:
    """A path a job names in a control document: `relpath`, and never inside `.hintfs/`."""
    out = relpath(path, what=what)
    if out.split("/", 1)[0] == CONTROL_DIR:
        raise refuse(what, path, f"is inside {CONTROL_DIR}/")
    return out


def job_name(name: object, *, what: str = "job name") -> str:
    """A job's name: one path component (it names control files), bounded, not hidden, and
    printable (`str.isprintable`: no control character, line or paragraph separator, format
    character such as a bidi override, space other than ' ', surrogate (bytes that are not
    UTF-8), private-use or unassigned character): it is logged, shown in `hintfs status` and
    in status files. The one rule of job names: the mount applies it when a control file is
    created, the job-side API (hintfs.client, hintfs.plan) before it writes one."""
    if not isinstance(name, str) or not name:
        raise refuse(what, name, "must be a non-empty string")
    if "/" in name or "\0" in name or name.startswith("."):
        raise refuse(what, name, "must be one path component, not starting with '.'")
    bad = next((c for c in name if not c.isprintable()), None)
    if bad is not None:
        raise refuse(what, name[:80], f"contains the unprintable character U+{ord(bad):04X} "
                     "(a control character, line separator, ...)")
    if name.endswith((".error", ".status")):
        raise refuse(what, name, "must not end in .error or .status")
    if len(name.encode("utf-8", "surrogateescape")) > MAX_JOB_NAME_BYTES:
        raise refuse(what, name[:40] + "...", f"is longer than {MAX_JOB_NAME_BYTES} bytes")
    return name


def printable(text: str) -> str:
    """`text` with every character that is not printable escaped as in a Python literal (`\\n`,
    `\\x1b`, `\\u2028`, `\\udcff` for a byte that is not UTF-8): what a log line or a one-line
    message shows of a name or path that came from outside, so that it can never start a line
    of its own. Printable text (any script, the ASCII space) is unchanged."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def child(parent: str, name: bytes) -> str:
    """The store-relative path of `name` (a name from the kernel) inside `parent`."""
    text = name.decode("utf-8", "surrogateescape")
    if text in ("", ".", "..") or "/" in text or "\0" in text:
        raise HintfsError(errno.EINVAL, f"invalid name {text!r}")
    if len(name) > MAX_NAME_BYTES:
        raise HintfsError(errno.ENAMETOOLONG, f"name longer than {MAX_NAME_BYTES} bytes")
    return f"{parent}/{text}" if parent else text


def reserved(path: str, journal_dir: str = JOURNAL_DIR) -> bool:
    """Store paths no request through a mount may create, rename, link, remove or look up: the
    control folder at the root, the journal's folder (the configured one and the default one, so
    no user can plant a journal before it is enabled) and everything under them."""
    for top in (CONTROL_DIR, JOURNAL_DIR, journal_dir):
        if path == top or path.startswith(top + "/"):
            return True
    return False


def may_hold_reserved(folder: str, journal_dir: str = JOURNAL_DIR) -> bool:
    """Whether a name in `folder` may be `reserved`: the folder is one of those paths or under
    one, or one of them is under it (the root always)."""
    prefix = folder + "/" if folder else ""
    return any(folder == top or folder.startswith(top + "/") or top.startswith(prefix)
               for top in (CONTROL_DIR, JOURNAL_DIR, journal_dir))


def is_hidden_name(name: str) -> bool:
    """Names the mount never shows: staging files of writes in progress."""
    return name.startswith(STAGING_PREFIX)


def symlink_target_ok(link_rel: str, target: str) -> bool:
    """A symlink made through the mount may only point inside the store: relative, and never
    climbing above the root from where the link is."""
    if not target or target.startswith("/") or "\0" in target:
        return False
    depth = len([p for p in posixpath.dirname(link_rel).split("/") if p not in ("", ".")])
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return False
        elif part not in ("", "."):
            depth += 1
    return True


# -- opening beneath a root ------------------------------------------------------------------------
_SYS_OPENAT2 = 437                 # the same number on every architecture (new syscall table)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_have_openat2: bool | None = None


def _openat2(dir_fd: int, path: str, flags: int, mode: int) -> int:
    tmpfile = getattr(os, "O_TMPFILE", 0)
    creates = bool(flags & os.O_CREAT) or (tmpfile and flags & tmpfile == tmpfile)
    how = _OpenHow(flags, mode if creates else 0, _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
    fd: int = _libc.syscall(_SYS_OPENAT2, ctypes.c_int(dir_fd), os.fsencode(path), ctypes.byref(how),
                            ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    return fd


def have_openat2() -> bool:
    """Whether this kernel (and seccomp policy) lets us use openat2; probed once."""
    global _have_openat2
    if _have_openat2 is None:
        try:
            os.close(_openat2(os.open("/", os.O_PATH | os.O_CLOEXEC), ".", os.O_PATH | os.O_CLOEXEC, 0))
            _have_openat2 = True
        except OSError as err:
            _have_openat2 = err.errno not in (errno.ENOSYS, errno.EPERM)
    return _have_openat2


def _walk(root_fd: int, rel: str, flags: int, mode: int) -> int:
    """openat2's job without it: every directory on the way opened with O_NOFOLLOW."""
    parts = rel.split("/") if rel else []
    cur = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root_fd)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=cur)
            os.close(cur)
            cur = nxt
        if not parts:
            return os.open(".", flags | os.O_CLOEXEC, dir_fd=cur)
        return os.open(parts[-1], flags | os.O_CLOEXEC, mode, dir_fd=cur)
    finally:
        os.close(cur)


# A path the kernel gives us may be longer than PATH_MAX relative to the store root (a process
# deep inside the mount uses paths relative to its cwd): such paths are opened a piece at a time,
# each piece beneath the directory the previous one reached (still never leaving the root: a
# symlink in a piece may not climb above that piece's directory, which is stricter).
_CHUNK_BYTES = 3072


def _open_long(root_fd: int, rel: str, flags: int, mode: int) -> int:
    parts = rel.split("/")
    cur = -1
    try:
        while len(os.fsencode("/".join(parts))) > _CHUNK_BYTES:
            size, i = 0, 0
            while i < len(parts) - 1 and (i == 0 or size + len(os.fsencode(parts[i])) + 1 <= _CHUNK_BYTES):
                size += len(os.fsencode(parts[i])) + 1
                i += 1
            nxt = _openat2(root_fd if cur < 0 else cur, "/".join(parts[:i]), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0)
            if cur >= 0:
                os.close(cur)
            cur, parts = nxt, parts[i:]
        return _openat2(root_fd if cur < 0 else cur, "/".join(parts), flags | os.O_CLOEXEC, mode)
    finally:
        if cur >= 0:
            os.close(cur)


def beneath_in_one_call(rel: str) -> bytes | None:
    """`rel` (checked by `relpath`, not the root) as the bytes one `openat2(RESOLVE_BENEATH |
    RESOLVE_NO_MAGICLINKS)` call resolves as `open_beneath` does; None where `open_beneath` would
    not use that one call (no openat2 here, or a path opened a piece at a time)."""
    return beneath_in_one_call_raw(os.fsencode(rel))


def beneath_in_one_call_raw(raw: bytes) -> bytes | None:
    """`beneath_in_one_call` of a path already encoded."""
    if not raw or len(raw) > _CHUNK_BYTES or not have_openat2():
        return None
    return raw


def open_beneath(root_fd: int, rel: str, flags: int, mode: int = 0o644) -> int:
    """Open `rel` (already checked by `relpath`; '' is the root) beneath `root_fd`. A path that
    would leave the root (a symlink out of it, a magic link) fails with EACCES; other failures
    are the kernel's (ENOENT, ENOTDIR, ELOOP for a final symlink under O_NOFOLLOW, ...)."""
    try:
        if have_openat2():
            if len(rel) > _CHUNK_BYTES and len(os.fsencode(rel)) > _CHUNK_BYTES:
                return _open_long(root_fd, rel, flags, mode)
            return _openat2(root_fd, rel or ".", flags | os.O_CLOEXEC, mode)
        return _walk(root_fd, rel, flags, mode)
    except OSError as err:
        if err.errno == errno.EXDEV:
            raise HintfsError(errno.EACCES, f"{rel!r} leads out of the store root") from None
        raise


class Beneath:
    """`with Beneath(root_fd, rel) as (dir_fd, name):` the parent directory of `rel`, opened
    beneath the root (O_PATH), and its last component, for the *at() system calls; for the root
    itself, (root_fd, '.')."""

    __slots__ = ("root_fd", "rel", "fd")

    def __init__(self, root_fd: int, rel: str):
        self.root_fd = root_fd
        self.rel = rel
        self.fd = -1

    def __enter__(self) -> tuple[int, str]:
        if not self.rel:
            return self.root_fd, "."
        head, _, name = self.rel.rpartition("/")
        if not head:
            return self.root_fd, name
        self.fd = open_beneath(self.root_fd, head, os.O_PATH | os.O_DIRECTORY)
        return self.fd, name

    def __exit__(self, *exc) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PathTree:
    """An index of relative paths by folder, to find the ones at or below a path in time
    proportional to what is found (and the folders on the way), not to everything indexed: a
    round of journal removal records (a file or a folder each) was a pass over every known file
    and every replica, 20 times a second on an eval tier whose jobs delete old steps
    (bench/scale_xdc.py: a fifth of the agent's CPU). Not thread-safe: its owner's lock guards it."""

    __slots__ = ("_files", "_subs")

    def __init__(self) -> None:
        self._files: dict[str, set[str]] = {}    # folder -> the paths directly in it
        self._subs: dict[str, set[str]] = {}     # folder -> its subfolders with paths below them

    def add(self, path: str) -> None:
        folder = path.rpartition("/")[0]
        files = self._files.get(folder)
        if files is None:
            files = self._files[folder] = set()
            self._link(folder)
        files.add(path)

    def discard(self, path: str) -> None:
        folder = path.rpartition("/")[0]
        files = self._files.get(folder)
        if files is None or path not in files:
            return
        files.discard(path)
        if not files:
            del self._files[folder]
            self._unlink(folder)

    def clear(self) -> None:
        self._files.clear()
        self._subs.clear()

    def under(self, path: str) -> list[str]:
        """The indexed paths equal to `path` or below it (as a folder)."""
        folder = path.rpartition("/")[0]
        out = [path] if path in self._files.get(folder, ()) else []
        stack = [path]
        while stack:
            f = stack.pop()
            out.extend(self._files.get(f, ()))
            stack.extend(self._subs.get(f, ()))
        return out

    def has_below(self, folder: str) -> bool:
        """Whether a path below `folder` is indexed (not `folder` itself), without walking them:
        a folder is in the index only while it holds one (`_unlink`)."""
        return folder in self._files or bool(self._subs.get(folder))

    def _link(self, folder: str) -> None:
        while folder:
            parent = folder.rpartition("/")[0]
            subs = self._subs.setdefault(parent, set())
            if folder in subs:
                return
            subs.add(folder)
            folder = parent

    def _unlink(self, folder: str) -> None:
        """`folder` holds no path directly: take it (and parents left empty) out of the tree."""
        while folder and folder not in self._files and not self._subs.get(folder):
            self._subs.pop(folder, None)
            parent = folder.rpartition("/")[0]
            subs = self._subs.get(parent)
            if subs is not None:
                subs.discard(folder)
                if not subs:
                    del self._subs[parent]
            folder = parent


V = TypeVar("V")


class PathDict(dict[str, V], Generic[V]):
    """A dict of relative paths that keeps a `PathTree` of its keys (`under`). Changed only by
    item assignment, `del`, `pop` and `clear`; the other mutators raise."""

    def __init__(self) -> None:
        super().__init__()
        self._tree = PathTree()

    def under(self, path: str) -> list[str]:
        """The keys equal to `path` or below it."""
        return self._tree.under(path)

    def has_below(self, folder: str) -> bool:
        """Whether a key lies below `folder` (`PathTree.has_below`)."""
        return self._tree.has_below(folder)

    def __setitem__(self, path, value) -> None:
        super().__setitem__(path, value)
        self._tree.add(path)

    def __delitem__(self, path) -> None:
        super().__delitem__(path)
        self._tree.discard(path)

    def pop(self, path, *default):
        if path in self:
            self._tree.discard(path)
        return super().pop(path, *default)

    def clear(self) -> None:
        super().clear()
        self._tree.clear()

    def _bypass(self, *_args, **_kwargs):
        raise TypeError("PathDict changes only by [], del, pop and clear (its index is kept by them)")

    update = setdefault = popitem = __ior__ = _bypass


class PathSet(set[str]):
    """A set of relative paths that keeps a `PathTree` of them (`under`). Changed only by `add`,
    `discard`, `-=` and `clear`; the other mutators raise."""

    def __init__(self) -> None:
        super().__init__()
        self._tree = PathTree()

    def under(self, path: str) -> list[str]:
        """The paths equal to `path` or below it."""
        return self._tree.under(path)

    def add(self, path) -> None:
        super().add(path)
        self._tree.add(path)

    def discard(self, path) -> None:
        super().discard(path)
        self._tree.discard(path)

    def __isub__(self, other: AbstractSet[object]) -> Self:
        for path in list(other):
            self.discard(path)
        return self

    def clear(self) -> None:
        super().clear()
        self._tree.clear()

    def _bypass(self, *_args, **_kwargs):
        raise TypeError("PathSet changes only by add, discard, -= and clear (its index is kept by them)")

    remove = pop = update = difference_update = intersection_update = symmetric_difference_update = _bypass
    __ior__ = __iand__ = __ixor__ = _bypass

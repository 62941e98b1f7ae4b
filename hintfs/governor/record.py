"""The governor's locks and its restart record, in the socket's folder.

One governor per GPU set: a daemon holds an exclusive flock on `<socket name>.lock` (its socket),
on `<shm_name>.lock` (its instance name) and on `governor-gpu<i>.lock` for each GPU it governs, in
the socket's folder; a second daemon that needs any of them refuses to start, naming the pid that
holds it. The folder must belong to root or the daemon's user and be writable by nobody else
(sticky folders aside); each file is opened without following links, and must be a regular file
of the daemon's user, not writable by others, with one link.

A GPU's lock file is also its record: a header naming the instance that holds it (pid, instance
name) and one entry per client (id, pid, the process's start time, uid, role, the bytes it may
hold, state). The daemon keeps it mapped and writes an entry with plain stores as the ledger
changes (no syscall on a reservation's path); an increase is written before the client may use
the bytes (before the reply or the grow command). When a daemon dies, the record stays: the next
instance reads it and holds back the bytes of each previous client whose process still runs,
until that client registers again or its process is gone (hintfs/governor/daemon.py).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("hintfs.governor")

MAGIC = 0x4F43455256474E48      # "HNGVRECO"
VERSION = 1
HDR_WORDS = 32                  # magic, version, pid, gpu, entries, next id; name at 16..31
NAME_AT, NAME_BYTES = 16, 128
ENTRY_WORDS = 12                # id, pid, start, uid, role, bytes, state, 0; name at 8..11
ENTRY_NAME_BYTES = 32
(E_ID, E_PID, E_START, E_UID, E_ROLE, E_BYTES, E_STATE) = range(7)
FREE, LIVE, HELD = 0, 1, 2
ROLES = {"training": 1, "inference": 2, "observer": 3}
ROLE_NAMES = {v: k for k, v in ROLES.items()}


class LockError(RuntimeError):
    """The folder or a lock file is not safe to use, or another governor holds the lock."""


def open_folder(path: str) -> int:
    """An O_DIRECTORY fd of the socket's folder, after checking who may write it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise LockError(f"socket folder {path}: {e.strerror or e}") from None
    st = os.fstat(fd)
    me = os.geteuid()
    if st.st_uid not in (0, me):
        os.close(fd)
        raise LockError(f"socket folder {path} belongs to uid {st.st_uid}, not root or this daemon's user")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        os.close(fd)
        raise LockError(f"socket folder {path} is writable by other users "
                        f"(mode {stat.S_IMODE(st.st_mode):04o}); use a folder only root or the daemon may write")
    return fd


def _lock_file(dir_fd: int, name: str, what: str) -> int:
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as e:
        why = "is a symlink" if e.errno == errno.ELOOP else (e.strerror or str(e))
        raise LockError(f"lock file {name} ({what}): {why}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1 or st.st_mode & 0o022:
        os.close(fd)
        raise LockError(f"lock file {name} ({what}) is not a regular file of this daemon's user "
                        "writable only by it (not touched)")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise LockError(f"{what} is in use by another governor"
                        + (f" (pid {holder})" if holder else "") + f" ({name} is locked)") from None
    return fd


def _holder(fd: int) -> int:
    try:
        head = os.pread(fd, 24, 0)
        magic, _version, pid = struct.unpack("<QQQ", head)
        return pid if magic == MAGIC else 0
    except (OSError, struct.error):
        return 0


def _header(pid: int, gpu: int, n_entries: int, next_id: int, name: str) -> bytes:
    words = [MAGIC, VERSION, pid, gpu, n_entries, next_id] + [0] * (NAME_AT - 6)
    raw = name.encode()[:NAME_BYTES - 1]
    return struct.pack(f"<{NAME_AT}Q", *words) + raw.ljust(NAME_BYTES, b"\0")


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


class Lock:
    """A plain lock file (the socket's, the instance name's): our pid in its header."""

    def __init__(self, dir_fd: int, name: str, what: str, instance: str) -> None:
        self.fd = _lock_file(dir_fd, name, what)
        data = _header(os.getpid(), 0, 0, 0, instance)
        os.pwrite(self.fd, data, 0)
        os.ftruncate(self.fd, len(data))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)     # the flock goes with it
            self.fd = -1


@dataclass
class Entry:
    client_id: int
    pid: int
    start: int
    uid: int
    role: str
    nbytes: int
    state: int
    name: str


class GpuRecord:
    """The lock and record of one GPU. `previous`: the entries the last instance left that still
    held memory (live or held back), `previous_instance` its name. `capacity` entries are mapped;
    `set`/`update`/`remove` write them in place."""

    def __init__(self, dir_fd: int, gpu: int, instance: str, capacity: int) -> None:
        self.fd = _lock_file(dir_fd, f"governor-gpu{gpu}.lock", f"GPU {gpu}")
        self._mm: mmap.mmap | None = None
        try:
            self.previous, self.previous_instance, self.next_id = self._read()
            carried = [e for e in self.previous if e.state in (LIVE, HELD)]
            self.capacity = capacity + len(carried)
            data = bytearray(_header(os.getpid(), gpu, self.capacity, self.next_id, instance))
            data += bytes(8 * ENTRY_WORDS * self.capacity)
            os.pwrite(self.fd, bytes(data), 0)
            os.ftruncate(self.fd, len(data))
            self._mm = mmap.mmap(self.fd, len(data))
            arr = np.frombuffer(self._mm, dtype=np.uint64)
            self.head = arr[:HDR_WORDS]
            self.entries = arr[HDR_WORDS:].reshape(self.capacity, ENTRY_WORDS)
            self._index: dict[int, int] = {}
            self._free = list(range(self.capacity - 1, -1, -1))
        except BaseException:
            self.close()
            raise

    def _read(self) -> tuple[list[Entry], str, int]:
        raw = os.pread(self.fd, 1 << 24, 0)
        if len(raw) < 8 * HDR_WORDS:
            return [], "", 1
        magic, version, _pid, _gpu, n, next_id = struct.unpack("<6Q", raw[:48])
        if magic == MAGIC and version != VERSION:    # (docs/versions.md) said, not silently dropped
            log.warning("a GPU's governor record (its governor-gpu lock file) is of version %d, this governor "
                        "reads version %d: the bytes its clients held are not held back (a downgrade? run the "
                        "governor that wrote it until its jobs end)", version, VERSION)
        if magic != MAGIC or version != VERSION:
            return [], "", 1
        name = _text(raw[8 * NAME_AT:8 * NAME_AT + NAME_BYTES])
        out = []
        n = min(n, (len(raw) - 8 * HDR_WORDS) // (8 * ENTRY_WORDS))
        for i in range(n):
            off = 8 * (HDR_WORDS + i * ENTRY_WORDS)
            w = struct.unpack(f"<{ENTRY_WORDS}Q", raw[off:off + 8 * ENTRY_WORDS])
            if w[E_STATE] in (LIVE, HELD) and w[E_ID] and w[E_ROLE] in ROLE_NAMES:
                ename = _text(raw[off + 64:off + 64 + ENTRY_NAME_BYTES])
                out.append(Entry(w[E_ID], w[E_PID], w[E_START], w[E_UID], ROLE_NAMES[w[E_ROLE]],
                                 w[E_BYTES], w[E_STATE], ename))
            next_id = max(next_id, w[E_ID] + 1)
        return out, name, max(1, next_id)

    def new_id(self) -> int:
        cid = self.next_id
        self.next_id += 1
        self.head[5] = self.next_id
        return cid

    def set(self, e: Entry) -> None:
        """Write an entry (state last: a reader never sees a live entry half written)."""
        i = self._index.get(e.client_id)
        if i is None:
            if not self._free:
                raise LockError("restart record full")
            i = self._free.pop()
            self._index[e.client_id] = i
        row = self.entries[i]
        row[E_STATE] = FREE
        row[E_ID], row[E_PID], row[E_START], row[E_UID] = e.client_id, e.pid, e.start, e.uid & (2**64 - 1)
        row[E_ROLE], row[E_BYTES] = ROLES[e.role], e.nbytes
        row[8:12] = np.frombuffer(e.name.encode()[:ENTRY_NAME_BYTES].ljust(ENTRY_NAME_BYTES, b"\0"), dtype=np.uint64)
        row[E_STATE] = e.state

    def update(self, client_id: int, nbytes: int, state: int | None = None) -> None:
        """The bytes a client may hold now (a plain store)."""
        i = self._index.get(client_id)
        if i is None:
            return
        self.entries[i][E_BYTES] = nbytes
        if state is not None:
            self.entries[i][E_STATE] = state

    def remove(self, client_id: int) -> None:
        i = self._index.pop(client_id, None)
        if i is not None:
            self.entries[i][E_STATE] = FREE
            self._free.append(i)

    def close(self) -> None:
        self.head = self.entries = None  # type: ignore[assignment]
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass
            self._mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def process_start(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot, /proc/PID/stat field 22), or
    None if there is no such process: with the pid it names one process, whatever reuses the pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
        if rest[0] in (b"Z", b"X"):
            return None
        return int(rest[19])
    except (OSError, IndexError, ValueError):
        return None

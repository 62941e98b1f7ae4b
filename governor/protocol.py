"""Wire formats: the shared-memory control words and the Unix-socket messages. No torch.

Shared memory (one file per GPU under /dev/shm, mmap'd by daemon and clients): a header of
HEADER_WORDS uint64 words, then `max_clients` slots of SLOT_WORDS uint64 words each. Every
word has one writer. Aligned 8-byte stores are atomic on x86-64 and stores are seen in program
order (TSO), which the publication protocol relies on:

  daemon, to command a client:  TARGET, CMD, CMD_T  then  SEQ += 1   (SEQ last: publishes)
  client, at a safe point:      reads SEQ; if SEQ != ACK: reads CMD/TARGET, stamps T_DETECT
  client, after releasing:      USED, T_DRAINED, T_RELEASED, ACK_FLAGS  then  ACK = SEQ
                                (ACK last; a client already under TARGET acks without releasing)
  daemon:                       sees ACK == SEQ, then trusts USED and lowers the ledger quota

QUOTA is written by the daemon whenever a quota is committed (after an ack, or a grow).
BUSY is written by inference clients (1 while a request runs): training may yield compute at
safe points while any BUSY is set. HEARTBEAT is the client's last monotonic ns.

Socket messages are JSON objects, one per line, request → one reply line (except `ack`,
which is a notification without a reply, sent after the ACK word so the daemon wakes at once).

Page handoff: a training client behind the page allocator may hand the pages it frees for a
shrink to the daemon instead of the driver: `pages {seq, n, page_bytes}` (no reply) carries n
file descriptors (SCM_RIGHTS), sent *before* the ACK word, whose flags then include ACK_LENT. The
daemon passes them on with the grant: a `reserve` reply with `pages: n` carries n fds, if the
inference client registered with `accept_pages`.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = 0x48494E5446534756  # "HINTFSGV"
VERSION = 1
HEADER_WORDS = 16
SLOT_WORDS = 16

# header words
H_MAGIC, H_VERSION, H_MAX_CLIENTS, H_SLOT_WORDS, H_TOTAL, H_USABLE = range(6)

# slot words
(W_OWNER, W_QUOTA, W_CMD, W_TARGET, W_CMD_T, W_SEQ, W_ACK, W_USED, W_T_DETECT, W_T_DRAINED,
 W_T_RELEASED, W_HEARTBEAT, W_BUSY, W_ROLE, W_ACK_FLAGS, W_FREED) = range(16)

CMD_NONE, CMD_SHRINK, CMD_GROW, CMD_STOP = 0, 1, 2, 3
# ACK_FLAGS bits: what the acknowledged shrink cost the client (for the timing split)
ACK_RELEASED = 1  # memory was physically returned (drain + release ran)
ACK_ABORTED = 2   # an unfinished micro-batch was dropped to get there
ACK_LENT = 4      # the released pages were sent to the daemon as fds (op `pages`) before the ack
ACK_FREED = 8     # the client holds fewer bytes than before (W_FREED says how many): memory moved
ROLE_FREE, ROLE_TRAINING, ROLE_INFERENCE = 0, 1, 2

MAX_LINE = 1 << 16


def now_ns() -> int:
    """CLOCK_MONOTONIC is system-wide, so stamps from different processes compare."""
    return time.monotonic_ns()


def shm_path(shm_name: str, gpu: int) -> Path:
    base = Path("/dev/shm")
    if not base.is_dir():  # pragma: no cover - non-Linux fallback
        base = Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"{shm_name}-gpu{gpu}"


def segment_bytes(max_clients: int) -> int:
    return 8 * (HEADER_WORDS + max_clients * SLOT_WORDS)


class ControlBlock:
    """The mmap'd words of one GPU. `words` is the header, `slots` a (max_clients, SLOT_WORDS)
    uint64 view; both alias the shared memory."""

    def __init__(self, path: Path, create: bool = False, max_clients: int = 64,
                 total: int = 0, usable: int = 0) -> None:
        self.path = Path(path)
        if create:
            size = segment_bytes(max_clients)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o660)
            try:
                os.ftruncate(fd, size)
                self._mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        else:
            fd = os.open(self.path, os.O_RDWR)
            try:
                self._mm = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
        arr = np.frombuffer(self._mm, dtype=np.uint64)
        self.words = arr[:HEADER_WORDS]
        if create:
            arr[:] = 0
            self.words[H_MAX_CLIENTS] = max_clients
            self.words[H_SLOT_WORDS] = SLOT_WORDS
            self.words[H_TOTAL] = total
            self.words[H_USABLE] = usable
            self.words[H_VERSION] = VERSION
            self.words[H_MAGIC] = MAGIC  # last: a reader seeing MAGIC sees the rest
        elif int(self.words[H_MAGIC]) != MAGIC or int(self.words[H_VERSION]) != VERSION:
            raise ValueError(f"{self.path}: not a governor control block")
        n = int(self.words[H_MAX_CLIENTS])
        self.max_clients = n
        self.slots = arr[HEADER_WORDS:HEADER_WORDS + n * SLOT_WORDS].reshape(n, SLOT_WORDS)

    def slot(self, i: int) -> np.ndarray:
        return self.slots[i]

    def inference_busy(self) -> bool:
        return bool(self.slots[:, W_BUSY].any())

    def close(self) -> None:
        # Drop numpy views before closing the map (they hold exported buffers).
        self.words = self.slots = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a slot view; the map dies with the process
            pass


@dataclass
class SlotWriter:
    """Daemon side of one slot."""

    slot: np.ndarray

    def command(self, cmd: int, target: int) -> int:
        s = self.slot
        s[W_TARGET] = target
        s[W_CMD] = cmd
        s[W_CMD_T] = now_ns()
        seq = int(s[W_SEQ]) + 1
        s[W_SEQ] = seq  # publish last
        return seq

    def acked(self, seq: int) -> bool:
        return int(self.slot[W_ACK]) >= seq


@dataclass
class Command:
    seq: int
    cmd: int
    target: int
    issued_ns: int


class SlotReader:
    """Client side of one slot: cheap enough to call at every safe point (~1 µs)."""

    def __init__(self, slot: np.ndarray) -> None:
        self.slot = slot

    def pending(self) -> Command | None:
        s = self.slot
        seq = int(s[W_SEQ])
        if seq == int(s[W_ACK]):
            return None
        return Command(seq, int(s[W_CMD]), int(s[W_TARGET]), int(s[W_CMD_T]))

    def stamp_detect(self) -> None:
        self.slot[W_T_DETECT] = now_ns()

    def ack(self, seq: int, used: int, drained_ns: int, released_ns: int, flags: int = 0,
            freed: int = 0) -> None:
        s = self.slot
        s[W_USED] = used
        s[W_FREED] = max(0, int(freed))
        s[W_T_DRAINED] = drained_ns
        s[W_T_RELEASED] = released_ns
        s[W_ACK_FLAGS] = flags
        s[W_ACK] = seq  # last: the daemon trusts USED once it sees ACK

    def quota(self) -> int:
        return int(self.slot[W_QUOTA])

    def heartbeat(self) -> None:
        self.slot[W_HEARTBEAT] = now_ns()

    def set_busy(self, busy: bool) -> None:
        self.slot[W_BUSY] = 1 if busy else 0


# --- socket messages ---------------------------------------------------------------------

class ProtocolError(ValueError):
    pass


def encode(msg: dict) -> bytes:
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


def decode(line: bytes) -> dict:
    try:
        msg = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"bad JSON: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("message must be an object with a string 'op'")
    return msg


class LineBuffer:
    """Splits a byte stream into lines; refuses lines longer than MAX_LINE."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        lines = []
        while True:
            i = self._buf.find(b"\n")
            if i < 0:
                break
            lines.append(bytes(self._buf[:i]))
            del self._buf[: i + 1]
        if len(self._buf) > MAX_LINE:
            raise ProtocolError("line too long")
        return lines


OPS = {"register", "reserve", "release", "usage", "ack", "pages", "stats", "ping"}
MAX_FDS_PER_MESSAGE = 250   # the kernel's SCM_RIGHTS limit is 253


def validate_request(msg: dict) -> dict:
    """Check the fields an op needs; raise ProtocolError naming the problem."""
    op = msg["op"]
    if op not in OPS:
        raise ProtocolError(f"unknown op {op!r}")

    def need(key: str, typ: type | tuple) -> None:
        if not isinstance(msg.get(key), typ) or isinstance(msg.get(key), bool):
            raise ProtocolError(f"{op}: '{key}' must be {getattr(typ, '__name__', typ)}")

    if op == "register":
        if msg.get("role") not in ("training", "inference"):
            raise ProtocolError("register: 'role' must be 'training' or 'inference'")
        need("gpu", int)
        need("pid", int)
    elif op in ("reserve", "release"):
        need("bytes", int)
        if msg["bytes"] < 0:
            raise ProtocolError(f"{op}: 'bytes' must be >= 0")
        from governor.ledger import MemoryKind
        try:
            MemoryKind(msg.get("kind", "workspace"))
        except ValueError:
            raise ProtocolError(f"{op}: unknown kind {msg.get('kind')!r}") from None
    elif op == "usage":
        if not isinstance(msg.get("kinds"), dict):
            raise ProtocolError("usage: 'kinds' must be an object")
        d = msg.get("drain_ms", 0.0)
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < 1e6:
            raise ProtocolError("usage: 'drain_ms' must be a number of ms >= 0")
    elif op == "ack":
        need("seq", int)
    elif op == "pages":
        need("seq", int)
        need("n", int)
        need("page_bytes", int)
        if not 0 <= msg["n"] <= MAX_FDS_PER_MESSAGE or msg["page_bytes"] <= 0:
            raise ProtocolError(f"pages: 'n' must be 0..{MAX_FDS_PER_MESSAGE} and 'page_bytes' > 0")
    return msg

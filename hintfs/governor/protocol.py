"""Wire formats: the shared-memory control words and the Unix-socket messages. No torch.

Shared memory: each client has a block of its own, an anonymous memfd the daemon creates when the
client registers and passes to it (SCM_RIGHTS) with the reply; nobody else can map it, and each
daemon instance creates fresh ones (no name to plant, follow or reopen). A block holds HEADER_WORDS
uint64 header words (written by the daemon: the card, and BUSY, how many inference clients of that
GPU run a request now) and one slot of SLOT_WORDS words. Every word has one writer. Aligned 8-byte
stores are atomic on x86-64 and stores are seen in program order (TSO), which the publication
protocol relies on:

  daemon, to command a client:  TARGET, CMD, CMD_T  then  SEQ += 1   (SEQ last: publishes)
  client, at a safe point:      reads SEQ; if SEQ != ACK: reads CMD/TARGET, stamps T_DETECT
  client, after releasing:      USED, T_DRAINED, T_RELEASED, ACK_FLAGS  then  ACK = SEQ
                                (ACK last; a client already under TARGET acks without releasing)
  daemon:                       sees ACK == the SEQ of a command it issued, then trusts USED
                                (bounded) and lowers the ledger quota to that command's target

SEQ starts at a random value in each new block, so an ack written into a new block for a command
of an old one (a client that re-registered after a restart) matches no command.
QUOTA is written by the daemon whenever a quota is committed (after an ack, or a grow).
BUSY (slot) is written by an inference client while a request runs, and announced to the daemon
(`busy` op), which counts them into the header's BUSY word of every training client's block.

Socket messages (hintfs/governor/messages.py parses them with bounds): JSON objects, one per line,
request → one reply line, except the notifications `ack`, `pages` and `busy`.

Page handoff: a training client behind the page allocator may hand the pages it frees for a
shrink to the daemon instead of the driver: `pages {seq, n, total, page_bytes}` (no reply) carries
n file descriptors (SCM_RIGHTS, n <= MAX_FDS_PER_MESSAGE; `total` over all the batches of that
command), sent *before* the ACK word, whose flags then include ACK_LENT. The daemon passes them
on with the grant: a `reserve` reply with `pages: n` carries n fds, in batches (the reply line with
the first, a bare newline with each further one), if the inference client registered with
`accept_pages` and runs as the same user as the trainer.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hintfs.governor.messages import (  # noqa: F401  (the wire's names, where clients look for them)
    MAX_FDS_PER_MESSAGE, LineBuffer, ProtocolError, decode, encode,
)

MAGIC = 0x48494E5446534756  # "HINTFSGV"
VERSION = 2
HEADER_WORDS = 16
SLOT_WORDS = 16

# header words (the daemon writes them)
H_MAGIC, H_VERSION, H_MAX_CLIENTS, H_SLOT_WORDS, H_TOTAL, H_USABLE, H_BUSY, H_CLIENT, H_GPU = range(9)

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

F_SEAL_FUTURE_WRITE = 0x0010


def layout_refusal(magic: int, version: int) -> str:
    """Why a block is not mapped: not a control block, or one of another layout version (the
    daemon makes each client's block in the layout of this VERSION: docs/versions.md)."""
    if magic != MAGIC or version == VERSION:
        return "not a governor control block"
    side = "upgrade hintfs in this job" if version > VERSION else "upgrade the governor (hintfs governor)"
    return f"a governor control block of layout version {version}, this client maps layout {VERSION}: {side}"


def now_ns() -> int:
    """CLOCK_MONOTONIC is system-wide, so stamps from different processes compare."""
    return time.monotonic_ns()


def segment_bytes(max_clients: int) -> int:
    return 8 * (HEADER_WORDS + max_clients * SLOT_WORDS)


def _seq_base() -> int:
    """Where a new block's SEQ starts: random, so that no ack of another block matches."""
    return secrets.randbelow(1 << 40) + 1


class ControlBlock:
    """The mmap'd words of a block. `words` is the header, `slots` a (max_clients, SLOT_WORDS)
    uint64 view; both alias the shared memory. A client's block has one slot (its own);
    `ControlBlock.memfd` makes one, `ControlBlock.from_fd` maps the one a client received. The
    path form (a file, created with O_EXCL and never through a symlink) is for tests."""

    def __init__(self, path: Path | None = None, create: bool = False, max_clients: int = 64,
                 total: int = 0, usable: int = 0, *, fd: int | None = None) -> None:
        self.path = Path(path) if path is not None else None
        if fd is None:
            assert self.path is not None
            flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL if create else flags, 0o600)
            own = True
        else:
            own = False
        try:
            if create:
                size = -(-segment_bytes(max_clients) // mmap.PAGESIZE) * mmap.PAGESIZE
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
                if size < segment_bytes(1):
                    raise ValueError(f"{self.path or 'block'}: not a governor control block")
            self._mm = mmap.mmap(fd, size)
        finally:
            if own:
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
            base = _seq_base()
            slots = arr[HEADER_WORDS:HEADER_WORDS + max_clients * SLOT_WORDS].reshape(max_clients, SLOT_WORDS)
            slots[:, W_SEQ] = base
            slots[:, W_ACK] = base
            self.words[H_MAGIC] = MAGIC  # last: a reader seeing MAGIC sees the rest
        elif (int(self.words[H_MAGIC]) != MAGIC or int(self.words[H_VERSION]) != VERSION
              or int(self.words[H_SLOT_WORDS]) != SLOT_WORDS
              or segment_bytes(int(self.words[H_MAX_CLIENTS])) > size):
            why = layout_refusal(int(self.words[H_MAGIC]), int(self.words[H_VERSION]))
            self.words = None  # type: ignore[assignment]
            del arr
            self._mm.close()
            raise ValueError(f"{self.path or 'block'}: {why}")
        n = int(self.words[H_MAX_CLIENTS])
        self.max_clients = n
        self.slots = arr[HEADER_WORDS:HEADER_WORDS + n * SLOT_WORDS].reshape(n, SLOT_WORDS)

    @classmethod
    def memfd(cls, name: str, total: int = 0, usable: int = 0) -> tuple[ControlBlock, int]:
        """A client's block: an anonymous memfd of one slot, sealed against resizing (a client
        that could shrink it would make the daemon's next read of its words fault). Returns the
        block (the daemon's mapping) and the fd to pass to the client (the caller closes it)."""
        fd = os.memfd_create(name[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            block = cls(create=True, max_clients=1, total=total, usable=usable, fd=fd)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(fd)
            raise
        return block, fd

    @classmethod
    def from_fd(cls, fd: int) -> ControlBlock:
        """Map a block received from the daemon (the fd may be closed afterwards)."""
        return cls(fd=fd)

    def slot(self, i: int) -> np.ndarray:
        row: np.ndarray = self.slots[i]
        return row

    def inference_busy(self) -> bool:
        """An inference client of this GPU runs a request (the daemon's count in the header)."""
        return bool(self.words[H_BUSY])

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
        return int(self.slot[W_ACK]) == seq


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

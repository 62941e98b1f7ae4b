"""`hintfs governor`: the per-host daemon. trio, no torch.

One ledger per GPU. Clients connect over a Unix socket (one connection = one client; the
connection closing means the client is gone and its memory returns to the ledger). Each client
gets a shared-memory block of its own (a memfd) for the quota/command/ack words. Inference
reservations that do not fit make the daemon shrink training quotas through those words and
wait for the acks, up to the reclaim deadline.

The boundary (docs/security.md, "Governor"): only the users the config allows are served (checked
at accept, SO_PEERCRED), each within per-user bounds; every message is parsed with bounds and
validated (hintfs/governor/messages.py); a client whose message is refused is answered and dropped, with
one log line, and whatever goes wrong in one connection ends that connection only. Pids come from
the kernel (a pidfd taken at accept), never from a message. A restart holds back what the previous
instance's clients may hold (hintfs/governor/record.py) until they register again or their process ends.
"""

from __future__ import annotations

import array
import errno
import grp
import logging
import os
import secrets
import select
import signal
import socket as pysocket
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio
from pydantic import BaseModel

from hintfs.common.refusals import RefusalLog
from hintfs.common.fdlimit import raise_open_file_limit
from hintfs.governor import cardmemory
from hintfs.governor.cardmemory import Card, CardMemoryError, Probe, with_card_memory
from mountconfig.governor import GiB, GovernorConfig
from hintfs.governor import messages as m
from hintfs.governor.ledger import ClientEntry, GpuLedger, HeldBack, LedgerError, MemoryKind, Role
from hintfs.governor.messages import MAX_FDS_PER_MESSAGE, LineBuffer, ProtocolError, encode
from hintfs.common.fdlimit import reserve_fd_table
from hintfs.governor.pagebroker import PageBroker, close_fds
from hintfs.governor.protocol import (
    ACK_ABORTED, ACK_FREED, ACK_LENT, ACK_RELEASED, CMD_GROW, CMD_SHRINK, H_BUSY, H_CLIENT, H_GPU,
    ROLE_INFERENCE, ROLE_TRAINING, W_ACK, W_ACK_FLAGS, W_FREED, W_OWNER, W_QUOTA, W_ROLE, W_T_DETECT,
    W_T_DRAINED, W_T_RELEASED, W_USED, HEADER_WORDS, SLOT_WORDS, ControlBlock, SlotWriter, now_ns,
)
from hintfs.governor.record import HELD, LIVE, Entry, GpuRecord, Lock, LockError, open_folder, process_start
from policy.governor_deadline import Commands, ReclaimOutcome, reclaim_outcome
from policy.governor_headroom import ArrivalRate, Ewma, headroom_bytes
from policy.governor_progress import (
    grow_decision, inference_limit_bytes, training_floor_bytes, training_target_bytes,
)

log = logging.getLogger("hintfs.governor")

SO_PEERGROUPS = getattr(pysocket, "SO_PEERGROUPS", 59)
SO_PEERPIDFD = getattr(pysocket, "SO_PEERPIDFD", 77)
FDS_PER_RECV = 253                 # the kernel's SCM_MAX_FD: room for any one message's fds
REFUSAL_LOG_EVERY_S = 10.0         # refused connections: one line per user this often at most
ROLE_WORD = {Role.TRAINING: ROLE_TRAINING, Role.INFERENCE: ROLE_INFERENCE, Role.OBSERVER: 3}


class DaemonStartError(RuntimeError):
    """A start-up problem the user can fix (socket in use, bad path); one line."""


class Refusal(Exception):
    """A well-formed request that cannot be served (limit, unknown GPU): answered, the
    connection stays."""


@dataclass
class Peer:
    """Who is on the other end of a connection, from the kernel at accept."""
    pid: int                 # 0: not in our pid namespace (SO_PEERCRED gives no pid)
    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    pidfd: int | None = None
    start: int | None = None  # the process's start time (with pid: one process)

    def gone(self) -> bool:
        """The process exited (its pidfd is readable). Unknown pid: never."""
        if self.pidfd is None:
            return False
        p = select.poll()
        p.register(self.pidfd, select.POLLIN)
        return bool(p.poll(0))

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


@dataclass
class Shrink:
    """A shrink command out to a trainer: which reservation waits on it (its pages go there)
    and the pages lent for it so far."""
    seq: int
    target: int
    for_client: int
    pages_total: int = 0
    pages_got: int = 0
    page_bytes: int = 0
    granted: bool = False
    pages_done: trio.Event = field(default_factory=trio.Event)


@dataclass
class GpuState:
    ledger: GpuLedger
    record: GpuRecord
    arrivals: ArrivalRate
    reclaim_s: Ewma
    lock: trio.Lock = field(default_factory=trio.Lock)
    free_since: float | None = None
    adjustments: list[dict] = field(default_factory=list)  # recent reclaim timings
    broker: PageBroker = field(default_factory=PageBroker)   # pages lent by training, in transit
    busy: int = 0                       # inference clients running a request now
    wake: trio.Event = field(default_factory=trio.Event)    # an ack arrived


@dataclass
class Conn:
    client_id: int
    gpu: int
    entry: ClientEntry
    peer: Peer
    block: ControlBlock
    accept_pages: bool = False          # inference: take lent pages (fds) with its grants
    drain_bound_s: float = 0.0          # training: how long its stop can take (its usage report)
    commands: Commands = field(default_factory=Commands)
    shrinks: dict[int, Shrink] = field(default_factory=dict)   # by seq, recent ones kept
    busy: bool = False

    @property
    def words(self):
        return self.block.slots[0]

    def who(self) -> str:
        return f"client {self.client_id} ({self.entry.name!r}, uid {self.peer.uid}, pid {self.peer.pid})"


class GovernorDaemon:
    def __init__(self, config: GovernorConfig, probe: Probe | None = None) -> None:
        """`probe`: reads the memory of the cards whose `total_bytes` the config leaves out
        (hintfs/governor/cardmemory.py: NVML; a test passes its own)."""
        self.cfg = config
        self.cards: dict[int, Card] = {}     # the cards whose memory was read at open()
        self._probe = probe
        self.gpus: dict[int, GpuState] = {}
        self.conns: dict[int, Conn] = {}
        self._listener_sock: pysocket.socket | None = None
        self._bound: str | None = None
        self._folder_fd: int | None = None
        self._locks: list[Lock] = []
        self.instance = ""
        self.ready = trio.Event()
        self.n_conns = 0
        self.conns_by_uid: dict[int, int] = {}
        self.clients_by_uid: dict[int, int] = {}
        self.reserving_by_uid: dict[int, int] = {}
        self._refused = RefusalLog(REFUSAL_LOG_EVERY_S)   # one line per uid and period
        self._loop_errors: set[str] = set()
        self.allowed_uids = {0, os.geteuid(), *config.allowed_uids}
        self.allowed_gids = set(config.allowed_gids)
        self.socket_gid: int | None = None

    # --- lifecycle ------------------------------------------------------------------
    def open(self) -> None:
        """Take the locks, bind the socket, read the previous instance's record; raises
        DaemonStartError for user mistakes. Whatever it made is undone on failure."""
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        try:
            self.cfg, self.cards = with_card_memory(self.cfg, self._probe or cardmemory.read_cards)
        except CardMemoryError as e:
            raise DaemonStartError(str(e)) from None
        cfg = self.cfg
        path = Path(cfg.socket_path)
        if cfg.socket_group is not None:
            try:
                self.socket_gid = (cfg.socket_group if isinstance(cfg.socket_group, int)
                                   else grp.getgrnam(cfg.socket_group).gr_gid)
            except KeyError:
                raise DaemonStartError(f"socket_group {cfg.socket_group!r}: no such group") from None
            self.allowed_gids.add(self.socket_gid)
        self._socket_folder(path.parent)
        self.instance = f"{cfg.shm_name}.{secrets.token_hex(4)}"
        try:
            self._folder_fd = open_folder(str(path.parent))
        except LockError as e:
            raise DaemonStartError(f"{e}; or set governor.socket_path") from None
        try:
            self._locks.append(Lock(self._folder_fd, path.name + ".lock", f"socket {path}", self.instance))
            self._locks.append(Lock(self._folder_fd, cfg.shm_name + ".lock", f"shm_name {cfg.shm_name!r}",
                                    self.instance))
            records = {g.index: GpuRecord(self._folder_fd, g.index, self.instance, cfg.max_clients)
                       for g in cfg.gpus}
        except LockError as e:
            raise DaemonStartError(str(e)) from None
        soft = raise_open_file_limit()
        if soft < cfg.fd_bound():
            log.warning("RLIMIT_NOFILE is %d, below the %d this config may need (docs/governor.md, "
                        "'Bounds'); raise LimitNOFILE", soft, cfg.fd_bound())
        for g in cfg.gpus:
            assert g.total_bytes is not None              # (with_card_memory filled it)
            ledger = GpuLedger(g.index, g.total_bytes, g.reserve_bytes)
            st = GpuState(ledger, records[g.index], arrivals=ArrivalRate(cfg.arrival_window_s),
                          reclaim_s=Ewma(cfg.reclaim_time_initial_ms / 1000))
            self.gpus[g.index] = st
            self._hold_back_previous(st)
        self._bind(path)
        reserve_fd_table(min(4096, cfg.fd_bound()))   # no table growth on a reclaim's path

    def _socket_folder(self, folder: Path) -> None:
        """Create the socket's folder if it is missing (0755, this daemon's user: what the unit's
        RuntimeDirectory makes), one level only: a missing parent is a typo more often than not.
        Who owns an existing one, and who may write it, `open_folder` checks next."""
        try:
            st = os.stat(folder)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise DaemonStartError(f"socket folder {folder}: {e.strerror or e}; set governor.socket_path") from None
        if st is not None:
            if not stat.S_ISDIR(st.st_mode):
                raise DaemonStartError(f"socket folder {folder} exists and is not a directory; "
                                       "set governor.socket_path")
            return
        if not folder.parent.is_dir():
            raise DaemonStartError(f"socket folder {folder} does not exist, nor its parent: create it, "
                                   "or set governor.socket_path")
        old = os.umask(0o022)
        try:
            os.mkdir(folder, 0o755)
        except FileExistsError:
            return                     # made meanwhile by someone else: open_folder checks it
        except OSError as e:
            hint = (" (run as root, or create it owned by this user and writable by no one else)"
                    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else "")
            raise DaemonStartError(f"cannot create socket folder {folder}: {e.strerror or e}{hint}; "
                                   "or set governor.socket_path") from None
        finally:
            os.umask(old)
        log.info("created the socket folder %s (mode 0755)", folder)

    def _hold_back_previous(self, st: GpuState) -> None:
        """The previous instance's clients whose process still runs may still hold their bytes:
        counted as used until they register again or their process ends."""
        rec = st.record
        for e in rec.previous:
            if e.role == "observer" or not e.pid or process_start(e.pid) != e.start:
                continue
            h = HeldBack(e.client_id, Role(e.role), e.pid, e.start, e.uid, e.name, e.nbytes)
            st.ledger.hold_back(h)
            rec.set(Entry(e.client_id, e.pid, e.start, e.uid, e.role, e.nbytes, HELD, e.name))
            log.info("GPU %d: client %d (%r, uid %d, pid %d) of instance %s may hold %d bytes: held back "
                     "until it registers again or its process ends", st.ledger.index, e.client_id,
                     e.name, e.uid, e.pid, rec.previous_instance, e.nbytes)

    def _bind(self, path: Path) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                raise DaemonStartError(f"socket_path {path} exists and is not a socket (not removed)")
            probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except OSError:
                os.unlink(path)  # stale socket of a dead daemon (we hold its lock)
            else:
                raise DaemonStartError(f"socket {path} is in use by another governor")
            finally:
                probe.close()
        mode = self._socket_mode()
        sock = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
            self._bound = str(path)
        except OSError as e:
            sock.close()
            raise DaemonStartError(f"cannot listen on {path}: {e.strerror or e}") from None
        finally:
            os.umask(old)
        try:
            if self.socket_gid is not None:
                os.chown(path, -1, self.socket_gid)
            os.chmod(path, mode)
            sock.listen(128)
        except OSError as e:
            sock.close()
            raise DaemonStartError(f"cannot listen on {path}: {e.strerror or e}") from None
        sock.setblocking(False)
        self._listener_sock = sock

    def gpus_text(self) -> str:
        """The governed GPUs for the start line: index, bytes and where that number came from."""
        parts = []
        for g in self.cfg.gpus:
            assert g.total_bytes is not None
            card = self.cards.get(g.index)
            source = f"{card.name}, read from the card" if card is not None else "total_bytes of the config"
            parts.append(f"GPU {g.index}: {g.total_bytes / GiB:.1f} GiB ({source}), "
                         f"{g.reserve_bytes / GiB:.1f} GiB reserved")
        return "; ".join(parts)

    def _socket_mode(self) -> int:
        if self.cfg.allowed_uids or self.cfg.allowed_gids:
            return 0o666      # any user may connect(); the daemon checks each peer at accept
        if self.socket_gid is not None:
            return 0o660
        return 0o600

    def close(self) -> None:
        if self._bound is not None and self.ready.is_set():
            log.info("governor %s stopped: socket %s removed, %d client(s) were connected",
                     self.instance, self._bound, len(self.conns))
        if self._listener_sock is not None:
            self._listener_sock.close()
            self._listener_sock = None
        if self._bound is not None:
            try:
                os.unlink(self._bound)
            except FileNotFoundError:
                pass
            self._bound = None
        for c in list(self.conns.values()):
            c.peer.close()
            c.block.close()
        self.conns.clear()
        for st in self.gpus.values():
            st.broker.drop_all()
            st.record.close()     # the record stays on disk for the next instance
        self.gpus.clear()
        for lk in self._locks:
            lk.close()
        self._locks = []
        if self._folder_fd is not None:
            os.close(self._folder_fd)
            self._folder_fd = None

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        assert self._listener_sock is not None, "call open() first"
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self._listener_sock))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._liveness_loop)
            nursery.start_soon(self._grow_loop)
            self.ready.set()
            log.info("governor %s started: listening on %s (mode %04o), pid %d; %s", self.instance,
                     self.cfg.socket_path, self._socket_mode(), os.getpid(), self.gpus_text())
            task_status.started()
            await trio.serve_listeners(self._handle, [listener], handler_nursery=nursery)

    # --- policy helpers ---------------------------------------------------------------
    def reclaim_estimate_s(self, st: GpuState) -> float:
        """How long a reclaim is expected to take: the EWMA of measured reclaims, but never less
        than what a training client says its stop can take (its bounded drain, itself at most the
        reclaim deadline), so that the headroom covers the arrivals of a slow stop."""
        bound = max((c.drain_bound_s for c in self.conns.values()
                     if c.gpu == st.ledger.index and c.entry.role is Role.TRAINING), default=0.0)
        return max(st.reclaim_s.value, bound)

    def headroom(self, st: GpuState) -> int:
        now = time.monotonic()
        return headroom_bytes(
            rate_per_s=st.arrivals.rate(now), reclaim_s=self.reclaim_estimate_s(st),
            bytes_per_arrival=st.arrivals.size_quantile(self.cfg.headroom_quantile),
            quantile=self.cfg.headroom_quantile, floor_bytes=self.cfg.min_headroom_bytes,
            cap_bytes=st.ledger.usable_bytes // 2)

    def training_target(self, st: GpuState) -> int:
        return training_target_bytes(st.ledger.usable_bytes, st.ledger.inference_bytes(),
                                     self.headroom(st), self.cfg.min_training_fraction)

    # --- who may connect ----------------------------------------------------------------
    def _allowed(self, peer: Peer) -> bool:
        if peer.uid in self.allowed_uids:
            return True
        return bool(self.allowed_gids & {peer.gid, *peer.groups})

    def _log_refused(self, peer: Peer, why: str) -> None:
        since = self._refused.note(peer.uid)
        if since is not None:
            log.warning("refused a connection of uid %d gid %d pid %d: %s%s", peer.uid, peer.gid,
                        peer.pid, why, RefusalLog.more(since))

    # --- connections --------------------------------------------------------------------
    async def _handle(self, stream: trio.SocketStream) -> None:
        sock = stream.socket
        try:
            peer = _peer(sock)
        except OSError:
            await stream.aclose()
            return
        why = None
        if not self._allowed(peer):
            why = "not allowed (governor.allowed_uids, allowed_gids, socket_group)"
        elif self.n_conns >= self.cfg.max_connections:
            why = f"max_connections ({self.cfg.max_connections}) reached"
        elif self.conns_by_uid.get(peer.uid, 0) >= self.cfg.max_connections_per_uid:
            why = f"max_connections_per_uid ({self.cfg.max_connections_per_uid}) reached"
        if why is not None:
            self._log_refused(peer, why)
            with trio.CancelScope(shield=True):
                await stream.aclose()
            return
        self.n_conns += 1
        self.conns_by_uid[peer.uid] = self.conns_by_uid.get(peer.uid, 0) + 1
        peer.pidfd = _pidfd(sock, peer.pid)
        if peer.pidfd is not None:
            peer.start = process_start(peer.pid)
            if peer.gone():
                peer.start = None
        conn: Conn | None = None
        lines = LineBuffer()
        fds: list[int] = []
        drop_reason = None
        try:
            while True:
                try:
                    data, anc, flags, _ = await sock.recvmsg(65536, pysocket.CMSG_SPACE(FDS_PER_RECV * 4))
                except OSError:
                    break
                fds = _fds_of(anc)
                if flags & pysocket.MSG_CTRUNC:
                    raise ProtocolError("more fds than one message may carry")
                if not data:
                    if fds:
                        raise ProtocolError("fds without a message")
                    break
                batch = lines.feed(data)
                if fds and (not batch or lines.partial):
                    raise ProtocolError("fds not with a complete pages message")
                for i, line in enumerate(batch):
                    msg = m.parse(line)
                    attached: list[int] = []
                    if fds and i == len(batch) - 1:
                        attached, fds = fds, []
                    if isinstance(msg, m.Pages):
                        if len(attached) != msg.n:
                            close_fds(attached)
                            raise ProtocolError(f"pages: {msg.n} announced, {len(attached)} fds came")
                        self._pages_in(conn, msg, attached)   # takes or closes them
                        continue
                    if attached:
                        close_fds(attached)
                        raise ProtocolError(f"{msg.op}: carries no fds")
                    if isinstance(msg, m.Ack):
                        self._on_ack(conn)
                        continue
                    if isinstance(msg, m.Busy):
                        self._busy(conn, msg.on)
                        continue
                    try:
                        reply, conn = await self._dispatch(msg, conn, peer)
                    except (Refusal, LedgerError) as e:
                        reply = {"ok": False, "error": str(e)}
                    await self._send(stream, reply)
        except ProtocolError as e:
            drop_reason = str(e)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as e:   # the error boundary: this connection ends, nothing else
            drop_reason = f"internal error {type(e).__name__}: {str(e)[:200]}"
        finally:
            close_fds(fds)
            if drop_reason is not None:
                who = conn.who() if conn is not None else f"a connection of uid {peer.uid} pid {peer.pid}"
                if conn is None:
                    log.warning("%s dropped: %s", who, drop_reason)
                with trio.move_on_after(1) as cs:
                    cs.shield = True
                    try:
                        await stream.send_all(encode({"ok": False, "error": drop_reason[:300], "dropped": True}))
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
            if conn is not None:
                self._drop(conn, "connection closed" if drop_reason is None else f"dropped: {drop_reason}",
                           hold=drop_reason is not None)
            peer.close()
            self.n_conns -= 1
            self.conns_by_uid[peer.uid] -= 1
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _send(self, stream: trio.SocketStream, reply: dict) -> None:
        """One reply line; fds travel with it as SCM_RIGHTS, at most MAX_FDS_PER_MESSAGE per
        message (the line with the first batch, a bare newline with each further one), then the
        daemon's copies are closed: the receiver holds them now."""
        fds = reply.pop("_fds", None)
        if fds:
            reply["nfds"] = len(fds)
        data = encode(reply)
        if not fds:
            await stream.send_all(data)
            return
        try:
            for i in range(0, len(fds), MAX_FDS_PER_MESSAGE):
                part = fds[i:i + MAX_FDS_PER_MESSAGE]
                payload = data if i == 0 else b"\n"
                sent = await stream.socket.sendmsg(
                    [payload], [(pysocket.SOL_SOCKET, pysocket.SCM_RIGHTS, array.array("i", part))])
                if sent < len(payload):
                    await stream.send_all(payload[sent:])
        finally:
            close_fds(fds)

    def _drop(self, conn: Conn, why: str, hold: bool = False) -> None:
        """The client is gone. `hold`: the daemon dropped it (a refused message) while its
        process may still run and hold memory: that memory stays held back until it ends."""
        if self.conns.pop(conn.client_id, None) is None:
            return
        st = self.gpus[conn.gpu]
        e = conn.entry
        held = e.held()
        st.ledger.remove(conn.client_id)
        self.clients_by_uid[conn.peer.uid] -= 1
        if conn.busy:
            conn.busy = False
            self._set_busy_words(st, -1)
        if hold and held and conn.peer.pid and conn.peer.start is not None and not conn.peer.gone():
            st.ledger.hold_back(HeldBack(conn.client_id, e.role, conn.peer.pid, conn.peer.start,
                                         conn.peer.uid, e.name, held))
            st.record.update(conn.client_id, held, HELD)
            log.warning("%s gone (%s): its %d bytes are held back until its process ends",
                        conn.who(), why, held)
        else:
            st.record.remove(conn.client_id)
            log.info("%s gone (%s): %d bytes back on GPU %d", conn.who(), why, held, conn.gpu)
        st.broker.drop(conn.client_id)      # pages lent for its reservations: nobody takes them
        conn.block.close()
        st.wake.set()

    def _record(self, st: GpuState, c: Conn) -> None:
        st.record.update(c.client_id, c.entry.held())

    async def _dispatch(self, msg: BaseModel, conn: Conn | None, peer: Peer):
        if isinstance(msg, m.Simple):
            if msg.op == "ping":
                return {"ok": True}, conn
            return {"ok": True, "instance": self.instance,
                    "gpus": [self._stats(st) for st in self.gpus.values()]}, conn
        if isinstance(msg, m.Register):
            if conn is not None:
                raise ProtocolError("already registered on this connection")
            return self._register(msg, peer)
        if conn is None:
            raise ProtocolError(f"{msg.op}: register first")   # type: ignore[attr-defined]
        st = self.gpus[conn.gpu]
        if isinstance(msg, m.Usage):
            if conn.entry.role is not Role.TRAINING:
                raise ProtocolError("usage: only training clients report usage")
            st.ledger.report(conn.client_id, dict(msg.kinds))
            conn.drain_bound_s = min(msg.drain_ms, self.cfg.reclaim_deadline_ms) / 1e3
            return {"ok": True}, conn
        assert isinstance(msg, m.Reserve)
        if conn.entry.role is not Role.INFERENCE:
            raise ProtocolError(f"{msg.op}: only inference clients reserve memory")
        if msg.bytes > st.ledger.usable_bytes:
            raise ProtocolError(f"{msg.op}: {msg.bytes} bytes exceed the card's {st.ledger.usable_bytes} usable")
        if msg.op == "release":
            freed = st.ledger.release(conn.client_id, msg.kind, msg.bytes)
            self._record(st, conn)
            return {"ok": True, "released": freed}, conn
        uid = conn.peer.uid
        if self.reserving_by_uid.get(uid, 0) >= self.cfg.max_reserves_in_flight_per_uid:
            raise Refusal(f"reserve: max_reserves_in_flight_per_uid ({self.cfg.max_reserves_in_flight_per_uid}) reached")
        self.reserving_by_uid[uid] = self.reserving_by_uid.get(uid, 0) + 1
        try:
            return await self._reserve(st, conn, msg.kind, msg.bytes), conn
        finally:
            self.reserving_by_uid[uid] -= 1

    def _register(self, msg: m.Register, peer: Peer):
        if not peer.pid or peer.pidfd is None or peer.start is None:
            raise ProtocolError("register: the kernel gives no pid for this process (another pid "
                                "namespace?): it cannot be a client")
        st = self.gpus.get(msg.gpu)
        if st is None:
            raise Refusal(f"register: GPU {msg.gpu} is not governed here")
        if self.clients_by_uid.get(peer.uid, 0) >= self.cfg.max_clients_per_uid:
            raise Refusal(f"register: max_clients_per_uid ({self.cfg.max_clients_per_uid}) reached")
        if len(st.ledger.clients) >= self.cfg.max_clients:
            raise Refusal(f"register: max_clients ({self.cfg.max_clients}) reached on GPU {msg.gpu}")
        role = Role(msg.role)
        ledger = st.ledger
        quota, reserved = 0, {}
        resume = msg.resume
        if resume is not None and resume.client not in ledger.held_back and not resume.quota \
                and not any(resume.held.values()):
            resume = None          # it held nothing: a new registration like any other
        if resume is not None:
            h = ledger.held_back.get(resume.client)
            if h is None or (h.pid, h.start, h.uid, h.role) != (peer.pid, peer.start, peer.uid, role):
                raise Refusal(f"register: client {resume.client} is no client of the previous "
                              "instance held back for this process")
            ledger.release_held_back(h.client_id)
            cid = h.client_id
            if role is Role.TRAINING:
                quota = min(h.nbytes, resume.quota if resume.quota is not None else h.nbytes)
            else:
                left = h.nbytes
                for k, v in resume.held.items():
                    reserved[k] = min(v, left)
                    left -= reserved[k]
        else:
            cid = st.record.new_id()
        name = f"{self.instance}-gpu{msg.gpu}-client{cid}"
        block, fd = ControlBlock.memfd(name, ledger.total_bytes, ledger.usable_bytes)
        try:
            block.words[H_CLIENT] = cid
            block.words[H_GPU] = msg.gpu
            block.words[H_BUSY] = st.busy
            s = block.slots[0]
            s[W_OWNER] = peer.pid
            s[W_ROLE] = ROLE_WORD[role]
            entry = ClientEntry(cid, role, peer.pid, msg.name, 0, uid=peer.uid)
            ledger.add(entry)
            if role is Role.TRAINING:
                if resume is None:
                    share = max(0, min(ledger.free_bytes() - self.headroom(st),
                                       self.training_target(st) - ledger.training_bytes()))
                    quota = share if msg.want_bytes is None else min(msg.want_bytes, share)
                ledger.set_quota(cid, quota)
                s[W_QUOTA] = quota
            for k, v in reserved.items():
                ledger.grant(cid, k, v)
            st.record.set(Entry(cid, peer.pid, peer.start or 0, peer.uid, role.value, entry.held(), LIVE,
                                msg.name))
        except BaseException:
            os.close(fd)
            block.close()
            ledger.remove(cid)
            raise
        conn = Conn(cid, msg.gpu, entry, peer, block,
                    accept_pages=msg.accept_pages and role is Role.INFERENCE)
        self.conns[cid] = conn
        self.clients_by_uid[peer.uid] = self.clients_by_uid.get(peer.uid, 0) + 1
        log.info("client %d registered%s: %s %r uid %d pid %d GPU %d quota %d held %d", cid,
                 " again after a restart" if resume else "", role.value, msg.name, peer.uid,
                 peer.pid, msg.gpu, entry.quota, entry.held())
        if (role is Role.TRAINING and resume is not None and resume.quota is not None
                and resume.quota > quota):
            self._command(conn, CMD_SHRINK, quota, for_client=0)   # it holds more than it may
        return {"ok": True, "client": cid, "slot": 0, "instance": self.instance, "protocol": m.PROTOCOL,
                "header_words": HEADER_WORDS, "slot_words": SLOT_WORDS, "quota": entry.quota,
                "held": {k.value: v for k, v in entry.reserved.items()},
                "usable_bytes": ledger.usable_bytes,
                "keepalive": {"min_s": self.cfg.keepalive_min_s,
                              "max_s": self.cfg.keepalive_max_s,
                              "quantile": self.cfg.keepalive_quantile},
                "_fds": [fd]}, conn

    def _busy(self, conn: Conn | None, on: bool) -> None:
        if conn is None or conn.entry.role is not Role.INFERENCE:
            raise ProtocolError("busy: only inference clients")
        if on != conn.busy:
            conn.busy = on
            self._set_busy_words(self.gpus[conn.gpu], 1 if on else -1)

    def _set_busy_words(self, st: GpuState, delta: int) -> None:
        st.busy = max(0, st.busy + delta)
        for c in self.conns.values():
            if c.gpu == st.ledger.index and c.entry.role is not Role.INFERENCE:
                c.block.words[H_BUSY] = st.busy

    # --- commands and acks --------------------------------------------------------------
    def _command(self, c: Conn, cmd: int, target: int, for_client: int) -> int:
        seq = SlotWriter(c.words).command(cmd, target)
        c.commands.issue(seq, cmd, target)
        if cmd == CMD_SHRINK:
            c.shrinks[seq] = Shrink(seq, target, for_client)
            for old in sorted(c.shrinks)[:-8]:       # keep the recent ones (late pages)
                del c.shrinks[old]
        return seq

    def _collect_ack(self, st: GpuState, c: Conn) -> bool:
        """Read the client's own ACK word; if it acknowledges a command of ours, settle it: a
        shrink's target becomes the quota (only if no newer command is out, which would have
        superseded it), and its USED (bounded) trims the last usage report. Late acks count."""
        if c.client_id not in self.conns:
            return False
        got = c.commands.on_ack(int(c.words[W_ACK]))
        if got is None:
            return False
        cmd, target, newest = got
        if cmd == CMD_SHRINK and newest and target < c.entry.quota:
            st.ledger.set_quota(c.client_id, target)
            c.words[W_QUOTA] = target
            self._record(st, c)
            st.ledger.trim_reported(c.client_id, min(int(c.words[W_USED]), st.ledger.usable_bytes))
        st.wake.set()
        return True

    def _on_ack(self, conn: Conn | None) -> None:
        if conn is None or conn.entry.role is not Role.TRAINING:
            raise ProtocolError("ack: only training clients acknowledge")
        self._collect_ack(self.gpus[conn.gpu], conn)

    # --- reclaim ---------------------------------------------------------------------
    async def _reserve(self, st: GpuState, conn: Conn, kind: MemoryKind, nbytes: int) -> dict:
        t0 = now_ns()
        ledger = st.ledger
        limit = inference_limit_bytes(ledger.usable_bytes, self.cfg.min_training_fraction)
        if ledger.inference_bytes() + nbytes > limit:    # refused before it counts as an arrival
            return {"ok": False, "error": f"reserve: {nbytes} bytes would exceed inference's "
                    f"limit of {limit} (training keeps min_training_fraction)"}
        st.arrivals.observe(time.monotonic(), nbytes)
        async with st.lock:
            if conn.client_id not in self.conns:
                return {"ok": False, "error": "reserve: client gone"}
            for trainer in self._trainers(st):
                self._collect_ack(st, trainer)
            if ledger.inference_bytes() + nbytes > limit:
                return {"ok": False, "error": f"reserve: {nbytes} bytes would exceed inference's "
                        f"limit of {limit} (training keeps min_training_fraction)"}
            if nbytes <= ledger.free_bytes():
                self._grant(st, conn, kind, nbytes)
                reply = {"ok": True, "granted": nbytes, "reclaimed": 0,
                         "timing_ms": {"total": (now_ns() - t0) / 1e6}}
                if st.broker.parked.get(conn.client_id):    # lent for it by a shrink acked late
                    pages, page_bytes = self._take_pages(st, conn, nbytes)
                    if pages:
                        reply.update(pages=len(pages), page_bytes=page_bytes, _fds=pages)
                return reply
            need = nbytes - ledger.free_bytes()
            floor = training_floor_bytes(ledger.usable_bytes, self.cfg.min_training_fraction)
            plan = ledger.plan_shrink(need, floor)
            waiting: dict[int, int] = {}      # trainer -> the seq whose ack this waits for
            for cid, quota in plan.items():
                c = self.conns.get(cid)
                if c is None:
                    continue
                seq = c.commands.wait_for(CMD_SHRINK, quota)
                if seq is not None and seq in c.shrinks:   # a late ack of it will count
                    c.shrinks[seq].for_client = conn.client_id
                else:
                    seq = self._command(c, CMD_SHRINK, quota, conn.client_id)
                waiting[cid] = seq
            issued = dict(waiting)
            t_cmd = now_ns()
            start = trio.current_time()
            acked: list[int] = []  # clients whose ack of a command this reclaim waited for came
            deadline_s = self.cfg.reclaim_deadline_ms / 1000
            poll_s = self.cfg.ack_poll_interval_ms / 1000
            while True:
                for cid in list(waiting):
                    c = self.conns.get(cid)
                    if c is None:  # died meanwhile: its memory is already back
                        del waiting[cid]
                        continue
                    self._collect_ack(st, c)
                    if c.commands.settled(waiting[cid]):
                        acked.append(cid)
                        del waiting[cid]
                elapsed = trio.current_time() - start
                outcome = reclaim_outcome(ledger.free_bytes(), nbytes, elapsed, deadline_s,
                                          self.cfg.deadline_miss_action)
                if outcome is ReclaimOutcome.WAIT and not waiting:
                    outcome = reclaim_outcome(ledger.free_bytes(), nbytes, deadline_s,
                                              deadline_s, self.cfg.deadline_miss_action)
                if outcome is ReclaimOutcome.GRANT:
                    break
                if outcome is ReclaimOutcome.REJECT and not waiting:
                    return {"ok": False, "error": f"reserve: {nbytes} bytes are not free and cannot be "
                            "reclaimed now (training's floor, or memory held back after a restart)"}
                if outcome is ReclaimOutcome.REJECT:
                    log.warning("reclaim of %d bytes for %s missed the %.1f ms deadline: rejected; "
                                "not acknowledged by %s", need, conn.who(), self.cfg.reclaim_deadline_ms,
                                self._names(waiting) or "nobody (training's floor or a late release)")
                    return {"ok": False, "error": "reserve: training missed the reclaim deadline"}
                if outcome is ReclaimOutcome.STOP_TRAINING:
                    log.warning("reclaim of %d bytes for %s missed the %.1f ms deadline: stopping %s",
                                need, conn.who(), self.cfg.reclaim_deadline_ms, self._names(waiting))
                    stopped = await self._stop_training(st, list(waiting))
                    if ledger.free_bytes() >= nbytes:
                        break
                    return {"ok": False, "error": "reserve: memory not free after stopping training"
                            + ("" if stopped else " (a stuck trainer could not be stopped)")}
                st.wake = trio.Event()
                with trio.move_on_after(min(poll_s * 5, max(deadline_s - elapsed, 0) + 1e-4)):
                    await st.wake.wait()
            self._grant(st, conn, kind, nbytes)
            pages, page_bytes = await self._lent_pages(st, conn, acked, issued, nbytes)
            t_done = now_ns()
            timing = self._timing(st, acked, t_cmd, t0, t_done)
            st.reclaim_s.update((t_done - t_cmd) / 1e9)
            st.adjustments.append(timing)
            del st.adjustments[:-1000]
            reply = {"ok": True, "granted": nbytes, "reclaimed": need, "timing_ms": timing}
            if pages:
                reply.update(pages=len(pages), page_bytes=page_bytes, _fds=pages)
            return reply

    def _names(self, cids) -> str:
        return ", ".join(self.conns[c].who() for c in cids if c in self.conns)

    def _trainers(self, st: GpuState) -> list[Conn]:
        return [c for c in self.conns.values() if c.gpu == st.ledger.index and c.entry.role is Role.TRAINING]

    def _grant(self, st: GpuState, conn: Conn, kind: MemoryKind, nbytes: int) -> None:
        st.ledger.grant(conn.client_id, kind, nbytes)
        self._record(st, conn)      # before the reply: a restart holds it back
        st.free_since = None

    # --- the page handoff ---------------------------------------------------------------
    def _pages_in(self, conn: Conn | None, msg: m.Pages, fds: list[int]) -> None:
        """Pages a trainer lends for one of its shrink commands: accepted only for a shrink this
        daemon sent it, in pages of at least page_bytes, at most every page of the GPU for one
        command and the config's page bound for one user, and parked for the reservation that
        shrink serves (which takes only what it covers). Anything else is refused."""
        try:
            if conn is None or conn.entry.role is not Role.TRAINING:
                raise ProtocolError("pages: only training clients lend pages")
            st = self.gpus[conn.gpu]
            sh = conn.shrinks.get(msg.seq)
            if sh is None:
                raise ProtocolError(f"pages: no shrink command {msg.seq} was sent to this client")
            if not self.cfg.page_bytes <= msg.page_bytes <= st.ledger.usable_bytes:
                raise ProtocolError(f"pages: page_bytes must be {self.cfg.page_bytes}..{st.ledger.usable_bytes}")
            most = -(-st.ledger.usable_bytes // msg.page_bytes)     # every page of the GPU
            if sh.pages_total == 0:
                if msg.total > most:
                    raise ProtocolError(f"pages: {msg.total} pages of {msg.page_bytes} bytes: more than the GPU holds")
                sh.pages_total, sh.page_bytes = msg.total, msg.page_bytes
            elif (msg.total, msg.page_bytes) != (sh.pages_total, sh.page_bytes):
                raise ProtocolError("pages: total and page_bytes must not change within a command")
            if sh.pages_got + msg.n > sh.pages_total:
                raise ProtocolError("pages: more pages than announced")
            bound = sum(self.cfg.pages_bound(g) for g in self.cfg.gpus)
            if st.broker.parked_by_uid.get(conn.peer.uid, 0) + msg.n > bound:
                raise ProtocolError(f"pages: more than {bound} pages of one user in transit")
        except ProtocolError:
            close_fds(fds)
            raise
        sh.pages_got += msg.n
        st.wake.set()
        if sh.granted:
            close_fds(fds)        # its reservation was granted already: nobody takes them
        else:
            st.broker.add(sh.for_client, conn.peer.uid, fds, msg.page_bytes)
        if sh.pages_got == sh.pages_total:
            sh.pages_done.set()

    async def _lent_pages(self, st: GpuState, conn: Conn, acked: list[int],
                          seqs: dict[int, int], nbytes: int) -> tuple[list[int], int]:
        """Pages that training lent for this reservation, for the grant; the rest are closed. The
        `pages` messages precede the ACK word on the client's side, but the daemon reads them on
        another task: wait briefly for those of the acks that announced pages."""
        for cid in acked:
            c = self.conns.get(cid)
            if c is None or not int(c.words[W_ACK_FLAGS]) & ACK_LENT:
                continue
            sh = c.shrinks.get(seqs.get(cid, 0))
            if sh is None:
                continue
            with trio.move_on_after(self.cfg.reclaim_deadline_ms / 1000):
                if sh.pages_total == 0:         # not one batch read yet
                    while sh.pages_total == 0 and cid in self.conns:
                        st.wake = trio.Event()
                        await st.wake.wait()
                await sh.pages_done.wait()
        return self._take_pages(st, conn, nbytes)

    def _take_pages(self, st: GpuState, conn: Conn, nbytes: int) -> tuple[list[int], int]:
        """At a grant: the pages lent for this client's reservation by trainers of its own user
        (if it accepts pages), within `nbytes`; every other page lent for it is closed, and pages
        of settled shrinks that come later are closed as they arrive."""
        for c in self._trainers(st):
            for sh in c.shrinks.values():
                if sh.for_client == conn.client_id and c.commands.settled(sh.seq):
                    sh.granted = True
        out, size = (st.broker.take(conn.client_id, conn.peer.uid, nbytes)
                     if conn.accept_pages else ([], 0))
        st.broker.drop(conn.client_id)
        return out, size

    def _timing(self, st: GpuState, acked: list[int], t_cmd: int, t0: int, t_done: int) -> dict:
        """Split of the slowest acknowledging client: detect (command → safe point), drain
        (safe point → GPU idle), release (→ memory returned), ack (→ daemon saw the ack).
        `released`: the client physically gave memory back (else it was already under target);
        `aborted`: it dropped an unfinished micro-batch to do so; `freed`: the client's held
        bytes went down by `freed_mib` (an abort early in a micro-batch can run the release path
        and free nothing). Only clients that acked a command this reclaim waited for count. With
        none (memory came free another way) there is no split. The stamps are the client's own
        words: they shape only the timing its own reclaims report."""
        worst = None
        for cid in acked:
            c = self.conns.get(cid)
            if c is None:
                continue
            s = c.words
            det, dr, rel = int(s[W_T_DETECT]), int(s[W_T_DRAINED]), int(s[W_T_RELEASED])
            if det and dr and rel and (worst is None or rel > worst[2]):
                worst = (det, dr, rel, int(s[W_ACK_FLAGS]), min(int(s[W_FREED]), st.ledger.usable_bytes))
        out = {"total": (t_done - t0) / 1e6, "reclaim": (t_done - t_cmd) / 1e6}
        if worst:
            out.update(detect=(worst[0] - t_cmd) / 1e6, drain=(worst[1] - worst[0]) / 1e6,
                       release=(worst[2] - worst[1]) / 1e6, ack=(t_done - worst[2]) / 1e6,
                       released=bool(worst[3] & ACK_RELEASED),
                       aborted=bool(worst[3] & ACK_ABORTED), lent=bool(worst[3] & ACK_LENT),
                       freed=bool(worst[3] & ACK_FREED),
                       freed_mib=(worst[4] if worst[3] & ACK_FREED else 0) / (1 << 20))
        return out

    async def _stop_training(self, st: GpuState, cids: list[int]) -> bool:
        """SIGKILL the stuck trainers through the pidfds taken when they connected (a pid that
        still belongs to that connection's process, never a number a client sent). A signal that
        cannot be sent is logged; False then."""
        ok = True
        signalled = []
        for cid in cids:
            c = self.conns.get(cid)
            if c is None:
                continue
            if c.peer.pidfd is None:
                log.warning("not stopping stuck %s: no pid from the kernel", c.who())
                ok = False
                continue
            log.warning("stopping stuck training %s: missed the reclaim deadline", c.who())
            try:
                signal.pidfd_send_signal(c.peer.pidfd, signal.SIGKILL)
                signalled.append(cid)
            except ProcessLookupError:
                signalled.append(cid)
            except OSError as e:
                log.warning("could not stop stuck training %s: %s", c.who(), e.strerror or e)
                ok = False
        # The connection closes when the process is gone; that returns its memory.
        with trio.move_on_after(10):
            while any(cid in self.conns for cid in signalled):
                for cid in signalled:
                    c = self.conns.get(cid)
                    if c is not None and c.peer.gone():
                        self._drop(c, "stopped")
                await trio.sleep(0.005)
        return ok

    async def _grow_loop(self) -> None:
        """Give spare memory back to training once it has stayed free (hysteresis)."""
        while True:
            await trio.sleep(min(0.05, self.cfg.grow_after_free_s / 4 or 0.05))
            try:
                self._grow_once()
            except Exception as e:     # never the daemon's end; one line per kind of error
                self._loop_error("grow", e)

    def _grow_once(self) -> None:
        for st in self.gpus.values():
            if st.lock.locked():
                continue
            trainers = self._trainers(st)
            if not trainers:
                continue
            target = self.training_target(st)
            current = st.ledger.training_bytes()
            now = time.monotonic()
            if target <= current or any(c.commands.newest() for c in trainers):
                st.free_since = None
                continue
            if st.free_since is None:
                st.free_since = now
            new_total = grow_decision(current, target, st.free_since, now,
                                      self.cfg.grow_after_free_s, self.cfg.grow_step_fraction)
            if new_total is None:
                continue
            extra = min(new_total - current, st.ledger.free_bytes()) // len(trainers)
            if extra <= 0:
                continue
            for c in trainers:
                q = c.entry.quota + extra
                st.ledger.set_quota(c.client_id, q)
                self._record(st, c)          # before the command: a restart holds it back
                c.words[W_QUOTA] = q
                self._command(c, CMD_GROW, q, for_client=0)
            st.free_since = now  # next step again only after another quiet period

    async def _liveness_loop(self) -> None:
        """Clients whose process died but whose connection lingers (an fd inherited), previous
        clients held back whose process ended, acks nobody announced, stale lent pages."""
        while True:
            await trio.sleep(self.cfg.liveness_interval_s)
            try:
                self._liveness_once()
            except Exception as e:
                self._loop_error("liveness", e)

    def _liveness_once(self) -> None:
        for conn in list(self.conns.values()):
            if conn.peer.gone():
                self._drop(conn, "process gone")
        for st in self.gpus.values():
            for h in list(st.ledger.held_back.values()):
                if process_start(h.pid) != h.start:
                    st.ledger.release_held_back(h.client_id)
                    st.record.remove(h.client_id)
                    log.info("GPU %d: held-back client %d (%r, pid %d) ended: %d bytes free",
                             st.ledger.index, h.client_id, h.name, h.pid, h.nbytes)
                    st.wake.set()
            if not st.lock.locked():
                for c in self._trainers(st):
                    self._collect_ack(st, c)
            st.broker.drop_stale(max(1.0, self.cfg.reclaim_deadline_ms / 1000))

    def _loop_error(self, loop: str, e: Exception) -> None:
        key = f"{loop}:{type(e).__name__}"
        if key not in self._loop_errors:
            self._loop_errors.add(key)
            log.error("%s loop: %s: %s (the daemon goes on; logged once)", loop, type(e).__name__, e)

    def _stats(self, st: GpuState) -> dict:
        snap = st.ledger.snapshot()
        snap["headroom_bytes"] = self.headroom(st)
        snap["training_target_bytes"] = self.training_target(st)
        snap["reclaim_estimate_ms"] = self.reclaim_estimate_s(st) * 1e3
        snap["busy"] = st.busy
        adj = [a["reclaim"] for a in st.adjustments]
        snap["adjustments"] = len(adj)
        snap["pages"] = st.broker.stats()
        if adj:
            s = sorted(adj)
            snap["adjust_ms"] = {"mean": sum(s) / len(s), "p99": s[min(len(s) - 1, int(0.99 * len(s)))]}
        return snap


def _fds_of(ancillary) -> list[int]:
    out: list[int] = []
    for level, kind, data in ancillary:
        if level == pysocket.SOL_SOCKET and kind == pysocket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
            out.extend(fds)
    return out


def _peer_cred(sock) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer, from the kernel (SO_PEERCRED; pid 0 outside our pid namespace)."""
    creds = sock.getsockopt(pysocket.SOL_SOCKET, pysocket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def _peer(sock) -> Peer:
    pid, uid, gid = _peer_cred(sock)
    groups: tuple[int, ...] = ()
    try:
        raw = sock.getsockopt(pysocket.SOL_SOCKET, SO_PEERGROUPS, 4 * 4096)
        groups = tuple(array.array("I", raw[:len(raw) - len(raw) % 4]))
    except OSError:
        pass
    return Peer(pid, uid, gid, groups)


def _pidfd(sock, pid: int) -> int | None:
    """A pidfd of the peer process: SO_PEERPIDFD (the process that connected, Linux 6.5), else
    pidfd_open of SO_PEERCRED's pid while the peer is still connected. None without a pid."""
    if not pid:
        return None
    try:
        fd = sock.getsockopt(pysocket.SOL_SOCKET, SO_PEERPIDFD)
        if isinstance(fd, int) and fd >= 0:
            os.set_inheritable(fd, False)
            return fd
    except OSError as e:
        if e.errno not in (errno.ENOPROTOOPT, errno.EINVAL, errno.ESRCH):
            return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


async def run_daemon(config: GovernorConfig) -> None:
    d = GovernorDaemon(config)
    d.open()
    try:
        await d.serve()
    finally:
        d.close()

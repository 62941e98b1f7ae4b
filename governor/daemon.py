"""`hintfs governor`: the per-host daemon. trio, no torch.

One ledger and one shared-memory control block per GPU. Clients connect over a Unix socket
(one connection = one client; the connection closing means the client is gone and its memory
returns to the ledger). Inference reservations that do not fit make the daemon shrink training
quotas through the control words and wait for the acks, up to the reclaim deadline.
"""

from __future__ import annotations

import array
import logging
import os
import signal
import socket as pysocket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from common.procs import pid_alive
from mountconfig.governor import GovernorConfig
from governor.ledger import ClientEntry, GpuLedger, LedgerError, MemoryKind, Role
from governor.pagebroker import PageBroker, close_fds, reserve_fd_table
from governor.protocol import (
    ACK_ABORTED, ACK_FREED, ACK_LENT, ACK_RELEASED, CMD_GROW, CMD_SHRINK, MAX_FDS_PER_MESSAGE, ROLE_INFERENCE,
    ROLE_TRAINING, W_ACK, W_ACK_FLAGS, W_OWNER, W_QUOTA, W_ROLE,
    W_T_DETECT, W_T_DRAINED, W_T_RELEASED, W_USED, W_FREED, ControlBlock, LineBuffer,
    ProtocolError, SlotWriter, decode, encode, now_ns, shm_path, validate_request, HEADER_WORDS,
    SLOT_WORDS,
)
from policy.governor_deadline import ReclaimOutcome, reclaim_outcome
from policy.governor_headroom import ArrivalRate, Ewma, headroom_bytes
from policy.governor_progress import (
    grow_decision, inference_limit_bytes, training_floor_bytes, training_target_bytes,
)

log = logging.getLogger("hintfs.governor")


class DaemonStartError(RuntimeError):
    """A start-up problem the user can fix (socket in use, bad path); one line."""


@dataclass
class GpuState:
    ledger: GpuLedger
    block: ControlBlock
    lock: trio.Lock = field(default_factory=trio.Lock)
    arrivals: ArrivalRate | None = None
    reclaim_s: Ewma | None = None
    free_since: float | None = None
    adjustments: list[dict] = field(default_factory=list)  # recent reclaim timings
    broker: PageBroker = field(default_factory=PageBroker)   # pages lent by training, in transit

    def free_slot(self) -> int:
        roles = self.block.slots[:, W_ROLE]
        for i in range(self.block.max_clients):
            if int(roles[i]) == 0:
                return i
        raise LedgerError("no free client slot (raise max_clients)")


@dataclass
class Conn:
    client_id: int
    gpu: int
    entry: ClientEntry
    ack_event: trio.Event = field(default_factory=trio.Event)
    accept_pages: bool = False          # inference: take lent pages (fds) with its grants
    lent_seq: int = 0                   # training: the last command whose pages arrived
    pages_event: trio.Event = field(default_factory=trio.Event)
    drain_bound_s: float = 0.0          # training: how long its stop can take (its usage report)


class GovernorDaemon:
    def __init__(self, config: GovernorConfig) -> None:
        self.cfg = config
        self.gpus: dict[int, GpuState] = {}
        self.conns: dict[int, Conn] = {}
        self._next_id = 1
        self._listener_sock: pysocket.socket | None = None
        self.ready = trio.Event()

    # --- lifecycle ------------------------------------------------------------------
    def open(self) -> None:
        """Bind the socket and create control blocks; raises DaemonStartError for user mistakes."""
        path = Path(self.cfg.socket_path)
        if not path.parent.is_dir():
            raise DaemonStartError(f"socket directory {path.parent} does not exist")
        if path.exists():
            probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()  # stale socket of a dead daemon
            else:
                raise DaemonStartError(f"socket {path} is in use by another governor")
            finally:
                probe.close()
        sock = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            os.chmod(path, 0o666)
            sock.listen(128)
        except OSError as e:
            sock.close()
            raise DaemonStartError(f"cannot listen on {path}: {e.strerror or e}") from None
        sock.setblocking(False)
        self._listener_sock = sock
        reserve_fd_table(4096)   # lent pages arrive as fds: no table growth on a reclaim's path
        for g in self.cfg.gpus:
            ledger = GpuLedger(g.index, g.total_bytes, g.reserve_bytes)
            block = ControlBlock(shm_path(self.cfg.shm_name, g.index), create=True,
                                 max_clients=self.cfg.max_clients, total=g.total_bytes,
                                 usable=ledger.usable_bytes)
            self.gpus[g.index] = GpuState(
                ledger, block, arrivals=ArrivalRate(self.cfg.arrival_window_s),
                reclaim_s=Ewma(self.cfg.reclaim_time_initial_ms / 1000))

    def close(self) -> None:
        if self._listener_sock is not None:
            self._listener_sock.close()
            try:
                os.unlink(self.cfg.socket_path)
            except FileNotFoundError:
                pass
        for st in self.gpus.values():
            st.block.close()
            try:
                os.unlink(st.block.path)
            except FileNotFoundError:
                pass

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        assert self._listener_sock is not None, "call open() first"
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self._listener_sock))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._liveness_loop)
            nursery.start_soon(self._grow_loop)
            self.ready.set()
            log.info("governor listening on %s for GPUs %s", self.cfg.socket_path,
                     sorted(self.gpus))
            task_status.started()
            await trio.serve_listeners(self._handle, [listener], handler_nursery=nursery)

    # --- policy helpers ---------------------------------------------------------------
    def reclaim_estimate_s(self, st: GpuState) -> float:
        """How long a reclaim is expected to take: the EWMA of measured reclaims, but never less
        than what a training client says its stop can take (its bounded drain), so that the
        headroom covers the arrivals of a slow stop before one was measured."""
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

    # --- connections --------------------------------------------------------------------
    async def _handle(self, stream: trio.SocketStream) -> None:
        conn: Conn | None = None
        lines = LineBuffer()
        sock = stream.socket
        peer_pid = _peer_pid(sock)
        fds: list[int] = []   # received with SCM_RIGHTS, not yet claimed by a `pages` message
        try:
            while True:
                try:
                    data, anc, _, _ = await sock.recvmsg(65536, pysocket.CMSG_SPACE(
                        MAX_FDS_PER_MESSAGE * 4))
                except OSError:
                    break
                fds.extend(_fds_of(anc))
                if not data:
                    break
                for line in lines.feed(data):
                    try:
                        msg = validate_request(decode(line))
                    except ProtocolError as e:
                        # fds that came with a message we cannot read belong to nobody we know
                        close_fds(fds)
                        fds = []
                        await stream.send_all(encode({"ok": False, "error": str(e)}))
                        continue
                    if msg["op"] == "ack":
                        if conn is not None:
                            conn.ack_event.set()
                        continue
                    if msg["op"] == "pages":   # no reply: like ack, sent on the shrink's path
                        taken, fds = fds[:msg["n"]], fds[msg["n"]:]
                        self._pages_in(conn, msg, taken)
                        continue
                    try:
                        reply, conn = await self._dispatch(msg, conn, peer_pid)
                    except (LedgerError, ProtocolError) as e:
                        reply = {"ok": False, "error": str(e)}
                    await self._send(stream, reply)
        except (ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            close_fds(fds)
            if conn is not None:
                self._drop(conn, "connection closed")
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _send(self, stream: trio.SocketStream, reply: dict) -> None:
        """One reply line; lent pages travel with it as SCM_RIGHTS (then the daemon's copies
        are closed: the receiver holds the memory now)."""
        fds = reply.pop("_fds", None)
        data = encode(reply)
        if not fds:
            await stream.send_all(data)
            return
        try:
            sent = await stream.socket.sendmsg(
                [data], [(pysocket.SOL_SOCKET, pysocket.SCM_RIGHTS, array.array("i", fds))])
            if sent < len(data):
                await stream.send_all(data[sent:])
        finally:
            close_fds(fds)

    def _pages_in(self, conn: Conn | None, msg: dict, fds: list[int]) -> None:
        if conn is None or conn.entry.role is not Role.TRAINING or len(fds) != msg["n"]:
            close_fds(fds)   # not a training client, or fds missing: nothing to trust
            return
        self.gpus[conn.gpu].broker.add(fds, msg["page_bytes"])
        conn.lent_seq = max(conn.lent_seq, msg["seq"])
        conn.pages_event.set()

    def _drop(self, conn: Conn, why: str) -> None:
        if self.conns.pop(conn.client_id, None) is None:
            return
        st = self.gpus[conn.gpu]
        freed = st.ledger.remove(conn.client_id)
        st.block.slots[conn.entry.slot, :] = 0
        log.info("client %d (%s, pid %d) gone (%s): %d bytes back on GPU %d", conn.client_id,
                 conn.entry.name, conn.entry.pid, why, freed, conn.gpu)

    async def _dispatch(self, msg: dict, conn: Conn | None, peer_pid: int | None):
        op = msg["op"]
        if op == "ping":
            return {"ok": True}, conn
        if op == "stats":
            return {"ok": True, "gpus": [self._stats(st) for st in self.gpus.values()]}, conn
        if op == "register":
            if conn is not None:
                raise ProtocolError("already registered on this connection")
            return self._register(msg, peer_pid)
        if conn is None:
            raise ProtocolError(f"{op}: register first")
        st = self.gpus[conn.gpu]
        if op == "usage":
            usage = {}
            for k, v in msg["kinds"].items():
                try:
                    usage[MemoryKind(k)] = int(v)
                except (ValueError, TypeError):
                    raise ProtocolError(f"usage: bad kind or value {k!r}") from None
            st.ledger.report(conn.client_id, usage)
            conn.drain_bound_s = float(msg.get("drain_ms", 0.0)) / 1e3
            return {"ok": True}, conn
        if conn.entry.role is not Role.INFERENCE:
            raise ProtocolError(f"{op}: only inference clients reserve memory")
        kind = MemoryKind(msg.get("kind", "workspace"))
        if op == "release":
            freed = st.ledger.release(conn.client_id, kind, msg["bytes"])
            return {"ok": True, "released": freed}, conn
        return await self._reserve(st, conn, kind, msg["bytes"]), conn

    def _register(self, msg: dict, peer_pid: int | None):
        gpu = msg["gpu"]
        st = self.gpus.get(gpu)
        if st is None:
            raise ProtocolError(f"register: GPU {gpu} is not governed here")
        role = Role(msg["role"])
        pid = peer_pid or msg["pid"]
        slot = st.free_slot()
        cid = self._next_id
        self._next_id += 1
        entry = ClientEntry(cid, role, pid, str(msg.get("name", ""))[:100], slot)
        st.ledger.add(entry)
        s = st.block.slots[slot]
        s[:] = 0
        s[W_OWNER] = pid
        s[W_ROLE] = ROLE_TRAINING if role is Role.TRAINING else ROLE_INFERENCE
        if role is Role.TRAINING:
            want = msg.get("want_bytes")
            share = max(0, min(st.ledger.free_bytes() - self.headroom(st),
                               self.training_target(st) - st.ledger.training_bytes()))
            quota = share if not isinstance(want, int) else max(0, min(want, share))
            st.ledger.set_quota(cid, quota)
            s[W_QUOTA] = quota
        conn = Conn(cid, gpu, entry, accept_pages=bool(msg.get("accept_pages")) and role is Role.INFERENCE)
        self.conns[cid] = conn
        log.info("client %d registered: %s %r pid %d GPU %d slot %d quota %d", cid, role.value,
                 entry.name, pid, gpu, slot, entry.quota)
        return {"ok": True, "client": cid, "slot": slot, "shm": str(st.block.path),
                "header_words": HEADER_WORDS, "slot_words": SLOT_WORDS, "quota": entry.quota,
                "usable_bytes": st.ledger.usable_bytes,
                "keepalive": {"min_s": self.cfg.keepalive_min_s,
                              "max_s": self.cfg.keepalive_max_s,
                              "quantile": self.cfg.keepalive_quantile}}, conn

    # --- reclaim ---------------------------------------------------------------------
    async def _reserve(self, st: GpuState, conn: Conn, kind: MemoryKind, nbytes: int) -> dict:
        t0 = now_ns()
        st.arrivals.observe(time.monotonic(), nbytes)
        async with st.lock:
            ledger = st.ledger
            limit = inference_limit_bytes(ledger.usable_bytes, self.cfg.min_training_fraction)
            if ledger.inference_bytes() + nbytes > limit:
                return {"ok": False, "error": f"reserve: {nbytes} bytes would exceed inference's "
                        f"limit of {limit} (training keeps min_training_fraction)"}
            if nbytes <= ledger.free_bytes():
                ledger.grant(conn.client_id, kind, nbytes)
                st.free_since = None
                return {"ok": True, "granted": nbytes, "reclaimed": 0,
                        "timing_ms": {"total": (now_ns() - t0) / 1e6}}
            need = nbytes - ledger.free_bytes()
            floor = training_floor_bytes(ledger.usable_bytes, self.cfg.min_training_fraction)
            plan = ledger.plan_shrink(need, floor)
            issued = {}
            for cid, quota in plan.items():
                c = self.conns.get(cid)
                if c is None:
                    continue
                c.ack_event = trio.Event()
                issued[cid] = (SlotWriter(st.block.slots[c.entry.slot]).command(CMD_SHRINK, quota),
                               quota)
            issued_seq = {cid: seq for cid, (seq, _) in issued.items()}
            t_cmd = now_ns()
            acked: list[int] = []  # clients whose ack of *this* command was seen
            deadline_s = self.cfg.reclaim_deadline_ms / 1000
            poll_s = self.cfg.ack_poll_interval_ms / 1000
            while True:
                for cid in list(issued):
                    seq, quota = issued[cid]
                    c = self.conns.get(cid)
                    if c is None:  # died meanwhile: its memory is already back
                        del issued[cid]
                        continue
                    if int(st.block.slots[c.entry.slot][W_ACK]) >= seq:
                        ledger.set_quota(cid, quota)
                        ledger.trim_reported(cid, int(st.block.slots[c.entry.slot][W_USED]))
                        st.block.slots[c.entry.slot][W_QUOTA] = quota
                        acked.append(cid)
                        del issued[cid]
                elapsed = (now_ns() - t_cmd) / 1e9
                outcome = reclaim_outcome(ledger.free_bytes(), nbytes, elapsed, deadline_s,
                                          self.cfg.deadline_miss_action)
                if outcome is ReclaimOutcome.WAIT and not issued:
                    outcome = reclaim_outcome(ledger.free_bytes(), nbytes, deadline_s,
                                              deadline_s, self.cfg.deadline_miss_action)
                if outcome is ReclaimOutcome.GRANT:
                    break
                if outcome is ReclaimOutcome.REJECT:
                    log.warning("reclaim of %d bytes missed the %.1f ms deadline: rejected",
                                need, self.cfg.reclaim_deadline_ms)
                    return {"ok": False, "error": "reserve: training missed the reclaim deadline"}
                if outcome is ReclaimOutcome.STOP_TRAINING:
                    await self._stop_training(st, list(issued))
                    if ledger.free_bytes() >= nbytes:
                        break
                    return {"ok": False, "error": "reserve: memory not free after stopping training"}
                waiters = [self.conns[c].ack_event for c in issued if c in self.conns]
                with trio.move_on_after(min(poll_s * 5, max(deadline_s - elapsed, 0) + 1e-4)):
                    if waiters:
                        await waiters[0].wait()
            ledger.grant(conn.client_id, kind, nbytes)
            st.free_since = None
            pages = await self._lent_pages(st, conn, acked, issued_seq, nbytes)
            t_done = now_ns()
            timing = self._timing(st, acked, t_cmd, t0, t_done)
            st.reclaim_s.update((t_done - t_cmd) / 1e9)
            st.adjustments.append(timing)
            del st.adjustments[:-1000]
            reply = {"ok": True, "granted": nbytes, "reclaimed": need, "timing_ms": timing}
            if pages:
                reply.update(pages=len(pages), page_bytes=st.broker.page_bytes, _fds=pages)
            return reply

    async def _lent_pages(self, st: GpuState, conn: Conn, acked: list[int], seqs: dict[int, int],
                          nbytes: int) -> list[int]:
        """Pages that training lent for this reclaim, for the grant; the rest are closed. The
        `pages` message precedes the ACK word on the client's side, but the daemon reads it on
        another task: wait briefly for the ones whose ack announced pages."""
        for cid in acked:
            c = self.conns.get(cid)
            if c is None or not int(st.block.slots[c.entry.slot][W_ACK_FLAGS]) & ACK_LENT:
                continue
            with trio.move_on_after(self.cfg.reclaim_deadline_ms / 1000):
                while c.lent_seq < seqs.get(cid, 0):
                    c.pages_event = trio.Event()
                    await c.pages_event.wait()
        out = st.broker.take(nbytes) if conn.accept_pages else []
        st.broker.drop_all()
        return out

    def _timing(self, st: GpuState, acked: list[int], t_cmd: int, t0: int, t_done: int) -> dict:
        """Split of the slowest acknowledging client: detect (command → safe point), drain
        (safe point → GPU idle), release (→ memory returned), ack (→ daemon saw the ack).
        `released`: the client physically gave memory back (else it was already under target);
        `aborted`: it dropped an unfinished micro-batch to do so; `freed`: the client's held
        bytes went down by `freed_mib` (an abort early in a micro-batch can run the release path
        and free nothing). Only clients that acked this
        command count: their stamps belong to it. With none (memory came free another way, e.g.
        a late ack of an earlier command) there is no split."""
        worst = None
        for cid in acked:
            c = self.conns.get(cid)
            if c is None:
                continue
            s = st.block.slots[c.entry.slot]
            det, dr, rel = int(s[W_T_DETECT]), int(s[W_T_DRAINED]), int(s[W_T_RELEASED])
            if det and dr and rel and (worst is None or rel > worst[2]):
                worst = (det, dr, rel, int(s[W_ACK_FLAGS]), int(s[W_FREED]))
        out = {"total": (t_done - t0) / 1e6, "reclaim": (t_done - t_cmd) / 1e6}
        if worst:
            out.update(detect=(worst[0] - t_cmd) / 1e6, drain=(worst[1] - worst[0]) / 1e6,
                       release=(worst[2] - worst[1]) / 1e6, ack=(t_done - worst[2]) / 1e6,
                       released=bool(worst[3] & ACK_RELEASED),
                       aborted=bool(worst[3] & ACK_ABORTED), lent=bool(worst[3] & ACK_LENT),
                       freed=bool(worst[3] & ACK_FREED),
                       freed_mib=(worst[4] if worst[3] & ACK_FREED else 0) / (1 << 20))
        return out

    async def _stop_training(self, st: GpuState, cids: list[int]) -> None:
        for cid in cids:
            c = self.conns.get(cid)
            if c is None:
                continue
            log.warning("stopping training client %d (pid %d): missed reclaim deadline",
                        cid, c.entry.pid)
            try:
                os.kill(c.entry.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # The connection closes when the process is gone; that returns its memory.
        with trio.move_on_after(10):
            while any(cid in self.conns for cid in cids):
                for cid in cids:
                    c = self.conns.get(cid)
                    if c is not None and not pid_alive(c.entry.pid):
                        self._drop(c, "stopped")
                await trio.sleep(0.005)

    async def _grow_loop(self) -> None:
        """Give spare memory back to training once it has stayed free (hysteresis)."""
        while True:
            await trio.sleep(min(0.05, self.cfg.grow_after_free_s / 4 or 0.05))
            for st in self.gpus.values():
                if st.lock.locked():
                    continue
                trainers = [self.conns[c.client_id] for c in st.ledger.training()
                            if c.client_id in self.conns]
                if not trainers:
                    continue
                target = self.training_target(st)
                current = st.ledger.training_bytes()
                now = time.monotonic()
                if target <= current:
                    st.free_since = None
                    continue
                if st.free_since is None:
                    st.free_since = now
                new_total = grow_decision(current, target, st.free_since, now,
                                          self.cfg.grow_after_free_s, self.cfg.grow_step_fraction)
                if new_total is None:
                    continue
                extra = (new_total - current) // len(trainers)
                for c in trainers:
                    q = c.entry.quota + extra
                    st.ledger.set_quota(c.client_id, q)
                    s = st.block.slots[c.entry.slot]
                    s[W_QUOTA] = q
                    SlotWriter(s).command(CMD_GROW, q)
                st.free_since = now  # next step again only after another quiet period

    async def _liveness_loop(self) -> None:
        """Catch clients whose process died but whose connection lingers (e.g. fd inherited)."""
        while True:
            await trio.sleep(self.cfg.liveness_interval_s)
            for conn in list(self.conns.values()):
                if not pid_alive(conn.entry.pid):
                    self._drop(conn, "pid gone")
            for st in self.gpus.values():
                st.broker.drop_stale(self.cfg.reclaim_deadline_ms / 1000)

    def _stats(self, st: GpuState) -> dict:
        snap = st.ledger.snapshot()
        snap["headroom_bytes"] = self.headroom(st)
        snap["training_target_bytes"] = self.training_target(st)
        snap["reclaim_estimate_ms"] = self.reclaim_estimate_s(st) * 1e3
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


def _peer_pid(sock) -> int | None:
    try:
        creds = sock.getsockopt(pysocket.SOL_SOCKET, pysocket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[0]
    except (OSError, AttributeError):
        return None


async def run_daemon(config: GovernorConfig) -> None:
    d = GovernorDaemon(config)
    d.open()
    try:
        await d.serve()
    finally:
        d.close()

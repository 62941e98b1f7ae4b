"""The storage agent: an Arrow Flight server on a storage node.

It serves byte ranges of store files and of the replicas it keeps on its own disk, makes
replicas on request (from the store, or from another agent: tree fan-out), keeps each for a TTL
within a byte budget, and reports its load. Protocol (all JSON in, JSON or bytes out):

- `do_get` tickets: a byte range `{"path", "offset", "length", "replica_only"?}` (served from a
  local replica when there is one), a transformed sample `{"op": "sample", ...}`, and the ready
  samples of a plan window `{"op": "samples_ready", ...}`.
- actions: replicate, drop, signal, plan_window, tier_stat, has, status, ping, and the write-time
  streams of training mounts: stream_open, stream_publish, stream_abort.
- `do_put`: chunks of a stream (`agent.streams`, docs/cross_dc.md "Write-time streaming").
Every request is parsed by `agent.rpc` (typed, bounded, paths by the one resolver) before it
reaches a handler; every error leaves as `agent.rpc.rpc_error` (errno + message).
Who may call: see docs/security.md (a token, or the 0700 unix socket of a mount's own agent).

Flight runs each call on its own thread; the agent's state is guarded by one lock, and reads
are bounded by a semaphore (`max_concurrent_reads`) and an optional token bucket
(`bandwidth_bytes_s`, used by the benchmarks to emulate a data node).
"""
from __future__ import annotations

import fcntl
import errno
import hashlib
import hmac
import itertools
import json
import logging
import os
import contextlib
import resource
import shutil
import stat as stat_mod
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import pyarrow as pa
import pyarrow.flight as fl

from common.errors import HintfsError
from common.fdlimit import raise_open_file_limit
from common.journal import Removals, later_by_same_writer, record_time_ns, removed_record, streamed_record
from common.secrets import read_token_file
from common.systemd import sd_notify
from stores import check_store, open_store

from agent import rpc, socketdir
from agent.catalog import ReplicaCatalog
from agent.rpc import rpc_error
from agent.demand import DemandReads, prefetch_pieces
from agent.fdserver import ReplicaFdServer
from agent.readmemory import ReadMemory
from agent.streams import (ANYONE, REFUSAL_LOG_S, StreamError, StreamFinished, StreamRefused, StreamTier,
                           VersionCheck)
from common.procs import pid_alive
from policy.stream import Sender, StreamLimits, chunks_touching, chunks_under
from stores.base import Stat, Store

log = logging.getLogger("hintfs.agent")
_CHUNK = 8 << 20
EVICT_HEADROOM = 0.02          # a full tier evicts this share of its budget beyond what a copy needs
_STREAM_PUBLISH_WAIT_S = 5.0   # a replicate waits this long for an unpublished stream's publish,
_STREAM_ALIVE_WAIT_S = 30.0    # ... up to this long while the stream is alive:
_STREAM_QUIET_S = 5.0          # a stream (or a folder's streams) with a call within this long
_instances = itertools.count()


class TokenBucket:
    """Bytes per second with a burst of one second's worth; `take` sleeps the caller."""

    def __init__(self, rate: int):
        self.rate = rate
        self.tokens = float(rate)
        self.stamp = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.rate, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= n
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


@dataclass
class Replica:
    path: str
    local: str
    size: int
    expires_at: float
    fd: int = -1          # kept open: a read is one pread, not open+read+close
    source_mtime_ns: int = 0   # the version copied (size + mtime verify a replica)
    last_used: float = 0.0     # monotonic time of the last read or copy (eviction order)
    record: Optional[str] = None   # the journal record this copy answered (one per close)


def _made_before(rep: Replica, t_ns: int) -> bool:
    """The replica holds a version written before `t_ns`: by the time of the journal record it was
    made for, else (a copy found by listing or fetched for a read) by the store's mtime."""
    made = record_time_ns(rep.record) if rep.record else None
    return (made if made is not None else rep.source_mtime_ns) < t_ns


class _Caller(fl.ServerMiddleware):
    """A call that presented the agent's token: `principal` names that token (a fingerprint,
    never the token) for per-sender bounds and the status."""

    def __init__(self, principal: str):
        self.principal = principal


class TokenMiddlewareFactory(fl.ServerMiddlewareFactory):
    def __init__(self, token: str):
        self.token = token
        self.principal = "token:" + hashlib.sha256(token.encode()).hexdigest()[:8]

    def start_call(self, info, headers):
        got = headers.get("authorization") or headers.get("Authorization") or []
        if not got or not hmac.compare_digest(str(got[0]).encode(), f"Bearer {self.token}".encode()):
            log.warning("refused %s call without a valid token", info.method)
            raise fl.FlightUnauthenticatedError("missing or wrong token")
        return _Caller(self.principal)


def _sender(context) -> Sender:
    """Who made a Flight call: the token it presented ("-": none configured) and its peer's host
    (the address without its port; "unix" for a unix socket). Streams are bounded per both."""
    caller = context.get_middleware("auth") if context is not None else None
    token = getattr(caller, "principal", "-")
    peer = context.peer() if context is not None else "-"
    if peer.startswith(("ipv4:", "ipv6:")):
        peer = peer.rsplit(":", 1)[0]
    elif peer.startswith("unix"):
        peer = "unix"
    return Sender(token, peer or "-")


MAX_FIRST = 1 << 16   # chunks a stream's open names to send first (a bounded answer)


class AgentServer(fl.FlightServerBase):
    def __init__(self, cfg, store: Store, location: Optional[str] = None, persistent: bool = False,
                 require_token: bool = False):
        acfg = cfg.agent
        tls = None
        if acfg.tls_cert_file and acfg.tls_key_file:
            with open(acfg.tls_cert_file, "rb") as c, open(acfg.tls_key_file, "rb") as k:
                tls = [fl.CertKeyPair(c.read(), k.read())]
        middleware = {}
        if acfg.token_file:
            middleware["auth"] = TokenMiddlewareFactory(read_token_file(acfg.token_file))
        elif require_token and acfg.auth != "none":
            raise HintfsError(errno.EPERM, "an agent that listens on a network needs [agent] token_file "
                              "(a 0600 file holding a shared secret); set [agent] auth = \"none\" only on a "
                              "host where every local user may read every file of the store")
        super().__init__(location or acfg.location, tls_certificates=tls, middleware=middleware)
        self.cfg = cfg
        self.store = store
        # Each agent instance keeps its replicas in a folder of its own, locked (flock) while it
        # runs, so two agents (or a mount's in-process agent) sharing `data_dir` never serve each
        # other's files. A persistent agent (`hintfs agent`) keeps its folder when it stops and
        # adopts the folders of stopped or crashed ones: its catalog is rebuilt from disk.
        # A mount's in-process agent removes its folder on exit and those of dead mounts.
        os.makedirs(acfg.data_dir, exist_ok=True)
        self.persistent = persistent
        kind = "agent" if persistent else "mount"
        self.data_dir = os.path.join(acfg.data_dir, f"{kind}-{os.getpid()}-{next(_instances)}")
        # Replicas are copies of files whose permissions the agent cannot carry over: only the
        # agent's user may open them (the folder is 0700, the files 0600).
        os.makedirs(self.data_dir, mode=0o700)
        os.chmod(self.data_dir, 0o700)
        self._lock_fd = _lock_folder(self.data_dir)
        self.budget = acfg.budget_bytes
        self.replicas: ReplicaCatalog[Replica] = ReplicaCatalog()
        self.follower = None           # (set last; adoption may make room before it exists)
        self._refusals_logged: dict[str, tuple[float, int]] = {}   # kind -> (logged at, since)
        self._partial: dict[str, dict] = {}   # interrupted copies: version, .part file, ranges done
        self.evictions = 0
        self.copies = 0                # copies made (from the store or a peer), for status
        self.resumed_ranges = 0
        self.lock = threading.Lock()
        self.read_slots = threading.BoundedSemaphore(acfg.max_concurrent_reads)
        self.bucket = TokenBucket(acfg.bandwidth_bytes_s)
        self.in_flight = 0
        self.bytes_served = 0
        self.reads_served = 0
        self.started = time.monotonic()
        self.token = None
        if cfg.agents.token_file:
            self.token = read_token_file(cfg.agents.token_file)
        self._samples = None
        self.socket_dir: Optional[socketdir.SocketDir] = None   # the in-process agent's socket folder
        self._copying: dict[str, threading.Event] = {}
        # path (a file or a folder) -> the time of the newest journal record saying it left the
        # store: a replica of it from before then is dropped, and not cataloged when a copy or
        # stream of it finishes later (`removed_from_store`)
        # (a restarted agent reads the journal again)
        self._removed = Removals()
        self._copying_version: dict[str, tuple[int, int]] = {}   # (size, mtime_ns) of copies in flight
        self._readers: "OrderedDict[str, tuple]" = OrderedDict()
        self._retired: list = []       # readers and fds replaced while reads may still use them;
        self._retired_fds: list = []   # closed by the reclaim loop a round later
        self._stop = threading.Event()
        # Write-time streams of training mounts: held apart until published (agent/streams.py);
        # `stream_cond` wakes callers waiting for a stream's publish (tier_stat, replicate).
        # Bounded per sender and in total (each stream holds a descriptor: at most a quarter of
        # this process's open-file limit); their bytes count in the budget (`reserve`).
        self.stream_limits = StreamLimits(acfg.stream_max_open, acfg.stream_max_per_peer, acfg.stream_max_per_token,
                                          int(acfg.budget_bytes * acfg.stream_peer_share)
                                          ).capped(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self.streams = StreamTier(os.path.join(self.data_dir, "streams"), time.monotonic, persistent,
                                  idle_s=acfg.stream_idle_s, limits=self.stream_limits, budget=self)
        self.stream_cond = threading.Condition()
        self.streams_published = 0
        self.streams_first_chunks = 0   # chunks named to send first at stream opens (ReadMemory)
        # path -> (size, mtime_ns) journaled, whose copy waits for a stream (`_wait_for_stream`)
        self._awaiting: dict[str, tuple[int, int]] = {}
        # Copies in flight whose finished ranges demand reads may serve: path -> _CopyInFlight.
        self._copy_reads: dict[str, "_CopyInFlight"] = {}
        self.demand = DemandReads(store, self.stream_cond, self._held_bytes, self._arriving,
                                  stream_behind_s=self._stream_behind_s if acfg.link_bytes_s else None)
        # What eval jobs read of each checkpoint file: the next checkpoint's streams send it first.
        self.read_memory = ReadMemory()
        _reap_dead_instances(acfg.data_dir, "mount")
        if persistent:
            self._adopt_stopped_instances(acfg.data_dir)
        self._reaper = threading.Thread(target=self._reclaim_loop, name="hintfs-agent-reclaim", daemon=True)
        self._reaper.start()
        self.link = None
        if acfg.link_bytes_s:
            from agent.linkgate import LinkGate
            self.link = LinkGate(acfg.link_bytes_s, acfg.link_chunk_bytes)
        self.fd_server = None
        if acfg.local_socket:   # replica fds for mounts on this host (FUSE passthrough)
            self.fd_server = ReplicaFdServer(acfg.local_socket, self.local_replica_fd, self.streams.verified_view)
        # A stream's version is served only once the store's word confirms it (agent/streams.py
        # VersionCheck): the journal the follower reads, or a batched stat.
        takes_streams = bool(acfg.stream_prefixes if acfg.stream_prefixes is not None else cfg.follow.prefixes)
        self.versions = VersionCheck(store, time.monotonic, self._version_confirmed, self._version_refused,
                                     self.streams.unconfirmed, cfg.follow.journal_dir if cfg.follow.prefixes else None,
                                     acfg.stream_record_wait_s, acfg.stream_verify_poll_s, start=takes_streams)
        self.follower = None
        if cfg.follow.prefixes:
            from agent.follower import Follower
            self.follower = Follower(self, cfg.follow).start()

    # -- reads ---------------------------------------------------------------------------------
    def read_range(self, path: str, offset: int, length: int, replica_only: bool = False,
                   expect: Optional[tuple[int, int]] = None, demand: bool = False) -> bytes:
        """Bytes of `path`: from its replica (of version `expect` when given); with `demand`
        (and `expect`), also while the replica is still arriving (agent/demand.py)."""
        if demand:
            if expect is None:
                raise rpc_error(errno.EINVAL, "a demand read names the version it opened (expect)")
            self.read_memory.remember(path, [(offset, length)])
            with self.read_slots:
                data = self.demand.read(path, tuple(expect), offset, length)
                with self.lock:
                    self.bytes_served += len(data)
                    self.reads_served += 1
                return data
        with self.read_slots:
            with self.lock:
                self.in_flight += 1
                rep = self.replicas.get(path)
            try:
                if rep is not None and expect is not None and (rep.size, rep.source_mtime_ns) != tuple(expect):
                    # A replica of another version than the reader's (the store file was replaced).
                    if replica_only:
                        raise rpc_error(errno.ESTALE, f"the replica of {path} is of another version")
                    rep = None
                if rep is not None:
                    rep.last_used = time.monotonic()
                    data = os.pread(rep.fd, length, offset)
                elif replica_only:
                    raise rpc_error(errno.ENOENT, f"no replica of {path}")
                else:
                    data = self._store_reader(path).read(offset, length)
                self.bucket.take(len(data))
                with self.lock:
                    self.bytes_served += len(data)
                    self.reads_served += 1
                return data
            finally:
                with self.lock:
                    self.in_flight -= 1

    @property
    def samples(self):
        """Storage-side transforms, started on first use (the process pool costs a fork)."""
        with self.lock:
            if self._samples is None:
                from agent.samples import SampleService
                self._samples = SampleService(self.store, self.cfg.transform_load)
            return self._samples

    def sample(self, req: rpc.SampleRequest) -> bytes:
        try:
            data, _how = self.samples.get(req.path, req.kind, req.params, req.aug_seed, req.allow_raw)
        except ValueError as err:   # transforms.TransformError: corrupt media or over a limit
            log.debug("transform of %s failed: %s", req.path, err)   # SampleService logged it once
            raise rpc_error(errno.EIO, f"transform of {req.path} failed: {err}") from None
        with self.lock:
            self.bytes_served += len(data)
        return data

    def samples_ready(self, req: rpc.SamplesReadyRequest):
        """Transformed samples already in the cache; nothing is started."""
        rows = []
        for path, kind, params, seed in req.samples:
            try:
                data = self.samples.peek(path, kind, params, seed)
            except (OSError, ValueError):
                data = None
            if data is not None:
                rows.append((path, seed, data))
        with self.lock:
            self.bytes_served += sum(len(r[2]) for r in rows)
        return pa.table({"path": pa.array([r[0] for r in rows], type=pa.string()),
                         "seed": pa.array([r[1] for r in rows], type=pa.int64()),
                         "data": pa.array([r[2] for r in rows], type=pa.large_binary())})

    def do_get(self, context, ticket):
        with _errors_as_rpc():
            req = rpc.parse_ticket(ticket.ticket)
            if isinstance(req, rpc.SampleRequest):
                data = self.sample(req)
            elif isinstance(req, rpc.SamplesReadyRequest):
                return fl.RecordBatchStream(self.samples_ready(req))
            else:
                data = self.read_range(req.path, req.offset, req.length, req.replica_only, req.expect,
                                       req.demand)
            return fl.RecordBatchStream(pa.table({"data": pa.array([data], type=pa.large_binary())}))

    def _store_reader(self, path: str):
        """An open reader of a store file, kept in a small LRU (reads are positional, so one
        reader serves concurrent calls). A file changed in the store gets a fresh reader."""
        st = self.store.stat(path)
        with self.lock:
            entry = self._readers.get(path)
            if entry is not None and entry[1] == st.identity():
                self._readers.move_to_end(path)
                return entry[0]
        reader, st = self.store.open_reader(path)
        with self.lock:
            old = self._readers.pop(path, None)
            self._readers[path] = (reader, st.identity())
            while len(self._readers) > 256:
                self._retired.append(self._readers.popitem(last=False)[1][0])
        if old is not None:
            self._retired.append(old[0])
        return reader

    # -- replicas ------------------------------------------------------------------------------
    def _adopt_stopped_instances(self, data_dir: str) -> None:
        """Rebuild the catalog from the folders of persistent agents that stopped or crashed:
        every replica with a sidecar and the right size moves here, and so does every cut copy
        with its progress (`_adopt_partial_copies`); anything else is removed with the folder."""
        now = time.time()
        adopted = 0
        for folder in _stopped_instances(data_dir, "agent"):
            for name, data, meta in _descriptions(folder, ".meta"):
                try:
                    if os.path.getsize(data) != int(meta["size"]) or float(meta["expires_at"]) <= now:
                        continue
                    path = str(meta["path"])
                    old = self.replicas.get(path)
                    if old is not None and old.source_mtime_ns >= int(meta["mtime_ns"]):
                        continue
                    local = self._local_name(path)
                    # opened before the move: a failed open (EMFILE) leaves it with the old folder
                    fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        os.rename(data, local)
                    except OSError:
                        os.close(fd)
                        raise
                    rep = Replica(path, local, int(meta["size"]), float(meta["expires_at"]), fd,
                                  int(meta["mtime_ns"]), time.monotonic(), meta.get("record"))
                    _write_sidecar(local, rep)
                    if old is not None:
                        os.close(old.fd)
                    self.replicas[path] = rep
                    adopted += 1
                except (OSError, ValueError, KeyError) as err:
                    log.warning("not adopting %s from %s: %s", name, folder, err)
            self._adopt_partial_copies(folder)
            if os.path.isdir(os.path.join(folder, "streams")):
                n = self.streams.adopt(os.path.join(folder, "streams"))
                if n:
                    log.info("adopted %d write-time streams from %s", n, folder)
            shutil.rmtree(folder, ignore_errors=True)
        if adopted:
            log.info("catalog rebuilt from disk: %d replicas (%d bytes)", adopted, self.used_bytes())

    def _make_room(self, path: str, size: int, reserve: bool = False) -> None:
        """Evict replicas (policy/tier.py) so that `size` more bytes fit the budget, or ENOSPC;
        `reserve`: and count them (a stream's chunks, until its part is handed over)."""
        from policy.tier import TierEntry, pick_evictions
        with self.lock:
            need = self.used_bytes() + size - self.budget
            if need <= 0:
                if reserve:
                    self.replicas.reserve(size)
                return
            now = time.time()
            newest = self.follower.newest_files() if self.follower is not None else set()
            pinned = self.follower.pinned_files() if self.follower is not None else set()
            entries = [TierEntry(p, r.size, r.last_used, r.expires_at <= now, p in newest, p in pinned)
                       for p, r in self.replicas.items() if p != path]
            # a little more than this copy needs: a full tier then sorts its catalog once per
            # EVICT_HEADROOM of the budget, not once per copy (bench/follower_queue.py)
            victims = pick_evictions(entries, need, need + int(self.budget * EVICT_HEADROOM))
            if not victims:
                raise HintfsError(errno.ENOSPC, f"budget: {path} needs {size} bytes, "
                                                f"{self.budget - self.used_bytes()} left and no replica may go")
        for p in victims:
            if self.drop(p):
                self.evictions += 1
                log.info("evicted %s to make room for %s", p, path)
        if reserve:
            with self.lock:
                self.replicas.reserve(size)

    # StreamBudget (agent/streams.py): stream chunks count in the budget beside replicas.
    def reserve(self, nbytes: int, path: str) -> None:
        self._make_room(path, nbytes, reserve=True)

    def release(self, nbytes: int) -> None:
        with self.lock:
            self.replicas.release(nbytes)

    def _adopt_partial_copies(self, folder: str) -> None:
        """Copies cut by the stop (or crash) of the agent that owned `folder`: their `.part` file
        and its progress move here, and the next copy of the same version resumes from them."""
        for name, data, doc in _descriptions(folder, ".part.progress"):
            part = data + ".part"
            try:
                path, size, chunk = str(doc["path"]), int(doc["size"]), int(doc["chunk"])
                done = {int(k): int(v) for k, v in doc["done"].items()}
                if path in self.replicas or path in self._partial or os.path.getsize(part) > size:
                    continue
                os.rename(part, self._local_name(path) + ".part")
                self._partial[path] = {"version": (size, int(doc["mtime_ns"])), "chunk": chunk, "done": done}
                log.info("adopted a cut copy of %s: %d ranges already here", path, len(done))
            except (OSError, ValueError, KeyError, AttributeError) as err:
                log.warning("not adopting the cut copy %s from %s: %s", name, folder, err)

    def _local_name(self, path: str) -> str:
        return os.path.join(self.data_dir, hashlib.sha256(path.encode()).hexdigest()[:32])

    def used_bytes(self) -> int:
        """Replicas and stream chunks not yet replicas (running sums: asked at every copy)."""
        return self.replicas.counted_bytes

    def replicate(self, path: str, ttl_s: float, source: Optional[str], parallel: int = 16,
                  priority: str = "background", job: Optional[str] = None, importance: float = 1.0,
                  expect: Optional[tuple[int, int]] = None, record: Optional[str] = None,
                  trusted: bool = True) -> dict:
        """Copy `path` here (from the store, or from the agent at `source`) and keep it `ttl_s`.

        The copy is `parallel` ranged reads of 8 MiB in flight, enough to fill the bandwidth-delay
        product of a long link; one copy per path at a time (a second caller waits for the first).
        The source's size and mtime are checked before and after: a file that changed during the
        copy is not kept (EAGAIN). `expect` = (size, mtime_ns) of the version to copy (from a
        journal record) saves the first check: one round trip less per file on a long link.
        A replica of another version than `expect` is replaced. `record`: the journal record
        that announced this version. Every close writes a record of its own, so a replica copied
        for another record is replaced even if size and mtime match: that is a rewrite within
        the mtime's precision (one second on S3), which size + mtime alone cannot see.

        `trusted` False (a caller over the network): `expect` and `record` are that caller's
        word, not the store's. The record is ignored, and `expect` is checked against the
        store's own stat before anything is copied (ESTALE when it differs), never taken as the
        version the replica holds.
        """
        if source:
            source = self._peer(source)   # before anything is evicted or reserved for the copy
        if not trusted:
            record = None
            if expect is not None:
                st = self.store.stat(path)
                if st.identity() != tuple(expect):
                    raise HintfsError(errno.ESTALE, f"{path}: the store has version {st.identity()}, "
                                                    f"not {tuple(expect)}")
        # A training mount is streaming this file here: its publish makes the replica, without a
        # second copy across the link (docs/cross_dc.md, "The commit marker").
        self._wait_for_stream(path, expect, streamed_record(record))
        while True:
            with self.lock:
                rep = self.replicas.get(path)
                # the same write, or a later one of the same writer (fsync, then close: two records
                # of one version; the later replica is what a copy would fetch now)
                same_write = (record is None or rep is None or rep.record in (None, record)
                              or later_by_same_writer(rep.record, record))
                if rep is not None and same_write and (
                        expect is None or (rep.size, rep.source_mtime_ns) == tuple(expect)):
                    if record is not None and rep.record is None:
                        rep.record = record   # copied before its record was seen: the same write
                    rep.expires_at = max(rep.expires_at, time.time() + ttl_s)
                    rep.last_used = time.monotonic()
                    if self.persistent:
                        _write_sidecar(rep.local, rep)
                    return {"path": path, "size": rep.size, "already": True}
                if rep is not None and expect is not None and rep.source_mtime_ns > int(expect[1]):
                    # A newer version is here already (its stream or copy came first): an older
                    # journal record never replaces it.
                    return {"path": path, "size": rep.size, "already": True, "newer": True}
                busy = self._copying.get(path)
                if busy is None:
                    self._copying[path] = threading.Event()
                    break
            busy.wait()
        try:
            if rep is not None:
                self.drop(path)    # an older version: the new one replaces it
            return self._copy_in(path, ttl_s, source, parallel, priority, job, importance, expect, record)
        finally:
            with self.lock:
                self._copying.pop(path).set()
                self._copying_version.pop(path, None)

    def _copy_in(self, path: str, ttl_s: float, source: Optional[str], parallel: int,
                 priority: str = "background", job: Optional[str] = None, importance: float = 1.0,
                 expect: Optional[tuple[int, int]] = None, record: Optional[str] = None) -> dict:
        if expect is not None and not source:
            st = Stat(stat_mod.S_IFREG | 0o644, int(expect[0]), int(expect[1]), int(expect[1]))
        else:
            st = self.store.stat(path)
        with self.lock:
            self._copying_version[path] = (st.size, st.mtime_ns)
        self._demand_may_come(path, (st.size, st.mtime_ns), open_reader=False)
        self._make_room(path, st.size)
        local = self._local_name(path)
        tmp = local + ".part"
        if source:
            from agent.client import AgentClient
            src = AgentClient(source, token=self.token)
            read = lambda off, n: src.read(path, off, n, replica_only=True)  # noqa: E731
        else:
            src = None
            open_data = getattr(self.store, "open_data", None)   # a reader without its own stat
            reader = open_data(path) if open_data is not None else self.store.open_reader(path)[0]
            read = reader.read
        chunk = self.cfg.agent.link_chunk_bytes if self.link is not None and not source else _CHUNK
        ranges = [(off, min(chunk, st.size - off)) for off in range(0, st.size, chunk)]
        # One ranged GET returns one version whole: asking for a byte more than expected shows a
        # grown file, and a same-size rewrite journals a record of its own (copied again then).
        single = expect is not None and not source and len(ranges) <= 1
        if single:
            ranges = [(0, st.size + 1)]
        # A copy of this very version that was cut (the link dropped) resumes at the ranges it
        # had not finished; the `.part` file is never served either way.
        partial = self._partial.pop(path, None)
        done: dict[int, int] = {}
        if (partial is not None and partial["version"] == st.identity() and partial["chunk"] == chunk
                and not single and os.path.exists(tmp)):
            done = partial["done"]
            fd = os.open(tmp, os.O_RDWR | os.O_CLOEXEC)
            log.info("resuming the copy of %s: %d of %d ranges already here", path, len(done), len(ranges))
        else:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        resumed = len(done)
        with self.lock:   # demand reads may read its finished ranges (`_held_bytes`)
            self._copy_reads[path] = _CopyInFlight(st.identity(), fd, done, st.size + 1 if single else chunk)
        ranges = [r for r in ranges if r[0] not in done]
        # A persistent agent also keeps the progress on disk (`.part.progress`, after an
        # fdatasync of the ranges it lists), so a copy cut by a crash resumes after a restart.
        progress = _Progress(tmp, path, st, chunk, fd) if self.persistent and not single else None
        tid = None
        if self.link is not None and not source and ranges:
            # Copies from the store cross the shared link: each chunk waits for its turn.
            from policy.link import transfer_weight
            tid = self.link.open(path, priority, transfer_weight(st.size, importance), [n for _o, n in ranges], job)
        try:
            def copy(rng) -> int:
                if tid is not None:
                    self.link.acquire(tid)
                data = read(*rng)
                os.pwrite(fd, data, rng[0])
                with self.lock:
                    done[rng[0]] = len(data)
                    snapshot = dict(done) if progress is not None and progress.due() else None
                if snapshot is not None:
                    progress.save(snapshot)
                self._streams_changed()   # a demand read may be waiting for this range
                return len(data)

            try:
                if len(ranges) > 1 and parallel > 1:
                    from concurrent.futures import ThreadPoolExecutor
                    with ThreadPoolExecutor(min(parallel, len(ranges))) as pool:
                        list(pool.map(copy, ranges))
                else:
                    list(map(copy, ranges))
            except BaseException:
                if not single:
                    with self.lock:
                        self._partial[path] = {"version": st.identity(), "chunk": chunk, "done": done}
                        snapshot = dict(done)
                    if progress is not None:
                        progress.save(snapshot, force=True)
                raise
            copied = sum(done.values())
        finally:
            with self.lock:
                if self._copy_reads.get(path) is not None and self._copy_reads[path].fd == fd:
                    del self._copy_reads[path]
                os.close(fd)
            if tid is not None:
                self.link.close(tid)
            if src is not None:
                src.close()
            else:
                reader.close()
        if progress is not None:
            progress.remove()
        after = st if single else self.store.stat(path)
        if copied != st.size or after.identity() != st.identity():
            os.unlink(tmp)
            raise rpc_error(errno.EAGAIN, f"{path} changed or was short during the copy")
        rep = self._replica_from(tmp, path, st.size, st.mtime_ns, ttl_s, record)
        with self.lock:
            removed = not self._catalog_unless_removed(rep)
            self.resumed_ranges += resumed
            self.copies += 1
        if removed:
            self._retire(rep)
            log.info("copy of %s not kept: the store removed it since", path)
            return {"path": path, "size": st.size, "already": False, "removed": True}
        log.info("replica of %s ready (%d bytes, ttl %.0fs, from %s)", path, st.size, ttl_s, source or "store")
        return {"path": path, "size": st.size, "already": False}

    def _replica_from(self, part: str, path: str, size: int, mtime_ns: int, ttl_s: float,
                      record: Optional[str]) -> "Replica":
        """A complete, verified part file (a copy's or a stream's) renamed to the replica of
        (size, mtime_ns) of `path`, with its sidecar in a persistent agent; the caller catalogs it."""
        local = self._local_name(path)
        os.rename(part, local)
        rep = Replica(path, local, size, time.time() + ttl_s, os.open(local, os.O_RDONLY | os.O_CLOEXEC),
                      mtime_ns, time.monotonic(), record)
        if self.persistent:
            _write_sidecar(local, rep)
        return rep

    def _peer(self, source: str) -> str:
        """A copy's `source` must be one of the agents this agent's config trusts, `[agents]
        locations`: bytes at a tier come only from sources the tier trusts (a copy from a source
        is not checked byte by byte against the store: only its size and mtime are). So never an
        address a caller names freely (before, with no `[agents] locations`, any grpc:// address:
        another user's Flight server answered the copy's reads with other bytes, and eval mounts
        served them), never a unix socket (a mount's private agent), and this agent's token goes
        only where its operator configured. With none configured, no copy names a source."""
        peers = self.cfg.agents.locations
        if not source.startswith(("grpc://", "grpc+tcp://", "grpc+tls://")):
            why, code = "only grpc:// or grpc+tls:// agents", errno.EINVAL
        elif not peers:
            why, code = "this agent trusts no other agent ([agents] locations is empty)", errno.EACCES
        elif source not in peers:
            why, code = "it is not one of [agents] locations", errno.EACCES
        else:
            return source
        self._log_refusal("source", "replicate from source %.200r refused: %s", source, why)
        raise HintfsError(code, f"source {source!r}: {why}")

    def _log_refusal(self, kind: str, fmt: str, *args) -> None:
        """One warning per kind of refusal every REFUSAL_LOG_S, with how many there were since
        (a caller repeating a refused call cannot fill the log)."""
        now = time.monotonic()
        with self.lock:
            at, since = self._refusals_logged.get(kind, (float("-inf"), 0))
            if now - at < REFUSAL_LOG_S:
                self._refusals_logged[kind] = (at, since + 1)
                return
            self._refusals_logged[kind] = (now, 0)
        log.warning(fmt + (f" ({since} more refused since the last line)" if since else ""), *args)

    def tier_stat(self, path: str, wait_s: float = 0.0, appear_s: float = 0.0) -> dict:
        """What this agent holds at `path`: a ready replica (its version), a copy in flight or a
        published stream still filling (the version), an unpublished stream ("streaming": its
        bytes are never served; with `wait_s` the answer waits that long for its publish), a
        folder of replicas, or nothing. Eval mounts answer lookups of routed paths with it instead
        of a round trip to the remote store.

        "absent" says `"expected": true` while other files of the folder are being streamed in (a
        call within `_STREAM_QUIET_S`): the file may be on its way (a commit marker published a
        few milliseconds ago). With `appear_s` the answer then waits that long for it to appear."""
        start = time.monotonic()
        while True:
            doc = self._tier_state(path)
            waited = time.monotonic() - start
            if doc["state"] == "streaming" and waited < wait_s:
                pass
            elif doc["state"] == "absent" and self.streams.folder_quiet_s(path) < _STREAM_QUIET_S:
                doc["expected"] = True
                if waited >= appear_s:
                    return doc
            else:
                return doc
            limit = wait_s if doc["state"] == "streaming" else appear_s
            with self.stream_cond:
                self.stream_cond.wait(min(0.02, max(start + limit - time.monotonic(), 0.001)))

    def _tier_state(self, path: str) -> dict:
        stream = self.streams.state_of(path)
        with self.lock:
            rep = self.replicas.get(path)
            if stream is not None and stream[1] is not None and (
                    rep is None or (rep.size, rep.source_mtime_ns) != stream[1]):
                return {"state": "copying", "size": stream[1][0], "mtime_ns": stream[1][1]}
            awaiting = self._awaiting.get(path)
            if awaiting is not None and (rep is None or (rep.size, rep.source_mtime_ns) != awaiting):
                # journaled (the store has this version), its stream not published here yet
                return {"state": "copying", "size": awaiting[0], "mtime_ns": awaiting[1]}
            if stream is not None and rep is None and path not in self._copying_version:
                return {"state": "streaming"}
            if rep is not None:
                return {"state": "ready", "size": rep.size, "mtime_ns": rep.source_mtime_ns}
            ver = self._copying_version.get(path)
            if ver is not None:
                return {"state": "copying", "size": ver[0], "mtime_ns": ver[1]}
            prefix = path.rstrip("/") + "/"
            if any(p.startswith(prefix) for p in self.replicas) or any(p.startswith(prefix) for p in self._copying):
                return {"state": "dir"}
        if self.streams.below(path.rstrip("/") + "/"):
            return {"state": "dir"}
        return {"state": "absent"}

    # -- demand reads (agent/demand.py): the bytes of a version still arriving -----------------
    def _held_bytes(self, path: str, version: tuple[int, int], offset: int, length: int) -> Optional[bytes]:
        """[offset, offset + length) of exactly `version` of `path`, if this agent holds it: its
        replica, a published stream's verified chunks, or a copy's finished ranges; else None."""
        n = max(0, min(length, version[0] - offset))
        with self.lock:
            rep = self.replicas.get(path)
            if rep is not None and (rep.size, rep.source_mtime_ns) == version and rep.fd >= 0:
                rep.last_used = time.monotonic()
                return os.pread(rep.fd, n, offset)
            copy = self._copy_reads.get(path)
            if copy is not None and copy.version == version and copy.covers(offset, length, version[0]):
                return os.pread(copy.fd, n, offset)   # under the lock: the copy closes its fd under it
        return self.streams.read_verified(path, version, offset, length)

    def _stream_behind_s(self, path: str, version: tuple[int, int]) -> Optional[float]:
        """Seconds of link (`[agent] link_bytes_s`) the streams' backlog still needs, when
        `version` of `path` comes by a stream; None when it does not, or when the backlog is not
        known (a stream whose size neither its publish, the journal nor its sender told)."""
        if self.streams.being_handed_over(path) == version:
            return 0.0                       # complete: in the catalog within milliseconds
        state = self.streams.state_of(path)
        with self.lock:
            awaited = dict(self._awaiting)   # journaled versions whose stream is not published here yet
        if state != ("filling", version) and not (state == ("streaming", None) and awaited.get(path) == version):
            return None
        backlog = self.streams.backlog_bytes({p: v[0] for p, v in awaited.items()})
        return None if backlog is None else backlog / self.cfg.agent.link_bytes_s

    def _prefetch(self, path: str, version: tuple[int, int], ranges: list[tuple[int, int]]) -> int:
        """An eval's read hint of `version` of `path`: remembered for the next checkpoint's stream,
        and the ranges the tier does not hold fetched at once (agent/demand.py); how many pieces."""
        self.read_memory.remember(path, prefetch_pieces(ranges, version[0]), hinted=True)
        return self.demand.prefetch(path, version, ranges)

    def _announced_version(self, path: str) -> Optional[tuple[int, int]]:
        """The version of `path` on its way here that demand reads may ask for: a published
        stream's, or the one a journal record announced; None if none is known."""
        state = self.streams.state_of(path)
        if state is not None and state[0] == "filling" and state[1] is not None:
            return state[1]
        with self.lock:
            return self._awaiting.get(path) or self._copying_version.get(path)

    def _hint_unversioned(self, path: str, ranges: list[tuple[int, int]]) -> int:
        """A read hint of a file the eval mount found without a version here (a stream not yet
        published): held until the version is announced (`_demand_may_come`). Held first, then
        looked at: a publish between the mount's look and this call is not missed."""
        self.demand.hold_hint(path, ranges)
        version = self._announced_version(path)
        return 0 if version is None else self._fetch_held_hint(path, version)

    def _fetch_held_hint(self, path: str, version: tuple[int, int]) -> int:
        """The pieces a hint held for `path` asks for (if one is), fetched for `version`; how many."""
        held = self.demand.take_hint(path)
        return self._prefetch(path, version, held) if held else 0

    def _demand_may_come(self, path: str, version: tuple[int, int], open_reader: bool = True) -> None:
        """This version of `path` was announced (a publish, a journal record, a copy's start)
        while its bytes are still on their way: open its store reader now (unless the caller
        reads the store itself), and fetch what a held hint asks for."""
        if open_reader:
            self.demand.prepare(path, version)
        n = self._fetch_held_hint(path, version)
        if n:
            log.debug("read hint of %s held until its version was announced: %d pieces fetching", path, n)

    def _arriving(self, path: str, version: tuple[int, int]) -> bool:
        """A published stream or a copy of exactly `version` of `path` is on its way here (a
        finished stream's part on its way into the catalog too)."""
        if self.streams.state_of(path) == ("filling", version) or self.streams.being_handed_over(path) == version:
            return True
        with self.lock:
            return self._copying_version.get(path) == version or self._awaiting.get(path) == version

    # -- write-time streams (a training mount sends each file while it is written) -------------
    def _wait_for_stream(self, path: str, expect: Optional[tuple[int, int]], announced: bool = False) -> None:
        """Wait while a stream may bring this version of `path` instead of a copy:

        - a published stream still filling, of version `expect`, a newer one (it supersedes the
          record: a file published at fsync and again at close), or any when None;
        - an unpublished one for `_STREAM_PUBLISH_WAIT_S` (its publish may be in flight), longer
          while it is alive (a call within `_STREAM_QUIET_S`), at most `_STREAM_ALIVE_WAIT_S`
          (it may be a newer write);
        - none yet, when `expect` is known and other files of its folder are being streamed: a
          stream that runs a file behind the writer opens the next file's stream only after the
          journal record of that file is out, and a small file (the commit marker) opens its
          stream in the call that publishes it. Waited for while the folder's streams are alive;
        - a finished stream whose part is on its way into the catalog (`being_handed_over`, at
          most `HANDOVER_S`): it left the streams' table before it is the replica, and a fetch
          that looked then found neither and copied the file a second time;
        - none yet, when the journal record says its writer streams the file (`announced`), for
          `_STREAM_PUBLISH_WAIT_S`: the record can overtake the stream's first call (the first
          file of a folder, on a loaded host).

        All bounded by `stream_idle_s`. While it waits with `expect`, the tier answers `copying`
        at that version (the journal says the store has it), so eval reads are served on demand."""
        start = time.monotonic()
        prepared = False
        announce = expect is not None   # the caller knows the store's version (journal record)
        if expect is None:   # (an eval's fetch on read) the version a follower's copy waits for
            with self.lock:
                expect = self._awaiting.get(path)
        if announce:
            with self.lock:
                self._awaiting[path] = (int(expect[0]), int(expect[1]))
        try:
            while not self._stop.is_set():
                waited = time.monotonic() - start
                if waited > self.cfg.agent.stream_idle_s:
                    return
                st = self.streams.state_of(path)
                if st is None and self.streams.being_handed_over(path) is not None:
                    pass   # finished, its part not yet the replica: a copy now would be a second one
                elif st is None:
                    if expect is None or self.has(path, *expect):
                        return
                    if (self.streams.folder_quiet_s(path) > _STREAM_QUIET_S
                            and not (announced and waited < _STREAM_PUBLISH_WAIT_S)):
                        return
                elif st[0] == "streaming":
                    if waited > _STREAM_ALIVE_WAIT_S or (waited > _STREAM_PUBLISH_WAIT_S
                                                         and self.streams.quiet_s(path) > _STREAM_QUIET_S):
                        return
                elif expect is not None and st[1] is not None and st[1][1] < int(expect[1]):
                    return   # an older version is filling: copy the one journaled
                if expect is not None and not prepared:
                    self._demand_may_come(path, (int(expect[0]), int(expect[1])))   # eval reads may come meanwhile
                    prepared = True
                with self.stream_cond:
                    self.stream_cond.wait(0.02)
        finally:
            if announce:
                with self.lock:
                    if self._awaiting.get(path) == (int(expect[0]), int(expect[1])):
                        del self._awaiting[path]

    def _streams_changed(self) -> None:
        with self.stream_cond:
            self.stream_cond.notify_all()

    def _check_stream_path(self, path: str) -> None:
        """A stream makes the replica eval mounts read: only strictly below the prefixes this
        tier takes streams for (`[agent] stream_prefixes`, else `[follow] prefixes`). A stream at a
        prefix itself would make the routed folder a file at the tier (ENOTDIR for its files)."""
        prefixes = self.cfg.agent.stream_prefixes
        if prefixes is None:
            prefixes = self.cfg.follow.prefixes
        if not any(path.startswith(p.rstrip("/") + "/") for p in prefixes):
            at = any(path == p.rstrip("/") for p in prefixes)
            self._log_refusal("stream path", "stream of %.300s refused: %s", path,
                              "it is a stream prefix itself" if at else "not under [agent] stream_prefixes")
            raise rpc_error(errno.EACCES, f"{path}: this tier takes no streams there (only below "
                                          "[agent] stream_prefixes, else [follow] prefixes)")

    def stream_open(self, req: "rpc.StreamOpenRequest", sender: Sender = ANYONE) -> dict:
        self._check_stream_path(req.path)
        try:
            held = self.streams.open(req.stream, req.gen, req.path, req.chunk, req.job, sender)
        except StreamRefused as err:
            raise rpc_error(err.errno, str(err)) from None
        except StreamError as err:
            raise rpc_error(errno.ESTALE, str(err)) from None
        # The chunks eval jobs read of this file's previous checkpoint: the sender sends them first.
        first = chunks_touching(self.read_memory.predict(req.path), req.chunk, MAX_FIRST)
        if first:
            log.debug("stream %s of %s: %d chunks of %d bytes first, by eval reads of the last checkpoint",
                      req.stream, req.path, len(first), req.chunk)
            with self.lock:
                self.streams_first_chunks += len(first)
        return {"held": sorted(held.items()), "first": first}

    def stream_put(self, req: "rpc.StreamPutRequest", reader, sender: Sender = ANYONE) -> dict:
        """One `do_put`: open the stream if asked, write its chunks, publish if asked. A put that
        completes a stream published (and confirmed) already makes it the replica, and answers
        "ready"."""
        result: dict = {}
        if req.open is not None:
            if (req.open.stream, req.open.gen) != (req.stream, req.gen):
                raise rpc_error(errno.EINVAL, "open names another stream or generation")
            result = self.stream_open(req.open, sender)
        complete = False
        try:
            if req.seen is not None:   # before the chunks land: known as soon as the call starts
                self.streams.saw(req.stream, req.gen, req.seen, sender)
            for batch in reader:
                data = batch.data
                offsets = data.column("offset").to_pylist()
                crcs = data.column("crc").to_pylist()
                chunks = data.column("data")
                for i, (off, crc) in enumerate(zip(offsets, crcs)):
                    # A view of Arrow's buffer, not a copy: `as_py()` copied each chunk (4 MiB)
                    # holding the GIL, the agent's largest CPU cost while receiving streams.
                    view = memoryview(chunks[i].as_buffer())
                    complete |= self.streams.put(req.stream, req.gen, int(off), view, int(crc), sender)
                self._streams_changed()   # demand reads may be waiting for these chunks
        except StreamFinished:
            for _ in reader:          # the rest of the call's chunks: the tier holds them
                pass
            return {**result, "state": "ready"}
        except StreamRefused as err:
            raise rpc_error(err.errno, str(err)) from None
        except StreamError as err:
            raise rpc_error(errno.ESTALE, str(err)) from None
        except (KeyError, TypeError, ValueError) as err:
            raise rpc_error(errno.EINVAL, f"stream chunks: {err}") from None
        if complete and self._finish_stream(req.stream, req.gen):
            result["state"] = "ready"
        if req.publish is not None:
            if (req.publish.stream, req.publish.gen) != (req.stream, req.gen):
                raise rpc_error(errno.EINVAL, "publish names another stream or generation")
            result.update(self.stream_publish(req.publish, sender))
        return result

    def _finish_stream(self, sid: str, gen: int) -> bool:
        """A published stream completed by its last chunks: made the replica of its version."""
        done = self.streams.finish_if_complete(sid, gen)
        if done is None:
            return False
        path, (size, mtime_ns), (record, ttl_s), part = done
        try:
            self._adopt_stream(path, part, size, mtime_ns, record, ttl_s)
        finally:
            self.streams.handed_over(path)
            self._streams_changed()
        return True

    def stream_publish(self, req: "rpc.StreamPublishRequest", sender: Sender = ANYONE) -> dict:
        """The training mount published the streamed file as (size, mtime_ns): a stream holding
        exactly those bytes (CRC of every chunk) becomes the replica of that version once the
        store's word confirms the version (a journal record, else a batched stat: `VersionCheck`;
        the sender's word is not enough: docs/cross_dc.md, "Versions the store has"). Otherwise
        the sender is told which chunks to send again (the put that brings the last of them makes
        the replica). A complete stream waiting for its confirmation answers "ready" with
        `"pending": true`: the sender has nothing more to send."""
        self._check_stream_path(req.path)
        version = (req.size, req.mtime_ns)
        known, record = self.versions.record_of(req.path, version)
        with self.lock:
            rep = self.replicas.get(req.path)
            replica_version = (rep.size, rep.source_mtime_ns) if rep is not None else None
        try:
            # The replica remembers the journal's record of its version, never the sender's.
            v, part = self.streams.publish(req.stream, req.gen, req.path, req.size, req.mtime_ns,
                                           req.crcs, replica_version, meta=(record, req.ttl_s), sender=sender,
                                           confirmed=known)
        except StreamRefused as err:
            raise rpc_error(err.errno, str(err)) from None
        except StreamError as err:
            raise rpc_error(errno.ESTALE, str(err)) from None
        except ValueError as err:
            raise rpc_error(errno.EINVAL, str(err)) from None
        self.versions.published()   # (an unconfirmed one is confirmed or refused by its thread)
        if known and v.state == "fill":   # eval reads may come before the last chunks: open the store file now
            self._demand_may_come(req.path, version)
        try:
            if part is not None:
                self._adopt_stream(req.path, part, req.size, req.mtime_ns, record, req.ttl_s)
        finally:
            if part is not None:
                self.streams.handed_over(req.path)
            self._streams_changed()
        out = {"state": v.state, "fetch": list(v.fetch)}
        if not known and v.state != "stale":
            out["pending"] = True
        return out

    def _version_confirmed(self, path: str, version: tuple[int, int], record: Optional[str]) -> None:
        """(VersionCheck) The store has `version` of `path`: its streams are confirmed; each one
        complete becomes the replica now, one still filling may be read on demand."""
        done = self.streams.confirm(path, version, lambda meta: (record, meta[1] if meta else 86400.0))
        for p, (size, mtime_ns), (rec, ttl_s), part in done:
            try:
                self._adopt_stream(p, part, size, mtime_ns, rec, ttl_s)
            except Exception as err:   # the follower copies the file
                log.warning("stream of %s not made a replica: %s", p, err)
            finally:
                self.streams.handed_over(p)
        if not done and self.streams.state_of(path) == ("filling", tuple(version)):
            self._demand_may_come(path, tuple(version))
        self._streams_changed()

    def _version_refused(self, path: str, version: tuple[int, int], why: str) -> None:
        """(VersionCheck) The store does not have `version` of `path`: its streams go."""
        if self.streams.refuse(path, version, why):
            self._streams_changed()

    def store_versions_seen(self, entries) -> None:
        """The follower read journal records: (path, (size, mtime_ns), record) the store has."""
        self.versions.learned([(p, v, r) for p, v, r in entries if v is not None and not removed_record(r)])

    def _adopt_stream(self, path: str, part: str, size: int, mtime_ns: int, record: Optional[str],
                      ttl_s: float) -> None:
        """A verified stream becomes the replica of (size, mtime_ns), as a finished copy would."""
        while True:
            with self.lock:
                busy = self._copying.get(path)
                if busy is None:
                    self._copying[path] = threading.Event()
                    break
            busy.wait()
        try:
            try:
                self._make_room(path, size)
            except BaseException:
                os.unlink(part)
                raise
            self.drop(path)
            rep = self._replica_from(part, path, size, mtime_ns, ttl_s, record)
            with self.lock:
                removed = not self._catalog_unless_removed(rep)
                self.streams_published += 1
            if removed:
                self._retire(rep)
                log.info("stream of %s not kept: the store removed it since", path)
            else:
                log.info("replica of %s ready from its write-time stream (%d bytes)", path, size)
        finally:
            with self.lock:
                self._copying.pop(path).set()

    def stream_abort(self, sid: str, sender: Sender = ANYONE) -> dict:
        try:
            gone = self.streams.abort(sid, sender)
        except StreamRefused as err:
            raise rpc_error(err.errno, str(err)) from None
        self._streams_changed()
        return {"dropped": gone}

    def do_put(self, context, descriptor, reader, writer):
        with _errors_as_rpc():
            req = rpc.parse_put(descriptor.command)
            result = self.stream_put(req, reader, _sender(context))
            writer.write(pa.py_buffer(json.dumps(result).encode()))

    def local_replica_fd(self, path: str, size: int, mtime_ns: int) -> int:
        """A new fd of a complete, unexpired replica of exactly this version of `path`, or -1: for
        the mount in this process, whose kernel then reads the replica file itself (passthrough).
        The fd keeps the file's data should the replica be evicted meanwhile."""
        with self.lock:
            rep = self.replicas.get(path)
            if (rep is None or rep.fd < 0 or rep.size != size or rep.source_mtime_ns != mtime_ns
                    or rep.expires_at <= time.time()):
                return -1
            rep.last_used = time.monotonic()
            return os.dup(rep.fd)

    def has(self, path: str, size: int, mtime_ns: int) -> bool:
        """A complete replica of exactly this version of `path` is here."""
        with self.lock:
            rep = self.replicas.get(path)
            return rep is not None and rep.size == size and rep.source_mtime_ns == mtime_ns

    def drop(self, path: str, only: Optional[Replica] = None) -> bool:
        """Drop the replica of `path` (`only` that one: not a newer one cataloged since)."""
        with self.lock:
            rep = self.replicas.get(path)
            if rep is None or (only is not None and rep is not only):
                return False
            del self.replicas[path]
        self._retire(rep)
        return True

    def _retire(self, rep: Replica) -> None:
        """Remove a replica's files; its fd is closed a reclaim round later (a read running on
        another thread may still hold it)."""
        self._retired_fds.append(rep.fd)
        for name in (rep.local + ".meta", rep.local):   # the description first: no orphan data is trusted
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass

    def removed_from_store(self, removals: list[tuple[str, int]]) -> list[str]:
        """Journal records (`common.journal.removed_record`) say each path, a file or a folder,
        left the store at its time (unlinked, renamed away): drop the replicas of it and under it
        made from an earlier version, and remember it, so that a copy or stream of such a version
        finishing later is not cataloged either. One pass over the replicas for all of them (a
        deleted checkpoint is a record per file). The paths dropped."""
        with self.lock:
            batch = self._removed.note_round(removals)
            gone = []
            for p, rep in self.replicas.items():
                t = batch.newest(p)
                if t is not None and _made_before(rep, t):
                    gone.append(rep)
        dropped = [rep.path for rep in gone if self.drop(rep.path, only=rep)]
        for p in dropped:
            log.info("replica of %s dropped: the store removed it", p)
        return dropped

    def _catalog_unless_removed(self, rep: Replica) -> bool:
        """(under self.lock) A finished copy's or stream's replica joins the catalog, unless a
        removal record newer than its version came meanwhile (the caller then retires it)."""
        if self._removed_since(rep):
            return False
        self.replicas[rep.path] = rep
        return True

    def _removed_since(self, rep: Replica) -> bool:
        """(under self.lock) A removal record of the replica's path or a folder above it is
        newer than the version it holds."""
        t = self._removed.newest(rep.path)
        return t is not None and _made_before(rep, t)

    def _reclaim_loop(self) -> None:
        interval = self.cfg.agent.reclaim_interval_s
        while not self._stop.wait(interval):
            with self.lock:
                readers, self._retired = self._retired, []
                fds, self._retired_fds = self._retired_fds, []
            self._stop.wait(min(interval, 1.0))   # let reads that picked them up finish
            for r in readers:
                r.close()
            for fd in fds:
                os.close(fd)
            now = time.time()
            with self.lock:
                gone = [p for p, r in self.replicas.items() if r.expires_at <= now]
            for p in gone:
                self.drop(p)
                log.info("replica of %s reclaimed at TTL", p)
            if self.streams.expire():
                self._streams_changed()
            self.streams.save_due()

    def status(self) -> dict:
        with self.lock:
            elapsed = max(time.monotonic() - self.started, 1e-9)
            return {
                "replicas": {p: {"size": r.size, "expires_in_s": round(r.expires_at - time.time(), 3)}
                             for p, r in self.replicas.items()},
                "load": {"reads_in_flight": self.in_flight, "reads_served": self.reads_served,
                         "bytes_served": self.bytes_served,
                         "bytes_per_s": round(self.bytes_served / elapsed, 1)},
                "budget": {"bytes": self.budget, "used": self.used_bytes(), "evictions": self.evictions},
                "resumed_ranges": self.resumed_ranges, "copies": self.copies,
                "streams": {"open": len(self.streams.streams), "published": self.streams_published,
                            "bytes_held": self.streams.bytes_held(), "bytes_counted": self.replicas.reserved_bytes,
                            "first_chunks": self.streams_first_chunks,
                            "files_read_remembered": len(self.read_memory),
                            "unconfirmed": len(self.streams.unconfirmed()),
                            "by_sender": {k: {"open": u.open, "bytes": u.bytes, "refused": u.refused}
                                          for k, u in self.streams.usage().items()},
                            "limits": {"open": self.stream_limits.max_streams,
                                       "per_peer": self.stream_limits.per_peer,
                                       "per_token": self.stream_limits.per_token,
                                       "peer_bytes": self.stream_limits.peer_bytes},
                            "versions": self.versions.status()},
                "demand": self.demand.status(),
            }

    def do_action(self, context, action):
        with _errors_as_rpc():
            kind = action.type
            req = rpc.parse_action(kind, action.body)   # (copied out of Flight's buffer there)
            result = self._act(kind, req, _sender(context))
        yield fl.Result(json.dumps(result).encode())

    def _act(self, kind: str, req, sender: Sender = ANYONE) -> dict:
        if kind == "prefetch":
            ranges = [(int(o), int(n)) for o, n in req.ranges]
            if req.expect is None:
                return {"fetching": self._hint_unversioned(req.path, ranges)}
            return {"fetching": self._prefetch(req.path, (int(req.expect[0]), int(req.expect[1])), ranges)}
        if kind == "replicate":
            return self.replicate(req.path, req.ttl_s, req.source, priority=req.priority, job=req.job,
                                  importance=req.importance, expect=req.expect, record=req.record, trusted=False)
        if kind == "signal":
            if self.link is None:
                return {"applied": False}
            if req.clear:
                self.link.clear(req.job)
            else:
                self.link.signal(req.job, req.severity)
            return {"applied": True}
        if kind == "drop":
            return {"dropped": self.drop(req.path)}
        if kind == "status":
            result = self.status()
            if self._samples is not None:
                result["samples"] = self._samples.status()
            if self.follower is not None:
                result["follow"] = self.follower.status()
            if self.link is not None:
                result["link_bytes_by_class"] = dict(self.link.sent)
            return result
        if kind == "plan_window":   # forget + prefetch in one call: one per plan step (per job)
            self.samples.forget({(p, s) for p, s in req.keep}, job=req.job)
            return {"started": self.samples.prefetch([tuple(x) for x in req.want], job=req.job) if req.want else 0}
        if kind == "tier_stat":
            return self.tier_stat(req.path, req.wait_s, req.appear_s)
        if kind == "stream_open":
            return self.stream_open(req, sender)
        if kind == "stream_publish":
            return self.stream_publish(req, sender)
        if kind == "stream_abort":
            return self.stream_abort(req.stream, sender)
        if kind == "has":
            return {"has": self.has(req.path, req.size, req.mtime_ns)}
        return {"ok": True}   # ping

    def list_actions(self, context):
        return [(name, doc) for name, (_model, doc) in rpc.ACTIONS.items()]

    def shutdown(self):
        self._stop.set()
        self.versions.close()
        if self.follower is not None:
            self.follower.stop()
        if self.link is not None:
            self.link.stop()
        if self._samples is not None:
            self._samples.close()
        if self.fd_server is not None:
            self.fd_server.close()
        super().shutdown()
        self.demand.close()
        self.streams.close()   # a persistent agent keeps each stream's part + progress to adopt
        if self.persistent:   # replicas stay for the next agent on this data_dir to adopt
            with self.lock:
                for r in self.replicas.values():
                    os.close(r.fd)
                self.replicas.clear()
        else:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self.socket_dir is not None:
            self.socket_dir.remove()


@dataclass
class _CopyInFlight:
    """A copy being made: its `.part` fd and the ranges written (offset -> length, filled under
    the agent's lock after each range's pwrite), for demand reads of this version."""
    version: tuple[int, int]
    fd: int
    done: dict
    chunk: int

    def covers(self, offset: int, length: int, size: int) -> bool:
        return all(self.done.get(i * self.chunk) == min(self.chunk, size - i * self.chunk)
                   for i in chunks_under(offset, length, size, self.chunk))


class _Progress:
    """The ranges of a copy that are on disk, in `<part>.progress` (JSON, tmp + rename). What it
    lists was fdatasync'ed first: after a crash, the listed ranges of the `.part` hold real data."""

    EVERY_S = 0.5

    def __init__(self, part: str, path: str, st, chunk: int, fd: int) -> None:
        self.file = part + ".progress"
        self.doc = {"path": path, "size": st.size, "mtime_ns": st.mtime_ns, "chunk": chunk}
        self.fd = fd
        self.last = time.monotonic()
        self.saving = threading.Lock()

    def due(self) -> bool:
        return time.monotonic() - self.last >= self.EVERY_S

    def save(self, done: dict, force: bool = False) -> None:
        if not self.saving.acquire(blocking=force):
            return   # another range's thread is saving right now
        try:
            self.last = time.monotonic()
            os.fdatasync(self.fd)
            tmp = self.file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({**self.doc, "done": {str(k): v for k, v in done.items()}}, f)
            os.rename(tmp, self.file)
        except OSError as err:
            log.warning("cannot save the progress of %s: %s", self.doc["path"], err)
        finally:
            self.saving.release()

    def remove(self) -> None:
        try:
            os.unlink(self.file)
        except FileNotFoundError:
            pass


def _descriptions(folder: str, suffix: str):
    """(name, the file it describes, its JSON) for each `*suffix` file of a stopped agent's
    folder: replica sidecars (`.meta`) and cut-copy progress (`.part.progress`). An unreadable
    description is logged and skipped; its file goes with the folder."""
    for name in os.listdir(folder):
        if not name.endswith(suffix):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                doc = json.load(f)
        except (OSError, ValueError) as err:
            log.warning("unreadable %s in %s: %s", name, folder, err)
            continue
        yield name, os.path.join(folder, name[: -len(suffix)]), doc


def _lock_folder(folder: str) -> int:
    """Hold an exclusive flock on `folder/.lock` for the life of this instance (the kernel drops it
    when the process dies, however it dies)."""
    fd = os.open(os.path.join(folder, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _stopped_instances(data_dir: str, kind: str) -> list[str]:
    """Folders of `kind` whose owner is gone: nobody holds their lock (an owner holds it from
    start to exit, and the kernel drops it when the owner dies). Folders without a lock file (older
    versions) count as gone when their pid is."""
    out = []
    for name in sorted(os.listdir(data_dir)):
        if not name.startswith(kind + "-"):
            continue
        folder = os.path.join(data_dir, name)
        lock = os.path.join(folder, ".lock")
        if os.path.exists(lock):
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue          # its owner runs
            os.close(fd)          # free: the owner stopped (a racing adopter finds it gone)
            out.append(folder)
        else:
            try:
                pid = int(name.split("-")[1])
            except (ValueError, IndexError):
                continue
            if not pid_alive(pid):
                out.append(folder)
    return out


def _reap_dead_instances(data_dir: str, kind: str) -> None:
    for folder in _stopped_instances(data_dir, kind):
        shutil.rmtree(folder, ignore_errors=True)


def _write_sidecar(local: str, rep: "Replica") -> None:
    """`<replica>.meta`: what the replica is a copy of, written after the data (tmp + rename), so
    a restarted agent trusts only complete, described copies."""
    tmp = local + ".meta.tmp"
    with open(tmp, "w") as f:
        json.dump({"path": rep.path, "size": rep.size, "mtime_ns": rep.source_mtime_ns,
                   "expires_at": rep.expires_at, "record": rep.record}, f)
    os.rename(tmp, local + ".meta")


@contextlib.contextmanager
def _errors_as_rpc():
    """Whatever a handler raises leaves as an errno + message (never a bare traceback text)."""
    try:
        yield
    except fl.FlightError:
        raise
    except OSError as err:
        code = err.errno or errno.EIO
        raise rpc_error(code, err.strerror or str(err)) from None
    except OverflowError as err:    # a number past what the system call takes (rpc bounds them first)
        raise rpc_error(errno.EINVAL, f"a number is out of range: {err}") from None
    except Exception as err:
        log.exception("agent request failed")
        raise rpc_error(errno.EIO, f"internal error: {type(err).__name__}") from None


def start_in_process(cfg, store: Store) -> tuple[AgentServer, str]:
    """The mount's own agent when no agents are configured: a thread serving a unix socket in a
    private 0700 folder (agent/socketdir.py), so only the mount's own user can reach it."""
    sock_dir = socketdir.make()
    location = f"grpc+unix://{sock_dir.socket}"
    try:
        server = AgentServer(cfg, store, location=location)
    except BaseException:
        sock_dir.remove()
        raise
    server.socket_dir = sock_dir
    threading.Thread(target=server.serve, name="hintfs-agent", daemon=True).start()
    return server, location


def run_agent(cfg) -> int:
    store = open_store(cfg.store, cfg.cache.spool_dir)
    check_store(store, cfg.store)
    if not cfg.agent.token_file and cfg.agent.auth == "none":
        log.warning("agent at %s runs WITHOUT authentication ([agent] auth = \"none\"): anyone who can "
                    "reach it can read every file of %s", cfg.agent.location, store.description)
    open_files = raise_open_file_limit()   # one fd per replica (before adopting a stopped agent's)
    server = AgentServer(cfg, store, persistent=True, require_token=True)
    log.info("agent serving %s at %s (replicas in %s; up to %d open files: one per replica)", store.description,
             cfg.agent.location, cfg.agent.data_dir, open_files)
    import signal
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    signal.signal(signal.SIGINT, lambda *_: threading.Thread(target=server.shutdown).start())
    sd_notify("READY=1")
    server.serve()
    return 0

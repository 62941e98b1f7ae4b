"""The agent's catalog: the replicas it holds, within its byte budget (eviction), their TTLs,
and what the store removed.

`Catalog` is the role: a replica is added (a finished copy or stream, `replica_from` +
`add_unless_removed`), read (`get`, `pread`, `local_fd`), renewed, dropped (`drop`, at its TTL by
`expire`, by a journal removal record: `removed_from_store`) or evicted to make room for a copy or
a stream's chunks (`make_room`, by `policy.tier`). The follower says which checkpoint folders
eviction must spare (`keep`): it is never asked back. `lock` is the agent's state lock; the
arrivals (`hintfs.agent.tier.Arrivals`) share it.

A replica's fd is opened when it is read and kept for the next read (a read is one pread),
but only for the `max_open_fds` replicas read last (`_fd`): a tier of three 16,384-file
checkpoints kept one fd per replica and hit its open-file limit, after which every copy failed
with EMFILE (bench/notes/scale_xdc.md). A read outside the lock pins the replica (`read`), so
that neither the cache nor a drop closes the fd under it; the fd of a dropped replica closes when
its last read ends. An fd is opened by the replica's file name and checked against the inode the
replica was made with: a newer version renamed over that name is never read as the older one.

`ReplicaCatalog` is its table: every copy asks how much of the budget is used (`make_room`).
Summing the catalog each time made a copy cost more the more replicas the tier held, under the
agent's lock: quadratic over a checkpoint of thousands of files (bench/follower_queue.py). Bytes
on the agent's disk that are not replicas yet, the chunks of write-time streams, count in the
same budget (`reserved_bytes`, `reserve`/`release`; issue 34: unpublished streams filled the
data folder past `budget_bytes`). `counted_bytes` is what the budget compares.
"""
from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Generic, NoReturn, Protocol, TypeVar

from hintfs.agent import persist
from hintfs.agent.rpc import BudgetStatus, ReplicaStatus
from hintfs.common.clock import SYSTEM_CLOCK, Clock
from hintfs.common.errors import HintfsError
from hintfs.common.fdlimit import share_of_open_files
from hintfs.common.journal import Removals, record_time_ns
from hintfs.common.paths import PathDict
from policy.tier import TierEntry, pick_evictions

MAX_HOLDERS = 256     # claims kept per replica (`Catalog.hold`): one per hint job that asked for it

log = logging.getLogger("hintfs.agent")
EVICT_HEADROOM = 0.02          # a full tier evicts this share of its budget beyond what a copy needs


class _Sized(Protocol):
    size: int


R = TypeVar("R", bound=_Sized)


class ReplicaCatalog(PathDict[R], Generic[R]):
    """path -> replica; `used_bytes` is the sum of their sizes; `under(path)`: the replicas at or
    below a path (`PathDict`). Changed only by item assignment, `del`, `pop` and `clear` (the
    others would bypass the sum: they raise). Not thread-safe: the agent's lock guards it."""

    def __init__(self) -> None:
        super().__init__()
        self.used_bytes = 0
        self.reserved_bytes = 0     # counted for what is not a replica (yet): stream chunks

    @property
    def counted_bytes(self) -> int:
        """Replicas and reservations: what the budget holds."""
        return self.used_bytes + self.reserved_bytes

    def reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes

    def release(self, nbytes: int) -> None:
        self.reserved_bytes = max(0, self.reserved_bytes - nbytes)

    def __setitem__(self, path: str, rep: R) -> None:
        old = self.get(path)
        if old is not None:
            self.used_bytes -= old.size
        super().__setitem__(path, rep)
        self.used_bytes += rep.size

    def __delitem__(self, path: str) -> None:
        self.used_bytes -= self[path].size
        super().__delitem__(path)

    def pop(self, path: str, *default: Any) -> Any:
        if path in self:
            rep = super().pop(path)
            self.used_bytes -= rep.size
            return rep
        return super().pop(path, *default)

    def clear(self) -> None:
        super().clear()
        self.used_bytes = 0

    def _bypass(self, *_args: Any, **_kwargs: Any) -> NoReturn:
        raise TypeError("ReplicaCatalog changes only by [], del, pop and clear (used_bytes is kept by them)")

    update = setdefault = popitem = __ior__ = _bypass




@dataclass
class Replica:
    path: str
    local: str
    size: int
    expires_at: float          # wall-clock time (kept in the sidecar across restarts)
    fd: int = -1               # open while among the replicas read last (`Catalog._fd`), else -1
    source_mtime_ns: int = 0   # the version copied (size + mtime verify a replica)
    last_used: float = 0.0     # monotonic time of the last read or copy (eviction order)
    record: str | None = None   # the journal record this copy answered (one per close)
    # who asked to keep it and until when (wall clock): a mount's hint job each (`Catalog.hold`);
    # a release by one of them drops the replica only once no other claim is live
    holders: dict[str, float] = field(default_factory=dict)
    ino: tuple[int, int] = (0, 0)   # (st_dev, st_ino) of its file: what a reopen must find
    pins: int = 0                   # reads using `fd` outside the catalog's lock
    retired: bool = False           # dropped: never reopened; its fd closes with the last pin

    @property
    def version(self) -> tuple[int, int]:
        return (self.size, self.source_mtime_ns)

    def live_holders(self, now: float) -> dict[str, float]:
        """The claims on it that have not ended by `now` (wall clock)."""
        return {h: t for h, t in self.holders.items() if t > now}


def made_before(rep: Replica, t_ns: int) -> bool:
    """The replica holds a version written before `t_ns`: by the time of the journal record it was
    made for, else (a copy found by listing or fetched for a read) by the store's mtime."""
    made = record_time_ns(rep.record) if rep.record else None
    return (made if made is not None else rep.source_mtime_ns) < t_ns


def _under(path: str, folders: frozenset[str]) -> bool:
    """`path` is in one of `folders` or below one."""
    while "/" in path:
        path = path.rsplit("/", 1)[0]
        if path in folders:
            return True
    return False


class Catalog:
    """The replicas of one agent instance (in `folder`), `budget` bytes at most with the stream
    chunks counted beside them. `persistent`: each replica has a sidecar (`persist.write_sidecar`)."""

    def __init__(self, folder: str, budget: int, persistent: bool, clock: Clock = SYSTEM_CLOCK,
                 max_open_fds: int | None = None) -> None:
        self.folder = folder
        self.budget = budget
        self.persistent = persistent
        self.clock = clock
        self.replicas: ReplicaCatalog[Replica] = ReplicaCatalog()
        self.lock = threading.Lock()
        self.evictions = 0
        # path (a file or a folder) -> the time of the newest journal record saying it left the
        # store: a replica of it from before then is dropped, and not cataloged when a copy or
        # stream of it finishes later (`removed_from_store`; a restarted agent reads the journal again)
        self._removed = Removals()
        # the replicas whose fd is open, least recently read first: at most `max_open_fds` of
        # them (half the open-file limit by default) unless more are pinned by reads
        self.max_open_fds = max_open_fds if max_open_fds is not None else share_of_open_files(0.5)
        self._open: OrderedDict[int, Replica] = OrderedDict()     # id(replica) -> replica
        self.fd_opens = 0          # fds opened for reads (a count that grows with cache misses)
        # checkpoint folders eviction spares, as the follower last said: (newest complete, being copied)
        self._kept: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())

    # -- what is here ----------------------------------------------------------------------------
    def local_name(self, path: str) -> str:
        return os.path.join(self.folder, hashlib.sha256(path.encode()).hexdigest()[:32])

    def used_bytes(self) -> int:
        """Replicas and stream chunks not yet replicas (running sums: asked at every copy)."""
        return self.replicas.counted_bytes

    def get(self, path: str) -> Replica | None:
        with self.lock:
            return self.replicas.get(path)

    def has(self, path: str, size: int, mtime_ns: int) -> bool:
        """A complete replica of exactly this version of `path` is here."""
        with self.lock:
            rep = self.replicas.get(path)
            return rep is not None and rep.size == size and rep.source_mtime_ns == mtime_ns

    def pread(self, path: str, version: tuple[int, int], offset: int, n: int) -> bytes | None:
        """(under `lock`) `n` bytes at `offset` of the replica of exactly `version`, or None."""
        rep = self.replicas.get(path)
        if rep is not None and rep.version == version:
            fd = self._fd(rep)
            if fd >= 0:
                rep.last_used = self.clock.monotonic()
                return os.pread(fd, n, offset)
        return None

    def read(self, rep: Replica, offset: int, n: int) -> bytes | None:
        """`n` bytes at `offset` of `rep`, read outside the lock (a read from disk does not hold up
        the copies and reads waiting for it), or None: the replica was dropped or its file is gone."""
        with self.lock:
            fd = self._fd(rep)
            if fd < 0:
                return None
            rep.pins += 1
            rep.last_used = self.clock.monotonic()
        try:
            return os.pread(fd, n, offset)
        finally:
            with self.lock:
                rep.pins -= 1
                if rep.retired and rep.pins == 0:
                    self._close_fd(rep)

    def _fd(self, rep: Replica) -> int:
        """(under `lock`) The replica's fd, opened now if it is not among the replicas read last;
        -1 when it was dropped or its file is not the one it was made with (gone, or a newer
        version renamed over its name)."""
        if rep.retired:
            return -1
        if rep.fd >= 0:
            self._open.move_to_end(id(rep))
            return rep.fd
        try:
            fd = self._open_file(rep.local)
        except FileNotFoundError:
            return -1
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != rep.ino:
            os.close(fd)
            return -1
        rep.fd = fd
        self._open[id(rep)] = rep
        self.fd_opens += 1
        self._shed(len(self._open) - self.max_open_fds, keep=rep)
        return fd

    def _open_file(self, name: str) -> int:
        """(under `lock`) Open a replica's file; out of open files (the limit was lowered, or
        other fds took it), close a quarter of the cached ones and try once more."""
        try:
            return os.open(name, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            if err.errno not in (errno.EMFILE, errno.ENFILE) or not self._shed(max(1, len(self._open) // 4)):
                raise
        return os.open(name, os.O_RDONLY | os.O_CLOEXEC)

    def _shed(self, n: int, keep: Replica | None = None) -> int:
        """(under `lock`) Close the fds of up to `n` replicas read least recently and not being
        read now (pinned ones stay open: their reads are running), never `keep`'s; how many."""
        closed = 0
        if n <= 0:
            return 0
        # a few pinned ones at the front are passed over; a bounded look, not the whole table
        for rep in list(itertools.islice(self._open.values(), n + 64)):
            if closed >= n:
                break
            if rep.pins == 0 and rep is not keep:
                self._close_fd(rep)
                closed += 1
        return closed

    def _retire_fd(self, rep: Replica) -> None:
        """(under `lock`) A replica dropped or replaced: never reopened; its fd closes now, or
        when the last read running on it ends (`read`)."""
        rep.retired = True
        if rep.pins == 0:
            self._close_fd(rep)
        else:
            self._open.pop(id(rep), None)   # no longer the cache's to close

    def _close_fd(self, rep: Replica) -> None:
        """(under `lock`) Close the replica's fd, if open."""
        self._open.pop(id(rep), None)
        if rep.fd >= 0:
            os.close(rep.fd)
            rep.fd = -1

    def open_fds(self) -> int:
        """How many replicas have their fd open now."""
        with self.lock:
            return len(self._open)

    def fd_status(self) -> dict[str, int]:
        """The replicas' fds, for the agent's status: open now, the most kept, opened so far."""
        with self.lock:
            return {"open": len(self._open), "max": self.max_open_fds, "opened": self.fd_opens}

    def local_fd(self, path: str, size: int, mtime_ns: int) -> int:
        """A new fd of a complete, unexpired replica of exactly this version of `path`, or -1: for
        the mount in this process, whose kernel then reads the replica file itself (passthrough).
        The fd keeps the file's data should the replica be evicted meanwhile."""
        with self.lock:
            rep = self.replicas.get(path)
            if (rep is None or rep.size != size or rep.source_mtime_ns != mtime_ns
                    or rep.expires_at <= self.clock.time()):
                return -1
            fd = self._fd(rep)
            if fd < 0:
                return -1
            rep.last_used = self.clock.monotonic()
            return os.dup(fd)

    def renew(self, rep: Replica, ttl_s: float) -> None:
        """(under `lock`) A copy asked for again: kept at least `ttl_s` more."""
        rep.expires_at = max(rep.expires_at, self.clock.time() + ttl_s)
        rep.last_used = self.clock.monotonic()
        if self.persistent:
            self.write_sidecar(rep)

    def write_sidecar(self, rep: Replica) -> None:
        persist.write_sidecar(rep.local, rep.path, rep.size, rep.source_mtime_ns, rep.expires_at, rep.record,
                              rep.holders)

    def hold(self, path: str, holder: str, ttl_s: float) -> bool:
        """`holder` (a mount's hint job) keeps the replica of `path` at least `ttl_s` more: its
        claim, beside the TTL every copy request sets. False: no replica here."""
        now = self.clock.time()
        with self.lock:
            rep = self.replicas.get(path)
            if rep is None:
                return False
            claims = rep.live_holders(now)
            claims[holder] = max(claims.get(holder, 0.0), now + ttl_s)
            if len(claims) > MAX_HOLDERS:      # bounded per replica: the claim that ends first goes
                del claims[min(claims, key=claims.__getitem__)]
            rep.holders = claims
            self.renew(rep, ttl_s)
        return True

    def unhold(self, path: str, holder: str) -> bool:
        """`holder` no longer needs the replica of `path` (its hint expired or was removed): it is
        dropped if that was the last live claim on it, kept while another holder's claim lasts (two
        jobs, or two hosts' mounts, hinted the same file). A replica `holder` never claimed (the
        tier's copy, another's) is not touched. True: dropped."""
        now = self.clock.time()
        with self.lock:
            rep = self.replicas.get(path)
            if rep is None or holder not in rep.holders:
                return False
            del rep.holders[holder]
            rep.holders = rep.live_holders(now)
            if rep.holders:
                if self.persistent:
                    self.write_sidecar(rep)
                return False
        return self.drop(path, only=rep)

    # -- in and out ------------------------------------------------------------------------------
    def replica_from(self, part: str, path: str, size: int, mtime_ns: int, ttl_s: float,
                     record: str | None) -> Replica:
        """A complete, verified part file (a copy's or a stream's) renamed to the replica of
        (size, mtime_ns) of `path`, with its sidecar in a persistent agent; `add_unless_removed`
        catalogs it."""
        local = self.local_name(path)
        st = os.stat(part)
        os.rename(part, local)
        rep = Replica(path, local, size, self.clock.time() + ttl_s, -1, mtime_ns, self.clock.monotonic(), record,
                      ino=(st.st_dev, st.st_ino))
        if self.persistent:
            self.write_sidecar(rep)
        return rep

    def add_unless_removed(self, rep: Replica) -> bool:
        """A finished copy's or stream's replica joins the catalog, unless a removal record newer
        than its version came meanwhile: then it is retired, and False."""
        with self.lock:
            removed = self._removed_since(rep)
            if not removed:
                self.replicas[rep.path] = rep
        if removed:
            self.retire(rep)
        return not removed

    def drop(self, path: str, only: Replica | None = None) -> bool:
        """Drop the replica of `path` (`only` that one: not a newer one cataloged since)."""
        with self.lock:
            rep = self.replicas.get(path)
            if rep is None or (only is not None and rep is not only):
                return False
            del self.replicas[path]
        self.retire(rep)
        return True

    def retire(self, rep: Replica) -> None:
        """Remove a replica's files; its fd closes now, or when the reads running on it end."""
        with self.lock:
            self._retire_fd(rep)
        for name in (rep.local + ".meta", rep.local):   # the description first: no orphan data is trusted
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass

    def expire(self) -> list[str]:
        """Drop the replicas whose TTL ran out; their paths."""
        now = self.clock.time()
        with self.lock:
            gone = [p for p, r in self.replicas.items() if r.expires_at <= now]
        for p in gone:
            self.drop(p)
            log.info("replica of %s reclaimed at TTL", p)
        return gone

    # -- the budget --------------------------------------------------------------------------------
    def keep(self, newest: frozenset[str], pinned: frozenset[str]) -> None:
        """The follower's word on its checkpoint folders: each job's newest complete one
        (`newest`, the likely next eval) and those still being copied (`pinned`: evicting their
        files would stall their completion). Eviction spares replicas below them (policy/tier.py)."""
        self._kept = (newest, pinned)

    def make_room(self, path: str, size: int, reserve: bool = False) -> None:
        """Evict replicas (policy/tier.py) so that `size` more bytes fit the budget, or ENOSPC;
        `reserve`: and count them (a stream's chunks, until its part is handed over)."""
        with self.lock:
            need = self.used_bytes() + size - self.budget
            if need <= 0:
                if reserve:
                    self.replicas.reserve(size)
                return
            now = self.clock.time()
            newest, pinned = self._kept
            entries = [TierEntry(p, r.size, r.last_used, r.expires_at <= now, _under(p, newest), _under(p, pinned))
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

    # StreamBudget (hintfs/agent/streams.py): stream chunks count in the budget beside replicas.
    def reserve(self, nbytes: int, path: str) -> None:
        self.make_room(path, nbytes, reserve=True)

    def release(self, nbytes: int) -> None:
        with self.lock:
            self.replicas.release(nbytes)

    # -- removals --------------------------------------------------------------------------------
    def removed_from_store(self, removals: list[tuple[str, int]]) -> list[str]:
        """Journal records (`hintfs.common.journal.removed_record`) say each path, a file or a folder,
        left the store at its time (unlinked, renamed away): drop the replicas of it and under it
        made from an earlier version, and remember it, so that a copy or stream of such a version
        finishing later is not cataloged either. One pass over the replicas for all of them (a
        deleted checkpoint is a record per file). The replicas looked at are those at or under the
        removed paths (`ReplicaCatalog.under`), not every replica: rounds with removals come 20
        times a second while jobs delete old steps. The paths dropped."""
        with self.lock:
            batch = self._removed.note_round(removals)
            gone = []
            for p in sorted({q for path, _t in removals for q in self.replicas.under(path)}):
                rep = self.replicas[p]
                t = batch.newest(p)
                if t is not None and made_before(rep, t):
                    gone.append(rep)
        dropped = [rep.path for rep in gone if self.drop(rep.path, only=rep)]
        for p in dropped:
            log.info("replica of %s dropped: the store removed it", p)
        return dropped

    def version_removed(self, path: str, version: tuple[int, int]) -> bool:
        """(under `lock`) A removal record of `path` or a folder above it is newer than `version`
        by its store mtime: a version still on its way here (a copy, a stream, one a journal
        record announced) that the store no longer has (`hintfs.agent.tier.TierView`)."""
        t = self._removed.newest(path)
        return t is not None and int(version[1]) < t

    def _removed_since(self, rep: Replica) -> bool:
        """(under `lock`) A removal record of the replica's path or a folder above it is newer
        than the version it holds."""
        t = self._removed.newest(rep.path)
        return t is not None and made_before(rep, t)

    # -- restarts ----------------------------------------------------------------------------------
    def adopt(self, folder: str) -> int:
        """The replicas of a stopped agent's `folder` (`persist.adopt_stopped_instances`): every
        one with a sidecar, the right size and time left moves here, unless this catalog has its
        version or a newer one. How many."""
        now = self.clock.time()
        adopted = 0
        for name, data, meta in persist.descriptions(folder, ".meta"):
            try:
                if os.path.getsize(data) != int(meta["size"]) or float(meta["expires_at"]) <= now:
                    continue
                path = str(meta["path"])
                old = self.replicas.get(path)
                if old is not None and old.source_mtime_ns >= int(meta["mtime_ns"]):
                    continue
                local = self.local_name(path)
                st = os.stat(data)
                os.rename(data, local)
                rep = Replica(path, local, int(meta["size"]), float(meta["expires_at"]), -1,
                              int(meta["mtime_ns"]), self.clock.monotonic(), meta.get("record"),
                              persist.holders_of(meta), ino=(st.st_dev, st.st_ino))
                self.write_sidecar(rep)
                with self.lock:
                    if old is not None:        # its file was just renamed over: never read again
                        self._retire_fd(old)
                    self.replicas[path] = rep
                adopted += 1
            except (OSError, ValueError, KeyError) as err:
                log.warning("not adopting %s from %s: %s", name, folder, err)
        return adopted

    def close(self) -> None:
        """A persistent agent closes its replicas' fds (the files stay for the next agent);
        another leaves them to its folder's removal."""
        if self.persistent:
            with self.lock:
                for r in list(self._open.values()):
                    self._close_fd(r)
                self.replicas.clear()

    # -- status ----------------------------------------------------------------------------------
    def status(self, listed: bool = True) -> tuple[dict[str, ReplicaStatus], int, BudgetStatus]:
        """(each replica's status, or none unless `listed`; how many there are; the budget). Plain
        values are taken under the lock, the models made after it (at 11,000 replicas: ~6 ms
        under the lock, not ~75: copies, streams and reads wait for it)."""
        now = self.clock.time()
        with self.lock:
            rows = ([(p, r.size, r.expires_at, len(r.live_holders(now)) if r.holders else 0)
                     for p, r in self.replicas.items()] if listed else [])
            count = len(self.replicas)
            budget = BudgetStatus(bytes=self.budget, used=self.used_bytes(), evictions=self.evictions)
        replicas = {p: ReplicaStatus(size=size, expires_in_s=round(at - now, 3), holders=holders)
                    for p, size, at, holders in rows}
        return replicas, count, budget


__all__ = ["ReplicaCatalog", "Catalog", "Replica", "made_before", "EVICT_HEADROOM"]

"""Cross-DC routes, the eval side: routed prefixes are served from a local tier, not across the WAN.

An eval mount's `[[routes]]` send paths under a prefix to a local tier agent. `RoutedStore` is the
one layer that does it, built by `fusefs/mount.py` only when there are routes. It is a `Store` over
the store: `stat` and `open_reader` of routed paths are answered from the tier, so that a lookup,
a getattr or an open of a checkpoint file the tier holds costs one loopback call instead of remote
round trips (100 ms each across datacenters; a DCP load opens a few files but walks several
folders). Everything else is passed to the store.

What the tier said is held in one place, `TierState` (its answers, with the time they came). A
reader of a routed file knows where its bytes come from (`fusefs.interfaces.Source`):

- ready (`TierReplicaReader`, source TIER): the tier holds a verified version (size + mtime of the
  store's file when it was copied): its attributes are served; data reads go to the tier's replica
  (blocks through `fusefs.replicaread`), and the reader can hand over a local fd of that replica
  when the tier agent is on this host (`local_socket`: FUSE passthrough). Its own `read` is only
  the fallback, and refuses a store file that is no longer that version.
- copying (`TierDemandReader`, source DEMAND): a copy is in flight (or a write-time stream was
  published and its last chunks are on the way); `stat` serves the version being copied and the
  open does not wait for the copy: each read asks the tier, which answers from what it holds of
  that version or fetches just those bytes from the store at once (hintfs/agent/demand.py,
  "demand-first"); the copy goes on, and the next open after it finished reads the tier's replica.
  If the tier cannot answer, the reads go to the store (of that version only).
- streaming: a training mount is sending the file and has not published it: the tier is asked to
  answer when it is published (at most `stream_wait_s`), then as above; its bytes are never served
  before, and after the wait the store answers (the older version, or no file). A read hint for
  such a file (or one the tier has not seen yet) is kept and sent when the file is opened while
  still arriving.
- dir: the tier holds files below the path, which is a folder.
- absent but expected (other files of its folder are being streamed in): a `stat` asks the store
  in a thread and the tier in short waits, the first answer wins (`_stat_race`; one thread per
  such stat, ended by the store's answer).
- absent, or the tier does not answer: the store's reader (source STORE), as without routes.

At each open of a routed file (`at_open`, after the close-to-open check) the layer settles the
source: a version the tier said it holds, or holds when asked now (`has`), is read from the tier
(`route_local`); any other is read as opened (`route_remote`) and the tier is asked to fetch it
(`fetch_on_read`). Time comes from the `clock` given (`hintfs.common.clock`: its monotonic seconds).

Consistency: routes are meant for write-once data (checkpoints). A routed file the tier holds is
served at the tier's version until the tier learns of a newer one (the follower copies each new
journaled version), so an overwrite in the remote store is seen with the journal's delay, not at
the next open. Everything else (writes, listings, paths outside the routes) goes to the store.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import stat as stat_mod
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Union
from collections.abc import Callable, Iterator, Sequence

import trio
from cachetools import LRUCache, TTLCache

from hintfs.agent.fdserver import TierSocket
from hintfs.common.clock import SYSTEM_CLOCK, Clock
from fusefs import workers
from fusefs.interfaces import Source
from fusefs.stats import Stats
from mountconfig.schema import RouteConfig
from hintfs.stores.base import Reader, Stat, Staging, StatxDirFactory, Store

if TYPE_CHECKING:
    from hintfs.agent.client import AgentClient
    from hintfs.agent.rpc import TierStatReply

log = logging.getLogger("hintfs.routes")

ROUTED_TTL_S = 86400.0      # a copy fetched because an eval read it lives a day at the tier
READY_MEMORY_S = 1.0        # a "ready" answer serves the lookup, open and routing of one file open
ANSWERS_MAX = 1 << 16       # tier answers remembered (paths)
APPEAR_WAIT_S = 5.0         # a stat waits at most this long for a file expected at the tier ...
APPEAR_SLICE_S = 0.02       # ... in tier calls this long, checking for the store's answer between
LATER_HINTS_S = 60.0        # a read hint for a file the tier is not receiving yet is kept this long ...
LATER_HINTS_MAX = 4096      # ... for at most this many files
EVAL_IMPORTANCE = 2.0       # an eval is waiting: twice the weight of predictive copies on the link
TIER_DOWN_LOG_S = 30.0      # "local tier unavailable" is logged once per agent this often
LOCAL_FDS_MAX = 4           # distinct files (the stream's part; the replica, when another) one reader keeps

Version = tuple[int, int]
# What a local tier said about a path: its reply (read like a dict: hintfs.agent.rpc.Reply), or a
# dict of the same keys made here ({"state": "absent"}, a "ready" learned from `has`)
TierAnswer = Union[dict, "TierStatReply"]  # noqa: UP007  (a string member: imported for typing only)
# (socket, path, size, mtime_ns) -> an fd of the tier's complete replica of that version, or -1
ReplicaFdFetch = Callable[[TierSocket, str, int, int], int]
# (socket, path, size, mtime_ns) -> (fd, None) of the complete replica, (fd, verified runs) of a
# published stream still filling, or (-1, None)
TierBytesFetch = Callable[[TierSocket, str, int, int], tuple[int, list[tuple[int, int]] | None]]

_DIR = Stat(stat_mod.S_IFDIR | 0o755, 0, 0, 0, 2)


def route_of(routes: Sequence[RouteConfig], path: str) -> RouteConfig | None:
    """The first route whose prefix is `path` or a folder above it, or None."""
    return next((r for r in routes if path == r.prefix or path.startswith(r.prefix.rstrip("/") + "/")), None)


def _version(doc: TierAnswer) -> Version:
    return int(doc["size"]), int(doc["mtime_ns"])


class TierState:
    """What the local tiers said, held once: the last answer about each path, with when it came;
    the fetches asked for; the read hints kept for files not arriving yet. Thread-safe (stats run
    in worker threads)."""

    def __init__(self, clock: Clock):
        self.clock = clock.monotonic
        self._lock = threading.Lock()
        self._answers: LRUCache = LRUCache(maxsize=ANSWERS_MAX)   # path -> (tier_stat doc, when)
        self.fetching: set[str] = set()                          # (trio loop only)
        self._later_hints: TTLCache = TTLCache(maxsize=LATER_HINTS_MAX, ttl=LATER_HINTS_S, timer=clock.monotonic)
        self._warned: dict[str, float] = {}

    def answered(self, path: str, doc: TierAnswer) -> None:
        with self._lock:
            self._answers[path] = (doc, self.clock())

    def fresh(self, path: str) -> TierAnswer | None:
        """The tier's "ready" answer for `path` if it came within READY_MEMORY_S: one file open is
        a lookup, an open and the routing check within milliseconds; each would be a call to the
        tier otherwise."""
        with self._lock:
            hit = self._answers.get(path)
        if hit is None or hit[0]["state"] != "ready" or self.clock() - hit[1] >= READY_MEMORY_S:
            return None
        answer: TierAnswer = hit[0]
        return answer

    def holds(self, path: str, version: Version) -> bool:
        """The tier's last answer about `path` was that it holds exactly this version."""
        with self._lock:
            hit = self._answers.get(path)
        return hit is not None and hit[0]["state"] == "ready" and _version(hit[0]) == version

    def hint_later(self, path: str, ranges: list[tuple[int, int]]) -> None:
        with self._lock:
            self._later_hints[path] = list(ranges)

    def take_later_hint(self, path: str) -> list[tuple[int, int]] | None:
        with self._lock:
            return self._later_hints.pop(path, None)

    def should_warn(self, agent: str) -> bool:
        """Whether "tier `agent` unavailable" is due in the log (not once per lookup)."""
        now = self.clock()
        with self._lock:
            if now - self._warned.get(agent, -1e18) <= TIER_DOWN_LOG_S:
                return False
            self._warned[agent] = now
            return True


class StoreFallbackReader:
    """Reads the store's copy of one version, opened only if someone reads through it (reads from
    the tier failed over): ESTALE once the store has another version."""

    def __init__(self, store: Store, path: str, identity: Version):
        self.store, self.path, self.identity = store, path, identity
        self.reader: Reader | None = None

    def read(self, offset: int, size: int) -> bytes:
        if self.reader is None:
            reader, st = self.store.open_reader(self.path)
            if st.identity() != self.identity:
                reader.close()
                raise OSError(errno.ESTALE, f"{self.path} changed in the store since the local tier copied it")
            self.reader = reader
        return self.reader.read(offset, size)

    def read_nowait(self, offset: int, size: int):
        return None

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


class TierReplicaReader:
    """A routed file the tier holds whole at this version (source TIER): its reads go to the tier's
    replica (`location`, through the replica reads); `read` here is their fallback (`fallback`: the
    store's copy of that version). With the tier agent on this host, `local_fd` hands over an fd
    of the replica itself (blocking: a worker thread)."""
    source = Source.TIER

    def __init__(self, path: str, identity: Version, location: str, fallback: Reader,
                 socket: TierSocket | None = None, fetch_fd: ReplicaFdFetch | None = None):
        self.path, self.identity, self.location, self.fallback = path, identity, location, fallback
        self._socket, self._fetch_fd = socket, fetch_fd

    def local_fd(self) -> int:
        if self._socket is None or self._fetch_fd is None:
            return -1
        return self._fetch_fd(self._socket, self.path, *self.identity)

    def read(self, offset: int, size: int) -> bytes:
        return self.fallback.read(offset, size)

    def read_nowait(self, offset: int, size: int):
        return None

    def close(self) -> None:
        self.fallback.close()


class TierDemandReader:
    """Reads of a routed file the tier is still receiving (source DEMAND): each read is one call to
    the tier (demand read of the version opened); if the tier cannot answer, the store copy of that
    version.

    With a tier agent on this host (`local`: its fd socket), a read first looks at the tier's
    bytes itself: the replica once it is complete, or the runs of the published stream verified
    so far (`hintfs.agent.fdserver`). Those are read with `pread`, not one Flight call each; a read they
    do not cover asks the socket again (one unix round trip), then the tier by Flight."""
    source = Source.DEMAND

    def __init__(self, client: AgentClient, store: Store, path: str, identity: Version, stats: Stats,
                 local: Callable[[], tuple[int, list[tuple[int, int]] | None]] | None = None):
        self.client, self.path, self.identity, self.stats = client, path, identity, stats
        self.fallback = StoreFallbackReader(store, path, identity)
        self.tier_failed = False
        self.local = local
        self._lock = threading.Lock()     # reads of one open file run in several threads
        self._fds: dict[tuple[int, int], int] = {}   # (dev, inode) -> fd, closed only at close()
        self._current = -1                # the fd of the newest answer, and what it covers:
        self._runs: list[tuple[int, int]] = []
        self._whole = False               # the complete replica

    def local_fd(self) -> int:
        return -1                         # not complete: nothing the kernel may read by itself

    def _covered(self, offset: int, end: int) -> int | None:
        """(under _lock) An fd holding [offset, end) of the version opened, or None."""
        if self._current < 0:
            return None
        if self._whole or any(o <= offset and end <= o + n for o, n in self._runs):
            return self._current
        return None

    def _ask_local(self) -> None:
        assert self.local is not None
        fd, runs = self.local()
        if fd < 0:
            return
        st = os.fstat(fd)
        inode = (st.st_dev, st.st_ino)
        with self._lock:
            known = self._fds.get(inode)
            if known is not None:
                os.close(fd)              # the same file as before (a read may be using that fd)
                fd = known
            elif len(self._fds) >= LOCAL_FDS_MAX:
                os.close(fd)
                return
            else:
                self._fds[inode] = fd
            self._current, self._whole, self._runs = fd, runs is None, runs or []

    def _read_local(self, offset: int, size: int) -> bytes | None:
        end = min(offset + size, self.identity[0])
        if end <= offset:
            return b""
        for attempt in range(2):
            with self._lock:
                fd = self._covered(offset, end)
            if fd is not None:
                return os.pread(fd, end - offset, offset)
            if attempt == 0:
                self._ask_local()
        return None

    def read(self, offset: int, size: int) -> bytes:
        if self.local is not None:       # (even after a failed Flight call: the replica may be here now)
            try:
                data = self._read_local(offset, size)
            except OSError as err:
                log.info("cannot read the local tier's bytes of %s (asking it by Flight): %s", self.path, err)
                data = None
            if data is not None:
                self.stats.add("route_demand_local_reads")
                return data
        if not self.tier_failed:
            try:
                got = self.client.read(self.path, offset, size, replica_only=True, expect=self.identity,
                                       demand=True)
                self.stats.add("route_demand_reads")
                return got
            except OSError as err:
                self.tier_failed = True    # the copy failed, the tier went away: not asked again
                log.warning("local tier cannot serve %s while it arrives (reading the store): %s", self.path, err)
        self.stats.add("route_demand_store_reads")
        return self.fallback.read(offset, size)

    def read_nowait(self, offset: int, size: int):
        return None

    def close(self) -> None:
        self.fallback.close()
        with self._lock:
            fds, self._fds, self._current = list(self._fds.values()), {}, -1
        for fd in fds:
            os.close(fd)


class RoutedStore:
    """A `Store`: routed paths' `stat` and `open_reader` from the local tier, the rest the store's;
    `at_open` settles where an open's reads go. Collaborators: the agent clients by location, the
    fd fetches of a tier agent on this host (`hintfs.agent.fdserver`), the filesystem's limiter of
    blocking calls, and the clock."""

    def __init__(self, store: Store, routes: Sequence[RouteConfig], clients: dict[str, AgentClient], stats: Stats, *,
                 io_limiter: trio.CapacityLimiter | None = None,
                 fetch_fd: ReplicaFdFetch | None = None, tier_bytes: TierBytesFetch | None = None,
                 clock: Clock = SYSTEM_CLOCK):
        self._store = store
        self.routes = list(routes)
        self.clients = clients            # location -> hintfs.agent.client.AgentClient (blocking)
        self.stats = stats
        self.io_limiter = io_limiter or trio.CapacityLimiter(8)   # tier calls are store-like blocking I/O
        self.fetch_fd = fetch_fd          # a complete replica's fd from a tier agent on this host
        self.tier_bytes = tier_bytes      # the bytes it holds so far of a file still arriving
        self.clock = clock.monotonic
        self.state = TierState(clock)
        # A stat may be a call to the tier agent: never inline in the trio loop.
        self.inline_metadata = False
        # A routed file is read from the tier's replica: by passthrough when the tier agent is on
        # this host and hands its fds out (`local_socket`); other files as the store allows.
        self.passthrough_capable = store.passthrough_capable or any(r.local_socket for r in self.routes)
        self.inode_numbers = store.inode_numbers
        self.description = store.description

    def routes_path(self, path: str) -> bool:
        return route_of(self.routes, path) is not None

    def local_socket_of(self, path: str) -> TierSocket | None:
        """The fd socket of the tier agent on this host for `path`, with the uid that agent runs
        as (`hintfs.agent.fdserver` checks both before it takes an fd); None without one."""
        route = route_of(self.routes, path)
        if route is None or not route.local_socket:
            return None
        return TierSocket(route.local_socket, route.local_socket_uid)

    # -- not routed: the store's --------------------------------------------------------------
    def check(self) -> None:
        self._store.check()

    def refuse_device(self, st_dev: int, statx_dir: StatxDirFactory | None = None) -> None:
        self._store.refuse_device(st_dev, statx_dir)

    def iter_dir(self, rel: str) -> Iterator[tuple[str, Stat]]:
        return self._store.iter_dir(rel)

    @property
    def lists_after(self) -> bool:
        return self._store.lists_after

    def iter_dir_after(self, rel: str, after: str) -> Iterator[tuple[str, Stat]]:
        return self._store.iter_dir_after(rel, after)

    def readlink(self, rel: str) -> str:
        return self._store.readlink(rel)

    def symlink(self, rel: str, target: str) -> None:
        self._store.symlink(rel, target)

    def mknod(self, rel: str, mode: int, rdev: int) -> None:
        self._store.mknod(rel, mode, rdev)

    def link(self, src: str, dst: str) -> None:
        self._store.link(src, dst)

    def mkdir(self, rel: str, mode: int) -> None:
        self._store.mkdir(rel, mode)

    def rmdir(self, rel: str) -> None:
        self._store.rmdir(rel)

    def unlink(self, rel: str) -> None:
        self._store.unlink(rel)

    def rename(self, src: str, dst: str, noreplace: bool) -> None:
        self._store.rename(src, dst, noreplace)

    def chmod(self, rel: str, mode: int) -> None:
        self._store.chmod(rel, mode)

    def chown(self, rel: str, uid: int, gid: int) -> None:
        self._store.chown(rel, uid, gid)

    def utimens(self, rel: str, atime_ns: int, mtime_ns: int) -> None:
        self._store.utimens(rel, atime_ns, mtime_ns)

    def statfs(self):
        return self._store.statfs()

    def new_staging(self, rel: str, copy_existing: bool, source: Staging | None = None) -> Staging:
        return self._store.new_staging(rel, copy_existing, source)

    def commit(self, staging: Staging, rel: str, keep: bool = False) -> Stat:
        return self._store.commit(staging, rel, keep)

    def discard(self, staging: Staging) -> None:
        self._store.discard(staging)

    def unname(self, staging: Staging) -> None:
        self._store.unname(staging)

    def follow(self, staging: Staging, rel: str) -> None:
        self._store.follow(staging, rel)

    def nameless_copy(self, staging: Staging) -> Staging:
        return self._store.nameless_copy(staging)

    def put_small(self, rel: str, data: bytes) -> None:
        self._store.put_small(rel, data)

    # -- routed ---------------------------------------------------------------------------------
    def _tier(self, path: str, appear_s: float = 0.0) -> tuple[AgentClient | None, TierAnswer]:
        route = route_of(self.routes, path)
        if route is None:
            return None, {"state": "absent"}
        client = self.clients[route.local_agent]
        doc = self.state.fresh(path)
        if doc is not None:
            return client, doc
        try:
            doc = client.tier_stat(path, route.stream_wait_s, appear_s)
        except OSError as err:
            if self.state.should_warn(route.local_agent):
                log.warning("local tier %s unavailable (reading the store): %s", route.local_agent, err)
            self.stats.add("route_tier_down")
            return None, {"state": "absent"}
        if doc["state"] == "streaming":
            self.stats.add("route_stream_unpublished")
        self.state.answered(path, doc)
        return client, doc

    @staticmethod
    def _file(doc: TierAnswer) -> Stat:
        return Stat(stat_mod.S_IFREG | 0o644, int(doc["size"]), int(doc["mtime_ns"]), int(doc["mtime_ns"]))

    def stat(self, rel: str) -> Stat:
        _client, doc = self._tier(rel)
        if doc["state"] == "absent" and doc.get("expected"):
            return self._stat_race(rel)
        return self._stat_of(rel, doc)

    def current(self, rel: str) -> Stat:
        """As `open_reader`'s Stat would be, without opening: a routed file the tier holds is its
        version there; any other, the store's `current`."""
        _client, doc = self._tier(rel)
        if doc["state"] in ("ready", "copying"):
            return self._file(doc)
        return self._store.current(rel)

    def _stat_race(self, rel: str) -> Stat:
        """The tier lacks `rel` but its folder is being streamed in: the file may be a few
        milliseconds away (a commit marker closed on the training side reaches the tier in one
        WAN trip, its store stat needs a round trip). Ask the store in a thread and the tier in
        short waits; the first to know the file answers. A store that says it does not exist
        answers too: the tier only holds what the store published."""
        store_stat: Future[Stat] = Future()

        def ask_store() -> None:
            try:
                store_stat.set_result(self._store.stat(rel))
            except BaseException as err:   # handed to the caller by result()
                store_stat.set_exception(err)

        threading.Thread(target=ask_store, name="route-stat", daemon=True).start()
        deadline = self.clock() + APPEAR_WAIT_S
        doc: TierAnswer = {"state": "absent", "expected": True}
        while not store_stat.done() and doc["state"] == "absent" and doc.get("expected") \
                and self.clock() < deadline:
            _client, doc = self._tier(rel, APPEAR_SLICE_S)
        if doc["state"] not in ("absent", "streaming"):
            self.stats.add("route_stat_race_tier")
            return self._stat_of(rel, doc)
        self.stats.add("route_stat_race_store")
        return store_stat.result()   # bounded by the store's own timeouts, as a stat without the race

    def _stat_of(self, rel: str, doc: TierAnswer) -> Stat:
        state = doc["state"]
        if state in ("ready", "copying"):
            self.stats.add("route_tier_stat")
            return self._file(doc)
        if state == "dir":
            self.stats.add("route_tier_stat")
            return _DIR
        return self._store.stat(rel)

    def prefetch(self, files: dict[str, list[tuple[int, int]]]) -> int:
        """Read hints: for each routed file the tier is still receiving, ask it to fetch these
        ranges at once (blocking: a worker thread). How many pieces the tiers started (a file
        without a version at the tier yet counts 0: its pieces start at its publish). A file the
        tier holds whole is told too: the tier remembers what eval jobs read, and the next
        checkpoint's stream sends those chunks first (hintfs/agent/readmemory.py)."""
        n = 0
        for path, ranges in files.items():
            route = route_of(self.routes, path)
            if route is None:
                continue
            client = self.clients[route.local_agent]
            try:
                doc = client.tier_stat(path)   # no wait: an unpublished stream has no version yet
                if doc["state"] in ("copying", "ready"):
                    n += client.prefetch(path, _version(doc), ranges)
                elif doc["state"] in ("streaming", "absent"):
                    # No version there yet: the tier holds the hint and fetches when the publish
                    # (or the journal record) announces one; and it is sent again when the file
                    # is opened still arriving (a tier that dropped it still gets it then).
                    self.state.hint_later(path, ranges)
                    n += client.prefetch(path, None, ranges)
            except OSError as err:
                log.info("read hint for %s not forwarded to the tier: %s", path, err)
        return n

    def _forward_later_hint(self, client, path: str, identity: Version) -> None:
        """A file hinted before the tier was receiving it is opened: while arriving, the hint's
        ranges are fetched now, all at once, instead of one read after another; complete, the
        tier only learns them. (A hint dropped here was lost for the next checkpoint's order:
        files completed sooner once the publish stopped waiting for its last chunks.)"""
        ranges = self.state.take_later_hint(path)
        if ranges is None:
            return
        try:
            client.prefetch(path, identity, ranges)
            self.stats.add("route_hints_at_open")
        except OSError as err:
            log.info("read hint for %s not forwarded to the tier: %s", path, err)

    def open_reader(self, rel: str, lazy: bool = False) -> tuple[Reader, Stat]:
        client, doc = self._tier(rel)
        if doc["state"] == "copying" and client is not None:   # (no client: "absent")
            # Demand-first: reads do not wait for the whole file (hintfs/agent/demand.py).
            self.stats.add("route_demand_opens")
            st = self._file(doc)
            self._forward_later_hint(client, rel, st.identity())
            sock = self.local_socket_of(rel) if self.tier_bytes is not None else None
            local = (functools.partial(self.tier_bytes, sock, rel, *st.identity())
                     if sock is not None and self.tier_bytes is not None else None)
            return TierDemandReader(client, self._store, rel, st.identity(), self.stats, local), st
        if doc["state"] == "ready":
            st = self._file(doc)
            # complete by now: nothing to fetch, but the tier learns what eval jobs read of it,
            # and sends those chunks of the next checkpoint's file first (hintfs/agent/readmemory.py)
            self._forward_later_hint(client, rel, st.identity())
            return self._tier_replica(rel, st.identity(), StoreFallbackReader(self._store, rel, st.identity())), st
        return self._store.open_reader(rel)

    def _tier_replica(self, path: str, identity: Version, fallback: Reader) -> TierReplicaReader:
        route = route_of(self.routes, path)
        assert route is not None
        return TierReplicaReader(path, identity, route.local_agent, fallback, self.local_socket_of(path), self.fetch_fd)

    # -- at open --------------------------------------------------------------------------------
    async def at_open(self, path: str, reader: Reader, st: Stat) -> Reader:
        """A routed file is being opened for reading (after `open_reader` and the close-to-open
        check): the reader its reads go through. A version the tier holds is read from the tier
        (a `TierReplicaReader`: the one just opened, or one over it when the tier holds the
        version by now); any other as opened, and the tier is asked to fetch it."""
        route = route_of(self.routes, path)
        if route is None:
            return reader
        identity = st.identity()
        local = isinstance(reader, TierReplicaReader) or self.state.holds(path, identity)
        if not local:
            try:
                local = await workers.run_sync(self.clients[route.local_agent].has, path, *identity,
                                               limiter=self.io_limiter)
            except OSError as err:
                log.warning("local tier %s unavailable for %s: %s", route.local_agent, path, err)
            if local:
                self.state.answered(path, {"state": "ready", "size": identity[0], "mtime_ns": identity[1]})
        if local:
            self.stats.add("route_local")
            return reader if isinstance(reader, TierReplicaReader) else self._tier_replica(path, identity, reader)
        self.stats.add("route_remote")
        if route.fetch_on_read and path not in self.state.fetching:
            self.state.fetching.add(path)
            trio.lowlevel.spawn_system_task(self._fetch_to_local_tier, self.clients[route.local_agent], path)
        return reader

    async def _fetch_to_local_tier(self, client, path: str) -> None:
        try:
            # An eval is waiting for this file: eval class, twice the weight of predictive copies.
            job = "/".join(path.split("/")[:-2])
            await workers.run_sync(functools.partial(client.replicate, path, ttl_s=ROUTED_TTL_S,
                                                     priority="eval", job=job, importance=EVAL_IMPORTANCE),
                                   limiter=self.io_limiter)
            self.stats.add("route_fetches")
        except OSError as err:
            log.warning("local tier fetch of %s failed: %s", path, err)
        finally:
            self.state.fetching.discard(path)


__all__ = ["RoutedStore", "TierState", "TierReplicaReader", "TierDemandReader", "StoreFallbackReader", "route_of"]

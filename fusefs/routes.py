"""Cross-DC routes, the eval side: routed prefixes are served from a local tier, not across the WAN.

An eval mount's `[[routes]]` send paths under a prefix to a local tier agent. Two layers, both
built by `fusefs/mount.py` only when there are routes:

- `TierRouting` (the filesystem's `OpenRouting`): at each open of a routed file, ask the tier
  whether it holds exactly this version; if so its reads go to the tier (through the replica
  router), else they read through and the tier is asked to fetch the file (`fetch_on_read`).
- `RoutedStore` (a `Store` over the store): answers `stat` and `open_reader` of routed paths
  from the tier, so that a lookup, a getattr or an open of a checkpoint file the tier holds costs
  one loopback call instead of remote round trips (100 ms each across datacenters; a DCP load
  opens a few files but walks several folders). Everything else is passed to the store.

- ready: the tier holds a verified version (size + mtime of the store's file when it was copied):
  its attributes are served; data reads go to the tier (the lazily opened store reader is only the
  fallback, and refuses a store file that is no longer that version).
- copying: a copy is in flight (or a write-time stream was published and its last chunks are on
  the way); `stat` serves the version being copied and the open does not wait for the copy: each
  read asks the tier (`_TierDemandReader`), which answers from what it holds of that version or
  fetches just those bytes from the store at once (agent/demand.py, "demand-first"); the copy goes
  on, and the next open after it finished reads the tier's replica. If the tier cannot answer, the
  reads go to the store (of that version only).
- streaming: a training mount is sending the file and has not published it: the tier is asked to
  answer when it is published (at most `stream_wait_s`), then as above; its bytes are never served
  before, and after the wait the store answers (the older version, or no file). A read hint for
  such a file (or one the tier has not seen yet) is kept and sent when the file is opened while
  still arriving.
- dir: the tier holds files below the path, which is a folder.
- absent but expected (other files of its folder are being streamed in): a `stat` asks the store
  in a thread and the tier in short waits, the first answer wins (`_stat_race`; one thread per
  such stat, ended by the store's answer).
- absent, or the tier does not answer: the store, as without routes.

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
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable, Iterator, Optional

import trio

from agent.fdserver import TierSocket
from fusefs.hints import ReplicaRouter
from fusefs.stats import Stats
from stores.base import Stat, Staging, Store

log = logging.getLogger("hintfs.routes")

ROUTED_TTL_S = 86400.0      # a copy fetched because an eval read it lives a day at the tier
READY_MEMORY_S = 1.0        # a "ready" answer serves the lookup, open and routing of one file open
APPEAR_WAIT_S = 5.0         # a stat waits at most this long for a file expected at the tier ...
APPEAR_SLICE_S = 0.02       # ... in tier calls this long, checking for the store's answer between
LATER_HINTS_S = 60.0        # a read hint for a file the tier is not receiving yet is kept this long ...
LATER_HINTS_MAX = 4096      # ... for at most this many files
EVAL_IMPORTANCE = 2.0       # an eval is waiting: twice the weight of predictive copies on the link

_DIR = Stat(stat_mod.S_IFDIR | 0o755, 0, 0, 0, 2)


class _StoreFallbackReader:
    """Reads the store copy only if someone reads through it (replica reads failed over)."""

    def __init__(self, store, path: str, identity: tuple[int, int]):
        self.store, self.path, self.identity = store, path, identity
        self.reader = None

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


LOCAL_FDS_MAX = 4   # distinct files (the stream's part; the replica, when another) one reader keeps


class _TierDemandReader:
    """Reads of a routed file the tier is still receiving: each read is one call to the tier
    (demand read of the version opened); if the tier cannot answer, the store copy of that version.

    With a tier agent on this host (`local`: its fd socket), a read first looks at the tier's
    bytes itself: the replica once it is complete, or the runs of the published stream verified
    so far (`agent.fdserver`). Those are read with `pread`, not one Flight call each; a read they
    do not cover asks the socket again (one unix round trip), then the tier by Flight."""

    def __init__(self, client, store, path: str, identity: tuple[int, int], stats: Stats,
                 local: Optional[Callable[[], tuple[int, Optional[list[tuple[int, int]]]]]] = None):
        self.client, self.path, self.identity, self.stats = client, path, identity, stats
        self.fallback = _StoreFallbackReader(store, path, identity)
        self.tier_failed = False
        self.local = local
        self._lock = threading.Lock()     # reads of one open file run in several threads
        self._fds: dict[tuple[int, int], int] = {}   # (dev, inode) -> fd, closed only at close()
        self._current = -1                # the fd of the newest answer, and what it covers:
        self._runs: list[tuple[int, int]] = []
        self._whole = False               # the complete replica

    def _covered(self, offset: int, end: int) -> Optional[int]:
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

    def _read_local(self, offset: int, size: int) -> Optional[bytes]:
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
                data = self.client.read(self.path, offset, size, True, self.identity, demand=True)
                self.stats.add("route_demand_reads")
                return data
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


def route_of(routes, path: str):
    """The first route whose prefix is `path` or a folder above it, or None."""
    return next((r for r in routes if path == r.prefix or path.startswith(r.prefix.rstrip("/") + "/")), None)


class TierRouting:
    """At open: serve a routed path from the local tier when it holds exactly this version
    (size and mtime verified by the agent); otherwise read through and ask it to fetch."""

    def __init__(self, routes, clients: dict, router: ReplicaRouter, stats: Stats,
                 io_limiter: trio.CapacityLimiter, view: Optional["RoutedStore"] = None):
        self.routes = list(routes)
        self.view = view                # its recent "ready" answers spare a `has` call per open
        self.clients = clients          # location -> agent.client.AgentClient
        self.router = router            # the replica router that replica reads follow
        self.stats = stats
        self.io_limiter = io_limiter    # the filesystem's: tier calls are store-like blocking I/O
        self._checked: dict[tuple, bool] = {}
        self._fetching: set[str] = set()

    async def _io(self, fn, *args):
        return await trio.to_thread.run_sync(fn, *args, limiter=self.io_limiter)

    async def on_open(self, path: str, st: Stat) -> None:
        route = route_of(self.routes, path)
        if route is None:
            return
        key = (path, st.identity())
        if self._checked.get(key):
            return
        client = self.clients[route.local_agent]
        if self.view is not None and self.view.recently_ready(path, st.identity()):
            local = True
        else:
            try:
                local = await self._io(client.has, path, st.size, st.mtime_ns)
            except OSError as err:
                log.warning("local tier %s unavailable for %s: %s", route.local_agent, path, err)
                local = False
        if local:
            self._checked[key] = True
            self.router.replicas[path] = [route.local_agent]
            self.stats.add("route_local")
            return
        self.router.replicas.pop(path, None)
        self.stats.add("route_remote")
        if route.fetch_on_read and path not in self._fetching:
            self._fetching.add(path)
            trio.lowlevel.spawn_system_task(self._fetch_to_local_tier, client, path)

    async def _fetch_to_local_tier(self, client, path: str) -> None:
        try:
            # An eval is waiting for this file: eval class, twice the weight of predictive copies.
            job = "/".join(path.split("/")[:-2])
            await self._io(functools.partial(client.replicate, path, ttl_s=ROUTED_TTL_S, priority="eval",
                                             job=job, importance=EVAL_IMPORTANCE))
            self.stats.add("route_fetches")
        except OSError as err:
            log.warning("local tier fetch of %s failed: %s", path, err)
        finally:
            self._fetching.discard(path)


class RoutedStore:
    """A `Store`: routed paths' `stat` and `open_reader` from the local tier, the rest the store's."""

    def __init__(self, store: Store, routes, clients: dict, stats: Stats):
        self._store = store
        self.routes = list(routes)
        self.clients = clients
        self.stats = stats
        # A stat may be a call to the tier agent: never inline in the trio loop.
        self.inline_metadata = False
        # A routed file is read from the tier's replica: by passthrough when the tier agent is on
        # this host and hands its fds out (`local_socket`); other files as the store allows.
        self.passthrough_capable = store.passthrough_capable or any(r.local_socket for r in self.routes)
        self.description = store.description
        self._warned: dict[str, float] = {}
        # path -> (tier_stat "ready" answer, when): one file open is a lookup, an open and the
        # routing check within milliseconds; each would be a call to the tier otherwise.
        self._ready: dict[str, tuple[dict, float]] = {}
        # Read hints for routed files the tier was not receiving yet (an unpublished stream, or
        # not there yet): path -> (ranges, when); forwarded when the file is opened as arriving.
        self._later_hints: "OrderedDict[str, tuple[list[tuple[int, int]], float]]" = OrderedDict()
        self._hints_lock = threading.Lock()
        # (socket, path, size, mtime_ns) -> the tier's bytes on this host (`agent.fdserver`
        # `receive_tier_bytes`); set by `fusefs.mount.assemble` when a route has a local socket.
        self.tier_bytes: Optional[Callable[[TierSocket, str, int, int],
                                           tuple[int, Optional[list[tuple[int, int]]]]]] = None

    # -- not routed: the store's --------------------------------------------------------------
    def check(self) -> None:
        self._store.check()

    def local_socket_of(self, path: str) -> Optional[TierSocket]:
        """The fd socket of the tier agent on this host for `path`, with the uid that agent runs
        as (`agent.fdserver` checks both before it takes an fd); None without one."""
        route = route_of(self.routes, path)
        if route is None or not route.local_socket:
            return None
        return TierSocket(route.local_socket, route.local_socket_uid)

    def refuse_device(self, st_dev: int) -> None:
        self._store.refuse_device(st_dev)

    def iter_dir(self, rel: str) -> Iterator[tuple[str, Stat]]:
        return self._store.iter_dir(rel)

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

    def new_staging(self, rel: str, copy_existing: bool) -> Staging:
        return self._store.new_staging(rel, copy_existing)

    def commit(self, staging: Staging, rel: str, keep: bool = False) -> Stat:
        return self._store.commit(staging, rel, keep)

    def discard(self, staging: Staging) -> None:
        self._store.discard(staging)

    def put_small(self, rel: str, data: bytes) -> None:
        self._store.put_small(rel, data)

    # -- routed ---------------------------------------------------------------------------------

    def recently_ready(self, path: str, identity: tuple[int, int]) -> bool:
        """The tier said "ready" for exactly this version of `path` within READY_MEMORY_S."""
        hit = self._ready.get(path)
        return (hit is not None and time.monotonic() - hit[1] < READY_MEMORY_S
                and (int(hit[0]["size"]), int(hit[0]["mtime_ns"])) == identity)

    def _tier(self, path: str, appear_s: float = 0.0) -> tuple[Optional[object], dict]:
        route = route_of(self.routes, path)
        if route is None:
            return None, {"state": "absent"}
        client = self.clients[route.local_agent]
        hit = self._ready.get(path)
        if hit is not None and time.monotonic() - hit[1] < READY_MEMORY_S:
            return client, hit[0]
        try:
            doc = client.tier_stat(path, route.stream_wait_s, appear_s)
            if doc["state"] == "streaming":
                self.stats.add("route_stream_unpublished")
            if doc["state"] == "ready":
                if len(self._ready) > 4096:
                    self._ready.clear()
                self._ready[path] = (doc, time.monotonic())
            else:
                self._ready.pop(path, None)
            return client, doc
        except OSError as err:
            now = time.monotonic()
            if now - self._warned.get(route.local_agent, -1e9) > 30:   # not once per lookup
                self._warned[route.local_agent] = now
                log.warning("local tier %s unavailable (reading the store): %s", route.local_agent, err)
            self.stats.add("route_tier_down")
            return None, {"state": "absent"}

    @staticmethod
    def _file(doc: dict) -> Stat:
        return Stat(stat_mod.S_IFREG | 0o644, int(doc["size"]), int(doc["mtime_ns"]), int(doc["mtime_ns"]))

    def stat(self, rel: str) -> Stat:
        _client, doc = self._tier(rel)
        if doc["state"] == "absent" and doc.get("expected"):
            return self._stat_race(rel)
        return self._stat_of(rel, doc)

    def _stat_race(self, rel: str) -> Stat:
        """The tier lacks `rel` but its folder is being streamed in: the file may be a few
        milliseconds away (a commit marker closed on the training side reaches the tier in one
        WAN trip, its store stat needs a round trip). Ask the store in a thread and the tier in
        short waits; the first to know the file answers. A store that says it does not exist
        answers too: the tier only holds what the store published."""
        store_stat: Future = Future()

        def ask_store() -> None:
            try:
                store_stat.set_result(self._store.stat(rel))
            except BaseException as err:   # handed to the caller by result()
                store_stat.set_exception(err)

        threading.Thread(target=ask_store, name="route-stat", daemon=True).start()
        deadline = time.monotonic() + APPEAR_WAIT_S
        doc: dict = {"state": "absent", "expected": True}
        while not store_stat.done() and doc["state"] == "absent" and doc.get("expected") \
                and time.monotonic() < deadline:
            _client, doc = self._tier(rel, APPEAR_SLICE_S)
        if doc["state"] not in ("absent", "streaming"):
            self.stats.add("route_stat_race_tier")
            return self._stat_of(rel, doc)
        self.stats.add("route_stat_race_store")
        return store_stat.result()   # bounded by the store's own timeouts, as a stat without the race

    def _stat_of(self, rel: str, doc: dict) -> Stat:
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
        checkpoint's stream sends those chunks first (agent/readmemory.py)."""
        n = 0
        for path, ranges in files.items():
            route = route_of(self.routes, path)
            if route is None:
                continue
            client = self.clients[route.local_agent]
            try:
                doc = client.tier_stat(path)   # no wait: an unpublished stream has no version yet
                if doc["state"] in ("copying", "ready"):
                    n += client.prefetch(path, (int(doc["size"]), int(doc["mtime_ns"])), ranges)
                elif doc["state"] in ("streaming", "absent"):
                    # No version there yet: the tier holds the hint and fetches when the publish
                    # (or the journal record) announces one; and it is sent again when the file
                    # is opened still arriving (a tier that dropped it still gets it then).
                    self._hint_later(path, ranges)
                    n += client.prefetch(path, None, ranges)
            except OSError as err:
                log.info("read hint for %s not forwarded to the tier: %s", path, err)
        return n

    def _hint_later(self, path: str, ranges: list[tuple[int, int]]) -> None:
        now = time.monotonic()
        with self._hints_lock:
            self._later_hints[path] = (list(ranges), now)
            self._later_hints.move_to_end(path)
            while self._later_hints and (len(self._later_hints) > LATER_HINTS_MAX
                                         or now - next(iter(self._later_hints.values()))[1] > LATER_HINTS_S):
                self._later_hints.popitem(last=False)

    def _forward_later_hint(self, client, path: str, identity: tuple[int, int]) -> None:
        """A file hinted before the tier was receiving it is opened: while arriving, the hint's
        ranges are fetched now, all at once, instead of one read after another; complete, the
        tier only learns them. (A hint dropped here was lost for the next checkpoint's order:
        files completed sooner once the publish stopped waiting for its last chunks.)"""
        with self._hints_lock:
            hint = self._later_hints.pop(path, None)
        if hint is None or time.monotonic() - hint[1] > LATER_HINTS_S:
            return
        try:
            client.prefetch(path, identity, hint[0])
            self.stats.add("route_hints_at_open")
        except OSError as err:
            log.info("read hint for %s not forwarded to the tier: %s", path, err)

    def open_reader(self, rel: str):
        client, doc = self._tier(rel)
        if doc["state"] == "copying":
            # Demand-first: reads do not wait for the whole file (agent/demand.py).
            self.stats.add("route_demand_opens")
            st = self._file(doc)
            self._forward_later_hint(client, rel, st.identity())
            sock = self.local_socket_of(rel) if self.tier_bytes is not None else None
            local = (functools.partial(self.tier_bytes, sock, rel, *st.identity())
                     if sock is not None and self.tier_bytes is not None else None)
            return _TierDemandReader(client, self._store, rel, st.identity(), self.stats, local), st
        if doc["state"] == "ready":
            st = self._file(doc)
            # complete by now: nothing to fetch, but the tier learns what eval jobs read of it,
            # and sends those chunks of the next checkpoint's file first (agent/readmemory.py)
            self._forward_later_hint(client, rel, st.identity())
            return _StoreFallbackReader(self._store, rel, st.identity()), st
        return self._store.open_reader(rel)

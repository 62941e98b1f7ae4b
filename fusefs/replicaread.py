"""Reads of hinted files from their replicas: blocks, single-flight, failover, hedging.

A read is served in `replicas.block_bytes` blocks. Concurrent misses of one block on this host
wait for a single fetch (single-flight), and recently fetched blocks stay in a small LRU, so 8
ranks on one host cost one remote read. A fetch goes to the replica with fewer reads in flight
of two sampled ones (power of two choices); if it has not answered after `hedge_after_ms`, a
second fetch goes to another replica (or the store) and the first answer wins; errors and
`read_timeout_s` fail over to the next replica and finally to the store. Hinted files are
checkpoints, immutable once written: blocks are keyed by the file's (size, mtime) too.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Optional

import trio

from agent.fdserver import TierSocket
from fusefs.hints import ReplicaRouter
from fusefs.stats import Stats
from mountconfig import MountConfig
from stores.base import Store

log = logging.getLogger("hintfs.replicaread")

_CACHE_BLOCKS = 16


class ReplicaReads:
    def __init__(self, router: ReplicaRouter, clients: dict, cfg: MountConfig, stats: Stats, *,
                 store: Store, io_limiter: trio.CapacityLimiter):
        self.router = router
        self.clients = clients
        self.block = cfg.replicas.block_bytes
        self.timeout = cfg.replicas.read_timeout_s
        self.hedge_s = cfg.replicas.hedge_after_ms / 1000.0
        self.stats = stats
        self.store = store              # the last fallback (the mount's view of it: routes too)
        self.io_limiter = io_limiter    # the filesystem's, for store reads
        self.limiter = trio.CapacityLimiter(64)
        self._blocks: OrderedDict[tuple, bytes] = OrderedDict()
        self._fetching: dict[tuple, trio.Event] = {}
        # The mount's in-process agent (same host, same process): its complete replicas can back
        # passthrough opens (`AgentServer.local_replica_fd`); set by `fusefs.mount.assemble`.
        self.local_copy: Optional[Callable[[str, int, int], int]] = None
        # Agents on this host in other processes (a route's tier agent with a `local_socket`):
        # (path -> socket and its agent's uid, or None; blocking fetch of an fd, which checks the
        # socket, its peer and the fd first: agent.fdserver), asked in a worker thread.
        self.local_socket_of: Optional[Callable[[str], Optional[TierSocket]]] = None
        self.fetch_fd: Optional[Callable[[TierSocket, str, int, int], int]] = None

    async def store_read(self, path: str, off: int, length: int) -> bytes:
        """One read of the store copy (the last fallback of replica reads)."""
        def read():
            reader, _st = self.store.open_reader(path)
            try:
                return reader.read(off, length)
            finally:
                reader.close()
        return await trio.to_thread.run_sync(read, limiter=self.io_limiter)

    def has_replicas(self, path: str) -> bool:
        return bool(self.router.replicas.get(path))

    async def local_fd(self, path: str, identity: tuple[int, int]) -> int:
        fd = self.local_copy(path, *identity) if self.local_copy is not None else -1
        if fd < 0 and self.local_socket_of is not None:
            sock = self.local_socket_of(path)
            if sock is not None:
                fd = await trio.to_thread.run_sync(self.fetch_fd, sock, path, *identity)
                if fd >= 0:
                    self.stats.add("tier_fd_opens")
        return fd

    async def read(self, path: str, identity, off: int, size: int) -> bytes:
        out = []
        pos, end = off, off + size
        while pos < end:
            b = pos // self.block
            data = await self._get_block(path, identity, b)
            start = pos - b * self.block
            piece = data[start:start + (end - pos)]
            if not piece:
                break
            out.append(piece)
            pos += len(piece)
            if len(data) < self.block:
                break  # end of file
        return b"".join(out)

    async def _get_block(self, path: str, identity, b: int) -> bytes:
        key = (path, identity, b)
        while True:
            data = self._blocks.get(key)
            if data is not None:
                self._blocks.move_to_end(key)
                self.stats.add("replica_block_hits")
                return data
            pending = self._fetching.get(key)
            if pending is None:
                break
            self.stats.add("replica_singleflight_waits")
            await pending.wait()
            if key not in self._blocks:   # the fetch failed: try ourselves
                break
        done = trio.Event()
        self._fetching[key] = done
        try:
            data = await self._fetch(path, identity, b * self.block, self.block)
            self._blocks[key] = data
            while len(self._blocks) > _CACHE_BLOCKS:
                self._blocks.popitem(last=False)
            return data
        finally:
            del self._fetching[key]
            done.set()

    async def _from_agent(self, loc: str, path: str, identity, off: int, length: int) -> bytes:
        self.router.in_flight[loc] = self.router.in_flight.get(loc, 0) + 1
        try:
            with trio.fail_after(self.timeout):
                # `identity`: the agent refuses (ESTALE) a replica of another version than the one opened
                return await trio.to_thread.run_sync(self.clients[loc].read, path, off, length, True,
                                                     tuple(identity), limiter=self.limiter, abandon_on_cancel=True)
        finally:
            self.router.in_flight[loc] -= 1

    async def _fetch(self, path: str, identity, off: int, length: int) -> bytes:
        tried: list[str] = []
        while True:
            loc = self.router.pick(path, exclude=tuple(tried))
            if loc is None:
                break
            tried.append(loc)
            try:
                data = await self._hedged(path, identity, off, length, loc, tried)
                self.stats.add("replica_reads")
                return data
            except (OSError, trio.TooSlowError) as err:
                self.stats.add("replica_failovers")
                log.warning("replica read of %s at %s failed, trying another source: %s", path, loc, err)
        self.stats.add("replica_store_fallbacks")
        return await self.store_read(path, off, length)

    async def _hedged(self, path: str, identity, off: int, length: int, loc: str, tried: list[str]) -> bytes:
        if self.hedge_s <= 0:
            return await self._from_agent(loc, path, identity, off, length)
        result: dict = {}
        failures: list[BaseException] = []

        async def attempt(source: Optional[str], delay: float, scope_box: list) -> None:
            if delay:
                await trio.sleep(delay)
                if result:
                    return
                self.stats.add("replica_hedges")
            try:
                if source is None:
                    data = await self.store_read(path, off, length)
                else:
                    data = await self._from_agent(source, path, identity, off, length)
            except (OSError, trio.TooSlowError) as err:
                failures.append(err)
                return
            if not result:
                result["data"] = data
                scope_box[0].cancel()

        backup = self.router.pick(path, exclude=tuple(tried))
        async with trio.open_nursery() as nursery:
            box = [nursery.cancel_scope]
            nursery.start_soon(attempt, loc, 0.0, box)
            nursery.start_soon(attempt, backup, self.hedge_s, box)
        if "data" in result:
            return result["data"]
        raise failures[0] if failures else OSError(5, f"no source answered for {path}")

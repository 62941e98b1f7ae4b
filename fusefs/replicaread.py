"""Reads of files from their replicas: blocks, single-flight, failover, hedging.

A read is served in `replicas.block_bytes` blocks. Concurrent misses of one block on this host
wait for a single fetch (single-flight), and recently fetched blocks stay in a small LRU, so 8
ranks on one host cost one remote read. A fetch goes to the replica this host has asked for
the fewest bytes (`ReplicaRouter.pick`); if it has not answered after `hedge_after_ms`, a
second fetch goes to another replica (or the store) and the first answer wins; errors and
`read_timeout_s` fail over to the next replica and finally to the store: the reader the handle
opened (`fallback`: the store's copy of the version opened). Replicas are copies of immutable files
(checkpoints): blocks are keyed by the file's (size, mtime) too.

Where the replicas are: a hinted file's, in the hints' `ReplicaRouter` (asked at each block, so a
reclaimed replica is not read); a routed file's, the local tier (`locations`, fixed at open:
`fusefs.routes`). The in-process agent's complete replicas can back FUSE passthrough opens
(`local_fd`).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import trio
from cachetools import LRUCache

from fusefs import workers
from fusefs.hints import ReplicaRouter
from fusefs.stats import Stats
from mountconfig.schema import ReplicasConfig
from hintfs.stores.base import Reader

log = logging.getLogger("hintfs.replicaread")

_CACHE_BLOCKS = 16
# The smallest piece a block is cut into so that a host reads a file of few blocks from every
# replica (`ReplicaReads._fetch`): below it, a request costs more than the bytes it spreads.
MIN_PIECE_BYTES = 64 << 10


def pieces_of(replicas: int, length: int, size: int, block: int, stripe: int) -> int:
    """How many pieces one block of `length` bytes (of a file of `size` bytes read in `block`
    bytes) is fetched in, from as many replicas at once: pieces of `stripe` bytes, and where the
    file's blocks are fewer than its replicas, enough pieces (of at least `MIN_PIECE_BYTES`) that
    the file's blocks together ask every replica once. 1: the block whole, from one replica."""
    if stripe <= 0 or replicas <= 1:
        return 1
    pieces = min(replicas, length // stripe)
    blocks = max(1, -(-size // block))
    if blocks * max(pieces, 1) < replicas:
        pieces = max(pieces, min(-(-replicas // blocks), length // MIN_PIECE_BYTES))
    return max(1, min(replicas, pieces))


class ReplicaReads:
    def __init__(self, router: ReplicaRouter, clients: dict, options: ReplicasConfig, stats: Stats, *,
                 io_limiter: trio.CapacityLimiter, local_copy: Callable[[str, int, int], int] | None = None):
        self.router = router
        self.clients = clients
        self.block = options.block_bytes
        self.stripe = options.stripe_bytes
        self.timeout = options.read_timeout_s
        self.hedge_s = options.hedge_after_ms / 1000.0
        self.stats = stats
        self.io_limiter = io_limiter    # the filesystem's, for store reads
        self.limiter = trio.CapacityLimiter(64)
        self._blocks: LRUCache = LRUCache(maxsize=_CACHE_BLOCKS)   # (path, identity, block) -> bytes
        self._fetching: dict[tuple, trio.Event] = {}
        # The mount's in-process agent (same host, same process): its complete replicas can back
        # passthrough opens (`AgentServer.local_replica_fd`).
        self.local_copy = local_copy

    async def store_read(self, fallback: Reader, off: int, length: int) -> bytes:
        """One read of the store copy (the last fallback of replica reads)."""
        return await workers.run_sync(fallback.read, off, length, limiter=self.io_limiter)

    def has_replicas(self, path: str) -> bool:
        return bool(self.router.replicas.get(path))

    def local_fd(self, path: str, identity: tuple[int, int]) -> int:
        """A new fd of the in-process agent's complete replica of exactly this version, or -1."""
        return self.local_copy(path, *identity) if self.local_copy is not None else -1

    async def read(self, path: str, identity, off: int, size: int, *, fallback: Reader,
                   locations: Sequence[str] | None = None) -> bytes:
        """Bytes of `path` at version `identity` from the replicas at `locations` (None: the hinted
        ones), the store's copy through `fallback` when none answers."""
        out = []
        pos, end = off, off + size
        while pos < end:
            b = pos // self.block
            data = await self._get_block(path, identity, b, fallback, locations)
            start = pos - b * self.block
            piece = data[start:start + (end - pos)]
            if not piece:
                break
            out.append(piece)
            pos += len(piece)
            if len(data) < self.block:
                break  # end of file
        return b"".join(out)

    async def _get_block(self, path: str, identity, b: int, fallback: Reader,
                         locations: Sequence[str] | None) -> bytes:
        key = (path, identity, b)
        while True:
            data: bytes | None = self._blocks.get(key)
            if data is not None:
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
            # never past the end of the version opened (identity: size, mtime): a 20 KB file's block
            # is one 20 KB request, not pieces of a 4 MiB one (two of them empty), and the bytes
            # `ReplicaRouter.pick` charges each replica are the bytes it will serve
            length = max(0, min(self.block, int(identity[0]) - b * self.block))
            data = await self._fetch(path, identity, b * self.block, length, fallback, locations) if length else b""
            self._blocks[key] = data
            return data
        finally:
            del self._fetching[key]
            done.set()

    async def _from_agent(self, loc: str, path: str, identity, off: int, length: int) -> bytes:
        self.router.in_flight[loc] = self.router.in_flight.get(loc, 0) + 1
        try:
            with trio.fail_after(self.timeout):
                # `identity`: the agent refuses (ESTALE) a replica of another version than the one opened
                read = functools.partial(self.clients[loc].read, path, off, length, replica_only=True,
                                         expect=tuple(identity))
                return await trio.to_thread.run_sync(read, limiter=self.limiter, abandon_on_cancel=True)
        finally:
            self.router.in_flight[loc] -= 1

    async def _fetch(self, path: str, identity, off: int, length: int, fallback: Reader,
                     locations: Sequence[str] | None) -> bytes:
        """One block: from one replica, or, where the file has several and the block is at least
        two `stripe_bytes` long, in pieces from as many replicas at once. Each host reads a file
        in few blocks (4 MiB): whole, the hosts' blocks land on the agents like balls in bins (32
        hosts reading a hot file of 3.9 MB from 32 replicas: the busiest agent served ~2x the
        mean); in pieces, each host spreads its own bytes over the agents (`ReplicaRouter.pick`),
        so their sum is even, and one host's block arrives from many agents at once.

        A file of fewer blocks than it has replicas is cut finer (pieces of at least
        `MIN_PIECE_BYTES`) so that each host asks every replica for a share: in `stripe_bytes`
        pieces a 3.9 MB hot file with 32 replicas was 14 pieces a host, and 32 hosts' 14 agents
        each overlapped like balls in bins (bench/scale_storm.py at 4,096 readers: the busiest
        agent served 1.18-1.85x the mean); in 32 pieces, each host's bytes are even over all 32."""
        n = len(self.router.replicas.get(path, ()) if locations is None else locations)
        pieces = pieces_of(n, length, int(identity[0]), self.block, self.stripe)
        if pieces <= 1:
            return await self._fetch_one(path, identity, off, length, fallback, locations)
        step = -(-length // pieces)
        parts: list[bytes] = [b""] * pieces

        async def piece(i: int) -> None:
            start = off + i * step
            parts[i] = await self._fetch_one(path, identity, start, min(step, off + length - start), fallback,
                                             locations)
        try:
            async with trio.open_nursery() as nursery:
                for i in range(pieces):
                    nursery.start_soon(piece, i)
        except* OSError as group:
            raise group.exceptions[0] from None
        self.stats.add("replica_striped_blocks")
        out = []
        for data in parts:          # (a piece short of its length is the end of the file)
            out.append(data)
            if len(data) < step:
                break
        return b"".join(out)

    async def _fetch_one(self, path: str, identity, off: int, length: int, fallback: Reader,
                         locations: Sequence[str] | None) -> bytes:
        tried: list[str] = []
        while True:
            loc = self.router.pick(path, exclude=tuple(tried), among=locations, size=length)
            if loc is None:
                break
            tried.append(loc)
            try:
                data = await self._hedged(path, identity, off, length, loc, tried, fallback, locations)
                self.stats.add("replica_reads")
                return data
            except (OSError, trio.TooSlowError) as err:
                self.stats.add("replica_failovers")
                log.warning("replica read of %s at %s failed, trying another source: %s", path, loc, err)
        self.stats.add("replica_store_fallbacks")
        return await self.store_read(fallback, off, length)

    async def _hedged(self, path: str, identity, off: int, length: int, loc: str, tried: list[str],
                      fallback: Reader, locations: Sequence[str] | None) -> bytes:
        if self.hedge_s <= 0:
            return await self._from_agent(loc, path, identity, off, length)
        result: dict[str, bytes] = {}
        failures: list[BaseException] = []

        async def attempt(source: str | None, delay: float, scope_box: list) -> None:
            if delay:
                await trio.sleep(delay)
                if result:
                    return
                self.stats.add("replica_hedges")
                if source is not None:
                    self.router.sent[source] = self.router.sent.get(source, 0) + length
            try:
                if source is None:
                    data = await self.store_read(fallback, off, length)
                else:
                    data = await self._from_agent(source, path, identity, off, length)
            except (OSError, trio.TooSlowError) as err:
                failures.append(err)
                return
            if not result:
                result["data"] = data
                scope_box[0].cancel()

        backup = self.router.pick(path, exclude=tuple(tried), among=locations)   # (its bytes counted if sent)
        async with trio.open_nursery() as nursery:
            box = [nursery.cancel_scope]
            nursery.start_soon(attempt, loc, 0.0, box)
            nursery.start_soon(attempt, backup, self.hedge_s, box)
        if "data" in result:
            return result["data"]
        raise failures[0] if failures else OSError(5, f"no source answered for {path}")

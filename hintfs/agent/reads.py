"""What the agent serves: byte ranges (of a replica, of the store, or on demand of a version still
arriving) and transformed samples, within `max_concurrent_reads` at once and an optional
`bandwidth_bytes_s` (the benchmarks emulate a data node with it)."""
from __future__ import annotations

import errno
import logging
import threading
from typing import Any

import pyarrow as pa

from hintfs.agent import rpc
from hintfs.agent.catalog import Catalog
from hintfs.agent.demand import DemandReads
from hintfs.agent.lru import EvictingLRU
from hintfs.agent.readmemory import ReadMemory
from hintfs.agent.rpc import LoadStatus, SampleRequest, SamplesReadyRequest, rpc_error
from hintfs.agent.samples import SampleService
from hintfs.common.clock import SYSTEM_CLOCK, Clock
from mountconfig.schema import TransformLoadConfig
from hintfs.stores.base import Store

log = logging.getLogger("hintfs.agent")
STORE_READERS = 256            # open store readers kept (least recently used first out)


class TokenBucket:
    """Bytes per second with a burst of one second's worth; `take` sleeps the caller."""

    def __init__(self, rate: int, clock: Clock = SYSTEM_CLOCK):
        self.rate = rate
        self.clock = clock
        self.tokens = float(rate)
        self.stamp = clock.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self.lock:
            now = self.clock.monotonic()
            self.tokens = min(self.rate, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= n
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait > 0:
            self.clock.sleep(wait)


class Reads:
    def __init__(self, store: Store, catalog: Catalog, demand: DemandReads, memory: ReadMemory, *,
                 max_concurrent: int, bandwidth_bytes_s: int, transform_load: TransformLoadConfig,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.store = store
        self.catalog = catalog
        self.demand = demand
        self.memory = memory
        self.transform_load = transform_load
        self.clock = clock
        self.slots = threading.BoundedSemaphore(max_concurrent)
        self.bucket = TokenBucket(bandwidth_bytes_s, clock)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.bytes_served = 0
        self.bytes_saved = 0
        self.reads_served = 0
        self.started = clock.monotonic()
        self._retired: list[Any] = []      # readers replaced while reads may still use them
        # open store readers, path -> (reader, identity); closed a reclaim round after they leave
        self._readers: EvictingLRU[str, tuple[Any, tuple]] = EvictingLRU(
            STORE_READERS, lambda _path, entry: self._retired.append(entry[0]))
        self._samples: SampleService | None = None

    def read_range(self, path: str, offset: int, length: int, replica_only: bool = False,
                   expect: tuple[int, int] | None = None, demand: bool = False,
                   compress: bool = False) -> tuple[bytes, int | None]:
        """Bytes of `path`: from its replica (of version `expect` when given); with `demand`
        (and `expect`), also while the replica is still arriving (hintfs/agent/demand.py).
        Returns (payload, raw size): with `compress`, the payload is the range compressed where
        that pays (`rpc.pack_range`) and the raw size its length; else (the bytes, None)."""
        if demand:
            if expect is None:
                raise rpc_error(errno.EINVAL, "a demand read names the version it opened (expect)")
            self.memory.remember(path, [(offset, length)])
            with self.slots:
                data = self.demand.read(path, (int(expect[0]), int(expect[1])), offset, length)
                return self._send(data, compress, charge=False)
        with self.slots:
            with self.lock:
                self.in_flight += 1
            rep = self.catalog.get(path)
            try:
                if rep is not None and expect is not None and rep.version != tuple(expect):
                    # A replica of another version than the reader's (the store file was replaced).
                    if replica_only:
                        raise rpc_error(errno.ESTALE, f"the replica of {path} is of another version")
                    rep = None
                held = self.catalog.read(rep, offset, length) if rep is not None else None
                if held is None and replica_only:
                    raise rpc_error(errno.ENOENT, f"no replica of {path}")
                data = held if held is not None else self._store_reader(path).read(offset, length)
                return self._send(data, compress, charge=True)
            finally:
                with self.lock:
                    self.in_flight -= 1

    def _send(self, data: bytes, compress: bool, charge: bool) -> tuple[bytes, int | None]:
        """The payload of a read (compressed where asked and it pays), counted and, with
        `charge`, taken from the bandwidth bucket: both count the bytes sent."""
        packed = rpc.pack_range(data) if compress else None
        payload = data if packed is None else packed
        if charge:
            self.bucket.take(len(payload))
        self._served(len(payload), saved=len(data) - len(payload))
        return payload, None if packed is None else len(data)

    def _served(self, nbytes: int, reads: int = 1, saved: int = 0) -> None:
        with self.lock:
            self.bytes_served += nbytes
            self.bytes_saved += saved
            self.reads_served += reads

    def _store_reader(self, path: str) -> Any:
        """An open reader of a store file, kept in a small LRU (reads are positional, so one
        reader serves concurrent calls). A file changed in the store gets a fresh reader."""
        st = self.store.stat(path)
        with self.lock:
            entry = self._readers.get(path)
            if entry is not None and entry[1] == st.identity():
                return entry[0]
        reader, st = self.store.open_reader(path)
        with self.lock:
            old = self._readers.pop(path, None)
            self._readers[path] = (reader, st.identity())
        if old is not None:
            self._retired.append(old[0])
        return reader

    def take_retired(self) -> list[Any]:
        """Readers that left the cache (the reclaim loop closes them a round later)."""
        with self.lock:
            readers, self._retired = self._retired, []
        return readers

    # -- transformed samples (hintfs/agent/samples.py) -------------------------------------------------
    @property
    def samples(self) -> SampleService:
        """Storage-side transforms, started on first use (the process pool costs a fork)."""
        with self.lock:
            if self._samples is None:
                self._samples = SampleService(self.store, self.transform_load, clock=self.clock.monotonic)
            return self._samples

    def sample(self, req: SampleRequest) -> bytes:
        try:
            data, _how = self.samples.get(req.path, req.kind, req.params, req.aug_seed, req.allow_raw)
        except ValueError as err:   # transforms.TransformError: corrupt media or over a limit
            log.debug("transform of %s failed: %s", req.path, err)   # SampleService logged it once
            raise rpc_error(errno.EIO, f"transform of {req.path} failed: {err}") from None
        self._served(len(data), reads=0)
        return data

    def samples_ready(self, req: SamplesReadyRequest) -> pa.Table:
        """Transformed samples already in the cache; nothing is started."""
        rows = []
        for path, kind, params, seed in req.samples:
            try:
                data = self.samples.peek(path, kind, params, seed)
            except (OSError, ValueError):
                data = None
            if data is not None:
                rows.append((path, seed, data))
        self._served(sum(len(r[2]) for r in rows), reads=0)
        return pa.table({"path": pa.array([r[0] for r in rows], type=pa.string()),
                         "seed": pa.array([r[1] for r in rows], type=pa.int64()),
                         "data": pa.array([r[2] for r in rows], type=pa.large_binary())})

    def samples_status(self) -> dict | None:
        return self._samples.status() if self._samples is not None else None

    def status(self) -> LoadStatus:
        with self.lock:
            elapsed = max(self.clock.monotonic() - self.started, 1e-9)
            return LoadStatus(reads_in_flight=self.in_flight, reads_served=self.reads_served,
                              bytes_served=self.bytes_served, bytes_per_s=round(self.bytes_served / elapsed, 1),
                              bytes_saved=self.bytes_saved)

    def close(self) -> None:
        if self._samples is not None:
            self._samples.close()


__all__ = ["Reads", "TokenBucket"]

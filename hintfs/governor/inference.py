"""Inference client: blocking `reserve(bytes)`, a model cache with keep-alive, a growing KV cache.

Every byte an inference process puts on the GPU is reserved first; `reserve` returns once the
governor granted it (it may have shrunk training to do so). While a request runs, the slot's
BUSY word is set so that training yields compute at its next safe point.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from collections.abc import Callable

from hintfs.governor.client import GovernorClient, GovernorError
from policy.governor_keepalive import IdleHistory, keepalive_s


class ReservationRejected(GovernorError):
    pass


class InferenceClient:
    """`accept_pages=True`: grants that made training shrink may come with training's freed
    pages as fds (`pop_pages()`); map them (hintfs.governor.vmm_pool.PagePool.import_fds) and ZERO
    them before use. Unclaimed pages are closed at the next reserve."""

    def __init__(self, socket_path: str, gpu: int = 0, name: str = "inference",
                 accept_pages: bool = False, reconnect_timeout_s: float = 10.0) -> None:
        self.client = GovernorClient(socket_path, "inference", gpu=gpu, name=name,
                                     accept_pages=accept_pages, reconnect_timeout_s=reconnect_timeout_s)
        if accept_pages:   # lent pages come as fds with a grant: room for them, table grown now
            from hintfs.common.fdlimit import raise_open_file_limit
            from hintfs.common.fdlimit import reserve_fd_table
            raise_open_file_limit()
            reserve_fd_table(4096)
        self.timings: list[dict] = []
        self._pages: list[int] = []
        self.page_bytes = 0

    def pop_pages(self) -> tuple[list[int], int]:
        """The fds lent with the last grant (the caller owns them now), and the page size."""
        out, self._pages = self._pages, []
        return out, self.page_bytes

    def _drop_pages(self) -> None:
        for fd in self._pages:
            os.close(fd)
        self._pages = []

    @property
    def held(self) -> dict[str, int]:
        """Bytes reserved by kind (the client's books, which a restart's re-registration keeps)."""
        return self.client.held

    def reserve(self, nbytes: int, kind: str = "workspace", timeout_s: float = 5.0) -> dict:
        """Block until `nbytes` of `kind` are granted; retries rejected reclaims until timeout.
        A reclaim that missed its deadline is asked again at once: the daemon waits for the
        shrink already out, so its late ack is what grants it."""
        end = time.monotonic() + timeout_s
        delay = 0.001
        while True:
            try:
                r = self.client.request({"op": "reserve", "kind": kind, "bytes": int(nbytes)})
            except GovernorError as e:
                if "limit" in str(e) or self.client.broken or time.monotonic() + delay > end:
                    raise ReservationRejected(str(e)) from None
                if "deadline" not in str(e):
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
                continue
            self._drop_pages()
            if r.get("fds"):
                self._pages, self.page_bytes = r.pop("fds"), int(r["page_bytes"])
            if r.get("reclaimed"):
                self.timings.append(r["timing_ms"])
            return r

    def release(self, nbytes: int, kind: str = "workspace") -> None:
        nbytes = min(int(nbytes), self.held.get(kind, 0))
        if nbytes:
            self.client.request({"op": "release", "kind": kind, "bytes": nbytes})

    @contextlib.contextmanager
    def busy(self):
        """Mark a request in flight: training yields compute at safe points meanwhile."""
        self.client.set_busy(True)
        try:
            yield
        finally:
            self.client.set_busy(False)

    @property
    def keepalive_params(self) -> dict:
        return self.client.keepalive

    def close(self) -> None:
        self._drop_pages()
        self.client.close()


@dataclass
class CachedModel:
    name: str
    model: object
    nbytes: int
    history: IdleHistory = field(default_factory=IdleHistory)
    in_use: int = 0


class ModelCache:
    """Resident models, each evicted once idle longer than its keep-alive (policy from its own
    idle-gap history). Loading reserves the weights' bytes first."""

    def __init__(self, client: InferenceClient, clock: Callable[[], float] = time.monotonic,
                 keepalive: dict | None = None) -> None:
        self.client = client
        self.clock = clock
        self.ka = keepalive or client.keepalive_params
        self.models: OrderedDict[str, CachedModel] = OrderedDict()
        self.cold_starts = 0
        self._histories: dict[str, IdleHistory] = {}

    def keepalive_of(self, name: str) -> float:
        h = self._histories.get(name)
        return keepalive_s(h.gaps if h else [], self.ka["quantile"], self.ka["min_s"],
                           self.ka["max_s"])

    @contextlib.contextmanager
    def use(self, name: str, loader: Callable[[], object], nbytes: int):
        """Yield the model `name`, loading it (after reserving `nbytes`) if not resident."""
        now = self.clock()
        self.evict_expired(now)
        m = self.models.get(name)
        if m is None:
            self._reserve_evicting(nbytes)
            try:
                model = loader()
            except BaseException:
                self.client.release(nbytes, "weights")
                raise
            hist = self._histories.setdefault(name, IdleHistory())
            m = CachedModel(name, model, nbytes, hist)
            self.models[name] = m
            self.cold_starts += 1
        self.models.move_to_end(name)
        m.history.started(now)
        m.in_use += 1
        try:
            yield m.model
        finally:
            m.in_use -= 1
            m.history.ended(self.clock())

    def _reserve_evicting(self, nbytes: int) -> None:
        """Reserve the weights; if refused, evict idle models, least recently used first."""
        while True:
            try:
                self.client.reserve(nbytes, "weights", timeout_s=0.2)
                return
            except ReservationRejected:
                idle = [n for n, m in self.models.items() if m.in_use == 0]
                if not idle:
                    raise
                self.evict(idle[0])

    def evict_expired(self, now: float | None = None) -> list[str]:
        now = self.clock() if now is None else now
        gone = []
        for name, m in list(self.models.items()):
            since = m.history.idle_since()
            if m.in_use == 0 and since is not None and now - since > self.keepalive_of(name):
                gone.append(name)
                self.evict(name)
        return gone

    def evict(self, name: str) -> None:
        m = self.models.pop(name)
        m.model = None  # drop the weights before returning their bytes
        _free_device_cache()
        self.client.release(m.nbytes, "weights")


class KVCache:
    """The elastic part of an LLM server: KV blocks reserved in chunks as sequences grow and
    returned when they finish. `alloc(nbytes)` builds the chunk's tensor after the grant."""

    def __init__(self, client: InferenceClient, bytes_per_token: int, chunk_bytes: int,
                 alloc: Callable[[int], object]) -> None:
        self.client = client
        self.bytes_per_token = bytes_per_token
        self.chunk_bytes = chunk_bytes
        self.alloc = alloc
        self.chunks: list[object] = []
        self.tokens = 0

    @property
    def capacity_tokens(self) -> int:
        return len(self.chunks) * self.chunk_bytes // self.bytes_per_token

    def ensure(self, tokens: int) -> None:
        """Make room for `tokens` tokens in total (grow only)."""
        while self.capacity_tokens < tokens:
            self.client.reserve(self.chunk_bytes, "kv_cache")
            self.chunks.append(self.alloc(self.chunk_bytes))
        self.tokens = tokens

    def shrink_to(self, tokens: int) -> None:
        """Sequences finished: keep only the chunks `tokens` need, return the rest."""
        self.tokens = tokens
        need = -(-tokens * self.bytes_per_token // self.chunk_bytes)
        freed = 0
        while len(self.chunks) > need:
            self.chunks.pop()
            freed += self.chunk_bytes
        if freed:
            _free_device_cache()
            self.client.release(freed, "kv_cache")


def _free_device_cache() -> None:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def priority_stream(device=None):
    """A CUDA stream of the highest priority (torch imported here, not at module level): run
    inference on it so that its kernels are scheduled ahead of training's where the GPU
    schedules both (bench/README.md measures what this buys on one H200)."""
    import torch

    # torch maps a priority beyond the device's range to the nearest valid one: the highest
    return torch.cuda.Stream(device=device, priority=-100)

"""Storage-side transforms in the agent: `.tensor` samples made in a process pool, cached,
made ahead of the plan, and replaced by raw bytes when the storage CPU is busy.

- `get(...)` returns the bytes of a `.tensor` file (transforms.container format) for one sample:
  from the byte-bounded cache, from a transform already running (single-flight), or from a new
  transform in the pool. With fallback on, it returns the raw container instead when the
  agent's CPU share is above `cpu_enter` (until it drops below `cpu_leave`) or when the transform
  misses `deadline_ms`; the client then transforms locally and gets the identical tensor.
- `prefetch(samples)` starts transforms for samples of the next plan steps; `forget_before`
  frees what the plan has passed.
Everything here runs on Flight's threads or the pool, never in a trio loop.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ProcessPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Optional

import psutil

log = logging.getLogger("hintfs.samples")


def transform_to_container(kind: str, raw: bytes, params_json: str, aug_seed: int, meta: dict) -> bytes:
    """Runs in a worker process: decode + transform + encode the `.tensor` bytes."""
    import transforms
    from transforms.container import encode_tensor, make_meta
    arrays = transforms.apply(kind, raw, params_json, aug_seed)
    return encode_tensor(arrays, make_meta(kind, params_json, aug_seed, meta["source"], meta["source_size"],
                                           meta["source_mtime_ns"]))


@dataclass(frozen=True)
class SampleKey:
    path: str
    size: int
    mtime_ns: int
    params_hash: str
    aug_seed: int


class LoadMonitor:
    """The agent's CPU share with hysteresis: busy above `enter`, idle again below `leave`."""

    def __init__(self, enter: float, leave: float, interval_s: float = 0.25):
        self.enter, self.leave = enter, leave
        self.busy = False
        self.share = 0.0
        self._stop = threading.Event()
        psutil.cpu_percent(None)
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="hintfs-load", daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        # The busy share of the cores this agent may run on (its affinity set): a burner or the
        # agent's own transforms there count; a trainer pinned to other cores does not.
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        psutil.cpu_percent(None, percpu=True)
        while not self._stop.wait(interval):
            per = psutil.cpu_percent(None, percpu=True)
            mine = [per[c] for c in cores if c < len(per)] if cores else per
            self.update(sum(mine) / (100.0 * max(1, len(mine))))

    def update(self, share: float) -> None:
        self.share = share
        if self.busy and share < self.leave:
            self.busy = False
        elif not self.busy and share >= self.enter:
            self.busy = True

    def stop(self) -> None:
        self._stop.set()


class SampleService:
    def __init__(self, store, load_cfg):
        self.store = store
        self.cfg = load_cfg
        # forkserver, not fork: the agent process runs gRPC and trio threads, which a fork
        # would copy mid-flight (locks held by other threads stay locked in the child).
        self.pool = ProcessPoolExecutor(max_workers=load_cfg.workers,
                                        mp_context=multiprocessing.get_context("forkserver"))
        self.monitor = LoadMonitor(load_cfg.cpu_enter, load_cfg.cpu_leave)
        self.lock = threading.Lock()
        self.cache: OrderedDict[SampleKey, bytes] = OrderedDict()
        self.cache_bytes = 0
        self.running: dict[SampleKey, Future] = {}
        self.backlog: deque = deque()     # prefetches waiting for an idle worker
        self.counts = {"tensor": 0, "raw_busy": 0, "raw_deadline": 0, "cache_hits": 0, "prefetched": 0,
                       "errors": 0}

    # -- the cache -----------------------------------------------------------------------------
    def _put(self, key: SampleKey, data: bytes) -> None:
        with self.lock:
            if key in self.cache or len(data) > self.cfg.cache_bytes:
                return
            self.cache[key] = data
            self.cache_bytes += len(data)
            while self.cache_bytes > self.cfg.cache_bytes:
                _, old = self.cache.popitem(last=False)
                self.cache_bytes -= len(old)

    def forget(self, keep: set) -> None:
        """Free cached samples the plan has passed (not in `keep`), and drop stale prefetches."""
        with self.lock:
            self.backlog = deque(b for b in self.backlog if (b[0].path, b[0].aug_seed) in keep)
            for key in [k for k in self.cache if (k.path, k.aug_seed) not in keep]:
                self.cache_bytes -= len(self.cache.pop(key))

    # -- making samples ------------------------------------------------------------------------
    def _key_and_meta(self, path: str, kind: str, params, aug_seed: int):
        from transforms.params import params_hash, params_json, parse_params
        p = parse_params(kind, params)
        st = self.store.stat(path)
        key = SampleKey(path, st.size, st.mtime_ns, params_hash(p), int(aug_seed))
        meta = {"source": path, "source_size": st.size, "source_mtime_ns": st.mtime_ns}
        return key, meta, params_json(p)

    def _read_raw(self, path: str) -> bytes:
        reader, st = self.store.open_reader(path)
        try:
            return reader.read(0, st.size)
        finally:
            reader.close()

    def _start(self, key: SampleKey, kind: str, pjson: str, meta: dict) -> Future:
        with self.lock:
            fut = self.running.get(key)
            if fut is not None:
                return fut
            raw = None
        raw = self._read_raw(key.path)
        with self.lock:
            fut = self.running.get(key)
            if fut is not None:
                return fut
            fut = self.pool.submit(transform_to_container, kind, raw, pjson, key.aug_seed, meta)
            self.running[key] = fut

        def done(f: Future, key=key) -> None:
            with self.lock:
                self.running.pop(key, None)
            if not f.cancelled() and f.exception() is None:
                self._put(key, f.result())
            self._pump()

        fut.add_done_callback(done)
        return fut

    def _raw_container(self, kind: str, pjson: str, key: SampleKey, meta: dict) -> bytes:
        from transforms.container import encode_raw, make_meta
        return encode_raw(self._read_raw(key.path), make_meta(kind, pjson, key.aug_seed, meta["source"],
                                                              meta["source_size"], meta["source_mtime_ns"]))

    def _cached(self, key: SampleKey) -> Optional[bytes]:
        """A cache hit (counted, moved to the recent end) or None; the caller holds the lock."""
        data = self.cache.get(key)
        if data is not None:
            self.cache.move_to_end(key)
            self.counts["cache_hits"] += 1
        return data

    def get(self, path: str, kind: str, params, aug_seed: int, allow_raw: bool = True) -> tuple[bytes, str]:
        """The `.tensor` bytes and how they were made: tensor | cache | raw_busy | raw_deadline."""
        key, meta, pjson = self._key_and_meta(path, kind, params, aug_seed)
        with self.lock:
            data = self._cached(key)
            if data is not None:
                return data, "cache"
            running = key in self.running
        fallback = allow_raw and self.cfg.fallback
        if fallback and self.monitor.busy and not running:
            self.counts["raw_busy"] += 1
            return self._raw_container(kind, pjson, key, meta), "raw_busy"
        fut = self._start(key, kind, pjson, meta)
        try:
            data = fut.result(timeout=self.cfg.deadline_ms / 1000.0 if fallback else None)
        except FutureTimeout:
            self.counts["raw_deadline"] += 1
            return self._raw_container(kind, pjson, key, meta), "raw_deadline"
        except Exception as err:
            self.counts["errors"] += 1
            log.error("transform of %s failed: %s", path, err)
            raise
        self.counts["tensor"] += 1
        return data, "tensor"

    def peek(self, path: str, kind: str, params, aug_seed: int) -> Optional[bytes]:
        """The cached `.tensor` bytes of this sample, or None (nothing is started)."""
        key, _meta, _pjson = self._key_and_meta(path, kind, params, aug_seed)
        with self.lock:
            return self._cached(key)

    def prefetch(self, samples: list[tuple[str, str, object, int]]) -> int:
        """Start transforms for (path, kind, params, aug_seed) not cached or running yet."""
        started = 0
        for path, kind, params, seed in samples:
            try:
                key, meta, pjson = self._key_and_meta(path, kind, params, seed)
            except OSError:
                continue
            with self.lock:
                if key in self.cache or key in self.running:
                    continue
            if self.cfg.fallback and self.monitor.busy:
                break   # do not add load while shedding it
            with self.lock:
                self.backlog.append((key, kind, pjson, meta))
            started += 1
        self.counts["prefetched"] += started
        self._pump()
        return started

    def _pump(self) -> None:
        """Feed prefetches to the pool only while it has idle workers, so a sample a reader is
        waiting for (submitted directly by `get`) never queues behind the lookahead."""
        while True:
            with self.lock:
                if not self.backlog or len(self.running) >= self.cfg.workers:
                    return
                key, kind, pjson, meta = self.backlog.popleft()
                if key in self.cache or key in self.running:
                    continue
            try:
                self._start(key, kind, pjson, meta)
            except OSError as err:
                log.warning("prefetch of %s failed: %s", key.path, err)

    def status(self) -> dict:
        with self.lock:
            return {**self.counts, "cached": len(self.cache), "cache_bytes": self.cache_bytes,
                    "running": len(self.running), "backlog": len(self.backlog),
                    "cpu_share": round(self.monitor.share, 3),
                    "busy": self.monitor.busy}

    def close(self) -> None:
        self.monitor.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)

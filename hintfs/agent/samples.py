"""Storage-side transforms in the agent: `.tensor` samples made in a process pool, cached,
made ahead of the plan, and replaced by raw bytes when the storage CPU is busy.

- `get(...)` returns the bytes of a `.tensor` file (hintfs.transforms.container format) for one sample:
  from the byte-bounded cache, from a transform already running (single-flight), or from a new
  transform in the pool. With fallback on, it returns the raw container instead when the
  agent's CPU share is above `cpu_enter` (until it drops below `cpu_leave`) or when the transform
  misses `deadline_ms`; the client then transforms locally and gets the identical tensor.
- `prefetch(samples, job)` starts transforms for samples of a job's next plan steps, and
  `forget(keep, job)` frees what that job's plan has passed. The cache is held per job (issue 34,
  finding 8: one job's plan registration evicted another job's prefetched samples): a sample a
  job prefetched is *held* by that job until its own window leaves it or its plan ends (no
  window for JOB_IDLE_S); `forget` of one job never touches another's. A job holds at most
  JOB_SHARE of `cache_bytes` and all jobs together at most `cache_bytes`: past either, a
  prefetched sample is cached unheld (evicted first, least recently used, as demand reads'
  samples are). At most MAX_JOBS jobs hold samples; another job's prefetches are unheld.
- Media bounds: every transform runs in a worker process of `TransformPool` under the sample's
  limits (hintfs.transforms.limits: pixels, frames, decoded bytes from the header, before decoding;
  the worker's address space capped at 3x `max_decoded_bytes` over its baseline). A worker
  that runs past the sample's `time_limit_s` (+1 s grace) is killed and replaced, and the sample
  is EIO; a worker that dies is replaced and its sample retried once on a fresh worker (EIO if
  that one dies too). A source whose transform failed is remembered (`bad`), so it is EIO in
  every mode: it is never handed out as a raw container later. Before a raw container is
  handed out, the checks that need no decoder run (file size, truncation, image header, a
  video's container), and an image is decoded once in a worker of its own (`checks`:
  `transforms.check_decodes`; a source that decoded is remembered, DECODED_MAX): a
  `.tensor` never holds bytes the transform would refuse (issue 34, finding 12). A video's
  frames are not decoded for a raw container: docs/transforms.md says what that leaves.
Everything here runs on Flight's threads or the pool, never in a trio loop.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from collections.abc import Callable, Iterable

import psutil
from cachetools import FIFOCache, LRUCache

from hintfs.agent.transformpool import TransformPool
from hintfs.transforms.errors import TransformError, TransformTimeout, WorkerDied

log = logging.getLogger("hintfs.samples")

BAD_MAX = 4096              # sources remembered as failed (LRU)
DECODED_MAX = 65536         # image sources remembered as decoding, so that a raw container skips the check
CHECK_WORKERS = 1           # worker processes of the decode checks (`SampleService.checks`), besides the pool
TRANSIENT_BAD_S = 60.0      # how long a time-out or a worker death is remembered
JOB_SHARE = 0.5             # of transform_load.cache_bytes: the most one job's prefetched samples hold
JOB_IDLE_S = 600.0          # a job with no plan window for this long has ended: its samples are freed
MAX_JOBS = 256              # jobs holding prefetched samples at once
SHARED_JOB = ""             # the job of plan windows that name none (older mounts)


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


@dataclass
class JobHold:
    """What one job's plan holds in the cache: the window it named last ((path, aug_seed) kept),
    the samples of it that are cached and held, their bytes, and when it last called."""
    window: set
    held: set
    bytes: int
    last: float


class SampleService:
    def __init__(self, store, load_cfg, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.cfg = load_cfg
        self.clock = clock
        self.pool = TransformPool(load_cfg.workers)
        self._checks: TransformPool | None = None
        self.monitor = LoadMonitor(load_cfg.cpu_enter, load_cfg.cpu_leave)
        self.lock = threading.Lock()
        self.cache: OrderedDict[SampleKey, bytes] = OrderedDict()
        self.cache_bytes = 0
        self.holders: dict[SampleKey, set[str]] = {}   # cached samples held by jobs' plans
        self.held_bytes = 0                            # bytes of those (each sample once)
        self.jobs: dict[str, JobHold] = {}
        self.running: dict[SampleKey, Future] = {}
        self._wanted_by: dict[SampleKey, set[str]] = {}   # jobs whose prefetch a running transform is
        self.backlog: deque = deque()     # prefetches waiting for an idle worker
        self.counts = {"tensor": 0, "raw_busy": 0, "raw_deadline": 0, "cache_hits": 0, "prefetched": 0,
                       "errors": 0, "refused": 0, "decode_checks": 0}
        # sources whose transform failed: (path, size, mtime_ns, params_hash) -> (reason, expiry),
        # the first BAD_MAX remembered (a lookup does not keep one longer)
        self.bad: FIFOCache[tuple, tuple[str, float]] = FIFOCache(BAD_MAX)
        # image sources that decoded (same key): their raw containers need no decode check again
        self.decoded: LRUCache[tuple, None] = LRUCache(DECODED_MAX)

    # -- the cache -----------------------------------------------------------------------------
    def _put(self, key: SampleKey, data: bytes, jobs: Iterable[str] = ()) -> None:
        """Cache a sample; held by each of `jobs` whose window still has it, as the bounds allow
        (a job's share, and all held samples within `cache_bytes`). Only unheld samples are
        evicted (least recently used first)."""
        with self.lock:
            if len(data) > self.cfg.cache_bytes:
                return
            if key not in self.cache:
                self.cache[key] = data
                self.cache_bytes += len(data)
            for job in jobs:
                hold = self.jobs.get(job)
                if hold is not None and (key.path, key.aug_seed) in hold.window:
                    self._hold(hold, job, key, len(self.cache[key]))
            while self.cache_bytes > self.cfg.cache_bytes:
                victim = next((k for k in self.cache if k not in self.holders), None)
                if victim is None:
                    break           # (cannot happen: held samples fit cache_bytes)
                self.cache_bytes -= len(self.cache.pop(victim))

    def _hold(self, hold: JobHold, job: str, key: SampleKey, size: int) -> None:
        """(under lock) `job` holds `key`, if its share and the total allow."""
        if key in hold.held:
            return
        new = key not in self.holders
        if hold.bytes + size > self.cfg.cache_bytes * JOB_SHARE or (new and self.held_bytes + size > self.cfg.cache_bytes):
            return
        hold.held.add(key)
        hold.bytes += size
        self.holders.setdefault(key, set()).add(job)
        if new:
            self.held_bytes += size

    def _unhold(self, hold: JobHold, job: str, key: SampleKey) -> None:
        """(under lock) `job` no longer holds `key`: freed, unless another job holds it too."""
        hold.held.discard(key)
        size = len(self.cache.get(key, b""))
        hold.bytes -= size
        jobs = self.holders.get(key)
        if jobs is not None:
            jobs.discard(job)
            if not jobs:
                del self.holders[key]
                self.held_bytes -= size
                self.cache_bytes -= len(self.cache.pop(key, b""))

    def _job(self, job: str | None) -> tuple[str, JobHold]:
        """(under lock) The hold of `job` (None: SHARED_JOB), made if new; jobs idle for
        JOB_IDLE_S end here (their samples become unheld)."""
        name = SHARED_JOB if job is None else job
        now = self.clock()
        for other, h in list(self.jobs.items()):
            if other != name and now - h.last > JOB_IDLE_S:
                self._end(other)
        hold = self.jobs.get(name)
        if hold is None:
            hold = JobHold(set(), set(), 0, now)
            if len(self.jobs) < MAX_JOBS:
                self.jobs[name] = hold
        hold.last = now
        return name, hold

    def _end(self, job: str) -> None:
        """(under lock) `job`'s plan ended: what it held is unheld."""
        hold = self.jobs.pop(job, None)
        if hold is not None:
            for key in list(hold.held):
                self._unhold(hold, job, key)

    def forget(self, keep: set, job: str | None = None) -> None:
        """`job`'s plan window is now `keep` ((path, aug_seed) pairs): what it held outside them is
        freed (unless another job holds it too), and its prefetches outside them are dropped.
        Other jobs' samples and prefetches are not touched, nor samples no job holds (made for a
        read, or past a job's bounds: evicted least recently used first). An empty `keep` ends
        the job's plan."""
        with self.lock:
            name, hold = self._job(job)
            self.backlog = deque(b for b in self.backlog
                                 if b[4] != name or (b[0].path, b[0].aug_seed) in keep)
            if not keep:
                self._end(name)
                return
            hold.window = set(keep)
            for key in [k for k in hold.held if (k.path, k.aug_seed) not in keep]:
                self._unhold(hold, name, key)

    # -- sources known to be bad ----------------------------------------------------------------
    @staticmethod
    def _bad_key(key: SampleKey) -> tuple:
        return (key.path, key.size, key.mtime_ns, key.params_hash)    # any seed: a source property

    def _bad_reason(self, key: SampleKey) -> str | None:
        """Why this source (at this size/mtime, with these params) failed before, or None; the
        caller holds the lock."""
        entry = self.bad.get(self._bad_key(key))
        if entry is None:
            return None
        reason, expiry = entry
        if expiry and self.clock() > expiry:
            del self.bad[self._bad_key(key)]
            return None
        return reason

    def _refuse(self, key: SampleKey, err: TransformError) -> None:
        """Remember a failed source (and log it once: the file and the limit or the damage)."""
        transient = isinstance(err, (TransformTimeout, WorkerDied))
        with self.lock:
            bk = self._bad_key(key)
            if bk in self.bad:
                return
            self.bad[bk] = (str(err), self.clock() + TRANSIENT_BAD_S if transient else 0.0)
            self.counts["refused"] += 1
        log.error("transform of %s refused: %s", key.path, err)

    # -- making samples ------------------------------------------------------------------------
    def _key_and_meta(self, path: str, kind: str, params, aug_seed: int):
        from hintfs.transforms.params import params_hash, params_json, parse_params
        p = parse_params(kind, params)
        st = self.store.stat(path)
        key = SampleKey(path, st.size, st.mtime_ns, params_hash(p), int(aug_seed))
        meta = {"source": path, "source_size": st.size, "source_mtime_ns": st.mtime_ns}
        return key, meta, params_json(p)

    def _read_raw(self, key: SampleKey, kind: str, pjson: str) -> bytes:
        """The whole source file, refused (TransformError, remembered) when it is over the
        sample's `max_source_bytes`: it is read into the agent's memory."""
        from hintfs.transforms.limits import check_source_size
        from hintfs.transforms.params import parse_params
        p = parse_params(kind, pjson)
        reader, st = self.store.open_reader(key.path)
        try:
            try:
                check_source_size(st.size, p)
            except TransformError as err:
                self._refuse(key, err)
                raise
            data: bytes = reader.read(0, st.size)
            return data
        finally:
            reader.close()

    def _start(self, key: SampleKey, kind: str, pjson: str, meta: dict) -> Future:
        from hintfs.transforms.params import parse_params
        with self.lock:
            fut = self.running.get(key)
            if fut is not None:
                return fut
        raw = self._read_raw(key, kind, pjson)
        limit = parse_params(kind, pjson).time_limit_s
        with self.lock:
            fut = self.running.get(key)
            if fut is not None:
                return fut
            fut = self.pool.submit((kind, raw, pjson, key.aug_seed, meta), limit, key.path)
            self.running[key] = fut
        del raw

        def done(f: Future, key=key) -> None:
            with self.lock:
                self.running.pop(key, None)
                jobs = self._wanted_by.pop(key, set())
            if not f.cancelled():
                err = f.exception()
                if err is None:
                    self._put(key, f.result(), jobs)
                elif isinstance(err, TransformError):
                    self._refuse(key, err)
                else:
                    log.error("transform of %s failed: %s: %s", key.path, type(err).__name__, err)
            self._pump()

        fut.add_done_callback(done)
        return fut

    def _raw_container(self, kind: str, pjson: str, key: SampleKey, meta: dict) -> bytes:
        """The raw-mode `.tensor` of a sample, after the checks that need no decoder (size,
        truncation, an image's header against the limits, a video's container) and, for an
        image, one decode in a worker (`_decodes`): what fails them is EIO here and remembered,
        never handed out raw. A `.tensor` holds only bytes the transform accepts; for a video,
        damage inside its frames is found by the client's transform of the raw bytes
        (`load_sample`: EIO) and by the agent's own transform when it runs."""
        from hintfs.transforms.container import encode_raw, make_meta
        from hintfs.transforms.limits import precheck
        from hintfs.transforms.params import parse_params
        raw = self._read_raw(key, kind, pjson)
        try:
            p = parse_params(kind, pjson)
            precheck(kind, raw, p)
            if kind == "image":
                self._decodes(key, kind, raw, pjson, meta, p.time_limit_s)
        except TransformError as err:
            self._refuse(key, err)
            raise
        return encode_raw(raw, make_meta(kind, pjson, key.aug_seed, meta["source"],
                                         meta["source_size"], meta["source_mtime_ns"]))

    @property
    def checks(self) -> TransformPool:
        """The decode checks' own worker(s), started at the first check: a fallback happens when
        the transform workers are busy (a missed deadline: the sample's own transform still runs
        in one), so a check queued behind them would wait as long as the transform."""
        with self.lock:
            if self._checks is None:
                self._checks = TransformPool(CHECK_WORKERS, fn=self.pool.fn)
            return self._checks

    def _decodes(self, key: SampleKey, kind: str, raw: bytes, pjson: str, meta: dict, limit: float) -> None:
        """The source decodes as the transform decodes it (a check worker decodes it once;
        remembered per source), or TransformError (a timeout or a worker's death too)."""
        bk = self._bad_key(key)
        with self.lock:
            if bk in self.decoded:
                self.decoded[bk]         # (the most recently used now)
                return
        self.checks.submit((kind, raw, pjson, key.aug_seed, {**meta, "check_only": True}), limit,
                           key.path).result()
        with self.lock:
            self.decoded[bk] = None
        self.counts["decode_checks"] += 1

    def _cached(self, key: SampleKey) -> bytes | None:
        """A cache hit (counted, moved to the recent end) or None; the caller holds the lock."""
        data = self.cache.get(key)
        if data is not None:
            self.cache.move_to_end(key)
            self.counts["cache_hits"] += 1
        return data

    def get(self, path: str, kind: str, params, aug_seed: int, allow_raw: bool = True) -> tuple[bytes, str]:
        """The `.tensor` bytes and how they were made: tensor | cache | raw_busy | raw_deadline.

        Raises TransformError (the agent answers EIO) for a source that is corrupt or over a
        limit, in every mode: a source that failed before is refused at once."""
        key, meta, pjson = self._key_and_meta(path, kind, params, aug_seed)
        with self.lock:
            data = self._cached(key)
            if data is not None:
                return data, "cache"
            reason = self._bad_reason(key)
            if reason is not None:
                self.counts["errors"] += 1
                raise TransformError(reason)
            running = key in self.running
        fallback = allow_raw and self.cfg.fallback
        try:
            if fallback and self.monitor.busy and not running:
                data = self._raw_container(kind, pjson, key, meta)
                self.counts["raw_busy"] += 1
                return data, "raw_busy"
            fut = self._start(key, kind, pjson, meta)
            try:
                data = fut.result(timeout=self.cfg.deadline_ms / 1000.0 if fallback else None)
            except FutureTimeout:
                data = self._raw_container(kind, pjson, key, meta)
                self.counts["raw_deadline"] += 1
                return data, "raw_deadline"
        except TransformError:
            self.counts["errors"] += 1
            raise
        except Exception as err:
            self.counts["errors"] += 1
            log.error("transform of %s failed: %s", path, err)
            raise
        self.counts["tensor"] += 1
        return data, "tensor"

    def peek(self, path: str, kind: str, params, aug_seed: int) -> bytes | None:
        """The cached `.tensor` bytes of this sample, or None (nothing is started)."""
        key, _meta, _pjson = self._key_and_meta(path, kind, params, aug_seed)
        with self.lock:
            return self._cached(key)

    def prefetch(self, samples: list[tuple[str, str, object, int]], job: str | None = None) -> int:
        """Start transforms for (path, kind, params, aug_seed) not cached or running yet, for
        `job`'s plan (None: the shared job of older mounts): it holds them once made (`_put`)."""
        started = 0
        with self.lock:
            name, hold = self._job(job)
            hold.window |= {(p, int(seed)) for p, _k, _params, seed in samples}
        for path, kind, params, seed in samples:
            try:
                key, meta, pjson = self._key_and_meta(path, kind, params, seed)
            except (OSError, ValueError):
                continue
            with self.lock:
                if key in self.cache:
                    if name in self.jobs:
                        self._hold(hold, name, key, len(self.cache[key]))
                    continue
                if key in self.running:
                    self._wanted_by.setdefault(key, set()).add(name)
                    continue
                if self._bad_reason(key) is not None:
                    continue
            if self.cfg.fallback and self.monitor.busy:
                break   # do not add load while shedding it
            with self.lock:
                self.backlog.append((key, kind, pjson, meta, name))
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
                key, kind, pjson, meta, job = self.backlog.popleft()
                if key in self.cache or key in self.running:
                    continue
                self._wanted_by.setdefault(key, set()).add(job)
            try:
                self._start(key, kind, pjson, meta)
            except TransformError:
                pass            # logged and remembered by _read_raw
            except (OSError, RuntimeError) as err:
                log.warning("prefetch of %s failed: %s", key.path, err)

    def status(self) -> dict:
        with self.lock:
            return {**self.counts, **self.pool.counts, "cached": len(self.cache),
                    "cache_bytes": self.cache_bytes, "running": len(self.running),
                    "jobs": len(self.jobs), "held": len(self.holders), "held_bytes": self.held_bytes,
                    "backlog": len(self.backlog), "bad": len(self.bad),
                    "cpu_share": round(self.monitor.share, 3),
                    "busy": self.monitor.busy}

    def close(self) -> None:
        self.monitor.stop()
        self.pool.shutdown()
        if self._checks is not None:
            self._checks.shutdown()

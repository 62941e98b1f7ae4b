"""Storage-side transforms in the agent: `.tensor` samples made in a process pool, cached,
made ahead of the plan by predicted cost, and replaced by raw bytes for the share of samples
storage cannot finish before their step.

- `get(...)` returns the bytes of a `.tensor` file (hintfs.transforms.container format) for one sample:
  from the byte-bounded cache, from a transform already running (single-flight), or from a new
  transform in the pool. With fallback on, it returns the raw container instead (the client then
  transforms locally and gets the identical tensor) when the schedule sent the sample raw
  (`raw_planned`), when a sample the reader waits for was not started and the client would have
  it sooner (`raw_late`), or when the transform misses `deadline_ms` (`raw_deadline`). The CPU
  threshold (`cpu_enter`/`cpu_leave`: `raw_busy`) applies only while no mount sends plan steps
  (older mounts): it is all or nothing, which issue 40 replaced.
- `prefetch(samples, job, steps=...)` puts samples of a job's next plan steps in the backlog, and
  `forget(keep, job)` frees what that job's plan has passed. With the steps (issue 40) the backlog
  is scheduled by `policy.transform_sched`: each sample is due when its step is read (the job's
  step rate), its cost is predicted (the plan's estimate, the same source's last CPU time, or a
  per-kind line in its size learned from the transforms made), the workers take samples by latest
  start time (heavy ones earliest), the samples storage cannot finish in time at its measured
  capacity (transforms' wall time over their CPU time) are sent raw, cheapest first, with
  hysteresis, and the job's lookahead grows while the window's predicted load nears the capacity,
  within the job's share of `cache_bytes` (`lookahead_for`). The cache is held per job (issue 34,
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

import functools
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from collections.abc import Callable, Iterable

import psutil
from cachetools import FIFOCache, LRUCache

from hintfs.agent.transformpool import TransformPool
from hintfs.transforms.errors import TransformError, TransformTimeout, WorkerDied
from policy.transform_sched import (CLIENT_STEP_SHARE, MARGIN_STEPS, Capacity, Ewma, FixedShare, Horizon, Item, OnlineCosts,
                                    StepClock, client_cost_s, late_goes_raw, own_share, raw_rank, relief_rank, schedule,
                                    worth_raw)

log = logging.getLogger("hintfs.samples")

BAD_MAX = 4096              # sources remembered as failed (LRU)
DECODED_MAX = 65536         # image sources remembered as decoding, so that a raw container skips the check
SERVED_MAX = 65536          # samples handed out raw, remembered so that a later window does not queue them again
WORK_MAX = 65536            # video sources whose decode work (from their index) is remembered
WORK_BUDGET_S = 0.05        # the most time one plan window spends indexing new videos (the rest: later windows)
INDEX_AHEAD_STEPS = 8       # a window's new videos are indexed only this many steps past its readers
INDEX_INFLIGHT = 16         # video indexes asked of the check worker and not yet answered, at most
INDEX_LIMIT_S = 5.0         # the most one index (a demux, no decoding) may take in the check worker
CHECK_AHEAD_STEPS = 2       # an image sent raw is decode-checked ahead only this many steps past its job's readers
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
class Pending:
    """A sample in the backlog: what makes it, the jobs that want it, its plan step (None: an
    older mount's window, in arrival order) and its predicted CPU seconds."""
    kind: str
    pjson: str
    meta: dict
    job: str
    step: int | None
    cost_s: float
    seq: int
    jobs: set
    est_ms: float | None = None      # the plan's estimate


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
        self._checks: TransformPool | None = None
        self._check_procs: dict[int, psutil.Process] = {}
        self._probe_lock = threading.Lock()     # the pool's threads call _checks_cpu
        # the cores the agent and its workers may run on (the decode checks share them: _learn)
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.pool = TransformPool(load_cfg.workers, probe=self._checks_cpu)
        self.monitor = LoadMonitor(load_cfg.cpu_enter, load_cfg.cpu_leave)
        self.lock = threading.Lock()
        self.cache: OrderedDict[SampleKey, bytes] = OrderedDict()
        self.cache_bytes = 0
        self.holders: dict[SampleKey, set[str]] = {}   # cached samples held by jobs' plans
        self.held_bytes = 0                            # bytes of those (each sample once)
        self.jobs: dict[str, JobHold] = {}
        self.running: dict[SampleKey, Future] = {}
        self._wanted_by: dict[SampleKey, set[str]] = {}   # jobs whose prefetch a running transform is
        self.backlog: dict[SampleKey, Pending] = {}   # prefetches waiting for an idle worker
        self.order: list[SampleKey] = []              # the backlog's keys, first first (the last schedule)
        self.raw_keys: set[SampleKey] = set()         # backlog samples the schedule sends raw
        self._seq = 0
        # issue 40: predictions (policy/transform_sched.py)
        self.costs = OnlineCosts()
        self.capacity = Capacity()
        self.check_share = Ewma(0.1, 0.6)   # an image's decode check over its transform, CPU
        self.out_bytes = Ewma(0.02)         # bytes of a made sample (slow: it bounds the lookahead, see _grow)
        self.clocks: dict[str, StepClock] = {}
        self.horizons: dict[str, Horizon] = {}
        self._load: dict[str, tuple[float, int, int]] = {}   # job -> (predicted CPU s, steps, samples) of its window
        self._memo: dict[str, dict[tuple[str, int], tuple]] = {}   # job -> (path, seed) -> (key, meta, pjson)
        self.started: dict[SampleKey, tuple[float, float]] = {}  # running: (start, predicted wall s)
        self._grown: dict[str, tuple] = {}      # job -> (window's predicted load, steps its memory holds): status
        self._checking: tuple | None = None      # (source, future) of the decode check made ahead
        share = getattr(load_cfg, "fixed_raw_share", None)
        self.fixed = FixedShare(share) if share is not None else None
        self.fixed_rank = relief_rank if getattr(load_cfg, "fixed_raw_order", "client") == "relief" else raw_rank
        self.counts = {"tensor": 0, "raw_busy": 0, "raw_deadline": 0, "raw_planned": 0, "raw_late": 0,
                       "cache_hits": 0, "prefetched": 0, "errors": 0, "refused": 0, "decode_checks": 0}
        # sources whose transform failed: (path, size, mtime_ns, params_hash) -> (reason, expiry),
        # the first BAD_MAX remembered (a lookup does not keep one longer)
        self.bad: FIFOCache[tuple, tuple[str, float]] = FIFOCache(BAD_MAX)
        # image sources that decoded (same key): their raw containers need no decode check again
        self.decoded: LRUCache[tuple, None] = LRUCache(DECODED_MAX)
        # video sources (same key) -> (work group, frames to decode x megapixels) or None (not indexable)
        self.work: LRUCache[tuple, tuple[str, float] | None] = LRUCache(WORK_MAX)
        self.indexing: set[tuple] = set()    # video sources whose index the check worker makes now
        # samples handed out raw (the reader has them): not queued again by the windows that still
        # name them; and per plan step the predicted client work handed out raw (the client budget)
        self.served: LRUCache[SampleKey, None] = LRUCache(SERVED_MAX)
        self.client_used: dict[tuple[str, int], float] = {}   # (job, step) -> client work handed out raw

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
        self._memo.pop(job, None)
        self.clocks.pop(job, None)
        self.horizons.pop(job, None)
        self._load.pop(job, None)
        self._grown.pop(job, None)
        self._drop_backlog(job, set())
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
            self._drop_backlog(name, keep)
            memo = self._memo.get(name)
            if memo is not None:
                for pk in [pk for pk in memo if pk not in keep]:
                    del memo[pk]
            if not keep:
                self._end(name)
                return
            hold.window = set(keep)
            for key in [k for k in hold.held if (k.path, k.aug_seed) not in keep]:
                self._unhold(hold, name, key)

    def _drop_backlog(self, job: str, keep: set) -> None:
        """(under lock) `job` no longer wants its backlog samples outside `keep`; a sample no job
        wants leaves the backlog."""
        for key in [k for k, p in self.backlog.items() if job in p.jobs and (k.path, k.aug_seed) not in keep]:
            p = self.backlog[key]
            p.jobs.discard(job)
            if not p.jobs:
                del self.backlog[key]
                self.raw_keys.discard(key)

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
            pending = self.backlog.pop(key, None)
            cost = pending.cost_s if pending is not None else self._predict(key, kind)
            self.started[key] = (self.clock(), cost * self.capacity.slowdown)
        del raw

        def done(f: Future, key=key, kind=kind) -> None:
            with self.lock:
                self.running.pop(key, None)
                self.started.pop(key, None)
                jobs = self._wanted_by.pop(key, set())
            if not f.cancelled():
                err = f.exception()
                if err is None:
                    self._learn(key, kind, f)
                    if kind == "image":
                        # it decoded, with the decoder, options and bounds its check would use: a raw
                        # container of it needs no check (so a later epoch's image saves storage all
                        # its cost when sent raw, and is cheap for the client: issue 40, run 10)
                        with self.lock:
                            self.decoded[self._bad_key(key)] = None
                    self._put(key, f.result(), jobs)
                elif isinstance(err, TransformError):
                    self._refuse(key, err)
                else:
                    log.error("transform of %s failed: %s: %s", key.path, type(err).__name__, err)
            self._pump()

        fut.add_done_callback(done)
        return fut

    # -- predictions and the schedule (issue 40) ---------------------------------------------------
    @staticmethod
    def _group(key: SampleKey, kind: str) -> str:
        return f"{kind}/{os.path.splitext(key.path)[1].lower()[:12]}"

    def _predict(self, key: SampleKey, kind: str, est_ms: float | None = None) -> float:
        """(under lock) The sample's predicted CPU seconds."""
        bk = self._bad_key(key)
        return self.costs.predict(self._group(key, kind), key.size, bk, est_ms, self.work.get(bk))

    def _index_new(self, resolved: list, steps: list[int] | None = None, step: int | None = None) -> None:
        """The decode work of the window's videos whose cost is not known yet (their index:
        demuxed, no pixels decoded; ~1-5 ms a 2-10 s clip, 35 ms a 5-minute one), window order
        first: a video's size says little of its cost (`OnlineCosts`). The demux runs in the
        check worker, under the sample's limits (hostile media never reach a decoder in the
        agent's own process); this only reads the sources, for at most WORK_BUDGET_S a window,
        with at most INDEX_INFLIGHT indexes asked and not answered. Until its answer, a video is
        predicted from its size.

        Only the videos of the next INDEX_AHEAD_STEPS steps past the readers (`steps`, `step`):
        the lookahead grows to 64 steps and more near full load, and when it did its ~180 new
        videos were indexed within 3 s (reading each whole and sending it to the check worker):
        0.3-0.4 of the one storage core in the bench's steps 17-28, where the transforms due then
        ran at twice their CPU time and started late (issue 40, run 7). A video further ahead is
        predicted from its size until it comes nearer; the order of heavy samples ahead is set
        by then."""
        t_end = time.monotonic() + WORK_BUDGET_S
        for i, kind, (key, _meta, pjson) in resolved:
            if kind != "video":
                continue
            if steps is not None and step is not None and int(steps[i]) > int(step) + INDEX_AHEAD_STEPS:
                continue
            bk = self._bad_key(key)
            with self.lock:
                if bk in self.work or bk in self.indexing or bk in self.costs.sources or key in self.cache \
                        or key in self.running or len(self.indexing) >= INDEX_INFLIGHT:
                    continue
                if self._bad_reason(key) is not None:
                    continue
                self.indexing.add(bk)
            if time.monotonic() > t_end:
                with self.lock:
                    self.indexing.discard(bk)
                return
            try:
                fut = self._submit_index(key, kind, pjson)
            except (OSError, TransformError, RuntimeError):
                fut = None   # (what fails here is found by its transform)
            if fut is None:
                with self.lock:
                    self.indexing.discard(bk)
                    self.work[bk] = None
            else:
                fut.add_done_callback(functools.partial(self._indexed, bk, key, kind))

    def _submit_index(self, key: SampleKey, kind: str, pjson: str) -> Future:
        """A video's index asked of the check worker (its bytes read here, as for its transform:
        `_read_raw`, within the source bound)."""
        from hintfs.transforms.params import parse_params
        raw = self._read_raw(key, kind, pjson)
        return self.checks.submit((kind, raw, pjson, key.aug_seed, {"work_only": True}),
                                  min(parse_params(kind, pjson).time_limit_s, INDEX_LIMIT_S), key.path)

    def _indexed(self, bk: tuple, key: SampleKey, kind: str, fut: Future) -> None:
        """The check worker's answer: (work group, frames to decode x megapixels), or None."""
        work: tuple[str, float] | None = None
        try:
            codec, x = json.loads(fut.result())
            if isinstance(codec, str) and isinstance(x, (int, float)) and 0 <= x < 1e9:
                work = (f"{self._group(key, kind)}/{codec[:32]}#work", float(x))
        except Exception:      # noqa: BLE001 (a refused or dead index: the transform reports it)
            work = None
        with self.lock:
            self.indexing.discard(bk)
            self.work[bk] = work

    def _learn(self, key: SampleKey, kind: str, f: Future) -> None:
        """A transform is done: its CPU time teaches the cost model, its wall time over that the
        capacity, its size the bytes a sample holds. The capacity is not taught by a worker's
        first task (its wall time includes the worker's start-up), and the CPU the decode checks
        took from the transform meanwhile counts as the agent's work (`own_share`), not as lost
        capacity: the schedule counts the checks already."""
        cpu, wall = getattr(f, "cpu_s", None), getattr(f, "wall_s", None)
        with self.lock:
            if cpu:
                bk = self._bad_key(key)
                self.costs.observe(self._group(key, kind), key.size, bk, cpu, self.work.get(bk))
                if wall and not getattr(f, "fresh", False):
                    own = own_share(getattr(f, "probe_s", 0.0) or 0.0, wall, self.cores, self.cfg.workers)
                    self.capacity.observe(wall, cpu, own)
            self.out_bytes.add(len(f.result()))

    def _checks_cpu(self) -> float:
        """CPU seconds the decode checks' workers have used so far (the transform pool's probe:
        its futures' `probe_s` is what they used during a transform)."""
        checks = self._checks
        if checks is None:
            return 0.0
        with self._probe_lock:
            return self._sum_cpu(checks.pids())

    def _sum_cpu(self, pids: list[int]) -> float:
        """(under _probe_lock) The CPU seconds of these processes so far."""
        total = 0.0
        for pid in [p for p in self._check_procs if p not in pids]:
            del self._check_procs[pid]
        for pid in pids:
            try:
                proc = self._check_procs.get(pid)
                if proc is None:
                    proc = self._check_procs[pid] = psutil.Process(pid)
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                self._check_procs.pop(pid, None)
        return total

    def _needs_check(self, key: SampleKey, kind: str) -> bool:
        """(under lock) Whether the sample's raw container waits for a decode check on storage: an
        image not known to decode, unless the config asks only the decoder-free checks of images
        (`transform_load.image_raw_check = "header"`, as for videos)."""
        return (kind == "image" and getattr(self.cfg, "image_raw_check", "decode") == "decode"
                and self._bad_key(key) not in self.decoded)

    def _raw_cost(self, key: SampleKey, kind: str, cost_s: float) -> float:
        """(under lock) Storage CPU seconds of the sample's raw container: an image not known to
        decode is decoded once (the check)."""
        if self._needs_check(key, kind):
            return cost_s * (self.check_share.value or 0.0)
        return 0.0

    def _remaining(self, now: float) -> tuple[float, float]:
        """(under lock) Predicted wall seconds until a worker is free, and until all running work is
        done per worker."""
        left = [max(0.0, t0 + w - now) for t0, w in self.started.values()]
        free = 0.0 if len(self.running) < self.cfg.workers else (min(left) if left else 0.0)
        return free, sum(left) / max(1, self.cfg.workers)

    def _reschedule(self) -> None:
        """(under lock) Order the backlog by latest start time and choose what goes raw."""
        now = self.clock()
        items = []
        for key, p in list(self.backlog.items()):
            if key in self.cache or key in self.running:
                del self.backlog[key]
                continue
            p.cost_s = self._predict(key, p.kind, p.est_ms)     # what was learned since
            deadline = None
            clock = self.clocks.get(p.job)
            if p.step is not None and clock is not None:
                due = clock.due(p.step, now)
                if due is not None:
                    deadline = due - MARGIN_STEPS * (clock.seconds_per_step or 0.0)
            items.append(Item(key, deadline, p.cost_s, self._raw_cost(key, p.kind, p.cost_s), p.seq,
                              None if p.step is None else (p.job, p.step), client_cost_s(p.cost_s, key.size)))
        self.raw_keys &= self.backlog.keys()
        _free, busy = self._remaining(now)
        if self.fixed is not None:
            sched = schedule(items, now, busy, self.cfg.workers, self.capacity.slowdown, fallback=False)
            sched.order = [k for k in sched.order if k not in self.raw_keys]
        else:
            sps = [c.seconds_per_step for c in self.clocks.values() if c.seconds_per_step]
            for job_step in list(self.client_used):   # steps their job's readers have passed
                clock = self.clocks.get(job_step[0])
                if clock is None or (clock.step is not None and job_step[1] < clock.step):
                    del self.client_used[job_step]
            sched = schedule(items, now, busy, self.cfg.workers, self.capacity.slowdown, self.raw_keys,
                             fallback=self.cfg.fallback,
                             client_s=CLIENT_STEP_SHARE * min(sps) if sps else None,
                             client_used=self.client_used)
            self.raw_keys = sched.raw
        self.order = sched.order

    def _eligible(self, p: Pending) -> bool:
        """(under lock) Within its job's horizon (the grown lookahead past its readers' step)."""
        if p.step is None:
            return True
        clock, horizon = self.clocks.get(p.job), self.horizons.get(p.job)
        if clock is None or clock.step is None or horizon is None:
            return True
        return p.step <= clock.step + horizon.steps

    def _grow(self, name: str, hold: JobHold, lookahead: int | None) -> None:
        """(under lock) The job's horizon from its window's predicted load and its memory share."""
        horizon = self.horizons.get(name)
        if horizon is None:
            horizon = self.horizons[name] = Horizon(lookahead if lookahead is not None else self.cfg.lookahead_steps)
        elif lookahead is not None:
            horizon.base = lookahead
        most = max(horizon.base, self.cfg.lookahead_max_steps)
        load = None
        clock = self.clocks.get(name)
        work, span, n = self._load.get(name, (0.0, 0, 0))
        sps = clock.seconds_per_step if clock is not None else None
        if sps and span:
            load = work * self.capacity.slowdown / (span * sps * max(1, self.cfg.workers))
        fit = most
        if self.out_bytes.value and span and n:
            others = self.held_bytes - hold.bytes
            allowance = min(self.cfg.cache_bytes * JOB_SHARE, self.cfg.cache_bytes - others)
            fit = int(max(0.0, allowance) // max(1.0, self.out_bytes.value * n / span)) - 1
        horizon.update(load, fit, most)
        self._grown[name] = (round(load, 3) if load is not None else None, fit)

    def lookahead_for(self, job: str | None) -> int | None:
        """The steps past its readers that `job`'s windows should reach (None: not scheduled)."""
        with self.lock:
            h = self.horizons.get(SHARED_JOB if job is None else job)
            return h.steps if h is not None else None

    def _raw_container(self, kind: str, pjson: str, key: SampleKey, meta: dict) -> bytes:
        """The raw-mode `.tensor` of a sample, after the checks that need no decoder (size,
        truncation, an image's header against the limits, a video's container) and, for an
        image, one decode in a worker (`_decodes`; not with `image_raw_check = "header"`): what
        fails them is EIO here and remembered, never handed out raw. A `.tensor` holds only bytes
        the transform accepts; for a video (and an image checked by its header only), damage
        inside its frames is found by the client's transform of the raw bytes (`load_sample`:
        EIO) and by the agent's own transform when it runs."""
        from hintfs.transforms.container import encode_raw, make_meta
        from hintfs.transforms.limits import precheck
        from hintfs.transforms.params import parse_params
        raw = self._read_raw(key, kind, pjson)
        try:
            p = parse_params(kind, pjson)
            precheck(kind, raw, p)
            with self.lock:
                check = self._needs_check(key, kind)
            if check:
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
            ahead = self._checking
        if ahead is not None and ahead[0] == bk and ahead[1] is not None:
            fut = ahead[1]               # checked ahead right now (`_check_ahead`): its answer
        else:
            fut = self._submit_check(key, kind, raw, pjson, meta, limit)
        fut.result()
        self._checked(key, kind, fut)

    def _submit_check(self, key: SampleKey, kind: str, raw: bytes, pjson: str, meta: dict, limit: float) -> Future:
        """One decode of the source in the check worker, as the transform decodes it."""
        return self.checks.submit((kind, raw, pjson, key.aug_seed, {**meta, "check_only": True}), limit, key.path)

    def _checked(self, key: SampleKey, kind: str, fut: Future) -> None:
        """A decode check passed: remembered, and its CPU time teaches the check's share."""
        bk = self._bad_key(key)
        with self.lock:
            if bk in self.decoded:
                return
            self.decoded[bk] = None
            cpu = getattr(fut, "cpu_s", None)
            if cpu:
                self.check_share.add(min(1.5, cpu / self._predict(key, kind)))
        self.counts["decode_checks"] += 1

    def _check_ahead(self) -> None:
        """Decode-check ahead one image the schedule sends raw (the earliest step first), so that
        its raw container needs no check when it is read: the reader does not wait for the check
        worker, on a core the transforms keep busy. One check ahead in flight at a time; its
        storage CPU is what the schedule counts as the image's raw cost.

        Only images of the next CHECK_AHEAD_STEPS steps past their job's readers: the schedule
        counts a check as storage work at its sample's place in deadline order, not at once.
        Before, every image designated raw over the whole grown lookahead (up to ~300 in the
        bench's first epoch) was checked at once, back to back: the check worker took 0.18-0.43 s
        (mostly 0.33-0.43) of each second of the one storage core in steps 17-42 of a traced
        L95, the transforms due then ran at twice their CPU time and started late (heavy videos'
        `.tensor` opens waited 146-343 ms), and 234 of the 316 images designated raw were made on storage after
        all (the designation of a far step changes as the capacity is learned): their checks
        were wasted (issue 40, run 7)."""
        with self.lock:
            if self._checking is not None or not self.cfg.fallback:
                return
            pick = None
            for key in self.raw_keys:
                p = self.backlog.get(key)
                if p is None or not self._needs_check(key, p.kind):
                    continue
                if self._bad_reason(key) is not None:
                    continue
                clock = self.clocks.get(p.job)
                if p.step is not None and clock is not None and clock.step is not None \
                        and p.step > clock.step + CHECK_AHEAD_STEPS:
                    continue
                rank = (p.step if p.step is not None else 1 << 62, p.seq)
                if pick is None or rank < pick[0]:
                    pick = (rank, key, p)
            if pick is None:
                return
            _rank, key, p = pick
            self._checking = (self._bad_key(key), None)
        from hintfs.transforms.limits import precheck
        from hintfs.transforms.params import parse_params
        try:
            raw = self._read_raw(key, p.kind, p.pjson)
            params = parse_params(p.kind, p.pjson)
            precheck(p.kind, raw, params)
            fut = self._submit_check(key, p.kind, raw, p.pjson, p.meta, params.time_limit_s)
        except TransformError as err:
            self._refuse(key, err)
            with self.lock:
                self._checking = None
            return
        except (OSError, RuntimeError) as err:
            log.warning("decode check of %s failed: %s", key.path, err)
            with self.lock:
                self._checking = None
            return
        with self.lock:
            self._checking = (self._bad_key(key), fut)
        del raw

        def done(f: Future, key=key, kind=p.kind) -> None:
            if not f.cancelled():
                err = f.exception()
                if err is None:
                    self._checked(key, kind, f)
                elif isinstance(err, TransformError):
                    self._refuse(key, err)
            with self.lock:
                self._checking = None
            if not f.cancelled():
                self._check_ahead()

        fut.add_done_callback(done)

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
        how = None
        if fallback and not running:
            with self.lock:
                how = self._raw_now(key, kind)
        try:
            if how is not None:
                data = self._raw_container(kind, pjson, key, meta)
                with self.lock:
                    self._served(key, self.backlog.pop(key, None))
                    self.raw_keys.discard(key)
                self.counts[how] += 1
                return data, how
            fut = self._start(key, kind, pjson, meta)
            try:
                data = fut.result(timeout=self.cfg.deadline_ms / 1000.0 if fallback and self.fixed is None
                                  else None)
            except FutureTimeout:
                data = self._raw_container(kind, pjson, key, meta)
                with self.lock:
                    self._served(key, None)
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

    def _served(self, key: SampleKey, p: Pending | None) -> None:
        """(under lock) `key` was handed out raw: the windows that still name it (its step is
        being read) do not queue it again, and its predicted client work counts against its
        step's client budget. Before, each such sample came back into the backlog as storage
        work (issue 40, run 6: all 248 raw samples of a traced 150-step L95, 26 of them then
        made anyway, 8% of the transforms' CPU), and the step's next samples were sent raw past
        the budget (one step: 252 ms of raw decodes against 92). (A plan that reads the same
        sample with the same seed again gets it on demand then: SERVED_MAX, least recently used.)"""
        self.served[key] = None
        if p is not None and p.step is not None:
            self.client_used[(p.job, p.step)] = (self.client_used.get((p.job, p.step), 0.0)
                                                 + client_cost_s(p.cost_s, key.size))

    def _raw_now(self, key: SampleKey, kind: str) -> str | None:
        """(under lock) Why a sample a reader waits for, not running, goes raw now, or None: the
        schedule sent it raw; or it was not started and the client would have it sooner
        (`late_goes_raw`); with no mount sending steps, the CPU threshold (older mounts)."""
        if key in self.raw_keys:
            return "raw_planned"
        if self.fixed is not None:
            return None                 # a fixed share: only the chosen samples go raw
        if self.clocks:
            cost = self._predict(key, kind)
            free, _busy = self._remaining(self.clock())
            if late_goes_raw(free, cost, self.capacity.slowdown, self._raw_cost(key, kind, cost),
                             client_cost_s(cost, key.size)):
                return "raw_late"
            return None
        return "raw_busy" if self.monitor.busy else None

    def peek(self, path: str, kind: str, params, aug_seed: int) -> bytes | None:
        """The cached `.tensor` bytes of this sample, or None (nothing is started)."""
        key, _meta, _pjson = self._key_and_meta(path, kind, params, aug_seed)
        with self.lock:
            return self._cached(key)

    def prefetch(self, samples: list[tuple[str, str, object, int]], job: str | None = None,
                 steps: list[int] | None = None, step: int | None = None, costs: list[float] | None = None,
                 lookahead: int | None = None) -> int:
        """Queue transforms for (path, kind, params, aug_seed) not cached or running yet, for
        `job`'s plan (None: the shared job of older mounts): it holds them once made (`_put`).
        With `steps` (each sample's plan step) and `step` (its readers' step) the backlog is
        scheduled by deadline (issue 40); `costs`: the plan's est_cost_ms (0: none)."""
        started = 0
        scheduled = steps is not None and step is not None
        with self.lock:
            name, hold = self._job(job)
            hold.window |= {(p, int(seed)) for p, _k, _params, seed in samples}
            if step is not None and steps is not None:
                self.clocks.setdefault(name, StepClock()).observe(int(step), self.clock())
            memo = self._memo.setdefault(name, {}) if name in self.jobs else {}
        # the sources not seen in this job's window yet: stat and parameters (outside the lock)
        resolved: list = []
        for i, (path, kind, params, seed) in enumerate(samples):
            ent = memo.get((path, int(seed)))
            if ent is None:
                try:
                    ent = self._key_and_meta(path, kind, params, seed)
                except (OSError, ValueError):
                    continue
                memo[(path, int(seed))] = ent
            resolved.append((i, kind, ent))
        if scheduled:
            self._index_new(resolved, steps, step)
        work = 0.0
        old_mount = not scheduled and self.cfg.fallback and self.monitor.busy and not self.clocks
        with self.lock:       # one hold of the lock for the window (a window is up to MAX_BATCH samples)
            for i, kind, (key, meta, pjson) in resolved:
                est = costs[i] if costs is not None and costs[i] > 0 else None
                cost = self._predict(key, kind, est)
                work += cost
                sstep = int(steps[i]) if scheduled and steps is not None else None
                if key in self.cache:
                    if name in self.jobs:
                        self._hold(hold, name, key, len(self.cache[key]))
                    continue
                if key in self.served:
                    continue
                if key in self.running:
                    self._wanted_by.setdefault(key, set()).add(name)
                    continue
                p = self.backlog.get(key)
                if p is not None:
                    p.jobs.add(name)
                    if sstep is not None and (p.step is None or (p.job == name and sstep < p.step)):
                        p.step, p.job = sstep, name
                    continue
                if self._bad_reason(key) is not None:
                    continue
                if old_mount:
                    break   # an older mount: do not add load while shedding it
                self._seq += 1
                self.backlog[key] = Pending(kind, pjson, meta, name, sstep, cost, self._seq, {name}, est)
                if self.fixed is not None:
                    it = Item(key, None, cost, self._raw_cost(key, kind, cost), client_s=client_cost_s(cost, key.size))
                    if worth_raw(it) and self.fixed.decide(self.fixed_rank(it)):
                        self.raw_keys.add(key)
                started += 1
        with self.lock:
            if scheduled and steps:
                self._load[name] = (work, max(steps) - min(steps) + 1, len(samples))
            if scheduled:
                self._grow(name, hold, lookahead)
            self._reschedule()
        self.counts["prefetched"] += started
        self._pump()
        self._check_ahead()
        return started

    def _pump(self) -> None:
        """Feed the backlog to the pool in the schedule's order, only while it has idle workers,
        so a sample a reader is waiting for (submitted directly by `get`) never queues behind the
        lookahead. Samples sent raw, and samples past their job's horizon, wait."""
        while True:
            with self.lock:
                if len(self.running) >= self.cfg.workers:
                    return
                pick = None
                for i, key in enumerate(self.order):
                    p = self.backlog.get(key)
                    if p is None or key in self.cache or key in self.running:
                        continue
                    if key in self.raw_keys or not self._eligible(p):
                        continue
                    pick = (i, key, p)
                    break
                if pick is None:
                    self.order = [k for k in self.order if k in self.backlog]
                    return
                i, key, p = pick
                del self.order[i]
                self._wanted_by.setdefault(key, set()).update(p.jobs)
            try:
                self._start(key, p.kind, p.pjson, p.meta)
            except TransformError:
                with self.lock:
                    self.backlog.pop(key, None)     # logged and remembered by _read_raw
            except (OSError, RuntimeError) as err:
                with self.lock:
                    self.backlog.pop(key, None)
                log.warning("prefetch of %s failed: %s", key.path, err)

    def status(self) -> dict:
        with self.lock:
            return {**self.counts, **self.pool.counts, "cached": len(self.cache),
                    "cache_bytes": self.cache_bytes, "running": len(self.running),
                    "jobs": len(self.jobs), "held": len(self.holders), "held_bytes": self.held_bytes,
                    "backlog": len(self.backlog), "bad": len(self.bad),
                    "raw_designated": len(self.raw_keys),
                    "slowdown": round(self.capacity.slowdown, 3),
                    "lookahead": max((h.steps for h in self.horizons.values()), default=None),
                    "window_load": {j: v[0] for j, v in list(self._grown.items())[:16]},
                    "window_fit": {j: v[1] for j, v in list(self._grown.items())[:16]},
                    "cpu_share": round(self.monitor.share, 3),
                    "busy": self.monitor.busy}

    def close(self) -> None:
        self.monitor.stop()
        self.pool.shutdown()
        if self._checks is not None:
            self._checks.shutdown()

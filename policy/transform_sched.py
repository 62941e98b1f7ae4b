"""Scheduling storage-side transforms by predicted cost (issue 40): pure, no I/O, time passed in.

The agent (hintfs/agent/samples.py) holds a backlog of samples its jobs' plans want, each due when
its plan step is read. This module decides, from predictions only:

- **when each step is read** (`StepClock`: the job's step rate, an EWMA of the seconds per step
  the mount's plan windows report);
- **what a sample costs** (`OnlineCosts`: the plan's `est_cost_ms` when the mount passes it, else
  the CPU time the same source took before, else a per-group (kind and extension) line in the
  source's size, fitted online from the transforms already made);
- **how fast storage runs now** (`Capacity`: the wall time of transforms over their CPU time,
  EWMA: 1 on an idle core, 2 when a burner takes half of it; the agent's own decode checks, which
  the schedule counts as work of their own, are not counted as lost capacity: `own_share`);
- **the order** (`schedule`): by latest start time, deadline minus predicted wall cost, so heavy
  samples start earliest and nothing starts later than it must;
- **what goes raw** (`schedule`): the samples storage cannot finish before their step at the
  measured capacity, the cheapest for the client first (`raw_rank`; a sample whose raw container
  saves storage less than MIN_SAVED_SHARE of its cost, such as an image not checked yet, whose raw
  container still costs its decode check on storage, is not sent raw), within a client budget per
  step of a job (a sample's client work is its transform and its raw bytes, `client_cost_s`; what was
  handed out raw already counted: `client_used`), with hysteresis: a
  sample is newly sent raw only when the schedule misses at `slowdown x (1 + h)`, and one sent raw
  before goes back to storage only when the schedule meets its deadlines at `slowdown x (1 + 2h)`;
- **how far ahead** (`Horizon`): the lookahead doubles while the predicted load of the window is
  near the capacity and halves when it is well under it, within the steps the job's memory share
  holds;
- **a fixed raw share** (`FixedShare`, for measurement): the cheapest `share` of the samples worth
  sending raw, by the running distribution of their `raw_rank`.
"""
from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from policy.linefit import ForgettingLine

DEFAULT_COST_S = 0.05       # a sample's predicted CPU cost before anything was measured
MIN_COST_S = 0.0005
MAX_COST_S = 600.0
SOURCES_MAX = 65536         # sources whose last measured cost is remembered
SLOWDOWN_MIN, SLOWDOWN_MAX = 0.5, 50.0
HYSTERESIS = 0.05           # h above
MARGIN_STEPS = 0.5          # a sample is due this much of a step before its step is read
CLIENT_STEP_SHARE = 0.8     # of a step: the most predicted client work sent raw per plan step (0.5 until
#                             the client read `.tensor` steps in a thread, hintfs.dataset.prefetch: under
#                             the bench's burner 0.5 left storage behind, p99 234 ms; 0.8 gave 37-75 ms)
MIN_SAVED_SHARE = 0.5       # of its cost: the least storage work a sample sent raw by the schedule must save
RAW_CLIENT_BYTES_PER_S = 100e6  # what a raw container's bytes cost the client besides the decode (read from the
#                             agent, through the mount and into the reader: a 62 MB clip sent raw under the bench's
#                             burner took the client 1.6 s against its 0.16 s transform, a step's stall of 1.1 s)
GROW_AT, SHRINK_AT = 0.7, 0.4   # predicted load of the window (work / capacity) that grows / shrinks the lookahead


class Ewma:
    """Exponentially weighted mean; None until the first value."""

    def __init__(self, alpha: float, value: float | None = None):
        self.alpha = alpha
        self.value = value

    def add(self, x: float) -> float:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        return self.value


class StepClock:
    """When a job's steps are read: the step its readers are at, and an EWMA of seconds per step
    from the times the step moved (the first move, from the registered step, is not counted: it
    includes the job's set-up)."""

    def __init__(self, alpha: float = 0.2):
        self.rate = Ewma(alpha)
        self.step: int | None = None
        self.since: float = 0.0          # when `step` was reached
        self._moves = 0

    def observe(self, step: int, now: float) -> None:
        if self.step is None:
            self.step, self.since = step, now
            return
        if step > self.step:
            if self._moves > 0:
                self.rate.add((now - self.since) / (step - self.step))
            self._moves += 1
            self.step, self.since = step, now
        elif step < self.step:           # a new registration went back: start over
            self.step, self.since, self._moves = step, now, 0

    @property
    def seconds_per_step(self) -> float | None:
        return self.rate.value

    def due(self, step: int, now: float) -> float | None:
        """When `step` is read (a time on the clock of `now`), or None while the rate is unknown."""
        sps = self.rate.value
        if sps is None or self.step is None:
            return None
        # the current step may already have taken longer than a step: never in the past for later steps
        base = max(self.since, now - sps) if step > self.step else self.since
        return base + (step - self.step) * sps


class _Line:
    """y = a + b x by least squares with forgetting (`decay` per observation; policy.linefit)."""

    def __init__(self, decay: float = 0.995):
        self.fit = ForgettingLine(decay)

    def add(self, x: float, y: float) -> None:
        self.fit.add(x, y)

    def predict(self, x: float) -> float | None:
        if self.fit.weight < 1:
            return None
        mx, my = self.fit.means()
        b = self.fit.slope(1e-12) if self.fit.weight >= 3 else None
        if b is None or b < 0:           # one size seen, or more bytes predicting less work
            return my
        return my + b * (x - mx)


class OnlineCosts:
    """Predicted CPU seconds of a sample: the plan's estimate when given, else the last measured
    cost of the same source (same parameters), else its work group's line in its decode work
    (a video's frames to decode x pixels, when the agent indexed it), else its group's line in
    MiB of source, else the mean of all measured, else DEFAULT_COST_S.

    A video's size says little of its cost (the bench's clips: correlation 0.3, 35-155 ms, its
    three long clips 22-62 MB costing what a 2 MB one does, which flattened the size line to the
    mean); the frames its K targets make the decoder decode (its GOP and frame count, from the
    demuxed index) times its pixels, per codec, do (correlation 0.89-0.93, mean error 7-8 ms
    against 18 ms; issue 40, run 6)."""

    def __init__(self, sources_max: int = SOURCES_MAX):
        self.sources: OrderedDict[Hashable, float] = OrderedDict()
        self.sources_max = sources_max
        self.groups: dict[str, _Line] = {}
        self.mean = Ewma(0.05)

    def observe(self, group: str, size_bytes: int, source: Hashable, cpu_s: float,
                work: tuple[str, float] | None = None) -> None:
        """`work`: (its group, its x) when the sample's decode work is known before its transform
        (a video's frames to decode x pixels, from its index): that group's line in x learns too."""
        cpu_s = min(max(float(cpu_s), MIN_COST_S), MAX_COST_S)
        self.sources[source] = cpu_s
        self.sources.move_to_end(source)
        while len(self.sources) > self.sources_max:
            self.sources.popitem(last=False)
        self.mean.add(cpu_s)
        for g, x in ((group, size_bytes / 2**20), *((work,) if work is not None else ())):
            line = self.groups.get(g)
            if line is None:
                if len(self.groups) >= 64:
                    continue
                line = self.groups[g] = _Line()
            line.add(x, cpu_s)

    def predict(self, group: str, size_bytes: int, source: Hashable, est_ms: float | None = None,
                work: tuple[str, float] | None = None) -> float:
        """`work`: as for `observe`; its group's line, once it has seen a transform, comes before
        the size's."""
        if est_ms is not None and est_ms > 0:
            return min(max(est_ms / 1000.0, MIN_COST_S), MAX_COST_S)
        known = self.sources.get(source)
        if known is not None:
            return known
        y = None
        if work is not None and work[0] in self.groups:
            y = self.groups[work[0]].predict(work[1])
        line = self.groups.get(group)
        if y is None and line is not None:
            y = line.predict(size_bytes / 2**20)
        if y is None:
            y = self.mean.value if self.mean.value is not None else DEFAULT_COST_S
        return min(max(y, MIN_COST_S), MAX_COST_S)


def own_share(other_cpu_s: float, wall_s: float, cores: int, workers: int) -> float:
    """CPU seconds a transform's worker lost, during its `wall_s`, to `other_cpu_s` of the agent's
    own other work (its decode checks, run in a process of their own) on the agent's `cores`:
    that work first takes the cores the `workers` leave idle; the rest is taken from the workers,
    evenly. One core, one worker: all of it (the transform's wall time is its CPU plus the check's)."""
    spare = max(0, cores - workers) * max(0.0, wall_s)
    return max(0.0, other_cpu_s - spare) / max(1, workers)


class Capacity:
    """Wall seconds per CPU second of the agent's work (EWMA) from its transforms: how much slower
    than one idle core storage runs now (a burner taking half the core: ~2).

    `own_s` (`own_share`): the CPU the transform lost to the agent's own decode checks. The
    schedule counts a check as storage work of its own (`Item.raw_cost_s`), so it is added to the
    transform's CPU, not taken as lost capacity: counted both ways, a core busy with checks read
    ~2 (one core: the transform and the check share it) and sent more samples raw, whose images
    need more checks (issue 40, the L95 stalls)."""

    def __init__(self, alpha: float = 0.1):
        self.ratio = Ewma(alpha)

    def observe(self, wall_s: float, cpu_s: float, own_s: float = 0.0) -> None:
        if cpu_s <= 0.002 or wall_s <= 0:     # too short to tell
            return
        self.ratio.add(min(max(wall_s / (cpu_s + max(0.0, own_s)), SLOWDOWN_MIN), SLOWDOWN_MAX))

    @property
    def slowdown(self) -> float:
        return self.ratio.value if self.ratio.value is not None else 1.0


@dataclass
class Item:
    key: Hashable
    deadline: float | None       # when it is read (None: no plan step known: after the others, in order)
    cost_s: float                # predicted CPU seconds on storage
    raw_cost_s: float = 0.0      # storage CPU seconds when it goes raw instead (an image's decode check)
    seq: int = 0                 # arrival order (ties, and the order of items without a deadline)
    step: Hashable | None = None  # its plan step, with its job ((job, step) in the agent): the client's
    #                               budget for raw samples is per step of a job, not shared by jobs at the same step
    client_s: float | None = None  # predicted client seconds when it goes raw (None: cost_s; `client_cost_s`)

    @property
    def client_work(self) -> float:
        return self.cost_s if self.client_s is None else self.client_s

    @property
    def saved_s(self) -> float:
        """Storage CPU seconds saved when it goes raw (its transform less its raw container's)."""
        return self.cost_s - self.raw_cost_s


@dataclass
class Schedule:
    order: list = field(default_factory=list)      # keys to make, first first (raw ones left out)
    raw: set = field(default_factory=set)          # keys to send raw


def _charge(used: dict, it: Item, client_s: float | None) -> bool:
    """Whether `it` fits its step's client budget (`client_s`, None: no bound; an item without a
    step always fits); if so, its client work is added to the step's tally in `used`."""
    if client_s is None or it.step is None:
        return True
    if used.get(it.step, 0.0) + it.client_work > client_s:
        return False
    used[it.step] = used.get(it.step, 0.0) + it.client_work
    return True


def _shed(items: list[Item], t0: float, per_worker: float, slowdown: float, prefer: set,
          client_s: float | None = None, client_used: dict | None = None) -> set:
    """Keys to send raw so that, at `per_worker` wall seconds per CPU second of work (the workers
    as one machine), every other item in deadline order finishes by its deadline: an item that
    cannot make it even alone goes itself; else, of those before it, the one saving storage the
    most per client work (then the cheapest; those in `prefer` first).
    `client_s`: at most this much predicted client work goes raw per plan step (the client decodes
    a step's raw samples in that step: past it, the client would stall instead); `client_used`:
    per step, the client work of samples already handed out raw (no longer items here)."""
    t = t0
    heap: list = []
    shed: set = set()
    client: dict = dict(client_used or {})

    for it in items:
        d = it.deadline
        assert d is not None
        # a sample whose raw container costs storage nearly what its transform does (an image not
        # checked yet: its decode check, 0.86-0.92 of the transform) is not sent raw: the client
        # would decode it all to save storage a tenth, and its check runs when it is read or just
        # before, beside the transforms due then. In the bench's first epoch (traced L95, issue
        # 40 run 7) 82-158 such images went raw in a 150-step run; with the checks made ahead
        # their check worker took up to 0.43 of the one storage core in steps 17-42, where the
        # heavy videos due then waited. A video, or an image checked before, saves all of it.
        worth = worth_raw(it)
        if worth and t0 + it.cost_s * slowdown > d and _charge(client, it, client_s):    # hopeless however the others go
            shed.add(it.key)
            t += it.raw_cost_s * per_worker
            continue
        t += it.cost_s * per_worker
        # cheapest for the client first (`raw_rank`: its client work times its client work per
        # storage work saved), as issue 40 asks: the client decodes those fastest. Run 14 (issue
        # 40; images decoded without FFmpeg's probe, so an image costs storage 7.3 ms and a video
        # 87 in the bench): under the burner, n = 2,000 samples a run, p99 0.2 ms in every run,
        # raw 0.47 and 0.47 with decode checks, 0.76 with header checks, the trainer 13.7-13.8 and
        # 13.1 ms a sample, within its bound (raw share x the client-only mean + 1 ms: 18.4-18.6,
        # 28.5). In the order before (`relief_rank`, the most storage saved per client work first)
        # the same run set sent 0.17-0.20 raw, mostly videos at ~59 ms of client CPU each: 14.1 and
        # 12.2 ms against bounds of 7.4 and 7.8. Measured per kind (C0, traced, n = 1,334 images and
        # 666 videos), the client spends 1.14x storage's transform on an image and 1.06x on a video:
        # shedding cheap samples costs the trainer a few percent more for the same relief. (Run 10,
        # when an image's decode was 0.86-0.92 of its transform through the demuxer's probe and
        # before the per-step client budget, cheapest first stalled under the burner: p99 111 and
        # 55 ms; an image not checked yet is still never sent raw here: `worth_raw`.)
        if worth:
            heapq.heappush(heap, (0 if it.key in prefer else 1, raw_rank(it), it.cost_s,
                                  it.seq, id(it), it))
        while t > d and heap:
            victim = heapq.heappop(heap)[-1]
            gain = victim.saved_s * per_worker
            if gain <= 0 or not _charge(client, victim, client_s):
                continue
            t -= gain
            shed.add(victim.key)
    return shed


def worth_raw(it: Item) -> bool:
    """Whether sending `it` raw saves storage at least MIN_SAVED_SHARE of its cost (`_shed`)."""
    return it.saved_s >= MIN_SAVED_SHARE * it.cost_s


def raw_rank(it: Item) -> float:
    """A fixed raw share's order (`FixedShare`), lowest first: the client's work for the sample,
    times its client work per storage work saved. Among samples that save storage all their cost
    (a video; an image checked before) and cost the client about that much, the cheapest go first,
    since the client decodes them fastest (issue 40); a raw container that costs the client more
    than it saves storage (a long clip's bytes) goes later. The schedule's order too (`_shed`,
    since run 14)."""
    return it.client_work * relief_rank(it)


def relief_rank(it: Item) -> float:
    """The client's work per storage work saved, lowest first (the most storage relief per unit of
    client work): a fixed share's order for measurement (`transform_load.fixed_raw_order =
    "relief"`; issue 40, run 12), and the schedule's own order until run 14 (`_shed`)."""
    return it.client_work / max(it.saved_s, 1e-9)


def _within_client(items: list[Item], first: set, more: set, client_s: float | None,
                   client_used: dict | None = None) -> set:
    """`first` and those of `more` that fit the per-step client budget left by `first` (`more`:
    samples kept raw by the hysteresis; each of the two sheds fits the budget alone, their union
    need not: issue 40, run 6, where steps got up to 172 ms of raw decodes against 92)."""
    if client_s is None or not more:
        return first | more
    used: dict = dict(client_used or {})
    for it in items:
        if it.key in first and it.step is not None:
            used[it.step] = used.get(it.step, 0.0) + it.client_work
    out = set(first)
    for it in items:
        if it.key in more and _charge(used, it, client_s):
            out.add(it.key)
    return out


def schedule(items: Iterable[Item], now: float, busy_s: float = 0.0, workers: int = 1,
             slowdown: float = 1.0, prev_raw: set | None = None, fallback: bool = True,
             hysteresis: float = HYSTERESIS, client_s: float | None = None,
             client_used: dict | None = None) -> Schedule:
    """The order to make `items` in and which go raw (see the module's docstring).

    `busy_s`: predicted wall seconds until the running transforms are done (per worker, mean);
    `prev_raw`: the keys sent raw by the previous schedule (kept raw unless clearly feasible);
    `client_s`: the most predicted client work sent raw per plan step (None: no bound);
    `client_used`: per plan step, the predicted client work of its samples already handed out raw."""
    items = list(items)
    prev = prev_raw or set()
    workers = max(1, workers)
    timed = sorted((it for it in items if it.deadline is not None), key=lambda it: (it.deadline, it.seq))
    t0 = now + max(0.0, busy_s)
    raw: set = set()
    if fallback and timed:
        lo = _shed(timed, t0, slowdown * (1 + hysteresis) / workers, slowdown * (1 + hysteresis), prev, client_s,
                   client_used)
        hi = _shed(timed, t0, slowdown * (1 + 2 * hysteresis) / workers, slowdown * (1 + 2 * hysteresis), prev,
                   client_s, client_used)
        raw = _within_client(timed, lo, (prev & hi) - lo, client_s, client_used)
    keep = [it for it in timed if it.key not in raw]
    keep.sort(key=lambda it: ((it.deadline or 0.0) - it.cost_s * slowdown, it.seq))   # latest start time
    order = [it.key for it in keep]
    order += [it.key for it in sorted((it for it in items if it.deadline is None), key=lambda it: it.seq)]
    return Schedule(order, raw)


LATE_RAW_FACTOR = 1.5        # a late sample goes raw when storage would take this much longer than the client


def client_cost_s(cost_s: float, raw_bytes: int) -> float:
    """Predicted client seconds of a sample sent raw: its transform, and its raw container's bytes
    at RAW_CLIENT_BYTES_PER_S."""
    return cost_s + max(0, raw_bytes) / RAW_CLIENT_BYTES_PER_S


def late_goes_raw(remaining_s: float, cost_s: float, slowdown: float, raw_cost_s: float = 0.0,
                  client_s: float | None = None) -> bool:
    """A sample a reader waits for that storage has not started: raw when the client (an idle core,
    slowdown 1) would clearly have it sooner than storage: storage's time (the running work,
    `remaining_s`, then its own cost at the measured slowdown) over LATE_RAW_FACTOR x the client's
    (the raw container's storage work, then the client's: `client_s`, by default the transform's
    `cost_s`). Near equal, storage makes it: the client's CPU is what the offload saves."""
    client = cost_s if client_s is None else client_s
    return remaining_s + cost_s * slowdown > LATE_RAW_FACTOR * (raw_cost_s * slowdown + client)


class Horizon:
    """How many steps past the job's readers the agent works: `base` (the mount's lookahead) at
    least; doubled while the predicted load of the window is >= GROW_AT of the capacity, halved
    (not below `base`) when it is < SHRINK_AT; never past `fit` (the steps the job's share of the
    cache holds) or `most` (what the mount may send)."""

    def __init__(self, base: int):
        self.base = max(0, base)
        self.steps = self.base

    def update(self, load: float | None, fit: int, most: int) -> int:
        s = self.steps
        if load is not None and load >= GROW_AT:
            s = max(s * 2, s + 1)
        elif load is not None and load < SHRINK_AT:
            s = s // 2
        s = min(s, fit, most)
        self.steps = max(self.base, s)
        return self.steps


class FixedShare:
    """For measurement: a sample goes raw when its value (the agent gives `raw_rank`, and asks only
    for samples `worth_raw`) is among the lowest `share` of the last `window` values (so about
    `share` of those samples go raw, the cheapest first). Before run 10 it ranked every sample by
    its predicted cost: the cheapest were images whose raw container costs storage its decode
    check, so no fixed share relieved storage and the sweep of shares had no reference."""

    def __init__(self, share: float, window: int = 1024):
        self.share = min(max(share, 0.0), 1.0)
        self.recent: deque = deque()
        self.sorted: list = []
        self.window = window
        self._u = 0.0               # where within a run of equal costs (a low-discrepancy sequence)

    def decide(self, cost_s: float) -> bool:
        self.recent.append(cost_s)
        insort(self.sorted, cost_s)
        if len(self.recent) > self.window:
            old = self.recent.popleft()
            del self.sorted[bisect_left(self.sorted, old)]
        if self.share <= 0:
            return False
        if self.share >= 1:
            return True
        # the rank of this cost among the recent ones; within equal costs (a cold cost model predicts
        # one value for all) spread evenly, so that `share` of them still go raw
        lo = bisect_left(self.sorted, cost_s)
        hi = bisect_left(self.sorted, math.nextafter(cost_s, math.inf))
        self._u = (self._u + 0.6180339887498949) % 1.0
        rank = (lo + self._u * (hi - lo - 1)) / max(1, len(self.sorted) - 1)
        return rank < self.share


__all__ = ["Capacity", "Ewma", "FixedShare", "Horizon", "Item", "OnlineCosts", "Schedule", "StepClock",
           "client_cost_s", "late_goes_raw", "own_share", "raw_rank", "relief_rank", "schedule", "worth_raw", "GROW_AT", "SHRINK_AT", "HYSTERESIS", "MARGIN_STEPS",
           "MIN_SAVED_SHARE"]

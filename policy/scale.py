"""A model of restart storms and cross-DC merges at scale (issue 37, item 5): pure, no I/O, no clock.

Restart storm: `world` ranks load one DCP checkpoint at once from `agents` storage agents; each
file has its replicas on consecutive agents from a first one (`home_agent`: a hash of the path, as
the mount places hinted replicas, or file i on agent i mod K, as bench/restart_storm.py does).
Readers pick a replica per read:

- ``default``: every file has `default_replicas` (3); readers pick one at random (uniform);
- ``hints``: the job's hint pre-scales each file to `policy.replicas.replica_count` replicas
  (readers / safe readers per replica, clamped); readers pick by the bytes each host asked of each
  replica, in pieces (`policy.replicas.choose_least_sent`), which the model takes as a balanced split
  of each file's work over its replicas;
- ``reactive``: the default placement, plus one replica per hot file per monitor window once its
  read rate passes a threshold, copied from a busy agent (a small fluid simulation, below).

The load time is ``storm_overhead_s + max(bandwidth, reads, chain)``:

- bandwidth: the busiest agent's bytes / `agent_bandwidth_bytes_s`, less the `agent_burst_s` an
  idle agent serves at once. The busiest agent's bytes are the largest per-agent sum; with random
  choice it is the expected maximum of per-agent sums whose spread comes from the choices
  (independent normal per agent, the variance of a sum of reads each landing there with
  probability 1/replicas). With balanced choice a file's work (bytes / bandwidth + reads x time
  per read: reads in flight even out time, not bytes) is water-filled onto its least busy
  replicas, files with fewer replicas first (the exact min-max for nested sets, close to it
  otherwise).
- reads: the agent with the most reads × max(`agent_read_s`, `read_latency_s` / `agent_read_slots`),
  and all reads × `shared_read_s` (a resource every agent and reader shares: the CPUs of the one
  machine a bench emulates the cluster on; 0 on a real cluster).
- chain: one rank's reads in a row: its bytes / `agent_bandwidth_bytes_s` + its reads ×
  `read_latency_s` (so one reader takes its bytes / per-agent bandwidth).

What it leaves out (say so where its numbers are quoted): block striping (an agent replicates
whole files, as hintfs agents do), a mount's single-flight (ranks of one host reading the same
block cost one remote read: for files every rank of a host reads, give hosts as the readers), the
network between readers and agents (each agent's bandwidth is its NIC or disk, whichever is
lower), the time a rank spends on anything but reads (deserialisation, copies to the GPU), and
failures.

Cross-DC merge (`merge_time`): commit on the training side -> an eval job's DCP load of a subset
of the tensors, across a link of `link_bandwidth_bytes_s` and `link_rtt_s`: a fixed part, round
trips per tensor (remote: reading the store across the link; copy: through the eval tier while
the follower copies the files; stream: files streamed while written), and the bytes it needs over
the link. `tier_complete_time`: the whole checkpoint in the eval tier, at least the tail over the
link or `follower_file_s` per file, whichever is longer, plus `eviction_file_s` per evicted file.

Every cost is a key of `Costs` (`COST_DOCS` says what each is and where it was measured);
`costs_from_mapping` reads a JSON object of them and refuses unknown keys.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace

from policy.replicas import fanout_rounds, replica_count

STRATEGIES = ("default", "reactive", "hints")


# -- costs --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Costs:
    """Per-operation costs (seconds, bytes per second); see COST_DOCS. The defaults are
    bench/scale_model.py's fit to this project's emulated data nodes (its `scale_costs` in
    bench/results/scale_model.json: the fit with `shared_read_s` = 0, each agent on a host of
    its own); they predict ratios, not another cluster's seconds."""

    agent_bandwidth_bytes_s: float = 1_500_000.0
    agent_burst_s: float = 1.0
    agent_read_slots: int = 4
    agent_read_s: float = 0.0028303
    read_latency_s: float = 0.0
    shared_read_s: float = 0.0
    storm_overhead_s: float = 0.5258426
    replica_copy_bytes_s: float = 0.0
    replica_copy_file_s: float = 0.0835
    link_bandwidth_bytes_s: float = 50_000_000.0
    link_rtt_s: float = 0.1
    merge_base_s: float = 0.019
    remote_rtts_per_tensor: float = 0.882611
    copy_rtts_per_tensor: float = 0.1995833
    stream_rtts_per_tensor: float = 0.0225105
    follower_file_s: float = 0.000889
    eviction_file_s: float = 0.0004862

COST_DOCS: dict[str, str] = {
    "agent_bandwidth_bytes_s": "bytes/s one agent serves (its disk or NIC, the lower); 0 = unlimited "
                               "(bench: [agent] bandwidth_bytes_s, 1.5 MB/s)",
    "agent_burst_s": "seconds of bandwidth an idle agent serves at once (the agent's token bucket holds 1 s; "
                     "0 for a disk or NIC)",
    "agent_read_slots": "reads one agent works on at once ([agent] max_concurrent_reads, bench: 4)",
    "agent_read_s": "an agent's own serial time per read, not overlapped with other reads (fitted: the "
                    "unlimited default storm)",
    "read_latency_s": "per-read latency besides the bytes (a round trip, a seek); holds one of the agent's "
                      "read slots (0 on the bench's loopback)",
    "shared_read_s": "time per read of a resource every agent and reader shares: the CPUs of the one machine "
                     "a bench runs the whole cluster on (fitted: the unlimited hints storm); 0 on a real cluster",
    "storm_overhead_s": "fixed per storm: readers released to first bytes, the last rank's tail (fitted)",
    "replica_copy_bytes_s": "bytes/s of one replica copy; 0 = the agent bandwidth (a copy reads its source "
                            "through the source's bandwidth)",
    "replica_copy_file_s": "fixed time of one replica copy (the replicate call, file create, fsync; fitted on "
                           "the bench's pre-scaling times)",
    "link_bandwidth_bytes_s": "bytes/s of the cross-DC link the eval's bytes get (bench relay: 400 Mbit/s)",
    "link_rtt_s": "round trip of the cross-DC link (bench relay: 2 x 50 ms)",
    "merge_base_s": "fixed per merge: the DCP load from local disk (cross_dc_eval's local mode, the floor)",
    "remote_rtts_per_tensor": "round trips per tensor of a DCP load reading the store across the link "
                              "(fitted: cross_dc_eval remote)",
    "copy_rtts_per_tensor": "round trips per tensor of a merge through the eval tier while its files are still "
                            "being copied (fitted: cross_dc_eval hintfs, copy after close)",
    "stream_rtts_per_tensor": "round trips per tensor of a merge of files the training mount streamed "
                              "(fitted: cross_dc_eval hintfs_stream)",
    "follower_file_s": "the eval tier follower's work per checkpoint file (bench/results/follower_queue.json, "
                       "4,096 files)",
    "eviction_file_s": "per file a full tier evicts (follower_queue.json, full tier vs not)",
}


def costs_from_mapping(mapping: Mapping[str, object], base: Costs | None = None) -> Costs:
    """`base` (default: Costs()) with the keys of `mapping` replaced. Unknown keys, non-numbers,
    negatives and read slots < 1 are a ValueError naming the key."""
    if not isinstance(mapping, Mapping):
        raise ValueError(f"costs: expected an object {{key: number}}, not {type(mapping).__name__}")
    known = {f.name for f in fields(Costs)}
    unknown = sorted(str(k) for k in mapping if k not in known)
    if unknown:
        raise ValueError(f"unknown cost key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(known))})")
    values: dict[str, float | int] = {}
    for key, value in mapping.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"cost {key}: expected a finite number, not {value!r}")
        if value < 0:
            raise ValueError(f"cost {key}: must be >= 0, not {value}")
        if key == "agent_read_slots":
            if value < 1 or int(value) != value:
                raise ValueError(f"cost agent_read_slots: must be a whole number >= 1, not {value}")
            values[key] = int(value)
        else:
            values[key] = float(value)
    return replace(base or Costs(), **values)  # type: ignore[arg-type]


def costs_to_mapping(costs: Costs) -> dict[str, float | int]:
    return {f.name: getattr(costs, f.name) for f in fields(Costs)}


# -- what a storm reads ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ReadGroup:
    """`readers` ranks each make `reads` reads of one file, `bytes` in all (`bytes_sq`: the sum of
    the squares of those reads' sizes, the spread of random replica choice)."""

    readers: int
    reads: int
    bytes: int
    bytes_sq: float

    @staticmethod
    def of(readers: int, sizes: Sequence[int]) -> ReadGroup:
        return ReadGroup(max(0, int(readers)), len(sizes), int(sum(sizes)), float(sum(s * s for s in sizes)))


@dataclass(frozen=True)
class FileLoad:
    path: str
    size: int
    groups: tuple[ReadGroup, ...]

    @property
    def readers(self) -> int:
        """The most readers any part of the file has (what a hint asks replicas for)."""
        return max((g.readers for g in self.groups), default=0)

    @property
    def demand_bytes(self) -> float:
        return float(sum(g.readers * g.bytes for g in self.groups))

    @property
    def demand_reads(self) -> float:
        return float(sum(g.readers * g.reads for g in self.groups))

    @property
    def demand_sq(self) -> float:
        return sum(g.readers * g.bytes_sq for g in self.groups)


@dataclass(frozen=True)
class Workload:
    """A storm: `world` ranks, the files they read, and the most one rank reads (bytes, reads)."""

    world: int
    files: tuple[FileLoad, ...]
    rank_bytes: int
    rank_reads: int

    @property
    def total_bytes(self) -> float:
        return sum(f.demand_bytes for f in self.files)

    @property
    def total_reads(self) -> float:
        return sum(f.demand_reads for f in self.files)


def dcp_layout(world: int, tp: int, metadata_bytes: int, replicated: Sequence[int], shard: Sequence[int],
               metadata_name: str = ".metadata") -> Workload:
    """The files of a DCP checkpoint saved by `tp` ranks with the replicated tensors deduplicated
    into rank 0's file (`dedup_save_to_lowest_rank`), loaded by `world` ranks with the same
    sharding (shard = rank % tp): every rank reads `.metadata` and all of `replicated` (the sizes
    of the reads of the replicated tensors); the world // tp ranks of each shard read `shard` from
    that shard's file. bench/restart_storm.py's checkpoint is dcp_layout(N, 4, ...)."""
    if world < 1 or tp < 1:
        raise ValueError("world and tp must be >= 1")
    per_shard = max(1, world // tp)
    files = [FileLoad(metadata_name, metadata_bytes, (ReadGroup.of(world, [metadata_bytes]),))]
    for k in range(tp):
        groups = [ReadGroup.of(per_shard, shard)]
        size = sum(shard)
        if k == 0:
            groups.insert(0, ReadGroup.of(world, replicated))
            size += sum(replicated)
        files.append(FileLoad(f"__{k}_0.distcp", size, tuple(groups)))
    return Workload(world, tuple(files), metadata_bytes + sum(replicated) + sum(shard),
                    1 + len(replicated) + len(shard))


# -- placement and per-agent loads ----------------------------------------------------------------
PLACEMENTS = ("hash", "index")


def home_agent(path: str, index: int, agents: int, placement: str = "hash") -> int:
    """Where a file's first replica goes: as the mount places hinted replicas (a hash of the path,
    fusefs/hints.py), or file i on agent i mod K (bench/restart_storm.py's placement)."""
    if placement == "hash":
        return int(hashlib.sha256(path.encode()).hexdigest(), 16) % agents
    if placement == "index":
        return index % agents
    raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, not {placement!r}")


def ring(home: int, replicas: int, agents: int) -> list[int]:
    return [(home + j) % agents for j in range(max(1, min(replicas, agents)))]


def replica_plan(workload: Workload, strategy: str, agents: int, *, default_replicas: int = 3,
                 max_replicas: int | None = None, safe_readers: int = 32) -> dict[str, int]:
    """Replicas per file at the storm's start: the default's fixed count, or the hint's
    (`policy.replicas.replica_count`, as the mount plans them). Reactive starts as the default."""
    if agents < 1:
        raise ValueError("agents must be >= 1")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
    if strategy in ("default", "reactive"):
        return {f.path: max(1, min(default_replicas, agents)) for f in workload.files}
    cap = agents if max_replicas is None else max_replicas
    return {f.path: replica_count(f.readers, safe_readers, default_replicas, cap, agents) for f in workload.files}


@dataclass(frozen=True)
class AgentLoads:
    bytes: tuple[float, ...]
    reads: tuple[float, ...]
    variance: tuple[float, ...]     # of bytes, from random choice (0 when balanced)


def agent_loads(workload: Workload, replicas: Mapping[str, int], agents: int, balanced: bool, *,
                placement: str = "hash", seconds_per_byte: float = 1.0, seconds_per_read: float = 0.0) -> AgentLoads:
    """Bytes and reads per agent: each file's split evenly over its replicas (random choice, with
    the variance that brings) or water-filled onto its least busy replicas (balanced: busy in
    seconds, `seconds_per_byte` x bytes + `seconds_per_read` x reads: the readers' choices even
    out their own requests), files with fewer replicas first."""
    loads = [0.0] * agents
    reads = [0.0] * agents
    busy = [0.0] * agents
    var = [0.0] * agents
    index = {f.path: i for i, f in enumerate(workload.files)}
    order = list(workload.files)
    if balanced:
        order.sort(key=lambda f: (replicas.get(f.path, 1), -f.demand_bytes, index[f.path]))
    for f in order:
        where = ring(home_agent(f.path, index[f.path], agents, placement), replicas.get(f.path, 1), agents)
        demand, nreads = f.demand_bytes, f.demand_reads
        if demand <= 0:
            continue
        r = len(where)
        if not balanced or r == 1:
            p = 1.0 / r
            for a in where:
                loads[a] += demand * p
                reads[a] += nreads * p
                var[a] += f.demand_sq * p * (1 - p)
                busy[a] += (demand * seconds_per_byte + nreads * seconds_per_read) * p
            continue
        work = demand * seconds_per_byte + nreads * seconds_per_read
        if work <= 0:
            work = demand
        level = _water_level([busy[a] for a in where], work)
        for a in where:
            add = max(0.0, level - busy[a])
            busy[a] += add
            loads[a] += demand * add / work
            reads[a] += nreads * add / work
    return AgentLoads(tuple(loads), tuple(reads), tuple(var))


def _water_level(levels: list[float], amount: float) -> float:
    """The level to which `amount` fills bins of these levels (lowest first)."""
    xs = sorted(levels)
    level, left = xs[0], amount
    for j in range(len(xs)):
        nxt = xs[j + 1] if j + 1 < len(xs) else math.inf
        room = (nxt - level) * (j + 1)
        if room >= left:
            return level + left / (j + 1)
        left -= room
        level = nxt
    return level


def expected_max(means: Sequence[float], sigmas: Sequence[float]) -> float:
    """E[max] of independent normals (numerically: the integral of 1 - prod(CDF)); the largest
    mean when no spread can change which is largest."""
    top = max(means)
    live = [(m, s) for m, s in zip(means, sigmas) if m + 6 * s >= top]
    if all(s <= 0 for _m, s in live):
        return top
    lo = min(m - 6 * s for m, s in live)
    hi = max(m + 6 * s for m, s in live)
    steps = 400
    h = (hi - lo) / steps
    area = 0.0
    for j in range(steps):
        x = lo + (j + 0.5) * h
        cdf = 1.0
        for m, s in live:
            cdf *= (1.0 if x >= m else 0.0) if s <= 0 else 0.5 * (1 + math.erf((x - m) / (s * math.sqrt(2))))
        area += (1 - cdf) * h
    return max(top, lo + area)


# -- load time ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadPrediction:
    seconds: float
    strategy: str
    agents: int
    bandwidth_s: float
    reads_s: float
    chain_s: float
    overhead_s: float
    busiest_agent_bytes: float
    limit: str                            # which term set the time
    replicas: Mapping[str, int]           # at the start (reactive: at the end)

    def as_dict(self) -> dict[str, object]:
        return {"seconds": round(self.seconds, 4), "strategy": self.strategy, "agents": self.agents,
                "bandwidth_s": round(self.bandwidth_s, 4), "reads_s": round(self.reads_s, 4),
                "chain_s": round(self.chain_s, 4), "overhead_s": round(self.overhead_s, 4),
                "busiest_agent_bytes": round(self.busiest_agent_bytes), "limit": self.limit}


def predict_load(workload: Workload, costs: Costs, agents: int, strategy: str = "hints", *,
                 replicas: Mapping[str, int] | None = None, default_replicas: int = 3,
                 max_replicas: int | None = None, safe_readers: int = 32, balanced: bool | None = None,
                 placement: str = "hash", window_s: float = 0.5, qps_threshold: float = 50.0) -> LoadPrediction:
    """The load time of one storm (module docstring). `replicas` overrides the plan (per path);
    `balanced` overrides the strategy's choice rule (hints: balanced; default, reactive: random);
    `placement`: where replicas go (`home_agent`)."""
    if agents < 1:
        raise ValueError("agents must be >= 1")
    if workload.world < 1:
        raise ValueError("world must be >= 1")
    plan = dict(replicas) if replicas is not None else replica_plan(
        workload, strategy, agents, default_replicas=default_replicas, max_replicas=max_replicas,
        safe_readers=safe_readers)
    bal = (strategy == "hints") if balanced is None else balanced
    bw = costs.agent_bandwidth_bytes_s
    per_read = max(costs.agent_read_s, costs.read_latency_s / costs.agent_read_slots)
    if strategy == "reactive" and replicas is None:
        bandwidth_s, busiest, plan, reads_at = _reactive(workload, costs, agents, plan, window_s, qps_threshold,
                                                         placement)
    else:
        loads = agent_loads(workload, plan, agents, bal, placement=placement,
                            seconds_per_byte=1.0 / bw if bw > 0 else 0.0, seconds_per_read=per_read)
        busiest = expected_max(loads.bytes, [math.sqrt(v) for v in loads.variance]) if not bal else max(loads.bytes)
        bandwidth_s = max(0.0, busiest / bw - costs.agent_burst_s) if bw > 0 else 0.0
        reads_at = max(loads.reads)
    reads_s = max(reads_at * per_read, workload.total_reads * costs.shared_read_s)
    chain_s = (workload.rank_bytes / bw if bw > 0 else 0.0) + workload.rank_reads * costs.read_latency_s
    terms = {"bandwidth of the busiest agent": bandwidth_s, "reads per agent or shared": reads_s,
             "one rank's reads in a row": chain_s}
    limit = max(terms, key=lambda k: terms[k])
    seconds = costs.storm_overhead_s + terms[limit]
    return LoadPrediction(seconds, strategy, agents, bandwidth_s, reads_s, chain_s, costs.storm_overhead_s,
                          busiest, limit, plan)


def _reactive(workload: Workload, costs: Costs, agents: int, start: Mapping[str, int], window_s: float,
              qps_threshold: float, placement: str) -> tuple[float, float, dict[str, int], float]:
    """Reactive replication as a fluid: reads are issued as earlier ones finish (one in flight per
    rank), each to a replica picked at random among those that exist at that moment; each agent
    serves its queue at its bandwidth (burst first). Every window, a file whose reads per second
    passed the threshold gets one more replica (one copy per file at a time, to the next agent on
    its ring), copied from its least busy non-home replica: the copy's bytes queue at the source
    like reads. Returns (bandwidth seconds, the busiest agent's bytes, replicas at the end, the
    most reads an agent served)."""
    bw = costs.agent_bandwidth_bytes_s
    files = workload.files
    n = len(files)
    homes = [home_agent(f.path, i, agents, placement) for i, f in enumerate(files)]
    sets = [ring(homes[i], start.get(f.path, 1), agents) for i, f in enumerate(files)]
    if bw <= 0:   # no bandwidth limit: copies change nothing the model counts
        loads = agent_loads(workload, {f.path: len(sets[i]) for i, f in enumerate(files)}, agents, False,
                            placement=placement)
        return 0.0, max(loads.bytes), {f.path: len(s) for f, s in zip(files, sets)}, max(loads.reads)
    left = [f.demand_bytes for f in files]
    rho = [f.demand_reads / f.demand_bytes if f.demand_bytes > 0 else 0.0 for f in files]
    queue: list[dict[int, float]] = [{} for _ in range(agents)]
    served = [0.0] * agents
    served_reads = [0.0] * agents
    tokens = [bw * costs.agent_burst_s] * agents
    in_flight = workload.world * workload.rank_bytes / max(1, workload.rank_reads)
    # copies in progress: [file, source, destination, bytes the source serves before it is done
    # (its queue when the copy started, then the copy: first in, first out), time it is ready]
    copies: list[list[float]] = []
    copy_load = [0.0] * agents            # copy bytes not served yet, per source
    copying = set()
    # steps: 20 per window, or fewer windows' worth when the storm is long (bounded work)
    loads = agent_loads(workload, {f.path: len(s) for f, s in zip(files, sets)}, agents, False, placement=placement)
    guess = max(loads.bytes) / bw + window_s
    dt = max(window_s / 20, guess / 4000)
    per_window = max(1, round(window_s / dt))
    window_reads = [0.0] * n
    t, step = 0.0, 0
    total = sum(left)
    while True:
        queued = sum(sum(q.values()) for q in queue)
        todo = sum(left)
        if todo <= total * 1e-9 and queued <= total * 1e-9:
            break
        if step > 2_000_000:
            raise RuntimeError("reactive model did not converge")
        room = in_flight - queued
        if room > 0 and todo > 0:
            x = min(room, todo)
            for i in range(n):
                if left[i] > 0:
                    part = x * left[i] / todo
                    left[i] -= part
                    share = part / len(sets[i])
                    for a in sets[i]:
                        queue[a][i] = queue[a].get(i, 0.0) + share
        done_serving = [0.0] * agents
        for a in range(agents):
            want = sum(queue[a].values()) + copy_load[a]
            avail = tokens[a] + bw * dt
            serve = min(want, avail)
            tokens[a] = min(bw * costs.agent_burst_s, avail - serve)
            if want <= 0 or serve <= 0:
                continue
            frac = serve / want
            for i, q in list(queue[a].items()):
                got = q * frac
                window_reads[i] += got * rho[i]
                served_reads[a] += got * rho[i]
                queue[a][i] = q - got
                if queue[a][i] <= 1e-9:
                    del queue[a][i]
            copy_load[a] -= copy_load[a] * frac
            served[a] += serve
            done_serving[a] = serve
        t += dt
        step += 1
        for c in list(copies):
            if c[3] > 0:
                c[3] -= done_serving[int(c[1])]
                if c[3] <= 0:
                    c[4] = t + costs.replica_copy_file_s
            if c[3] <= 0 and t >= c[4]:
                i, dst = int(c[0]), int(c[2])
                copies.remove(c)
                copying.discard(i)
                if dst not in sets[i]:
                    sets[i] = sets[i] + [dst]
        if step % per_window == 0:
            for i, f in enumerate(files):
                qps = window_reads[i] / (per_window * dt)
                window_reads[i] = 0.0
                if qps <= qps_threshold or i in copying or len(sets[i]) >= agents:
                    continue
                dst = ring(homes[i], len(sets[i]) + 1, agents)[-1]
                sources = sets[i][1:] or sets[i]
                src = min(sources, key=lambda a: sum(queue[a].values()) + copy_load[a])
                copying.add(i)
                size = f.size * bw / costs.replica_copy_bytes_s if costs.replica_copy_bytes_s > 0 else f.size
                ahead = sum(queue[src].values()) + copy_load[src] + size
                copy_load[src] += size
                copies.append([float(i), float(src), float(dst), float(ahead), math.inf])
    return t, max(served), {f.path: len(s) for f, s in zip(files, sets)}, max(served_reads)


def prescale_time(workload: Workload, replicas: Mapping[str, int], costs: Costs) -> float:
    """Hint -> every file at its replica count: per file one copy from the store, then a tree
    fan-out (`fanout_rounds`: every finished replica a source); files in parallel. A copy takes
    size / copy rate + `replica_copy_file_s`."""
    rate = costs.replica_copy_bytes_s or costs.agent_bandwidth_bytes_s
    worst = 0.0
    for f in workload.files:
        r = replicas.get(f.path, 1)
        if r <= 1:
            continue
        rounds = 1 + len(fanout_rounds(r - 1, 1)) if r > 2 else 1
        one = (f.size / rate if rate > 0 else 0.0) + costs.replica_copy_file_s
        worst = max(worst, rounds * one)
    return worst


def hot_set_plan(workload: Workload, agents: int, replicas: int, *, default_replicas: int = 3,
                 safe_readers: int = 32) -> dict[str, int]:
    """`replicas` replicas of each file every rank reads (the hot set: `.metadata`, the
    deduplicated replicated tensors), every other file as the hint policy plans it
    (`policy.replicas.replica_count` with `safe_readers`, up to the number of agents)."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    return {f.path: (max(1, min(replicas, agents)) if f.readers >= workload.world else
                     replica_count(f.readers, safe_readers, default_replicas, agents, agents))
            for f in workload.files}


def best_replicas(workload: Workload, costs: Costs, agents: int, candidates: Sequence[int],
                  tolerance: float = 0.10, *, plan: Callable[[int], Mapping[str, int]] | None = None,
                  placement: str = "hash", with_prescale: bool = False) -> tuple[int, dict[int, float]]:
    """The fewest replicas R among `candidates` whose load time (hints: balanced choice) is within
    `tolerance` of the best candidate's, and each candidate's time. `plan(R)` gives the replicas
    per file (default: `hot_set_plan`: R for the hot set). With `with_prescale`, the time to make
    the replicas counts too (a hint given at the restart)."""
    make = plan or (lambda r: hot_set_plan(workload, agents, r))
    times: dict[int, float] = {}
    for r in sorted({min(max(1, c), agents) for c in candidates}):
        replicas = make(r)
        p = predict_load(workload, costs, agents, "hints", replicas=replicas, placement=placement)
        times[r] = p.seconds + (prescale_time(workload, replicas, costs) if with_prescale else 0.0)
    best = min(times.values())
    return min(r for r, s in times.items() if s <= best * (1 + tolerance)), times


# -- cross-DC merge -------------------------------------------------------------------------------
@dataclass(frozen=True)
class MergeCase:
    """A merge: the checkpoint's bytes and files, the tensors and bytes the eval loads, the bytes
    that had not crossed the link at the commit (`tail_bytes`), the bytes a direct remote load
    pulls across (its readahead: at least the needed bytes), the files the tier evicts for it."""

    checkpoint_bytes: float
    files: int
    merge_tensors: int
    merge_bytes: float
    tail_bytes: float
    remote_bytes: float = 0.0
    evicted_files: int = 0


MERGE_MODES = ("remote", "copy", "stream")


def merge_time(case: MergeCase, costs: Costs, mode: str) -> float:
    """Commit -> merge done. ``remote``: the eval reads the store across the link; ``copy``: the
    eval tier's follower copies each file after its close, so at the commit the merge's files are
    still crossing and it reads through the tier's demand path; ``stream``: the training mount
    streamed the files while they were written, so the merge waits only for the part of its bytes
    in the tail. Each: `merge_base_s` + round trips per tensor x RTT x tensors + bytes / link."""
    if mode not in MERGE_MODES:
        raise ValueError(f"mode must be one of {', '.join(MERGE_MODES)}, not {mode!r}")
    w, rtt = costs.link_bandwidth_bytes_s, costs.link_rtt_s

    def over_link(nbytes: float) -> float:
        return nbytes / w if w > 0 else 0.0
    if mode == "remote":
        return (costs.merge_base_s + costs.remote_rtts_per_tensor * rtt * case.merge_tensors
                + over_link(max(case.remote_bytes, case.merge_bytes)))
    if mode == "copy":
        return costs.merge_base_s + costs.copy_rtts_per_tensor * rtt * case.merge_tensors + over_link(case.merge_bytes)
    missing = min(1.0, max(0.0, case.tail_bytes / case.checkpoint_bytes)) if case.checkpoint_bytes > 0 else 0.0
    return (costs.merge_base_s + costs.stream_rtts_per_tensor * rtt * case.merge_tensors
            + over_link(missing * case.merge_bytes))


def tier_complete_time(case: MergeCase, costs: Costs) -> float:
    """Commit -> every file of the checkpoint in the eval tier, at least: the tail across the link,
    or the follower's work per file, whichever is longer, plus the evictions that made room."""
    w = costs.link_bandwidth_bytes_s
    return (costs.merge_base_s + max(case.tail_bytes / w if w > 0 else 0.0, case.files * costs.follower_file_s)
            + case.evicted_files * costs.eviction_file_s)


# -- fitting --------------------------------------------------------------------------------------
def relative_error(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0


def fit_costs(points: Sequence[tuple[object, float]], base: Costs, keys: Sequence[str],
              predict: Callable[[Costs, object], float], *, bounds: tuple[float, float] = (1e-7, 100.0),
              iterations: int = 400) -> Costs:
    """The values of `keys` that minimise the sum of squared log errors of `predict(costs, point)`
    against each point's measured seconds: a scan of each key's range from `base` first (the loss
    is flat where another term sets the time), then Nelder-Mead in log space within `bounds`
    (deterministic)."""
    if not points:
        raise ValueError("nothing to fit")
    known = {f.name for f in fields(Costs)}
    for k in keys:
        if k not in known or k == "agent_read_slots":
            raise ValueError(f"cannot fit {k!r}")
    lo, hi = math.log(bounds[0]), math.log(bounds[1])

    def make(x: Sequence[float]) -> Costs:
        return replace(base, **{k: math.exp(min(hi, max(lo, v))) for k, v in zip(keys, x)})  # type: ignore[arg-type]

    def loss(x: Sequence[float]) -> float:
        c = make(x)
        return sum(math.log(max(predict(c, point), 1e-9) / measured) ** 2 for point, measured in points)

    x0 = [math.log(max(bounds[0], min(bounds[1], getattr(base, k) or bounds[0]))) for k in keys]
    for i in range(len(keys)):          # one scan per key, the others held
        grid = [lo + (hi - lo) * j / 48 for j in range(49)]
        x0[i] = min(grid, key=lambda v: loss(x0[:i] + [v] + x0[i + 1:]))
    n = len(keys)
    simplex = [list(x0)] + [[v + (1.0 if j == i else 0.0) for j, v in enumerate(x0)] for i in range(n)]
    values = [loss(x) for x in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=lambda i: values[i])
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < 1e-12:
            break
        centre = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        refl = [c + (c - w) for c, w in zip(centre, worst)]
        f_refl = loss(refl)
        if f_refl < values[0]:
            exp = [c + 2 * (c - w) for c, w in zip(centre, worst)]
            f_exp = loss(exp)
            simplex[-1], values[-1] = (exp, f_exp) if f_exp < f_refl else (refl, f_refl)
        elif f_refl < values[-2]:
            simplex[-1], values[-1] = refl, f_refl
        else:
            con = [c + 0.5 * (w - c) for c, w in zip(centre, worst)]
            f_con = loss(con)
            if f_con < values[-1]:
                simplex[-1], values[-1] = con, f_con
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (v - b) for b, v in zip(best, x)] for x in simplex[1:]]
                values = [values[0]] + [loss(x) for x in simplex[1:]]
    return make(simplex[min(range(n + 1), key=lambda i: values[i])])

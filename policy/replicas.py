"""Replica policy for restart storms (issue 3): pure functions of numbers, no I/O, no clocks.

A replication hint says how many readers each file will have. Storage pre-scales replicas so
that no replica serves more than its safe load, fans the copies out as a tree (each finished
replica becomes a source), spreads reads by the bytes each host asked of each replica
(`choose_least_sent`; the bench's emulated readers use the power of two choices), keeps replicas for a
TTL and shrinks the plan to the disk budget.
"""
from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from collections.abc import Mapping, Sequence


def replica_count(readers: int, safe_readers_per_replica: int, default: int, max_replicas: int,
                  agents: int) -> int:
    """clamp(ceil(readers / safe load), default, min(max_replicas, agents)), and at least 1."""
    if readers < 0 or safe_readers_per_replica < 1 or default < 1 or max_replicas < 1:
        raise ValueError("readers >= 0, safe_readers_per_replica >= 1, default >= 1, max_replicas >= 1")
    want = math.ceil(readers / safe_readers_per_replica)
    upper = max(1, min(max_replicas, agents))
    return max(1, min(max(want, default), upper))


@dataclass(frozen=True)
class ReplicaTarget:
    path: str
    readers: int
    replicas: int
    expires_at: float


def plan_replicas(files: Mapping[str, int], safe_readers_per_replica: int, default: int,
                  max_replicas: int, agents: int, now: float, ttl_s: float) -> list[ReplicaTarget]:
    """One target per hinted file, hottest first (they are copied first)."""
    targets = [ReplicaTarget(p, r, replica_count(r, safe_readers_per_replica, default, max_replicas, agents),
                             now + ttl_s) for p, r in files.items()]
    return sorted(targets, key=lambda t: (-t.readers, t.path))


def fit_to_budget(targets: Sequence[ReplicaTarget], sizes: Mapping[str, int], budget_bytes: int,
                  existing_copies: int = 1) -> tuple[list[ReplicaTarget], dict[str, int]]:
    """Shrink replica counts until the *extra* copies fit the disk budget.

    The store already holds `existing_copies` of each file. Copies are taken away from the file
    with the most replicas per reader first, so the hottest files keep theirs longest. Returns the
    new targets and, per file, how many replicas were dropped (reported in the hint status).
    """
    counts = {t.path: t.replicas for t in targets}
    readers = {t.path: t.readers for t in targets}

    def extra_bytes() -> int:
        return sum(max(0, counts[p] - existing_copies) * sizes.get(p, 0) for p in counts)

    dropped = {p: 0 for p in counts}
    while extra_bytes() > budget_bytes:
        candidates = [p for p in counts if counts[p] > existing_copies and sizes.get(p, 0) > 0]
        if not candidates:
            break
        victim = max(candidates, key=lambda p: (counts[p] / max(readers[p], 1), sizes.get(p, 0), p))
        counts[victim] -= 1
        dropped[victim] += 1
    new = [ReplicaTarget(t.path, t.readers, counts[t.path], t.expires_at) for t in targets]
    return new, {p: d for p, d in dropped.items() if d}


def hash_order(path: str, agents: Sequence[str]) -> list[str]:
    """Every agent, in the order a hash of `path` puts them (a ring starting at the hash)."""
    if not agents:
        return []
    start = int(hashlib.sha256(path.encode()).hexdigest(), 16) % len(agents)
    return [agents[(start + i) % len(agents)] for i in range(len(agents))]


def place(order: Sequence[str], n: int, placed: Mapping[str, float], spread: int | None = None) -> list[str]:
    """The `n` agents a hinted file's replicas go to: of its first `n * spread` agents in hash
    order (`hash_order`; None: all of them), the `n` this host has placed the fewest replicas on
    (`placed`), ties in hash order.

    Placing by the hash alone puts a host's files on agents as balls in bins: in
    bench/scale_storm.py's weak scaling (4,096 per-rank files of one reader each on 64 agents, each
    host hinting its own 64) the busiest agent served 1.50x the mean. When each host spreads its
    own replicas evenly, their sum over the hosts is even too (as `choose_least_sent` does for
    reads): 1.0 in that layout with every agent a candidate, 1.22 with two per replica
    (tests/unit/test_policy_replicas.py). Hosts that place the same files in the same order from
    the same counts choose the same agents (a hint's files are placed hottest first, so the files
    every host hints come first); otherwise a file several hosts hint gets more replicas."""
    if n < 1:
        return []
    if n >= len(order):
        return list(order)
    cands = list(order if spread is None else order[:min(len(order), n * max(1, spread))])
    rank = {a: i for i, a in enumerate(cands)}
    return sorted(cands, key=lambda a: (placed.get(a, 0), rank[a]))[:n]


def fanout_rounds(target: int, sources: int = 1) -> list[int]:
    """Copies started per round of a tree fan-out: every finished replica is a source next round.

    fanout_rounds(8) == [1, 2, 4]: 1 -> 2 -> 4 -> 8 replicas in three rounds, instead of seven
    copies from the one original.
    """
    if target < 1 or sources < 1:
        raise ValueError("target and sources must be >= 1")
    have, rounds = sources, []
    while have < target:
        start = min(have, target - have)
        rounds.append(start)
        have += start
    return rounds


def expired(targets: Sequence[ReplicaTarget], now: float) -> list[ReplicaTarget]:
    """Targets whose TTL has passed: their extra replicas are reclaimed."""
    return [t for t in targets if t.expires_at <= now]


def choose_least_sent(sent: Sequence[float], in_flight: Sequence[int], rng: random.Random) -> int:
    """The replica this host has asked for the fewest bytes so far; ties: fewer reads in flight,
    then at random. Hosts choose without knowing each other's choices: random or power-of-two
    choices per host leave some agents with many more bytes than others when each host reads
    each file in one or a few blocks (bench/scale_storm.py, 32 hosts on 32 agents: the busiest
    agent served 2.5x the mean). When each host spreads its own bytes evenly over the agents it
    may read from, their sum over the hosts is even too."""
    n = len(sent)
    if n == 0 or len(in_flight) != n:
        raise ValueError("no replicas" if n == 0 else "sent and in_flight differ in length")
    low = min(sent)
    tied = [i for i in range(n) if sent[i] == low]
    fewest = min(in_flight[i] for i in tied)
    tied = [i for i in tied if in_flight[i] == fewest]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def choose_replica(in_flight: Sequence[int], rng: random.Random) -> int:
    """Power of two choices: sample two replicas, read from the one with fewer reads in flight."""
    n = len(in_flight)
    if n == 0:
        raise ValueError("no replicas")
    if n == 1:
        return 0
    a, b = rng.sample(range(n), 2)
    return a if in_flight[a] <= in_flight[b] else b

"""Deterministic execution plans (issue 4, pure part): numbers in, schedule out. No I/O.

A plan says which sample every rank reads at every step. It is built from the dataset's
*indices* only (no data is read): each epoch is a seeded permutation of ``range(n)``, the
epochs are laid end to end as one stream of positions, and step ``s`` takes the global batch
``positions [s*G, (s+1)*G)`` with ``G = world_size * batch_per_rank``. In the plain layout
position ``j`` of a step goes to rank ``j // batch_per_rank``, slot ``j % batch_per_rank``.

Everything is computed with a version-independent 64-bit mixer (splitmix64 in numpy), not with
a library RNG whose streams may change between releases: the same inputs give the same plan
on any machine and any numpy.

Cost-aware mode keeps *which* samples a step holds and only changes *who* gets them: the
step's samples go to ranks by longest-processing-time greedy (heaviest first, to the least
loaded rank that still has a free slot), so every rank keeps ``batch_per_rank`` slots and the
slowest rank's transform work comes closer to the mean. `CostModel` estimates a sample's cost
from its metadata by least squares on a few features, per (kind, codec).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

_M64 = (1 << 64) - 1
_DOMAIN_PERM = 0x5045524D   # "PERM"
_DOMAIN_AUG = 0x41554753    # "AUGS"


# -- hashing -------------------------------------------------------------------------------------
def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _keys(seed: int, domain: int, epoch: np.ndarray | int, index: np.ndarray) -> np.ndarray:
    base = _mix64(np.array([seed & _M64], dtype=np.uint64))
    base = _mix64(base ^ np.uint64(domain))
    e = _mix64(base ^ np.asarray(epoch, dtype=np.uint64))
    return _mix64(e ^ np.asarray(index, dtype=np.uint64))


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of sample indices in `epoch`: indices sorted by a keyed hash (int64 array)."""
    keys = _keys(seed, _DOMAIN_PERM, epoch, np.arange(n, dtype=np.uint64))
    return np.argsort(keys, kind="stable").astype(np.int64)


def aug_seeds(seed: int, epoch: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Per-(epoch, sample) augmentation seed, a non-negative int64."""
    return (_keys(seed, _DOMAIN_AUG, epoch, index) >> np.uint64(1)).astype(np.int64)


def listing_hash(relpaths: Sequence[str]) -> str:
    """sha256 of the listing in order (one relpath per line)."""
    h = hashlib.sha256()
    for p in relpaths:
        h.update(p.encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


# -- the schedule --------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanSpec:
    n_samples: int
    seed: int
    world_size: int
    batch_per_rank: int
    steps: int
    drop_last: bool = False   # True: each epoch is n // G whole steps; its tail is skipped

    def __post_init__(self) -> None:
        if self.n_samples < 1:
            raise ValueError("the dataset listing is empty")
        if self.world_size < 1 or self.batch_per_rank < 1:
            raise ValueError("world_size and batch_per_rank must be >= 1")
        if self.steps < 0:
            raise ValueError("steps must be >= 0")
        if not 0 <= self.seed <= _M64:
            raise ValueError("seed must be in [0, 2**64)")
        if self.drop_last and self.n_samples < self.global_batch:
            raise ValueError(f"drop_last needs at least one global batch of samples "
                             f"({self.n_samples} < {self.global_batch})")

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_per_rank

    @property
    def steps_per_epoch(self) -> float:
        if self.drop_last:
            return self.n_samples // self.global_batch
        return self.n_samples / self.global_batch


class _PermCache:
    def __init__(self, seed: int, n: int, keep: int = 3):
        self.seed, self.n, self.keep = seed, n, keep
        self._perms: dict[int, np.ndarray] = {}

    def get(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = epoch_permutation(self.seed, epoch, self.n)
            self._perms[epoch] = perm
            while len(self._perms) > self.keep:
                del self._perms[min(self._perms)]
        return perm


def step_positions(spec: PlanSpec, start: int, stop: int,
                   cache: _PermCache | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(epoch, index) arrays of shape (stop-start, G): the samples of steps [start, stop) in
    position order."""
    G, n = spec.global_batch, spec.n_samples
    cache = cache or _PermCache(spec.seed, n)
    steps = np.arange(start, stop, dtype=np.int64)[:, None]
    j = np.arange(G, dtype=np.int64)[None, :]
    if spec.drop_last:
        spe = n // G
        epoch = np.broadcast_to(steps // spe, (stop - start, G))
        offset = (steps % spe) * G + j
    else:
        pos = steps * G + j
        epoch, offset = pos // n, pos % n
    index = np.empty(epoch.shape, dtype=np.int64)
    for e in np.unique(epoch):
        m = epoch == e
        index[m] = cache.get(int(e))[offset[m]]
    return np.ascontiguousarray(epoch), index


# -- cost-aware assignment -----------------------------------------------------------------------
def assign_lpt(costs: np.ndarray, world_size: int, batch_per_rank: int) -> np.ndarray:
    """Longest-processing-time greedy with `batch_per_rank` slots per rank, for many steps at
    once. `costs` is (S, G) in position order; returns the rank of every position, (S, G).
    Ties go to the lower position (sorting) and the lower rank (argmin): deterministic."""
    costs = np.asarray(costs, dtype=np.float64)
    S, G = costs.shape
    if G != world_size * batch_per_rank:
        raise ValueError(f"a step has {G} samples, expected {world_size} x {batch_per_rank}")
    order = np.argsort(-costs, axis=1, kind="stable")
    rows = np.arange(S)
    load = np.zeros((S, world_size))
    count = np.zeros((S, world_size), dtype=np.int64)
    rank_of = np.empty((S, G), dtype=np.int64)
    for t in range(G):
        items = order[:, t]
        c = costs[rows, items]
        masked = np.where(count >= batch_per_rank, np.inf, load)
        r = np.argmin(masked, axis=1)
        rank_of[rows, items] = r
        load[rows, r] += c
        count[rows, r] += 1
    return rank_of


def plain_ranks(steps: int, world_size: int, batch_per_rank: int) -> np.ndarray:
    return np.broadcast_to(np.arange(world_size * batch_per_rank) // batch_per_rank,
                           (steps, world_size * batch_per_rank)).copy()


def rank_loads(costs: np.ndarray, rank_of: np.ndarray, world_size: int) -> np.ndarray:
    """(S, world_size): the summed cost of each rank at each step."""
    costs = np.asarray(costs, dtype=np.float64)
    S = costs.shape[0]
    loads = np.zeros((S, world_size))
    np.add.at(loads, (np.repeat(np.arange(S), costs.shape[1]), rank_of.ravel()), costs.ravel())
    return loads


def max_mean_ratio(loads: np.ndarray) -> np.ndarray:
    """Per step: the slowest rank's cost over the mean rank's (1.0 = perfectly even)."""
    loads = np.atleast_2d(np.asarray(loads, dtype=np.float64))
    mean = loads.mean(axis=1)
    mx = loads.max(axis=1)
    return np.where(mean > 0, mx / np.where(mean > 0, mean, 1.0), 1.0)


def balance(costs: np.ndarray, world_size: int, batch_per_rank: int) -> np.ndarray:
    """The cost-aware rank of every position: LPT, except where the plain layout is already at
    least as even (so balancing never makes a step worse)."""
    costs = np.asarray(costs, dtype=np.float64)
    lpt = assign_lpt(costs, world_size, batch_per_rank)
    plain = plain_ranks(costs.shape[0], world_size, batch_per_rank)
    better = (max_mean_ratio(rank_loads(costs, lpt, world_size))
              < max_mean_ratio(rank_loads(costs, plain, world_size)))
    return np.where(better[:, None], lpt, plain)


def balance_report(costs: np.ndarray, world_size: int, batch_per_rank: int,
                   rank_of: np.ndarray | None = None) -> dict:
    """Per-step max/mean cost ratio before (plain layout) and after balancing (`rank_of`, or
    `balance(costs)` when not given): arrays `before`, `after`, and their mean/p99/max."""
    costs = np.atleast_2d(np.asarray(costs, dtype=np.float64))
    if rank_of is None:
        rank_of = balance(costs, world_size, batch_per_rank)
    before = max_mean_ratio(rank_loads(costs, plain_ranks(costs.shape[0], world_size, batch_per_rank),
                                       world_size))
    after = max_mean_ratio(rank_loads(costs, rank_of, world_size))
    return {"before": before, "after": after, **summarize_ratios(before, after)}


def summarize_ratios(before: np.ndarray, after: np.ndarray) -> dict:
    def s(a: np.ndarray) -> dict:
        if len(a) == 0:
            return {"mean": 1.0, "p99": 1.0, "max": 1.0}
        return {"mean": float(np.mean(a)), "p99": float(np.quantile(a, 0.99)), "max": float(np.max(a))}
    return {"summary": {"before": s(np.asarray(before)), "after": s(np.asarray(after))}}


def layout(rank_of: np.ndarray, batch_per_rank: int) -> np.ndarray:
    """(S, G): for output row e of a step (sorted by rank, then slot), the position it holds.
    Within a rank, slots keep the positions' order."""
    S, G = rank_of.shape
    return np.argsort(rank_of * G + np.arange(G)[None, :], axis=1, kind="stable")


@dataclass
class StepChunk:
    """Rows of steps [start, stop), sorted by (step, rank, slot)."""
    step: np.ndarray
    rank: np.ndarray
    slot: np.ndarray
    index: np.ndarray
    aug_seed: np.ndarray
    est_cost_ms: np.ndarray
    ratio_before: np.ndarray   # per step (ones without costs)
    ratio_after: np.ndarray


def build_chunks(spec: PlanSpec, costs: Sequence[float] | np.ndarray | None = None, cost_aware: bool = False,
                 steps_per_chunk: int = 1024) -> Iterator[StepChunk]:
    """The whole plan, `steps_per_chunk` steps at a time. `costs` (one per sample index, ms)
    fills est_cost_ms; `cost_aware` also balances ranks by it."""
    if cost_aware and costs is None:
        raise ValueError("cost-aware mode needs per-sample cost estimates")
    if costs is not None:
        costs = np.asarray(costs, dtype=np.float64)
        if costs.shape != (spec.n_samples,):
            raise ValueError(f"{costs.shape[0]} cost estimates for {spec.n_samples} samples")
    W, B, G = spec.world_size, spec.batch_per_rank, spec.global_batch
    cache = _PermCache(spec.seed, spec.n_samples)
    steps_per_chunk = max(1, steps_per_chunk)
    for start in range(0, spec.steps, steps_per_chunk):
        stop = min(spec.steps, start + steps_per_chunk)
        S = stop - start
        epoch, index = step_positions(spec, start, stop, cache)
        c = costs[index] if costs is not None else np.zeros((S, G))
        plain = plain_ranks(S, W, B)
        rank_of = balance(c, W, B) if cost_aware else plain
        before = max_mean_ratio(rank_loads(c, plain, W))
        after = max_mean_ratio(rank_loads(c, rank_of, W)) if cost_aware else before
        lay = layout(rank_of, B)
        rows = np.arange(S)[:, None]
        idx = index[rows, lay]
        ep = epoch[rows, lay]
        e = np.arange(G)[None, :]
        yield StepChunk(
            step=np.repeat(np.arange(start, stop, dtype=np.int64), G),
            rank=np.broadcast_to(e // B, (S, G)).ravel().astype(np.int32),
            slot=np.broadcast_to(e % B, (S, G)).ravel().astype(np.int32),
            index=idx.ravel(),
            aug_seed=aug_seeds(spec.seed, ep.ravel(), idx.ravel()),
            est_cost_ms=c[rows, lay].ravel().astype(np.float32),
            ratio_before=before, ratio_after=after)


# -- the cost model ------------------------------------------------------------------------------
FEATURES = ("const", "mib", "mpix", "duration_s", "mpix_s")


def features(bytes_: np.ndarray, width: np.ndarray, height: np.ndarray,
             duration_s: np.ndarray) -> np.ndarray:
    """(n, 5): 1, size in MiB, megapixels, duration in s, megapixel-seconds. Missing values
    (NaN) count as 0."""
    b = np.nan_to_num(np.asarray(bytes_, dtype=np.float64)) / (1 << 20)
    mp = np.nan_to_num(np.asarray(width, dtype=np.float64) * np.asarray(height, dtype=np.float64)) / 1e6
    d = np.nan_to_num(np.asarray(duration_s, dtype=np.float64))
    return np.stack([np.ones_like(b), b, mp, d, mp * d], axis=1)


@dataclass
class CostModel:
    """Linear cost (ms) in `FEATURES`, one coefficient vector per (kind, codec) with enough
    timed samples, and a global one for the rest. Estimates are clipped at `floor_ms`."""
    coefs: dict[str, list[float]] = field(default_factory=dict)   # "kind/codec" -> coefficients
    global_coef: list[float] = field(default_factory=lambda: [0.0] * len(FEATURES))
    floor_ms: float = 0.01

    @staticmethod
    def group(kind: str, codec: str) -> str:
        return f"{kind or ''}/{codec or ''}".lower()

    @classmethod
    def fit(cls, kinds: Sequence[str] | np.ndarray, codecs: Sequence[str] | np.ndarray, X: np.ndarray,
            measured_ms: np.ndarray,
            min_samples: int | None = None, floor_ms: float = 0.01) -> CostModel:
        X = np.asarray(X, dtype=np.float64)
        y = np.asarray(measured_ms, dtype=np.float64)
        if X.ndim != 2 or X.shape[0] != y.shape[0] or X.shape[0] == 0:
            raise ValueError("the timing table is empty or its columns disagree")
        if not np.all(np.isfinite(y)):
            raise ValueError("measured_ms has missing or infinite values")
        min_samples = min_samples or X.shape[1] + 1
        model = cls(floor_ms=floor_ms)
        model.global_coef = np.linalg.lstsq(X, y, rcond=None)[0].tolist()
        groups = np.array([cls.group(k, c) for k, c in zip(kinds, codecs)])
        for g in sorted(set(groups.tolist())):
            m = groups == g
            if m.sum() >= min_samples:
                model.coefs[g] = np.linalg.lstsq(X[m], y[m], rcond=None)[0].tolist()
        return model

    def predict(self, kinds: Sequence[str] | np.ndarray, codecs: Sequence[str] | np.ndarray,
                X: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        out = X @ np.asarray(self.global_coef)
        groups = np.array([self.group(k, c) for k, c in zip(kinds, codecs)])
        for g, coef in self.coefs.items():
            m = groups == g
            if m.any():
                out[m] = X[m] @ np.asarray(coef)
        floored: np.ndarray = np.maximum(out, self.floor_ms)
        return floored

    def to_dict(self) -> dict:
        return {"features": list(FEATURES), "coefs": self.coefs, "global": self.global_coef,
                "floor_ms": self.floor_ms}

    @classmethod
    def from_dict(cls, d: Mapping) -> CostModel:
        if list(d.get("features", FEATURES)) != list(FEATURES):
            raise ValueError("cost model features differ from this version's")
        return cls(coefs={k: list(v) for k, v in d.get("coefs", {}).items()},
                   global_coef=list(d["global"]), floor_ms=float(d.get("floor_ms", 0.01)))


def fill_missing(costs: np.ndarray) -> np.ndarray:
    """Samples without metadata (NaN) get the mean of the known estimates (1 ms if none)."""
    costs = np.asarray(costs, dtype=np.float64).copy()
    known = np.isfinite(costs)
    costs[~known] = float(costs[known].mean()) if known.any() else 1.0
    return costs

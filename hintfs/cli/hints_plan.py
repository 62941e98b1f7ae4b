"""`hintfs hints plan CHECKPOINT_DIR --world-size N`: how many replicas of which files a job should
ask for before a restart, and the load time the scale model (policy/scale.py) predicts with and
without them. Reads only the checkpoint's `.metadata` (hintfs.hintsource, as `hints set
--from-dcp` does) and its files' sizes; needs no mount."""
from __future__ import annotations

import json
import math
import os
from collections import defaultdict

from hintfs.cli.base import UserError, read_json_file
from hintfs.hintsource import dcp_read_ranges, hints_from_dcp
from policy.replicas import replica_count
from policy.scale import (
    Costs, FileLoad, ReadGroup, Workload, best_replicas, costs_from_mapping, predict_load,
    prescale_time,
)

GPUS_PER_AGENT = 16          # the default cluster shape: one storage agent per 16 GPUs (bench/scale_model.py)
CANDIDATES = (3, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOLERANCE = 0.10
SHOWN = 12                   # files listed one by one; the rest are summed up


def add_options(parser) -> None:
    """The options of `hints plan` besides CHECKPOINT_DIR and --world-size."""
    parser.add_argument("--agents", type=int, default=None, metavar="N",
                        help=f"storage agents serving the checkpoint (default: one per {GPUS_PER_AGENT} "
                             "ranks of --world-size)")
    parser.add_argument("--costs", default=None, metavar="COSTS.json",
                        help="a JSON object of per-operation costs replacing the built-in ones (keys: "
                             "docs/restart_storm.md, 'The scale model')")
    parser.add_argument("--safe-readers", type=int, default=32, metavar="N",
                        help="concurrent readers one replica serves (the mounts' "
                             "[replicas] safe_readers_per_replica; `hintfs calibrate` measures it)")
    parser.add_argument("--default-replicas", type=int, default=3, metavar="N",
                        help="replicas every file has without a hint (the default the prediction compares "
                             "with; also the fewest a hinted file gets)")
    parser.add_argument("--max-replicas", type=int, default=None, metavar="N",
                        help="the most replicas of one file (default: the fewest within 10%% of the best "
                             "load time the model finds)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def dcp_workload(ckpt_dir: str, world_size: int) -> tuple[Workload, dict[str, int], dict[str, int]]:
    """What `world_size` ranks read of the checkpoint at a restart, loaded with the sharding it was
    saved with (hintfs.hintsource's rule: a tensor in k chunks is read by world_size // k ranks per
    chunk, one in one chunk by every rank); the hint (readers per file) and the files' sizes."""
    chunks: dict[str, int] = {}

    def readers_of(fqn: str, n: int) -> int:
        chunks[fqn] = n
        return world_size if n == 1 else max(1, world_size // n)
    hints = hints_from_dcp(ckpt_dir, world_size, readers_of=readers_of)
    by_n: dict[int, list[str]] = defaultdict(list)
    for fqn, n in chunks.items():
        by_n[n].append(fqn)
    reads: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))   # path -> readers -> sizes
    rank_bytes = rank_reads = 0.0
    for n, fqns in sorted(by_n.items()):
        readers = world_size if n == 1 else max(1, world_size // n)
        ranges = dcp_read_ranges(ckpt_dir, fqns)
        for path, _offset, length in ranges:
            reads[path][readers].append(length)
        rank_bytes += sum(length for _p, _o, length in ranges) / n
        rank_reads += len(ranges) / n
    meta = os.path.join(ckpt_dir, ".metadata")
    sizes = {".metadata": os.path.getsize(meta)}
    with open(meta, "rb") as f:
        meta_wire = wire_bytes(f.read())
    # (its size stays what it is on disk: copies and budgets; its reads weigh what crosses)
    files = [FileLoad(".metadata", sizes[".metadata"], (ReadGroup.of(world_size, [meta_wire]),))]
    for path in sorted(set(hints) - {".metadata"}):
        full = os.path.join(ckpt_dir, path)
        sizes[path] = os.path.getsize(full) if os.path.exists(full) else sum(sum(v) for v in reads[path].values())
        groups = tuple(ReadGroup.of(r, s) for r, s in sorted(reads[path].items(), reverse=True))
        files.append(FileLoad(path, sizes[path], groups))
    workload = Workload(world_size, tuple(files), math.ceil(meta_wire + rank_bytes), math.ceil(1 + rank_reads))
    return workload, hints, sizes


def wire_bytes(data: bytes, piece: int = 256 << 10) -> int:
    """What `data` weighs on the agents' links when read in pieces of `piece` bytes: agents send
    a range compressed where that saves a quarter of it (`rpc.pack_range`; DCP's `.metadata`, a
    pickle, crosses at ~1/15 of its size). Only the `.metadata` is weighed so: the tensor files
    are mostly random bytes and reading them all would make the plan as slow as a restart."""
    from hintfs.agent.rpc import pack_range   # (pyarrow: not for every command line's start)
    total = 0
    for off in range(0, len(data), piece):
        chunk = data[off:off + piece]
        packed = pack_range(chunk)
        total += len(chunk) if packed is None else len(packed)
    return total


def _costs(path: str | None) -> tuple[Costs, str]:
    if path is None:
        return Costs(), "built in: this project's emulated data nodes (bench/results/scale_model.json)"
    doc = read_json_file(path, "--costs")
    if not isinstance(doc, dict):
        raise UserError(f"--costs {path}: expected a JSON object {{key: number}}, not {type(doc).__name__}")
    try:
        return costs_from_mapping(doc), path
    except ValueError as err:
        raise UserError(f"--costs {path}: {err}") from None


def _size(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def cmd_plan(args) -> int:
    ckpt = args.checkpoint
    if args.world_size is None:
        raise UserError("hints plan needs --world-size N: how many ranks load the checkpoint")
    if args.world_size < 1:
        raise UserError(f"--world-size must be >= 1, not {args.world_size}")
    for opt in ("agents", "safe_readers", "default_replicas", "max_replicas"):
        value = getattr(args, opt)
        if value is not None and value < 1:
            raise UserError(f"--{opt.replace('_', '-')} must be >= 1, not {value}")
    costs, costs_from = _costs(args.costs)
    if not os.path.isdir(ckpt):
        raise UserError(f"{ckpt}: no such directory (give a torch.distributed.checkpoint folder)")
    if not os.path.isfile(os.path.join(ckpt, ".metadata")):
        raise UserError(f"{ckpt} is not a DCP checkpoint folder: it has no .metadata "
                        "(torch.distributed.checkpoint writes one at the end of a save)")
    try:
        workload, hints, sizes = dcp_workload(ckpt, args.world_size)
    except ImportError as err:
        raise UserError(f"hints plan reads the checkpoint with torch, which is not importable here: {err}") from None
    except Exception as err:  # noqa: BLE001 - torch's unpickling raises anything on a foreign file
        raise UserError(f"{ckpt}/.metadata is not a DCP checkpoint's metadata ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else 'unreadable'})") from None

    agents = args.agents or max(1, math.ceil(args.world_size / GPUS_PER_AGENT))
    default = min(args.default_replicas, agents)
    cands = sorted({c for c in CANDIDATES if c <= agents} | {agents, default})
    if args.max_replicas is None:   # the cap the mount's [replicas] max_replicas would set
        cap, times = best_replicas(workload, costs, agents, cands, TOLERANCE, plan=lambda r: {
            f.path: replica_count(f.readers, args.safe_readers, min(default, r), r, agents)
            for f in workload.files})
    else:
        cap, times = min(args.max_replicas, agents), {}
    plan = {f.path: replica_count(f.readers, args.safe_readers, default, cap, agents) for f in workload.files}
    base = predict_load(workload, costs, agents, "default", default_replicas=default)
    hinted = predict_load(workload, costs, agents, "hints", replicas=plan)
    ready = prescale_time(workload, plan, costs)
    out = {
        "checkpoint": ckpt, "world_size": args.world_size, "agents": agents,
        "agents_assumed": args.agents is None, "files": len(workload.files),
        "bytes": sum(sizes.values()), "rank_bytes": workload.rank_bytes, "rank_reads": workload.rank_reads,
        "metadata_bytes": sizes[".metadata"], "metadata_wire_bytes": int(workload.files[0].groups[0].bytes),
        "max_replicas": cap, "replicas": plan, "readers": hints,
        "load_time_s": {"default": round(base.seconds, 3), "hints": round(hinted.seconds, 3)},
        "hints_over_default": round(hinted.seconds / base.seconds, 3) if base.seconds > 0 else None,
        "hint_to_ready_s": round(ready, 3),
        "limit": {"default": base.limit, "hints": hinted.limit},
        "load_time_by_max_replicas_s": {str(r): round(s, 3) for r, s in times.items()},
        "costs": costs_from,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print(out, workload, args, costs)
    return 0


def _print(out: dict, workload: Workload, args, costs: Costs) -> None:
    plan, readers = out["replicas"], out["readers"]
    shape = "assumed, one per %d ranks: --agents to set" % GPUS_PER_AGENT if out["agents_assumed"] else "--agents"
    print(f"checkpoint {out['checkpoint']}: {out['files']} files, {_size(out['bytes'])}; "
          f"each of {out['world_size']} ranks reads {_size(out['rank_bytes'])} in {out['rank_reads']} reads")
    print(f"storage agents: {out['agents']} ({shape})")
    print()
    print(f"replicas to ask for (most per file: {out['max_replicas']}):")
    order = sorted(workload.files, key=lambda f: (-plan[f.path], -readers.get(f.path, 0), f.path))
    width = max(len(f.path) for f in order[:SHOWN])
    print(f"  {'file':{width}s}  {'readers':>8s}  {'replicas':>8s}  {'size':>9s}")
    for f in order[:SHOWN]:
        print(f"  {f.path:{width}s}  {readers.get(f.path, 0):8d}  {plan[f.path]:8d}  {_size(f.size):>9s}")
    rest = order[SHOWN:]
    if rest:
        counts = sorted({plan[f.path] for f in rest})
        print(f"  ... {len(rest)} more files with {'/'.join(map(str, counts))} replicas")
    print()
    d, h = out["load_time_s"]["default"], out["load_time_s"]["hints"]
    print(f"predicted load time: default ({min(args.default_replicas, out['agents'])} replicas, readers pick "
          f"at random) {d:.2f} s; with these replicas (reads spread by bytes asked) {h:.2f} s"
          + (f" ({(h / d - 1):+.0%})" if d > 0 else ""))
    print(f"hint -> replicas ready: {out['hint_to_ready_s']:.2f} s (tree fan-out; give the hint that long "
          "before the restart)")
    print(f"what limits it: default: {out['limit']['default']}; hints: {out['limit']['hints']}")
    print()
    print(f"to ask for them: hintfs hints set MOUNT JOB --from-dcp {out['checkpoint']} --world-size "
          f"{out['world_size']}, with [replicas] safe_readers_per_replica = {args.safe_readers} and "
          f"max_replicas = {out['max_replicas']} on the mounts (their default max_replicas is 16)")
    print()
    print("assumptions: the model of policy/scale.py (docs/restart_storm.md, 'The scale model'); costs "
          f"{out['costs']} ({_size(costs.agent_bandwidth_bytes_s)}/s per agent; seconds hold for those "
          "costs only, the ratio is what carries over); every rank reads .metadata (on the agents' links: "
          f"{_size(out['metadata_wire_bytes'])} of its {_size(out['metadata_bytes'])}, compressed where that pays), "
          "the tensors stored once "
          "and its own shard (the load uses the save's sharding); whole-file replicas placed as the mount "
          "places them; no time but reads (no deserialisation, no copies to the GPU).")

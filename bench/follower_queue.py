"""How long the eval tier's follower takes to copy a checkpoint of many small files.

A real in-process agent with a link budget (`[agent] link_bytes_s`, as a cross-DC tier has; set
high here so that the link is not what is measured) follows a local store. Each rep journals a
new checkpoint of `--files` files of 64 bytes and a marker, and times the follower's round from
the records to the checkpoint's completion. What it shows is the follower's own work per file:
picking the next copy used to be a min over every queued file (bench/README.md).

    python bench/follower_queue.py [--files 4096] [--reps 3] [--keep-last 1]
                                   [--budget-checkpoints B] [--label NAME]

n = --reps checkpoints; the result goes into `--out` under `--label` (an older build's: copy
this file and bench/tier_rounds.py into a worktree of it and run it there).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hintfs.agent.server import start_in_process  # noqa: E402
from mountconfig import parse_config  # noqa: E402
from hintfs.stores.local import LocalStore  # noqa: E402
from tier_rounds import save_run, write_record  # noqa: E402  (bench/ is the script dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=4096, help="files per checkpoint (one per rank)")
    ap.add_argument("--reps", type=int, default=3, help="checkpoints, one timed round each")
    ap.add_argument("--keep-last", type=int, default=1, help="[follow] keep_last: checkpoints the tier holds")
    ap.add_argument("--budget-checkpoints", type=float, default=0.0,
                    help="[agent] budget_bytes as this many checkpoints' bytes (0: the default budget): "
                         "a full tier evicts at its copies")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "follower_queue.json"))
    ap.add_argument("--label", default="this build", help="the name of this run in --out")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hintfs-follow-queue-") as tmp:
        store = Path(tmp) / "store"
        (store / "ckpt").mkdir(parents=True)
        agent = {"data_dir": f"{tmp}/tier", "link_bytes_s": 10 * 10**9}
        if args.budget_checkpoints:
            agent["budget_bytes"] = int(args.budget_checkpoints * (args.files * 64 + 4))
        cfg = parse_config({"store": {"uri": f"file://{store}"}, "agent": agent,
                            "follow": {"prefixes": ["ckpt"], "poll_interval_s": 3600,
                                       "keep_last": args.keep_last}})
        server, _loc = start_in_process(LocalStore(str(store)), cfg.agent, peers=cfg.agents, follow=cfg.follow,
                                        transform_load=cfg.transform_load)
        follower = server.agent.follower
        rounds = []
        try:
            for k in range(args.reps):
                ck = store / "ckpt" / "job" / f"step_{k}"
                ck.mkdir(parents=True)
                for r in range(args.files):
                    (ck / f"__{r}_0.distcp").write_bytes(b"x" * 64)
                    write_record(store, f"ckpt/job/step_{k}/__{r}_0.distcp")
                (ck / ".metadata").write_bytes(b"plan")
                write_record(store, f"ckpt/job/step_{k}/.metadata")
                t0 = time.perf_counter()
                follower.step(wait=True)
                rounds.append(time.perf_counter() - t0)
                assert follower.status()["complete"][-1] == f"ckpt/job/step_{k}", follower.status()
                print(f"checkpoint {k + 1}: {args.files + 1} files copied and complete in {rounds[-1]:.2f} s")
            evictions = server.agent.catalog.evictions
        finally:
            server.shutdown()
    result = {"files_per_checkpoint": args.files, "keep_last": args.keep_last,
              "budget_checkpoints": args.budget_checkpoints, "evictions": evictions,
              "round_s": [round(s, 2) for s in rounds], "n": len(rounds),
              "round_median_s": round(statistics.median(rounds), 2),
              "per_file_ms": round(1000 * statistics.median(rounds) / (args.files + 1), 3)}
    print(json.dumps(result, indent=1))
    save_run(Path(args.out), args.label, result)


if __name__ == "__main__":
    main()

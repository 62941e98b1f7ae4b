"""The eval tier's round that reads a deleted checkpoint's removal records.

A training job that deletes an old checkpoint of F files (one per rank) through a journaled mount
writes F removal records. The tier's follower reads them in one round: it forgets those files and
the agent drops their replicas. This bench times that round with a real in-process agent and
follower over a local store, while the tier holds `--kept` other checkpoints of F files each.

    python bench/removal_rounds.py [--files 4096] [--kept 2] [--reps 3] [--label NAME]

Each rep deletes one more checkpoint; n = --reps rounds (each timed once). The result goes into
`--out` under `--label`, beside the runs already there (an older build's: copy this file and
bench/tier_rounds.py into a worktree of it and run it there with that build's name).
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
    ap.add_argument("--kept", type=int, default=2, help="checkpoints the tier still holds after the reps")
    ap.add_argument("--reps", type=int, default=3, help="checkpoints deleted, one per timed round")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "removal_rounds.json"))
    ap.add_argument("--label", default="this build", help="the name of this run in --out")
    args = ap.parse_args()
    steps = args.kept + args.reps
    with tempfile.TemporaryDirectory(prefix="hintfs-removals-") as tmp:
        store = Path(tmp) / "store"
        for k in range(steps):
            ck = store / "ckpt" / "job" / f"step_{k}"
            ck.mkdir(parents=True)
            for r in range(args.files):
                (ck / f"__{r}_0.distcp").write_bytes(b"x" * 64)
                write_record(store, f"ckpt/job/step_{k}/__{r}_0.distcp")
            (ck / ".metadata").write_bytes(b"plan")
            write_record(store, f"ckpt/job/step_{k}/.metadata")
        cfg = parse_config({"store": {"uri": f"file://{store}"}, "agent": {"data_dir": f"{tmp}/tier"},
                            "follow": {"prefixes": ["ckpt"], "poll_interval_s": 3600, "keep_last": steps}})
        server, _loc = start_in_process(LocalStore(str(store)), cfg.agent, peers=cfg.agents, follow=cfg.follow,
                                        transform_load=cfg.transform_load)
        follower = server.agent.follower
        try:
            t0 = time.perf_counter()
            follower.step(wait=True)
            copy_s = time.perf_counter() - t0
            held = len(server.agent.catalog.replicas)
            assert held == steps * (args.files + 1), held
            rounds = []
            for k in range(args.reps):
                ck = store / "ckpt" / "job" / f"step_{k}"
                for p in sorted(ck.iterdir()):           # `rm -r` through a journaled mount
                    p.unlink()
                    write_record(store, f"ckpt/job/step_{k}/{p.name}", removed=True)
                ck.rmdir()
                t0 = time.perf_counter()
                follower.step(wait=True)
                rounds.append(time.perf_counter() - t0)
                left = len(server.agent.catalog.replicas)
                assert left == (steps - k - 1) * (args.files + 1), left
                assert f"ckpt/job/step_{k}" not in follower.status()["complete"]
                print(f"round {k + 1}: {args.files + 1} removal records, {left + args.files + 1} replicas "
                      f"before: {rounds[-1]:.3f} s")
        finally:
            server.shutdown()
    result = {"files_per_checkpoint": args.files, "checkpoints": steps, "copy_round_s": round(copy_s, 2),
              "removal_round_s": [round(s, 3) for s in rounds], "n": len(rounds),
              "removal_round_median_s": round(statistics.median(rounds), 3)}
    print(json.dumps(result, indent=1))
    save_run(Path(args.out), args.label, result)


if __name__ == "__main__":
    main()

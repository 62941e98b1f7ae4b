#!/usr/bin/env python3
"""What reading `.tensor` files costs the training host, by how the trainer reads them (issue 40).

Files: 120 `.tensor` files like the multimodal bench's (80 images 224x224x3 uint8, 40 clips of 8
frames), written to a temporary folder under /dev/shm (no mount: this measures the client's side
alone; bench/multimodal_loading.py measures it through the mount). Batches of 4 samples, 500 of
them (n = 2,000 samples per way), everything pinned to one core (`--cpus`). Ways, interleaved over
`--repeats` rounds:

  per_sample   a DataLoader worker (fork, prefetch_factor 2) loading each file with
               `container.load_sample` into its own tensor (torch moves each to shared memory
               to send it)
  batch_worker the same DataLoader, the dataset's `__getitems__` = `hintfs.dataset.read_batch`
               (one shared-memory buffer per batch)
  threads      `hintfs.dataset.prefetch(depth=2, threads=1)` around `read_batch`, no worker process

For each: CPU per sample (the process and its reaped children, `os.times`) and the hand-over of a
prefetched batch (`next()` after a 50 ms sleep, so the batch is ready: 150 batches, the first 5
dropped), median over the rounds. `sudo` is not needed.

    .venv/bin/python bench/tensor_batches.py [--repeats 3] [--out bench/results/tensor_batches.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = ("per_sample", "batch_worker", "threads")


def make_files(folder: str) -> list[str]:
    import numpy as np
    sys.path.insert(0, REPO)
    from hintfs.transforms import container as tc
    rng = np.random.default_rng(0)
    paths = []
    for i in range(120):
        video = i >= 80
        arr = rng.integers(0, 255, size=(8, 224, 224, 3) if video else (224, 224, 3), dtype=np.uint8)
        kind, params = ("video", {"frames": 8, "size": 224, "crop": [224, 224]}) if video else \
            ("image", {"size": 224, "crop": [224, 224]})
        p = os.path.join(folder, f"{i}.tensor")
        with open(p, "wb") as f:
            f.write(tc.encode_tensor({"frames" if video else "pixels": arr},
                                     tc.make_meta(kind, params, 1, f"s{i}", 100, 1)))
        paths.append(p)
    return paths


def one(way: str, folder: str, batches: int, sleep_s: float) -> dict:
    """Runs in its own process (a fresh interpreter per way and round)."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader
    sys.path.insert(0, REPO)
    from hintfs.dataset import prefetch, read_batch
    from hintfs.transforms.container import load_sample
    torch.set_num_threads(1)
    paths = sorted((os.path.join(folder, n) for n in os.listdir(folder)), key=lambda p: int(os.path.basename(p)[:-7]))

    class PerSample:
        def __len__(self):
            return batches * 4

        def __getitem__(self, i):
            return {k: torch.from_numpy(v) for k, v in load_sample(paths[i % len(paths)]).items()}

    class Batched(PerSample):
        def __getitems__(self, idx):
            return read_batch([paths[i % len(paths)] for i in idx])

    index = [list(range(s * 4, (s + 1) * 4)) for s in range(batches)]

    def loader():
        if way == "threads":
            return prefetch(([paths[i % len(paths)] for i in b] for b in index), depth=2, threads=1)
        ds = PerSample() if way == "per_sample" else Batched()
        return iter(DataLoader(ds, batch_sampler=index, num_workers=1, prefetch_factor=2,
                               collate_fn=lambda x: x, multiprocessing_context="fork"))

    def close(it):
        if hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        else:
            it.close()

    t0 = os.times()
    it = loader()
    for _ in range(batches):
        next(it)
    close(it)
    t1 = os.times()
    cpu = sum(getattr(t1, k) - getattr(t0, k) for k in ("user", "system", "children_user", "children_system"))
    it = loader()
    time.sleep(0.5)
    waits = []
    for _ in range(min(batches, 150)):
        a = time.perf_counter()
        next(it)
        waits.append(time.perf_counter() - a)
        time.sleep(sleep_s)
    close(it)
    w = np.array(waits[5:]) * 1000
    return {"cpu_ms_per_sample": cpu / (batches * 4) * 1000, "handover_ms_p50": float(np.percentile(w, 50)),
            "handover_ms_p99": float(np.percentile(w, 99)), "handover_n": len(w)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, default=500)
    ap.add_argument("--cpus", default="1", help="CPUs every way is pinned to (taskset list)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "tensor_batches.json"))
    ap.add_argument("--one", nargs=2, metavar=("WAY", "FOLDER"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1], a.batches, 0.05)))
        return 0
    folder = tempfile.mkdtemp(prefix="hintfs-tb-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        make_files(folder)
        runs: dict[str, list[dict]] = {w: [] for w in WAYS}
        for r in range(a.repeats):
            for way in WAYS:   # interleaved: each round runs every way once
                out = subprocess.run(["taskset", "-c", a.cpus, sys.executable, __file__, "--batches", str(a.batches),
                                      "--one", way, folder], check=True, capture_output=True, text=True).stdout
                runs[way].append(json.loads(out.strip().splitlines()[-1]))
                print(f"round {r} {way}: {runs[way][-1]}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    summary = {w: {k: statistics.median(x[k] for x in runs[w]) for k in runs[w][0] if k != "handover_n"}
               for w in WAYS}
    doc = {"benchmark": "tensor_batches", "samples_per_way": a.batches * 4, "repeats": a.repeats, "cpus": a.cpus,
           "files": "120 .tensor files on /dev/shm: 80 of 224x224x3 uint8, 40 of 8x224x224x3 (490 KB mean)",
           "median": summary, "runs": runs,
           "ratio_cpu_vs_per_sample": {w: summary[w]["cpu_ms_per_sample"] / summary["per_sample"]["cpu_ms_per_sample"]
                                       for w in WAYS}}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

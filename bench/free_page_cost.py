"""What a page-cache write costs on this machine, by how long free memory sat idle before it.

Writes a 28 MiB file (the size of `cross_dc_eval.py`'s checkpoint) in 1 MiB `write()`s, unlinks
it, sleeps, and again, `--reps` times per pause. On a VM whose free memory goes back to the host
(virtio-balloon free page reporting), a write into memory freed seconds ago faults every page in
on the host; into memory freed just before, it does not. bench/README.md ("the VM's cold free
pages") has the figures and what they do to `cross_dc_eval.py`'s write ratio.

    python bench/free_page_cost.py [--reps 5]       # results/free_page_cost.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1 << 20


def write_ms(folder: str, buf: bytes, mib: int) -> float:
    path = os.path.join(folder, "page-cost")
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(mib):
            os.write(fd, buf)
        return (time.perf_counter() - t0) * 1000
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mib", type=int, default=28)
    ap.add_argument("--pauses", default="0.05,0.5,1,2,3", help="seconds idle before each write")
    ap.add_argument("--out", default=str(RESULTS / "free_page_cost.json"))
    a = ap.parse_args()
    buf = os.urandom(MIB)
    out: dict = {"config": {"reps": a.reps, "mib": a.mib, "kernel": os.uname().release,
                            "virtio_balloon": Path("/sys/bus/virtio/drivers/virtio_balloon").exists()},
                 "write_ms": {}}
    with tempfile.TemporaryDirectory(prefix="hintfs-page-cost-") as folder:
        for pause in (float(p) for p in a.pauses.split(",")):
            xs = []
            for _ in range(a.reps):
                time.sleep(pause)
                xs.append(round(write_ms(folder, buf, a.mib), 1))
            out["write_ms"][str(pause)] = {"n": len(xs), "median": statistics.median(xs), "reps": xs}
            print(f"idle {pause:>4} s before: {a.mib} MiB written in median {statistics.median(xs):.1f} ms "
                  f"(n={len(xs)}) {xs}", flush=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

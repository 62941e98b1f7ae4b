"""What a page-cache write costs on this machine, by how long free memory sat idle before it.

Writes a 28 MiB file (the size of `cross_dc_eval.py`'s checkpoint) in 1 MiB `write()`s, unlinks
it, sleeps, and again, `--reps` times per pause. On a VM whose free memory goes back to the host
(virtio-balloon free page reporting), a write into memory freed seconds ago faults every page in
on the host; into memory freed just before, it does not. bench/notes/cross_dc_eval.md ("the VM's cold free
pages") has the figures and what they do to `cross_dc_eval.py`'s write ratio.

    python bench/free_page_cost.py [--reps 5]       # results/free_page_cost.json

`--recycle` asks what a streaming mount's staging files do to it. After 3 s idle (cold free
memory) it writes file A, then file B, each `--mib` MiB: with A freed before B is written (the
copy-after-close mount: a file's staging goes at its close), or with A still held (the streaming
mount: the sender keeps its descriptor on A's staging until it has sent and published A). The
two arms alternate; the figure is B's write time.

    python bench/free_page_cost.py --recycle --mib 14 --reps 6   # results/free_page_recycle.json
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
        return write_into(fd, buf, mib)
    finally:
        os.close(fd)
        os.unlink(path)


def write_into(fd: int, buf: bytes, mib: int) -> float:
    t0 = time.perf_counter()
    for _ in range(mib):
        os.write(fd, buf)
    return (time.perf_counter() - t0) * 1000


def recycle(folder: str, buf: bytes, mib: int, reps: int) -> dict:
    """B's write time (ms) per arm: A freed before B, or A held while B is written."""
    out: dict = {"freed": [], "held": []}
    for i in range(reps):
        for arm in ("freed", "held") if i % 2 == 0 else ("held", "freed"):
            time.sleep(3.0)
            a_path, b_path = os.path.join(folder, "a"), os.path.join(folder, "b")
            fa = os.open(a_path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
            write_into(fa, buf, mib)
            os.unlink(a_path)
            if arm == "freed":       # the last reference: A's pages go back to the free lists now
                os.close(fa)
            fb = os.open(b_path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
            out[arm].append(round(write_into(fb, buf, mib), 1))
            os.close(fb)
            os.unlink(b_path)
            if arm == "held":
                os.close(fa)
    return {arm: {"n": len(xs), "median": statistics.median(xs), "reps": xs} for arm, xs in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mib", type=int, default=28)
    ap.add_argument("--pauses", default="0.05,0.5,1,2,3", help="seconds idle before each write")
    ap.add_argument("--recycle", action="store_true", help="file B's write, after file A freed or held")
    ap.add_argument("--out", default=None, help="default: results/free_page_cost.json "
                                                "(--recycle: results/free_page_recycle.json)")
    a = ap.parse_args()
    buf = os.urandom(MIB)
    out: dict = {"config": {"reps": a.reps, "mib": a.mib, "kernel": os.uname().release,
                            "virtio_balloon": Path("/sys/bus/virtio/drivers/virtio_balloon").exists()},
                 "write_ms": {}}
    dest = Path(a.out or RESULTS / ("free_page_recycle.json" if a.recycle else "free_page_cost.json"))
    # the temp folder, where bench/cross_dc_eval.py's mounts stage their files (a disk here)
    with tempfile.TemporaryDirectory(prefix="hintfs-page-cost-") as folder:
        if a.recycle:
            out["write_ms"] = recycle(folder, buf, a.mib, a.reps)
            for arm, v in out["write_ms"].items():
                print(f"A {arm}: B's {a.mib} MiB written in median {v['median']:.1f} ms (n={v['n']}) {v['reps']}")
            dest.write_text(json.dumps(out, indent=1) + "\n")
            return 0
        for pause in (float(p) for p in a.pauses.split(",")):
            xs = []
            for _ in range(a.reps):
                time.sleep(pause)
                xs.append(round(write_ms(folder, buf, a.mib), 1))
            out["write_ms"][str(pause)] = {"n": len(xs), "median": statistics.median(xs), "reps": xs}
            print(f"idle {pause:>4} s before: {a.mib} MiB written in median {statistics.median(xs):.1f} ms "
                  f"(n={len(xs)}) {xs}", flush=True)
    dest.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

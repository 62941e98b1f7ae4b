"""Daemon CPU per operation: a load-robust comparison of two hintfs builds (or one build over time).

Wall-clock throughput on a shared 2-core machine moves by 3-5x with whatever else runs; the CPU
time the mount daemon spends per file opened or per GiB moved moves far less. This bench mounts
each given `hintfs` console script over the same store (a private tmpfs), runs a fixed workload
through it, and reads the daemon's user+system CPU time from /proc before and after each phase:

  tree-pass1 / tree-pass2 : open + read + close of N small files (4-64 KiB, fixed seed), 1 reader
  seq-read                : one file read sequentially in 1 MiB reads (fresh mount, so uncached)
  seq-write               : one file written in 1 MiB writes, close included

Rounds alternate the builds (A B A B ...) so drifting load hits both alike. Reports the median
over rounds (n = rounds) of CPU microseconds per file and CPU seconds per GiB, and wall time.

Run as root:  .venv/bin/python bench/daemon_cpu.py --build new=.venv/bin/hintfs \
                  --build old=/path/to/other/venv/bin/hintfs [--files 3000] [--rounds 3]
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

from fuse_throughput import MiB, make_big_file, make_tree, run, seq_read, seq_write  # bench/ is the script dir

from tests.helpers.procs import proc_cpu_s as cpu_seconds  # (fuse_throughput put the repo on the path)


def daemon_pid(mountpoint: str) -> int:
    """The mount daemon: the process whose command line names this mountpoint (not the CLI)."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if os.fsencode(mountpoint) in argv and any(b"fusefs" in a for a in argv):
            return int(entry)
    raise RuntimeError(f"no daemon found for {mountpoint}")


def make_store(store: str, files: int, seq_mib: int) -> list[str]:
    """fuse_throughput's small-file tree and a sequential file of `seq_mib` MiB."""
    make_big_file(os.path.join(store, "seq.bin"), seq_mib * MiB)
    return [rel for rel, _size in make_tree(store, files)]


def read_tree(mnt: str, names: list[str]) -> None:
    for name in names:
        with open(os.path.join(mnt, name), "rb") as f:
            while f.read(1 << 20):
                pass


def one_round(hintfs: str, base: str, store: str, names: list[str], seq_mib: int, write_mib: int) -> dict:
    mnt = tempfile.mkdtemp(dir=base, prefix="mnt-")
    cfg = os.path.join(base, f"{os.path.basename(mnt)}.toml")
    with open(cfg, "w") as f:
        f.write(f'[store]\nuri = "file://{store}"\n[logging]\nfile = "{cfg}.log"\n')
    # From a neutral folder: builds before the -I fix import the daemon from the working directory.
    r = run([hintfs, "mount", cfg, mnt], cwd=base, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"{hintfs} mount failed: {r.stdout.strip()}")
    out: dict = {}
    try:
        pid = daemon_pid(mnt)
        phases = [("tree-pass1", lambda: read_tree(mnt, names), len(names), "files"),
                  ("tree-pass2", lambda: read_tree(mnt, names), len(names), "files"),
                  ("seq-read", lambda: seq_read(os.path.join(mnt, "seq.bin")), seq_mib / 1024, "GiB"),
                  ("seq-write", lambda: seq_write(os.path.join(mnt, "out.bin"), write_mib * MiB), write_mib / 1024, "GiB")]
        for phase, work, amount, unit in phases:
            c0, t0 = cpu_seconds(pid), time.perf_counter()
            work()
            wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - c0
            out[phase] = {"unit": unit, "amount": amount, "wall_s": wall, "daemon_cpu_s": cpu}
    finally:
        r = run([hintfs, "umount", mnt], timeout=120)
        if r.returncode != 0:
            run(["fusermount3", "-u", "-z", mnt])
        try:
            os.unlink(os.path.join(store, "out.bin"))
        except FileNotFoundError:
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="append", required=True, metavar="NAME=HINTFS",
                    help="a name and the hintfs console script to mount with (give two or more)")
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--seq-mib", type=int, default=512)
    ap.add_argument("--write-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", default="", help="JSON results file")
    args = ap.parse_args()
    # Absolute: mounts run from a neutral folder (see one_round).
    builds = [(name, os.path.abspath(path)) for name, path in (b.split("=", 1) for b in args.build)]
    base = tempfile.mkdtemp(prefix="hintfs-cpu-")
    store = os.path.join(base, "store")
    os.mkdir(store)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4g", "tmpfs", store], check=True)
    samples: dict = {name: [] for name, _ in builds}
    try:
        names = make_store(store, args.files, args.seq_mib)
        for rnd in range(args.rounds):
            for name, hintfs in builds:
                samples[name].append(one_round(hintfs, base, store, names, args.seq_mib, args.write_mib))
                print(f"round {rnd + 1} {name}: done", file=sys.stderr)
    finally:
        if subprocess.run(["umount", store]).returncode == 0:
            shutil.rmtree(base, ignore_errors=True)   # mountpoints, configs and logs of the rounds
    table = {}
    print(f"\nmedian over n={args.rounds} rounds; daemon CPU per unit of work (lower is better), wall in s")
    print("| phase | " + " | ".join(f"{n} CPU/unit | {n} wall" for n, _ in builds) + " |")
    print("|---|" + "---:|---:|" * len(builds))
    for phase in samples[builds[0][0]][0]:
        row = [phase]
        for name, _ in builds:
            rows = [s[phase] for s in samples[name]]
            unit = rows[0]["unit"]
            per = statistics.median(r["daemon_cpu_s"] / r["amount"] for r in rows)
            wall = statistics.median(r["wall_s"] for r in rows)
            table.setdefault(phase, {})[name] = {"cpu_per_unit": per, "unit": unit, "wall_s": wall, "n": len(rows)}
            shown = f"{per * 1e6:,.0f} µs/file" if unit == "files" else f"{per:.2f} s/GiB"
            row += [shown, f"{wall:.2f}"]
        print("| " + " | ".join(row) + " |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"files": args.files, "seq_mib": args.seq_mib, "write_mib": args.write_mib,
                       "rounds": args.rounds, "builds": [n for n, _ in builds], "median": table, "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

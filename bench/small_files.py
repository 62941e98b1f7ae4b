#!/usr/bin/env python3
"""Small files, side by side in one run (issue 39, part 2): open + read + close of N small files
(4-64 KiB, fuse_throughput's fixed-seed tree) on a fresh mount, through

  bindfs          Debian's bindfs (libfuse 2, single-threaded by default)
  bindfs_mt       bindfs --multithreaded
  passthrough_hp  libfuse's own example (multi-threaded, FUSE passthrough), built from the libfuse
                  source `make setup` fetches (see --passthrough-hp)
  hintfs          this checkout's `hintfs mount` (file:// store)
  floor           bench/pyfuse3_floor.py's minimal daemon on the same (patched) pyfuse3
  and, beside them: hintfs_imm (immutable_globs over the tree), floor_pt (the floor with FUSE
  passthrough, as hintfs), floor_fast (floor_pt with every inode marked for pyfuse3's fast path:
  docs/fastpath.md; hintfs_imm gets it by its own rule, fusefs/fastpath.py)

Cases: p1 (one reader, fresh mount), p1_pass2 (the same reader again on that mount: names and
attributes cached by the kernel), p8 (eight reader processes, fresh mount), p8_again (the eight
again on that mount once the kernel dropped its names and inodes, `drop_caches` 2: every name
looked up and every file opened again, as in an epoch over more files than the kernel keeps; no
goal of issue 39's). All systems run with
the same entry and attr timeouts (--timeout, default 86400 s: the only caching timeout
passthrough_hp has; `--nocache` is 0). CPUs pinned (taskset): every daemon on the last CPU, the
readers on the first; systems interleaved, the order rotated each round; median of n rounds.

Run as root:  .venv/bin/python bench/small_files.py [--files 5000] [--rounds 5] [--quick]
(passthrough_hp built by bench/build_passthrough_hp.sh; a system that cannot run here is n/a)
Writes bench/results/small_files.json (--output) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from fuse_throughput import _read_files, log, machine, make_tree, run, tree_read, wait_mounted  # noqa: E402

SYSTEMS = ["bindfs", "bindfs_mt", "passthrough_hp", "hintfs", "floor"]
# Also run by default: hintfs with immutable_globs (and so the fast path), the same without the
# fast path, the floor with passthrough, the floor with the fast path (each described in
# Mounts.available).
EXTRA = ["hintfs_imm", "hintfs_imm_nofast", "floor_pt", "floor_fast"]
PEERS = ["bindfs", "bindfs_mt", "passthrough_hp"]
CASES = ["p1", "p8", "p1_pass2", "p8_again"]
# Goals of issue 39 (hintfs / the best peer), and the first step (hintfs / floor). p8_again (eight
# readers again on the same mount after the kernel dropped its names and inodes: an epoch over a
# dataset larger than the kernel's caches) has no goal of its own.
GOALS = {"p1": 1.5, "p8": 1.0, "p1_pass2": 2.0}
FLOOR_GOAL = 0.9
DEFAULT_HP = os.path.join(REPO, ".venv", "libfuse-build", "src", "fuse3", "build-hp", "example", "passthrough_hp")


def cpus() -> tuple[list[int], list[int]]:
    """(reader CPUs, daemon CPUs): the daemon on the last CPU, readers on the others."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return allowed, allowed
    return allowed[:-1], allowed[-1:]


class Mounts:
    def __init__(self, base: str, store: str, timeout: float, hp: str | None, daemon_cpus: list[int]):
        self.base, self.store, self.timeout, self.hp = base, store, timeout, hp
        self.pin = ["taskset", "-c", ",".join(map(str, daemon_cpus))]
        self.hintfs = os.path.join(os.path.dirname(sys.executable), "hintfs")
        self.seq = 0
        self.requests: dict[str, list] = {}

    def available(self, system: str) -> bool:
        """Not in the default set: hintfs_nopt (hintfs with `[mount] passthrough = "off"`), hintfs_imm
        (`[cache] immutable_globs = ["tree/*"]`, immutable_timeout_s the same timeout: the fast path
        on), hintfs_imm_nofast (the same with `[mount] fast_path_inodes = 0`), floor_pt
        (the floor with FUSE passthrough, a backing id per open as hintfs), floor_fast (the floor on
        pyfuse3's fast path, patches/pyfuse3-fastpath.patch: docs/fastpath.md), hintfs_imm_nolookups
        (hintfs_imm with `[mount] fast_lookups = false`: every lookup in Python), hintfs_imm_noahead
        (hintfs_imm with `[mount] fast_opens_ahead = 0`: each file marked at its own first open),
        hintfs_nochecked (hintfs with `[mount] fast_checked_opens = false`: no path marked but
        those declared immutable, docs/fastpath.md "Checked marks"), hintfs_nospin (hintfs with
        `[mount] request_spin_us = 0`: the loop waits at once after each request)."""
        if system == "floor_fast":
            return run([sys.executable, "-c", "import pyfuse3; pyfuse3.fast_supported"], timeout=60).returncode == 0
        if system.startswith("bindfs"):
            return shutil.which("bindfs") is not None
        if system == "passthrough_hp":
            return bool(self.hp) and os.access(self.hp, os.X_OK)
        return True

    def command(self, system: str, mnt: str) -> list[str]:
        t = f"{self.timeout:g}"
        if system in ("bindfs", "bindfs_mt"):
            extra = ["--multithreaded"] if system == "bindfs_mt" else []
            return [*self.pin, "bindfs", *extra, "-o", f"attr_timeout={t},entry_timeout={t}", self.store, mnt]
        if system == "passthrough_hp":
            # Its timeouts are 86400 s, or 0 with --nocache: nothing else to pass.
            return [*self.pin, self.hp, *(["--nocache"] if self.timeout == 0 else []), self.store, mnt]
        if system.startswith("floor"):
            mode = {"floor": "plain", "floor_pt": "pt", "floor_fast": "fast"}[system]
            return [*self.pin, sys.executable, os.path.join(HERE, "pyfuse3_floor.py"), "--serve", self.store, mnt, t,
                    mode]
        cfg = os.path.join(self.base, f"hintfs-{self.seq}.toml")
        with open(cfg, "w") as f:
            f.write(f'[store]\nuri = "file://{self.store}"\n\n[cache]\nattr_timeout_s = {self.timeout}\n'
                    f'entry_timeout_s = {self.timeout}\n\n'
                    + (f'immutable_globs = ["tree/*"]\nimmutable_timeout_s = {self.timeout}\n\n'
                       if system.startswith("hintfs_imm") else "")
                    + ('[mount]\npassthrough = "off"\n\n' if system == "hintfs_nopt" else "")
                    + ('[mount]\nfast_path_inodes = 0\n\n' if system == "hintfs_imm_nofast" else "")
                    + ('[mount]\nfast_lookups = false\n\n' if system == "hintfs_imm_nolookups" else "")
                    + ('[mount]\nfast_opens_ahead = 0\n\n' if system == "hintfs_imm_noahead" else "")
                    + ('[mount]\nfast_checked_opens = false\n\n' if system == "hintfs_nochecked" else "")
                    + ('[mount]\nrequest_spin_us = 0\n\n' if system == "hintfs_nospin" else "") +
                    f'[logging]\nfile = "{os.path.join(self.base, f"hintfs-{self.seq}.log")}"\n')
        return [*self.pin, self.hintfs, "mount", cfg, mnt]

    @contextlib.contextmanager
    def mount(self, system: str):
        self.seq += 1
        mnt = os.path.join(self.base, f"mnt-{system}-{self.seq}")
        os.makedirs(mnt)
        proc = None
        try:
            cmd = self.command(system, mnt)
            if system.startswith("floor"):
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
            else:
                r = run(cmd, timeout=60)
                if r.returncode != 0:
                    raise RuntimeError(f"{system} mount failed: {r.stdout.strip()}")
            wait_mounted(mnt, proc, system)
            yield mnt
        finally:
            if system.startswith("hintfs") and os.path.ismount(mnt):
                run([self.hintfs, "umount", mnt], timeout=90)
            if os.path.ismount(mnt):
                if run(["fusermount3", "-u", mnt], timeout=30).returncode != 0:
                    time.sleep(0.5)
                    run(["fusermount3", "-u", "-z", mnt], timeout=30)
            if proc is not None:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.terminate()
                    proc.wait()
            with contextlib.suppress(OSError):
                os.rmdir(mnt)


CLK_TCK = os.sysconf("SC_CLK_TCK")


def daemon_pids(mnt: str) -> list[int]:
    """The processes serving `mnt`: those whose command line names it (the daemon of each system;
    `hintfs mount` and taskset have exited by then)."""
    want, me, out = os.fsencode(mnt), os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if want in f.read().split(b"\0"):
                        out.append(int(entry))
            except OSError:
                pass
    return out


def cpu_s(pids: list[int]) -> float:
    """user + system CPU seconds of `pids`, all their threads (10 ms ticks)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return total / CLK_TCK


def stats_of(root: str) -> dict | None:
    try:
        with open(os.path.join(root, ".hintfs", "stats")) as f:
            return json.load(f)
    except OSError:
        return None


def per_file(before: dict | None, after: dict | None, nfiles: int) -> dict:
    if not before or not after:
        return {}
    out = {}
    for op, v in after.get("ops", {}).items():
        d = v["count"] - before.get("ops", {}).get(op, {}).get("count", 0)
        if d:
            out[op] = round(d / nfiles, 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, help="files in the tree (default 5,000; --quick 1,000)")
    ap.add_argument("--rounds", type=int, help="rounds, each system once per case (default 5; --quick 1)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--timeout", type=float, default=86400.0,
                    help="entry and attr timeout of every system (passthrough_hp: 86400 or 0 only)")
    ap.add_argument("--systems", default=",".join(SYSTEMS + EXTRA))
    ap.add_argument("--passthrough-hp", default=DEFAULT_HP, help="libfuse's example/passthrough_hp binary")
    ap.add_argument("--output", help="JSON file ('' to skip; default bench/results/small_files.json, "
                    "small_files_quick.json with --quick)")
    ap.add_argument("--note", action="append", default=[])
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("small_files: run as root (tmpfs and FUSE mounts)", file=sys.stderr)
        return 2
    if args.timeout not in (0, 86400) and "passthrough_hp" in args.systems:
        print("small_files: passthrough_hp has timeouts 86400 or 0 only", file=sys.stderr)
        return 2
    nfiles = args.files or (1000 if args.quick else 5000)
    rounds = args.rounds or (1 if args.quick else 5)
    output = args.output if args.output is not None else os.path.join(
        REPO, "bench", "results", "small_files_quick.json" if args.quick else "small_files.json")
    reader_cpus, daemon_cpus = cpus()
    base = tempfile.mkdtemp(prefix="hintfs-small-")
    scratch = os.path.join(base, "fs")
    store = os.path.join(scratch, "store")
    os.makedirs(scratch)
    raw: dict = {c: {} for c in CASES}
    cpu: dict = {c: {} for c in CASES}   # the daemon's CPU µs per file: robust to other load
    notes = list(args.note)
    commands: dict = {}
    load_start = os.getloadavg()
    t_start = time.monotonic()
    try:
        r = run(["mount", "-t", "tmpfs", "-o", "size=2g", "tmpfs", scratch])
        if r.returncode != 0:
            print(f"small_files: tmpfs: {r.stdout.strip()}", file=sys.stderr)
            return 2
        os.makedirs(store)
        files = make_tree(store, nfiles)
        rels = [rel for rel, _ in files]
        total = sum(s for _, s in files)
        m = Mounts(base, store, args.timeout, args.passthrough_hp, daemon_cpus)
        commands = {s: " ".join(m.command(s, "MNT")).replace(store, "STORE").replace(base, "TMP")
                         .replace(REPO + "/", "").replace(sys.executable, "python") for s in SYSTEMS + EXTRA}
        systems = [s for s in args.systems.split(",") if m.available(s)]
        if "floor_fast" in systems:
            notes.append("floor_fast: the floor marking every inode for pyfuse3's fast path at its first open")
        if "hintfs_imm" in systems:
            notes.append("hintfs_imm: immutable_globs over the tree, so reopened files go through the fast path "
                         "(fusefs/fastpath.py)")
        for s in args.systems.split(","):
            if s not in systems:
                notes.append(f"{s}: not available, n/a")
                log(f"{s}: not available")
        os.sched_setaffinity(0, reader_cpus)   # the readers (forked below) and this process
        log(f"{nfiles} files, {rounds} rounds, timeouts {args.timeout:g} s; readers on CPUs {reader_cpus}, "
            f"daemons on {daemon_cpus}")
        pools = {k: mp.get_context("fork").Pool(k) for k in (1, 8)}
        for pool in pools.values():
            pool.map(abs, range(8))
        try:
            for rnd in range(rounds):
                order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
                for system in order:
                    for nprocs in (1, 8):
                        with m.mount(system) as root:
                            s0 = stats_of(root) if system.startswith("hintfs") else None
                            pids = daemon_pids(root)
                            c0 = cpu_s(pids)
                            dt1, nf1, nb1 = tree_read(pools[nprocs], root, rels, nprocs)
                            c1 = cpu_s(pids)
                            cpu[f"p{nprocs}"].setdefault(system, []).append((c1 - c0) / nf1 * 1e6)
                            s1 = stats_of(root) if system.startswith("hintfs") else None
                            if nf1 != nfiles or nb1 != total:
                                raise RuntimeError(f"{system}: read {nf1}/{nb1}, expected {nfiles}/{total}")
                            line = f"  round {rnd} {system:<15} p{nprocs}: {nf1 / dt1:8.0f} files/s"
                            raw[f"p{nprocs}"].setdefault(system, []).append(nf1 / dt1)
                            if nprocs == 1:
                                c1 = cpu_s(pids)
                                dt2, nf2, nb2 = tree_read(pools[1], root, rels, 1)
                                cpu["p1_pass2"].setdefault(system, []).append((cpu_s(pids) - c1) / nf2 * 1e6)
                                s2 = stats_of(root) if system.startswith("hintfs") else None
                                if nf2 != nfiles or nb2 != total:
                                    raise RuntimeError(f"{system}: pass 2 read {nf2}/{nb2}")
                                raw["p1_pass2"].setdefault(system, []).append(nf2 / dt2)
                                line += f"  pass2 {nf2 / dt2:8.0f} files/s"
                                if s0 is not None:
                                    m.requests.setdefault(f"{system}:p1", []).append(per_file(s0, s1, nfiles))
                                    m.requests.setdefault(f"{system}:p1_pass2", []).append(per_file(s1, s2, nfiles))
                            else:
                                if s0 is not None:
                                    m.requests.setdefault(f"{system}:p8", []).append(per_file(s0, s1, nfiles))
                                # The kernel forgets its names and inodes (the store is on tmpfs,
                                # whose own stay): every name is looked up and every file opened
                                # again, as in an epoch over more files than the kernel keeps.
                                run(["sync"])
                                with open("/proc/sys/vm/drop_caches", "w") as f:
                                    f.write("2\n")
                                c1 = cpu_s(pids)
                                dt2, nf2, nb2 = tree_read(pools[8], root, rels, 8)
                                cpu["p8_again"].setdefault(system, []).append((cpu_s(pids) - c1) / nf2 * 1e6)
                                if nf2 != nfiles or nb2 != total:
                                    raise RuntimeError(f"{system}: p8 again read {nf2}/{nb2}")
                                raw["p8_again"].setdefault(system, []).append(nf2 / dt2)
                                line += f"  again {nf2 / dt2:8.0f} files/s"
                                if s0 is not None:
                                    m.requests.setdefault(f"{system}:p8_again", []).append(
                                        per_file(s1, stats_of(root), nfiles))
                            log(line)
        finally:
            for pool in pools.values():
                pool.close()
                pool.join()
    finally:
        if run(["umount", scratch]).returncode != 0:   # a daemon just unmounted may still hold it
            time.sleep(1)
            run(["umount", "-l", scratch])
        shutil.rmtree(base, ignore_errors=True)
    summary: dict = {}
    for case in CASES:
        med = {s: statistics.median(v) for s, v in raw[case].items()}
        best = max((s for s in PEERS if s in med), key=lambda s: med[s], default=None)
        summary[case] = {
            **{s: {"files_per_s": round(med[s]), "n": len(raw[case][s]),
                   "daemon_cpu_us_per_file": round(statistics.median(cpu[case][s]), 1)} for s in med},
            "best_peer": best,
            "hintfs/best_peer": round(med["hintfs"] / med[best], 3) if best and "hintfs" in med else None,
            "hintfs/floor": round(med["hintfs"] / med["floor"], 3) if "floor" in med and "hintfs" in med else None,
            **{f"{s}/floor": round(med[s] / med["floor"], 3)
               for s in ("hintfs_nopt", "hintfs_imm", "hintfs_imm_nofast", "floor_pt", "floor_fast")
               if "floor" in med and s in med},
            **{f"{s}/best_peer": round(med[s] / med[best], 3) for s in ("hintfs_imm", "hintfs_imm_nofast", "floor_fast")
               if best and s in med},
            "goal_vs_best_peer": GOALS.get(case), "goal_vs_floor": FLOOR_GOAL if case in GOALS else None,
        }
    out = {
        "bench": "bench/small_files.py", "files": nfiles, "rounds": rounds, "file_sizes": "4-64 KiB",
        "entry_attr_timeout_s": args.timeout, "reader_cpus": reader_cpus, "daemon_cpus": daemon_cpus,
        "commands": commands,
        **summary, "raw_files_per_s": {c: {s: [round(x) for x in v] for s, v in raw[c].items()} for c in CASES},
        "raw_daemon_cpu_us_per_file": {c: {s: [round(x, 1) for x in v] for s, v in cpu[c].items()} for c in CASES},
        "hintfs_requests_per_file": m.requests,
        "machine": machine(), "load_start": load_start, "load_end": os.getloadavg(),
        "wall_s": round(time.monotonic() - t_start, 1), "notes": notes,
    }
    shown = SYSTEMS + EXTRA
    print("| case | " + " | ".join(shown) + " | hintfs/best peer (goal) | hintfs_imm/best peer | hintfs/floor (goal 0.9) |")
    print("|---|" + "---:|" * (len(shown) + 3))
    for case in CASES:
        r_ = summary[case]
        cells = [f"{r_[s]['files_per_s']:,}" if s in r_ else "n/a" for s in shown]
        hb, hf, hi = r_["hintfs/best_peer"], r_["hintfs/floor"], r_.get("hintfs_imm/best_peer")
        print(f"| {case} | " + " | ".join(cells) + f" | {hb if hb is not None else 'n/a'} ({'>= ' + str(GOALS[case]) if case in GOALS else 'no goal'}) | "
              f"{hi if hi is not None else 'n/a'} | {hf if hf is not None else 'n/a'} |")
    print("\nDaemon CPU, µs per file (median):")
    for case in CASES:
        r_ = summary[case]
        print(f"| {case} | " + " | ".join(f"{r_[s]['daemon_cpu_us_per_file']}" if s in r_ else "n/a" for s in shown) + " |")
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        log(f"wrote {output}")
    return 0


if __name__ == "__main__":
    _ = _read_files   # (the readers' function, forked into the pools by tree_read)
    sys.exit(main())

#!/usr/bin/env python3
"""FUSE throughput, side by side in one run: direct reads (no FUSE), bindfs (C), rclone mount
(Go, --vfs-cache-mode off) and hintfs, over the same store on a private tmpfs.

Cases (goals from the issue "Performance: bench/fuse_throughput.py"):
  1. seq-read-fresh : 1 GiB sequential read, 1 MiB reads, fresh mount, backing file cached
                      (goal: hintfs >= 1.0x bindfs)
  2. seq-read-again : the same file again through the same mount (goal: hintfs >= 0.3x direct)
  3. tree-N-pK      : N small files (4-64 KiB, fixed seed), open+read+close each, with 1 and 8
                      reader processes on a fresh mount; pass 1 (cold metadata) and pass 2
                      (warm) (goal: hintfs >= 0.8x bindfs). Also run as "hintfs-immutable" with
                      `[cache] immutable_globs = ["tree/*"]`.
  4. seq-write      : 1 GiB sequential write, 1 MiB writes, close included (goal: >= 0.8x bindfs)

Run as root (tmpfs and FUSE mounts):  .venv/bin/python bench/fuse_throughput.py [--quick]
Writes bench/results/fuse_throughput.json and prints a markdown table.
`--profile DIR` additionally samples the hintfs daemon with py-spy during each hintfs case
(numbers taken while profiling are slower; use it to find hot spots, not for the table).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Iterator, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results", "fuse_throughput.json")
MiB = 1 << 20
GiB = 1 << 30
SEED = 20240611
SYSTEMS = ["direct", "bindfs", "rclone", "hintfs"]
TREE_SYSTEMS = ["direct", "bindfs", "rclone", "hintfs", "hintfs-immutable"]

GOALS = [
    # (case, numerator system, denominator system, minimum ratio)
    ("seq-read-fresh", "hintfs", "bindfs", 1.0),
    ("seq-read-again", "hintfs", "direct", 0.3),
    ("tree-p1-pass1", "hintfs", "bindfs", 0.8),
    ("tree-p8-pass1", "hintfs", "bindfs", 0.8),
    ("seq-write", "hintfs", "bindfs", 0.8),
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


# -- data set ---------------------------------------------------------------------------------
def make_big_file(path: str, size: int) -> None:
    rnd = random.Random(SEED)
    block = bytearray(rnd.randbytes(MiB))
    with open(path, "wb", buffering=0) as f:
        for i in range(size // MiB):
            block[:8] = i.to_bytes(8, "little")   # each MiB differs: catches misplaced blocks
            f.write(block)


def make_tree(root: str, nfiles: int) -> list[tuple[str, int]]:
    """Files tree/dNNN/fNNNNNN.bin of 4-64 KiB; returns (relative path, size) in read order."""
    rnd = random.Random(SEED)
    payload = rnd.randbytes(64 * 1024 + 64)
    per_dir = 200
    files = []
    for i in range(nfiles):
        d = f"tree/d{i // per_dir:03d}"
        if i % per_dir == 0:
            os.makedirs(os.path.join(root, d), exist_ok=True)
        size = rnd.randint(4 * 1024, 64 * 1024)
        rel = f"{d}/f{i:06d}.bin"
        off = i % 64
        with open(os.path.join(root, rel), "wb") as f:
            f.write(payload[off:off + size])
        files.append((rel, size))
    return files


def warm(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 * MiB)
        while f.readinto(buf):
            pass


# -- workloads --------------------------------------------------------------------------------
def seq_read(path: str) -> tuple[float, int]:
    """Read the whole file with 1 MiB reads; return (seconds, bytes)."""
    buf = bytearray(MiB)
    n = 0
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            k = os.readv(fd, [buf])
            if not k:
                break
            n += k
    finally:
        os.close(fd)
    return time.perf_counter() - t0, n


def seq_write(path: str, size: int) -> tuple[float, int]:
    rnd = random.Random(SEED + 1)
    block = bytearray(rnd.randbytes(MiB))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(size // MiB):
            block[:8] = i.to_bytes(8, "little")
            os.write(fd, block)
    finally:
        os.close(fd)
    return time.perf_counter() - t0, size


def _read_files(args) -> tuple[int, int]:
    root, rels = args
    buf = bytearray(128 * 1024)
    nbytes = 0
    for rel in rels:
        fd = os.open(os.path.join(root, rel), os.O_RDONLY)
        try:
            while True:
                k = os.readv(fd, [buf])
                if not k:
                    break
                nbytes += k
        finally:
            os.close(fd)
    return len(rels), nbytes


def tree_read(pool, root: str, rels: list[str], nprocs: int) -> tuple[float, int, int]:
    per = (len(rels) + nprocs - 1) // nprocs
    slices = [(root, rels[i * per:(i + 1) * per]) for i in range(nprocs)]
    t0 = time.perf_counter()
    out = pool.map(_read_files, slices, chunksize=1)
    dt = time.perf_counter() - t0
    return dt, sum(o[0] for o in out), sum(o[1] for o in out)


# -- verification (outside the timed part) ----------------------------------------------------
def same_blocks(a: str, b: str, size: int, samples: int = 16) -> Optional[str]:
    rnd = random.Random(SEED + 2)
    with open(a, "rb") as fa, open(b, "rb") as fb:
        for off in [0, size - MiB] + [rnd.randrange(0, size // MiB) * MiB for _ in range(samples)]:
            fa.seek(off)
            fb.seek(off)
            if fa.read(MiB) != fb.read(MiB):
                return f"content differs at offset {off} between {a} and {b}"
    if os.path.getsize(a) != os.path.getsize(b):
        return f"size differs: {a} {os.path.getsize(a)} vs {b} {os.path.getsize(b)}"
    return None


def same_files(a_root: str, b_root: str, rels: list[str], samples: int = 50) -> Optional[str]:
    rnd = random.Random(SEED + 3)
    for rel in rnd.sample(rels, min(samples, len(rels))):
        with open(os.path.join(a_root, rel), "rb") as fa, open(os.path.join(b_root, rel), "rb") as fb:
            if fa.read() != fb.read():
                return f"content of {rel} differs through the mount"
    return None


# -- mounts -----------------------------------------------------------------------------------
class Env:
    def __init__(self, base: str, store: str, profile_dir: Optional[str]):
        self.base = base
        self.store = store
        self.profile_dir = profile_dir
        self.seq = 0
        self.have_bindfs = shutil.which("bindfs") is not None
        self.have_rclone = shutil.which("rclone") is not None
        self.hintfs = os.path.join(os.path.dirname(sys.executable), "hintfs")
        self.have_hintfs = os.access(self.hintfs, os.X_OK)
        self.hintfs_stats: dict[str, dict] = {}
        self.notes: list[str] = []
        self.warm_tree = False

    def available(self, system: str) -> bool:
        return {"direct": True, "bindfs": self.have_bindfs, "rclone": self.have_rclone,
                "hintfs": self.have_hintfs, "hintfs-immutable": self.have_hintfs}[system]

    def new_mountpoint(self, name: str) -> str:
        self.seq += 1
        mp_ = os.path.join(self.base, f"mnt-{name}-{self.seq}")
        os.makedirs(mp_)
        return mp_

    @contextlib.contextmanager
    def mount(self, system: str, label: str = "") -> Iterator[str]:
        """Yield the root to read from: the store itself for "direct", else a fresh mount."""
        if system == "direct":
            yield self.store
            return
        mnt = self.new_mountpoint(system)
        proc = None
        pid = None
        try:
            if system == "bindfs":
                r = run(["bindfs", self.store, mnt], timeout=30)
                if r.returncode != 0:
                    raise RuntimeError(f"bindfs failed: {r.stdout.strip()}")
            elif system == "rclone":
                conf = os.path.join(self.base, "rclone.conf")
                open(conf, "a").close()
                logf = open(os.path.join(self.base, f"rclone-{self.seq}.log"), "wb")
                proc = subprocess.Popen(
                    ["rclone", "mount", self.store, mnt, "--vfs-cache-mode", "off",
                     "--config", conf, "--log-level", "NOTICE"],
                    stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
                logf.close()
            else:
                cfg = os.path.join(self.base, f"hintfs-{self.seq}.toml")
                with open(cfg, "w") as f:
                    f.write(f'[store]\nuri = "file://{self.store}"\n\n')
                    if system == "hintfs-immutable":
                        f.write('[cache]\nimmutable_globs = ["tree/*"]\n\n')
                    f.write(f'[logging]\nfile = "{os.path.join(self.base, f"hintfs-{self.seq}.log")}"\n')
                r = run([self.hintfs, "mount", cfg, mnt], timeout=60)
                if r.returncode != 0:
                    raise RuntimeError(f"hintfs mount failed: {r.stdout.strip()}")
            deadline = time.monotonic() + 30
            while not os.path.ismount(mnt):
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"rclone exited with {proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{system} did not mount within 30 s")
                time.sleep(0.02)
            if system.startswith("hintfs"):
                with open(os.path.join(mnt, ".hintfs", "stats")) as f:
                    pid = json.load(f)["pid"]
            with self._profiled(pid, label):
                yield mnt
            if pid is not None and label:
                with open(os.path.join(mnt, ".hintfs", "stats")) as f:
                    self.hintfs_stats[f"{system}:{label}"] = json.load(f)
        finally:
            self._unmount(system, mnt, proc)

    @contextlib.contextmanager
    def _profiled(self, pid: Optional[int], label: str):
        if pid is None or not self.profile_dir or not label:
            yield
            return
        pyspy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        out = os.path.join(self.profile_dir, f"{label}.txt")
        p = subprocess.Popen([pyspy, "record", "--pid", str(pid), "--nonblocking", "--rate", "200",
                              "--format", "raw", "-o", out], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # let py-spy attach
        try:
            yield
        finally:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _unmount(self, system: str, mnt: str, proc) -> None:
        if system.startswith("hintfs") and os.path.ismount(mnt):
            r = run([self.hintfs, "umount", mnt], timeout=90)
            if r.returncode != 0:
                self.notes.append(f"hintfs umount {os.path.basename(mnt)}: {r.stdout.strip()}")
        if os.path.ismount(mnt):
            r = run(["fusermount3", "-u", mnt], timeout=30)
            if r.returncode != 0:
                time.sleep(0.5)
                run(["fusermount3", "-u", "-z", mnt], timeout=30)
        if proc is not None:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        with contextlib.suppress(OSError):
            os.rmdir(mnt)


# -- cases ------------------------------------------------------------------------------------
def median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def bench_seq_read(env: Env, systems: list[str], repeats: int, big_rel: str, size: int, raw: dict) -> None:
    for rep in range(repeats):  # systems interleaved: drift of this VM hits all of them alike
        for system in [s for s in systems if env.available(s)]:
            t0 = time.monotonic()
            warm(os.path.join(env.store, big_rel))
            with env.mount(system, label=f"seq-read-{system}-{rep}") as root:
                path = os.path.join(root, big_rel)
                dt1, n1 = seq_read(path)
                dt2, n2 = seq_read(path)
                for n in (n1, n2):
                    if n != size:
                        raise RuntimeError(f"{system}: read {n} bytes of {size}")
                if rep == 0 and system != "direct":
                    err = same_blocks(os.path.join(env.store, big_rel), path, size)
                    if err:
                        raise RuntimeError(f"{system}: {err}")
            raw.setdefault("seq-read-fresh", {}).setdefault(system, []).append(n1 / dt1 / 1e9)
            raw.setdefault("seq-read-again", {}).setdefault(system, []).append(n2 / dt2 / 1e9)
            log(f"  {system:<17} seq-read fresh {n1 / dt1 / 1e9:6.2f} GB/s  again {n2 / dt2 / 1e9:6.2f} GB/s"
                f"  ({time.monotonic() - t0:.1f}s)")


def bench_tree(env: Env, systems: list[str], repeats: int, files: list[tuple[str, int]], raw: dict,
               nprocs_list=(1, 8)) -> None:
    rels = [r for r, _ in files]
    total = sum(s for _, s in files)
    for nprocs in nprocs_list:
        with mp.get_context("fork").Pool(nprocs) as pool:
            pool.map(abs, range(nprocs))  # workers started before timing
            for rep in range(repeats):
                for system in [s for s in systems if env.available(s)]:
                    t0 = time.monotonic()
                    if env.warm_tree:
                        _read_files((env.store, rels))
                    with env.mount(system, label=f"tree-p{nprocs}-{system}-{rep}") as root:
                        dt1, nf1, nb1 = tree_read(pool, root, rels, nprocs)
                        dt2, nf2, nb2 = tree_read(pool, root, rels, nprocs)
                        for nf, nb in ((nf1, nb1), (nf2, nb2)):
                            if nf != len(rels) or nb != total:
                                raise RuntimeError(f"{system}: read {nf} files/{nb} bytes, "
                                                   f"expected {len(rels)}/{total}")
                        if rep == 0 and nprocs == 1 and system != "direct":
                            err = same_files(env.store, root, rels)
                            if err:
                                raise RuntimeError(f"{system}: {err}")
                    raw.setdefault(f"tree-p{nprocs}-pass1", {}).setdefault(system, []).append(nf1 / dt1)
                    raw.setdefault(f"tree-p{nprocs}-pass2", {}).setdefault(system, []).append(nf2 / dt2)
                    log(f"  {system:<17} tree p{nprocs}: pass1 {nf1 / dt1:8.0f} files/s  "
                        f"pass2 {nf2 / dt2:8.0f} files/s  ({time.monotonic() - t0:.1f}s)")


def bench_write(env: Env, systems: list[str], repeats: int, size: int, raw: dict) -> None:
    os.makedirs(os.path.join(env.store, "w"), exist_ok=True)
    for rep in range(repeats):
        for system in [s for s in systems if env.available(s)]:
            t0 = time.monotonic()
            with env.mount(system, label=f"seq-write-{system}-{rep}") as root:
                path = os.path.join(root, "w", "out.bin")
                dt, n = seq_write(path, size)
                st = os.stat(os.path.join(env.store, "w", "out.bin"))
                if st.st_size != size:
                    raise RuntimeError(f"{system}: store holds {st.st_size} bytes after close, wrote {size}")
                if rep == 0:
                    rnd = random.Random(SEED + 1)
                    block = bytearray(rnd.randbytes(MiB))
                    with open(os.path.join(env.store, "w", "out.bin"), "rb") as f:
                        for i in (0, 1, size // MiB // 2, size // MiB - 1):
                            block[:8] = i.to_bytes(8, "little")
                            f.seek(i * MiB)
                            if f.read(MiB) != block:
                                raise RuntimeError(f"{system}: written block {i} differs in the store")
                os.unlink(path)
            raw.setdefault("seq-write", {}).setdefault(system, []).append(n / dt / 1e9)
            log(f"  {system:<17} seq-write {n / dt / 1e9:6.2f} GB/s  ({time.monotonic() - t0:.1f}s)")


# -- report -----------------------------------------------------------------------------------
def summarize(raw: dict, env: Env) -> tuple[dict, list[dict]]:
    summary = {}
    for case, per in raw.items():
        med = {s: median(v) for s, v in per.items()}
        for s in TREE_SYSTEMS:
            if s not in med:
                med[s] = None
        ratios = {}
        for h in ("hintfs", "hintfs-immutable"):
            for d in ("bindfs", "direct", "rclone"):
                if med.get(h) and med.get(d):
                    ratios[f"{h}/{d}"] = round(med[h] / med[d], 3)
        summary[case] = {"unit": "files/s" if case.startswith("tree") else "GB/s",
                         "median": {k: (round(v, 4) if v is not None else None) for k, v in med.items()},
                         "ratios": ratios}
    goals = []
    for case, num, den, minimum in GOALS:
        for n in ([num, "hintfs-immutable"] if case.startswith("tree") else [num]):
            s = summary.get(case, {}).get("median", {})
            ratio = s.get(n) / s.get(den) if s.get(n) and s.get(den) else None
            goals.append({"case": case, "system": n, "vs": den, "min_ratio": minimum,
                          "ratio": round(ratio, 3) if ratio is not None else None,
                          "met": (ratio >= minimum) if ratio is not None else None})
    # The issue asks for >= 0.8x bindfs for the tree; report warm-metadata passes too.
    for case in ("tree-p1-pass2", "tree-p8-pass2"):
        for n in ("hintfs", "hintfs-immutable"):
            s = summary.get(case, {}).get("median", {})
            ratio = s.get(n) / s.get("bindfs") if s.get(n) and s.get("bindfs") else None
            goals.append({"case": case, "system": n, "vs": "bindfs", "min_ratio": 0.8,
                          "ratio": round(ratio, 3) if ratio is not None else None,
                          "met": (ratio >= 0.8) if ratio is not None else None})
    return summary, goals


def fmt(v: Optional[float], unit: str) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.0f}" if unit == "files/s" else f"{v:.2f}"


def table(summary: dict, case_order: list[str]) -> str:
    lines = ["| case | unit | direct | bindfs | rclone | hintfs | hintfs-immutable | hintfs/bindfs | hintfs/direct |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for case in case_order:
        if case not in summary:
            continue
        s = summary[case]
        m, u, r = s["median"], s["unit"], s["ratios"]
        hb = r.get("hintfs/bindfs")
        hd = r.get("hintfs/direct")
        imm = r.get("hintfs-immutable/bindfs")
        hb_s = "n/a" if hb is None else f"{hb:.2f}"
        if imm is not None:
            hb_s += f" (imm. {imm:.2f})"
        lines.append(f"| {case} | {u} | {fmt(m.get('direct'), u)} | {fmt(m.get('bindfs'), u)} | "
                     f"{fmt(m.get('rclone'), u)} | {fmt(m.get('hintfs'), u)} | "
                     f"{fmt(m.get('hintfs-immutable'), u)} | {hb_s} | "
                     f"{'n/a' if hd is None else f'{hd:.2f}'} |")
    return "\n".join(lines)


def tool_version(cmd: list[str]) -> Optional[str]:
    try:
        r = run(cmd, timeout=10)
        return r.stdout.strip().splitlines()[0] if r.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def machine() -> dict:
    info = {"nproc": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(f.readline().split()[1])
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    info["bindfs"] = tool_version(["bindfs", "--version"])
    info["rclone"] = tool_version(["rclone", "version"])
    info["fusermount3"] = tool_version(["fusermount3", "--version"])
    with contextlib.suppress(Exception):
        import pyfuse3
        info["pyfuse3"] = pyfuse3.__version__ if hasattr(pyfuse3, "__version__") else None
    return info


# -- main -------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="1 repeat, 512 MiB sequential file, 5,000 tree files (under 2 minutes)")
    ap.add_argument("--repeats", type=int, help="repeats per measurement (default: 1 quick, 3 full)")
    ap.add_argument("--files", type=int, help="files in the tree (default: 5,000 quick, 20,000 full)")
    ap.add_argument("--size-mib", type=int, help="sequential file size in MiB (default: 512 quick, 1024 full)")
    ap.add_argument("--cases", default="read,tree,write", help="comma-separated subset of read,tree,write")
    ap.add_argument("--systems", default=",".join(TREE_SYSTEMS), help="comma-separated subset")
    ap.add_argument("--output", default=RESULTS, help="JSON results file ('' to skip)")
    ap.add_argument("--store-on", choices=["tmpfs", "disk"], default="tmpfs",
                    help="tmpfs (default, always cached) or disk: a folder under TMPDIR (page cache may be "
                         "reclaimed by this VM; shows the RWF_NOWAIT path of file:// stores)")
    ap.add_argument("--profile", metavar="DIR", help="py-spy record the hintfs daemon into DIR")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("fuse_throughput: run as root (it mounts a tmpfs and FUSE filesystems)", file=sys.stderr)
        return 2
    mode = "quick" if args.quick else "full"
    repeats = args.repeats or (1 if args.quick else 3)
    nfiles = args.files or (5000 if args.quick else 20000)
    if args.size_mib is None:
        args.size_mib = 512 if args.quick else 1024
    size = args.size_mib * MiB
    cases = set(args.cases.split(","))
    wanted = args.systems.split(",")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        args.profile = os.path.abspath(args.profile)

    t_start = time.monotonic()
    base = tempfile.mkdtemp(prefix="hintfs-bench-")
    store = os.path.join(base, "store")
    os.makedirs(store)
    raw: dict = {}
    env = None
    tmpfs_mounted = False
    try:
        if args.store_on == "tmpfs":
            r = run(["mount", "-t", "tmpfs", "-o", "size=3g", "tmpfs", store])
            if r.returncode != 0:
                print(f"fuse_throughput: cannot mount a tmpfs for the store: {r.stdout.strip()}", file=sys.stderr)
                return 2
            tmpfs_mounted = True
        env = Env(base, store, args.profile)
        env.warm_tree = args.store_on != "tmpfs"
        for name, ok in (("bindfs", env.have_bindfs), ("rclone", env.have_rclone), ("hintfs", env.have_hintfs)):
            if not ok:
                log(f"{name} not found: reported as n/a")
                env.notes.append(f"{name} not installed: n/a")
        log(f"mode {mode}: {repeats} repeat(s), {args.size_mib} MiB file, {nfiles} tree files; store on {args.store_on}")
        big_rel = "big.bin"
        make_big_file(os.path.join(store, big_rel), size)
        files = make_tree(store, nfiles) if "tree" in cases else []
        log(f"data ready in {time.monotonic() - t_start:.1f}s")
        seq_systems = [s for s in SYSTEMS if s in wanted]
        if "read" in cases:
            log("case 1/2: sequential read (fresh mount, then again)")
            bench_seq_read(env, seq_systems, repeats, big_rel, size, raw)
        if "tree" in cases:
            log(f"case 3: {nfiles} files of 4-64 KiB, open+read+close")
            bench_tree(env, [s for s in TREE_SYSTEMS if s in wanted], repeats, files, raw)
        if "write" in cases:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(store, big_rel))  # room on the tmpfs
            log("case 4: sequential write")
            bench_write(env, seq_systems, repeats, size, raw)
    finally:
        if env is not None:
            for p in os.listdir(base):
                mnt = os.path.join(base, p)
                if p.startswith("mnt-") and os.path.ismount(mnt):
                    run(["fusermount3", "-u", "-z", mnt])
        if tmpfs_mounted:
            r = run(["umount", store])
            if r.returncode != 0:
                run(["umount", "-l", store])
        shutil.rmtree(base, ignore_errors=True)

    elapsed = time.monotonic() - t_start
    summary, goals = summarize(raw, env)
    order = ["seq-read-fresh", "seq-read-again", "tree-p1-pass1", "tree-p1-pass2", "tree-p8-pass1",
             "tree-p8-pass2", "seq-write"]
    print(f"\n### fuse_throughput ({mode}: {repeats} repeat(s), median; {args.size_mib} MiB sequential, "
          f"{nfiles} tree files; {os.cpu_count()} CPUs, kernel {platform.release()})\n")
    print(table(summary, order))
    print()
    for g in goals:
        status = "n/a" if g["met"] is None else ("met" if g["met"] else "NOT met")
        ratio = "n/a" if g["ratio"] is None else f"{g['ratio']:.2f}"
        print(f"- {g['case']}: {g['system']}/{g['vs']} = {ratio} (goal >= {g['min_ratio']}): {status}")
    print(f"\nelapsed {elapsed:.0f}s")
    if env.notes:
        print("notes: " + "; ".join(env.notes))
    if args.output:
        doc = {
            "benchmark": "fuse_throughput",
            "mode": mode,
            "repeats": repeats,
            "statistic": "median",
            "tree_files": nfiles,
            "tree_file_sizes": "4-64 KiB uniform, seed %d" % SEED,
            "seq_size_bytes": size,
            "io_size_bytes": MiB,
            "store": "tmpfs (size=3g)" if args.store_on == "tmpfs" else "folder on the disk under TMPDIR",
            "systems": {"direct": "the store on tmpfs, no FUSE",
                        "bindfs": "bindfs SRC MNT (defaults)",
                        "rclone": "rclone mount SRC MNT --vfs-cache-mode off",
                        "hintfs": "hintfs mount, [store] uri = file://SRC",
                        "hintfs-immutable": "hintfs, plus [cache] immutable_globs = [\"tree/*\"] (tree cases only)"},
            "machine": machine(),
            "elapsed_s": round(elapsed, 1),
            "cases": summary,
            "raw": {c: {s: [round(x, 4) for x in v] for s, v in per.items()} for c, per in raw.items()},
            "goals": goals,
            "notes": env.notes,
            "hintfs_stats": {k: {"ops": v.get("ops"), "cache": v.get("cache"), "counters": v.get("counters")}
                             for k, v in env.hintfs_stats.items() if k.endswith("-0")},
        }
        os.makedirs(os.path.dirname(args.output), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        log(f"wrote {os.path.relpath(args.output, REPO) if args.output.startswith(REPO) else args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Metadata of big folders (issue 39, part 3): `ls -l`, `stat` of every entry and `find`.

Data: one folder of N entries (`big/`, default 100,000 files) and a tree of M files (`tree/`,
default 1,000,000: 100 files per leaf folder, 100 leaf folders per top folder), file sizes
0-4095 bytes (fixed seed). Operations, each from a process pinned to CPU 1 (daemons to CPU 0):

  ls_l  : `ls -l big/ > /dev/null`
  find  : `find tree/ > /dev/null`
  stat  : lstat(2) of every path of the tree, one after another, in a fresh process (no listing
          before: every name is looked up by path)

Each operation runs on a fresh mount (pass 1: nothing cached by the kernel nor the daemon),
then once more on the same mount (pass 2). Systems, interleaved (the order rotates each repeat):

  file:// (a tmpfs): direct, bindfs (Debian's, libfuse 2: entry/attr timeouts 1 s), bindfs-cached
    (`-o entry_timeout=3600,attr_timeout=3600`: the timeouts hintfs gets here), hintfs (the folder
    and tree declared immutable: `[cache] immutable_globs`, timeouts 3600 s; readdirplus)
  s3:// (JuiceFS's S3 gateway on loopback, tests/helpers/s3server.py): direct (pyarrow: one
    listing for ls -l, a recursive listing for find, get_file_info per path for stat), hintfs
    (immutable as above), s3fs (Debian's s3fs-fuse, `-o use_path_request_style`, its defaults
    otherwise: stat cache of 100,000 entries, 900 s)

Daemon memory: hintfs's RSS (VmRSS) after mount and after `du -s` of the whole tree (every entry
looked up and cached: an inode each), and with `[cache] max_entries` below the tree's size.

Run as root:  .venv/bin/python bench/metadata.py [--quick] [--folder N] [--tree M] [--s3-folder N]
    [--s3-tree M] [--repeats n] [--ab-listing-spin]   (hintfs-nolistspin: `[mount] listing_spin_us = 0`)
    [--ab-fast-lookups]   (hintfs-nofastlookups: `[mount] fast_lookups = false`)
    [--ab-request-spin US]   (hintfs-spinUS: `[mount] request_spin_us = US`)
Writes bench/results/metadata.json (metadata_quick.json with --quick): median of n per case and
system, ratios, goals. A full-size file:// repeat takes ~8 minutes on 2 vCPUs (bindfs's stat of 1M
paths is 80-100 s a pass); S3 objects are created at ~180/s through the gateway, hence the
smaller S3 defaults. bench/notes/metadata.md has the runs.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tests.helpers.s3server import JuiceFSGateway  # noqa: E402  (the harness of tests and benches)

RESULTS = os.path.join(REPO, "bench", "results", "metadata.json")
SEED = 20261205
IMMUTABLE = '[cache]\nimmutable_globs = ["big", "big/*", "tree", "tree/*"]\n'
CLIENT_CPU, DAEMON_CPU = "1", "0"
OPS = ["ls_l", "find", "stat"]
FILE_SYSTEMS = ["direct", "bindfs", "bindfs-cached", "hintfs"]
S3_SYSTEMS = ["direct", "hintfs", "s3fs"]
BUCKET = "meta"
# (result key, op, source, numerator, denominator, minimum ratio): pass 1 and pass 2 each
GOALS = [("file", "bindfs", 1.0), ("file", "bindfs-cached", 1.0), ("s3", "s3fs", 2.0)]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def pinned(cpu: str, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", cpu, *cmd] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else cmd


# -- data set ---------------------------------------------------------------------------------
def tree_rels(n: int) -> tuple[list[str], list[str]]:
    """(files, folders) of a tree of n files: 100 a leaf folder, 100 leaf folders a top folder."""
    files, dirs = [], ["tree"]
    leaves = (n + 99) // 100
    for leaf in range(leaves):
        top = f"tree/d{leaf // 100:03d}"
        if leaf % 100 == 0:
            dirs.append(top)
        d = f"{top}/e{leaf % 100:02d}"
        dirs.append(d)
        files.extend(f"{d}/f{i:02d}" for i in range(min(100, n - leaf * 100)))
    return files, dirs


def folder_rels(n: int) -> list[str]:
    return [f"big/f{i:06d}" for i in range(n)]


def sizes(n: int) -> list[int]:
    rnd = random.Random(SEED)
    return [rnd.randrange(4096) for _ in range(n)]


def make_local(root: str, folder: int, tree: int) -> tuple[list[str], int]:
    """Create the data set under root; (every path of the tree, files and folders; entries)."""
    t0 = time.monotonic()
    files, dirs = tree_rels(tree)
    os.makedirs(os.path.join(root, "big"))
    for d in dirs:
        os.makedirs(os.path.join(root, d), exist_ok=True)
    big = folder_rels(folder)
    for rel, size in zip(big + files, sizes(len(big) + len(files))):
        fd = os.open(os.path.join(root, rel), os.O_CREAT | os.O_WRONLY, 0o644)
        if size:
            os.ftruncate(fd, size)
        os.close(fd)
    log(f"file:// data: {folder} + {tree} files, {len(dirs)} folders in {time.monotonic() - t0:.1f}s")
    return dirs + files, len(dirs) + len(files)


def make_s3(fs, folder: int, tree: int) -> tuple[list[str], dict]:
    """Create the objects (16 writers at once); the tree's paths and the creation rate."""
    files, dirs = tree_rels(tree)
    rels = folder_rels(folder) + files
    data = sizes(len(rels))
    fs.create_dir(BUCKET)

    def put(i: int) -> None:
        with fs.open_output_stream(f"{BUCKET}/{rels[i]}") as f:
            f.write(b"x" * data[i])

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(len(rels))))
    dt = time.monotonic() - t0
    log(f"s3 data: {len(rels)} objects in {dt:.1f}s ({len(rels) / dt:.0f}/s with 16 writers)")
    return dirs + files, {"objects": len(rels), "seconds": round(dt, 1), "objects_per_s": round(len(rels) / dt)}


# -- operations -------------------------------------------------------------------------------
_STAT_WORKER = """
import os, sys, time
root = sys.argv[1]
rels = open(sys.argv[2]).read().split("\\n")
t0 = time.perf_counter()
for rel in rels:
    os.lstat(root + "/" + rel)
print(time.perf_counter() - t0)
"""


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(pinned(CLIENT_CPU, cmd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       timeout=1800)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited with {r.returncode}: {r.stderr.strip()[-300:]}")
    return dt


def op_fuse(op: str, root: str, list_file: str) -> float:
    if op == "ls_l":
        return timed(["ls", "-l", "--color=never", os.path.join(root, "big")])
    if op == "find":
        return timed(["find", os.path.join(root, "tree")])
    r = run(pinned(CLIENT_CPU, [sys.executable, "-c", _STAT_WORKER, root, list_file]), timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"stat worker: {r.stdout.strip()[-300:]}")
    return float(r.stdout.strip().splitlines()[-1])


def op_s3_direct(fs, op: str, rels: list[str]) -> float:
    import pyarrow.fs as pafs
    t0 = time.perf_counter()
    if op == "ls_l":
        n = len(fs.get_file_info(pafs.FileSelector(f"{BUCKET}/big")))
    elif op == "find":
        n = len(fs.get_file_info(pafs.FileSelector(f"{BUCKET}/tree", recursive=True)))
    else:
        n = 0
        for rel in rels:
            n += fs.get_file_info(f"{BUCKET}/{rel}").type != pafs.FileType.NotFound
    dt = time.perf_counter() - t0
    if n == 0:
        raise RuntimeError(f"direct {op}: nothing listed")
    return dt


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def drop_caches() -> None:
    with contextlib.suppress(OSError):
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


# -- mounts -----------------------------------------------------------------------------------
class Mounts:
    def __init__(self, base: str):
        self.base = base
        self.seq = 0
        self.hintfs = os.path.join(os.path.dirname(sys.executable), "hintfs")
        self.notes: list[str] = []

    @contextlib.contextmanager
    def mount(self, system: str, store: str, s3: JuiceFSGateway | None = None, extra: str = "",
              immutable: bool = True) -> Iterator[
            tuple[str, int | None]]:
        """A fresh mount: (its root, the daemon's pid for hintfs)."""
        self.seq += 1
        mnt = os.path.join(self.base, f"mnt-{system}-{self.seq}")
        os.makedirs(mnt)
        pid = None
        try:
            if system.startswith("bindfs"):
                opts = ["-o", "entry_timeout=3600,attr_timeout=3600"] if system == "bindfs-cached" else []
                r = run(pinned(DAEMON_CPU, ["bindfs", *opts, store, mnt]), timeout=30)
                if r.returncode != 0:
                    raise RuntimeError(f"bindfs failed: {r.stdout.strip()}")
            elif system == "s3fs":
                assert s3 is not None
                pw = os.path.join(self.base, "s3fs.passwd")
                with open(pw, "w") as f:
                    f.write(f"{s3.access_key}:{s3.secret_key}\n")
                os.chmod(pw, 0o600)
                r = run(pinned(DAEMON_CPU, ["s3fs", BUCKET, mnt, "-o", f"url=http://{s3.endpoint}",
                                            "-o", "use_path_request_style", "-o", f"passwd_file={pw}"]), timeout=30)
                if r.returncode != 0:
                    raise RuntimeError(f"s3fs failed: {r.stdout.strip()}")
            else:
                cfg = os.path.join(self.base, f"hintfs-{self.seq}.toml")
                with open(cfg, "w") as f:
                    f.write(s3.store_toml(BUCKET) if s3 is not None else f'[store]\nuri = "file://{store}"\n')
                    f.write("\n" + (IMMUTABLE if immutable else "[cache]\n") + extra + "\n")
                    if system == "hintfs-nolistspin":
                        f.write("[mount]\nlisting_spin_us = 0\n")
                    if system == "hintfs-nofastlookups":
                        f.write("[mount]\nfast_lookups = false\n")
                    if system.startswith("hintfs-spin"):   # (--ab-request-spin US)
                        f.write(f"[mount]\nrequest_spin_us = {int(system[len('hintfs-spin'):])}\n")
                    f.write(f'[logging]\nfile = "{os.path.join(self.base, f"hintfs-{self.seq}.log")}"\n')
                r = run(pinned(DAEMON_CPU, [self.hintfs, "mount", cfg, mnt]), timeout=60)
                if r.returncode != 0:
                    raise RuntimeError(f"hintfs mount failed: {r.stdout.strip()}")
            deadline = time.monotonic() + 30
            while not os.path.ismount(mnt):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{system} did not mount within 30 s")
                time.sleep(0.02)
            if system.startswith("hintfs"):
                with open(os.path.join(mnt, ".hintfs", "stats")) as f:
                    pid = json.load(f)["pid"]
            yield mnt, pid
        finally:
            if system.startswith("hintfs") and os.path.ismount(mnt):
                r = run([self.hintfs, "umount", mnt], timeout=120)
                if r.returncode != 0:
                    self.notes.append(f"hintfs umount: {r.stdout.strip()[-200:]}")
            if os.path.ismount(mnt):
                cmd = "fusermount3" if system.startswith("hintfs") else "fusermount"
                if run([cmd, "-u", mnt], timeout=60).returncode != 0:
                    time.sleep(1)
                    run([cmd, "-u", "-z", mnt], timeout=60)
            with contextlib.suppress(OSError):
                os.rmdir(mnt)


# -- the runs ---------------------------------------------------------------------------------
def measure(results: dict, source: str, systems: list[str], repeats: int, one: Callable[[str, str], tuple],
            ops: list[str] = OPS) -> None:
    """results[source][op][system] = {"pass1": [...], "pass2": [...]}; `one(system, op)` -> (t1, t2)."""
    out = results.setdefault(source, {})
    for rep in range(repeats):
        order = systems[rep % len(systems):] + systems[:rep % len(systems)]
        for system in order:
            for op in ops:
                try:
                    t1, t2 = one(system, op)
                except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                    log(f"  {source} {op} {system}: failed: {e}")
                    out.setdefault(op, {}).setdefault(system, {}).setdefault("errors", []).append(str(e)[-300:])
                    continue
                cell = out.setdefault(op, {}).setdefault(system, {"pass1": [], "pass2": []})
                cell.setdefault("pass1", []).append(round(t1, 4))
                cell.setdefault("pass2", []).append(round(t2, 4))
                log(f"  {source} {op:5s} {system:14s} rep {rep}: pass1 {t1:.3f}s pass2 {t2:.3f}s")


def summarize(results: dict) -> None:
    for source in ("file", "s3"):
        for op, by_system in results.get(source, {}).items():
            for cell in by_system.values():
                for p in ("pass1", "pass2"):
                    if cell.get(p):
                        cell[f"{p}_median_s"] = round(statistics.median(cell[p]), 4)
                        cell["n"] = len(cell[p])


def headline(results: dict) -> None:
    """The keys the issue names: {system: median seconds} of pass 1 (and `_pass2`), file:// and s3."""
    sizes = results["sizes"]
    for key, op in (("ls_l", "ls_l"), ("stat", "stat"), ("find", "find")):
        for source, n in (("file", sizes["folder"] if op == "ls_l" else sizes["tree"]),
                          ("s3", sizes["s3_folder"] if op == "ls_l" else sizes["s3_tree"])):
            cells = results.get(source, {}).get(op, {})
            label = f"{n // 1000}k" if n < 1_000_000 else f"{n // 1_000_000}m"
            for ps in ("pass1", "pass2"):
                vals = {sys_: c[f"{ps}_median_s"] for sys_, c in cells.items() if f"{ps}_median_s" in c}
                if vals:
                    suffix = "" if ps == "pass1" else "_pass2"
                    results[f"{key}_{label}_s{suffix}" if source == "file" else f"s3_{key}_{label}_s{suffix}"] = vals


def goals(results: dict) -> list[dict]:
    out = []
    for source, peer, minimum in GOALS:
        for op in OPS:
            cells = results.get(source, {}).get(op, {})
            h, p = cells.get("hintfs", {}), cells.get(peer, {})
            for ps in ("pass1", "pass2"):
                k = f"{ps}_median_s"
                if k in h and k in p:
                    ratio = p[k] / h[k]    # speed ratio: the peer's time over hintfs's
                    out.append({"source": source, "op": op, "pass": ps, "vs": peer, "ratio": round(ratio, 2),
                                "goal": minimum, "met": ratio >= minimum})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (2,000 / 10,000; S3 500 / 1,000), n=1")
    ap.add_argument("--folder", type=int, default=100_000)
    ap.add_argument("--tree", type=int, default=1_000_000)
    ap.add_argument("--s3-folder", type=int, default=10_000)
    ap.add_argument("--s3-tree", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: file,s3,rss")
    ap.add_argument("--ops", default=",".join(OPS), help="comma list of the operations to run (default: all)")
    ap.add_argument("--ab-listing-spin", action="store_true",
                    help="file://: also hintfs-nolistspin, hintfs with [mount] listing_spin_us = 0 (an A/B "
                         "of the spin after a listing, interleaved with the others)")
    ap.add_argument("--ab-fast-lookups", action="store_true",
                    help="file://: also hintfs-nofastlookups, hintfs with [mount] fast_lookups = false (an A/B "
                         "of lookups answered inside pyfuse3, interleaved with the others)")
    ap.add_argument("--ab-request-spin", type=int, default=None, metavar="US",
                    help="file://: also hintfs-spinUS, hintfs with [mount] request_spin_us = US (an A/B of the "
                         "loop's spin after a request, interleaved with the others)")
    ap.add_argument("--max-entries", type=int, default=0,
                    help="also measure RSS with [cache] max_entries = this (0: a tenth of the tree)")
    ap.add_argument("--out", default="", help="results JSON (default bench/results/metadata.json, "
                    "metadata_quick.json with --quick, so `make bench` keeps the full run's)")
    args = ap.parse_args()
    if args.quick:
        args.folder, args.tree, args.s3_folder, args.s3_tree, args.repeats = 2000, 10_000, 500, 1000, 1
    args.out = args.out or (RESULTS.replace(".json", "_quick.json") if args.quick else RESULTS)
    skip = set(filter(None, args.skip.split(",")))
    if os.geteuid() != 0:
        sys.exit("run as root (tmpfs and FUSE mounts)")
    base = tempfile.mkdtemp(prefix="hintfs-meta-")
    store = os.path.join(base, "store")
    os.makedirs(store)
    m = Mounts(base)
    results: dict = {"machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                                 "python": platform.python_version()},
                     "argv": sys.argv[1:],
                     "sizes": {"folder": args.folder, "tree": args.tree, "s3_folder": args.s3_folder,
                               "s3_tree": args.s3_tree, "repeats": args.repeats},
                     "setup": {"client_cpu": CLIENT_CPU, "daemon_cpu": DAEMON_CPU, "hintfs_config": IMMUTABLE,
                               "bindfs": "Debian bindfs (libfuse 2), defaults: entry/attr timeout 1 s",
                               "bindfs-cached": "-o entry_timeout=3600,attr_timeout=3600",
                               "s3fs": "Debian s3fs 1.90, -o use_path_request_style, defaults otherwise"}}
    tmpfs = False
    try:
        if run(["mount", "-t", "tmpfs", "-o", "size=8g,nr_inodes=0", "tmpfs", store]).returncode == 0:
            tmpfs = True
        list_file = os.path.join(base, "tree.list")
        if "file" not in skip or "rss" not in skip:
            rels, entries = make_local(store, args.folder, args.tree)
            with open(list_file, "w") as f:
                f.write("\n".join(rels))

        def one_file(system: str, op: str) -> tuple[float, float]:
            drop_caches()
            if system == "direct":
                return op_fuse(op, store, list_file), op_fuse(op, store, list_file)
            with m.mount(system, store) as (mnt, _pid):
                return op_fuse(op, mnt, list_file), op_fuse(op, mnt, list_file)

        if "file" not in skip:
            systems = (FILE_SYSTEMS + (["hintfs-nolistspin"] if args.ab_listing_spin else [])
                       + (["hintfs-nofastlookups"] if args.ab_fast_lookups else [])
                       + ([f"hintfs-spin{args.ab_request_spin}"] if args.ab_request_spin is not None else []))
            measure(results, "file", systems, args.repeats, one_file, args.ops.split(","))
        if "rss" not in skip:
            results["rss"] = measure_rss(m, store, entries, args.max_entries or max(1000, entries // 10))
        if "s3" not in skip:
            results["s3_setup"] = run_s3(results, m, base, args)
    finally:
        summarize(results)
        headline(results)
        if "rss" in results:
            results["rss_per_entry_bytes"] = results["rss"]["rss_per_entry_bytes"]
        results["goals"] = goals(results)
        results["notes"] = m.notes
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        log(json.dumps(results["goals"], indent=None))
        if tmpfs:
            run(["umount", store])
        shutil.rmtree(base, ignore_errors=True)


def measure_rss(m: Mounts, store: str, entries: int, max_entries: int) -> dict:
    """hintfs's RSS after mount and after `du` stat'ed the whole tree, with and without a bound."""
    out = {}
    for label, extra, immutable in (("unbounded", "", True), ("bounded", f"max_entries = {max_entries}\n", True),
                                    ("not_immutable", "", False)):
        drop_caches()
        with m.mount("hintfs", store, extra=extra, immutable=immutable) as (mnt, pid):
            assert pid is not None
            before = rss_kib(pid)
            # `du` stats every name (a walk given names only would make no inode: fusefs/walks.py)
            t = timed(["du", "-s", os.path.join(mnt, "tree")])
            time.sleep(1.0)   # forgets the kernel sends after invalidations
            after = rss_kib(pid)
            with open(os.path.join(mnt, ".hintfs", "stats")) as f:
                st = json.load(f)
            trimmed = st.get("counters", {}).get("entries_trimmed", 0)
            lookups = st.get("ops", {}).get("lookup", {}).get("count", 0)
        out[label] = {"max_entries": max_entries if extra else None, "entries_listed": entries,
                      "immutable_globs": immutable,
                      "rss_after_mount_kib": before, "rss_after_du_kib": after, "du_s": round(t, 3),
                      "entries_trimmed": trimmed, "lookups": lookups,
                      "rss_per_entry_bytes": round((after - before) * 1024 / entries)}
        log(f"  rss {label}: {before} KiB -> {after} KiB after {entries} entries ({out[label]})")
    results_per_entry = out["unbounded"]["rss_per_entry_bytes"]
    out["rss_per_entry_bytes"] = results_per_entry
    return out


def run_s3(results: dict, m: Mounts, base: str, args) -> dict:
    with JuiceFSGateway(os.path.join(base, "s3")) as s3:
        fs = s3.filesystem()
        rels, setup = make_s3(fs, args.s3_folder, args.s3_tree)
        list_file = os.path.join(base, "s3tree.list")
        with open(list_file, "w") as f:
            f.write("\n".join(rels))

        def one_s3(system: str, op: str) -> tuple[float, float]:
            drop_caches()
            if system == "direct":
                return op_s3_direct(fs, op, rels), op_s3_direct(fs, op, rels)
            with m.mount(system, "", s3=s3) as (mnt, _pid):
                return op_fuse(op, mnt, list_file), op_fuse(op, mnt, list_file)

        measure(results, "s3", S3_SYSTEMS, args.repeats, one_s3, args.ops.split(","))
        setup["gateway"] = s3.name
    return setup


if __name__ == "__main__":
    main()

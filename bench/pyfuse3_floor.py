"""How fast can *any* pyfuse3 filesystem open+read+close small files on this machine?

A minimal read-only passthrough (inline lstat/open/pread, keep_cache, no stats, no checks) is
the floor of per-request cost that pyfuse3 + trio impose. Run side by side with bindfs and
hintfs over the same tmpfs tree, it tells how much of hintfs's gap to bindfs is its own code.

    sudo .venv/bin/python bench/pyfuse3_floor.py [--files 5000] [--repeats 3]

Writes bench/results/pyfuse3_floor.json.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def serve(root: str, mnt: str, timeout: float = 1.0, mode: str = "plain") -> None:
    """The minimal daemon: `timeout` is its entry and attr timeout (bench/small_files.py gives the
    peers' value). `mode`: "plain" (reads answered by the daemon, keep_cache), "pt" (FUSE
    passthrough: a backing id registered at each open of an inode, released at its last close, as
    hintfs does), "fast" (passthrough, the backing id kept and the inode marked for pyfuse3's fast
    path, patches/pyfuse3-fastpath.patch: later opens and their releases are answered inside
    pyfuse3, docs/fastpath.md)."""
    import pyfuse3
    import trio

    class Passthrough(pyfuse3.Operations):
        def __init__(self):
            super().__init__()
            self.paths = {pyfuse3.ROOT_INODE: root}
            self.inos = {root: pyfuse3.ROOT_INODE}
            self.fds = {}
            self.backing = {}   # "pt": ino -> [fd, backing id, opens]
            self.enable_passthrough = mode != "plain"

        def _attr(self, path):
            st = os.lstat(path)
            ino = self.inos.get(path)
            if ino is None:
                ino = self.inos[path] = len(self.paths) + 1
                self.paths[ino] = path
            a = pyfuse3.EntryAttributes()
            for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_mtime_ns", "st_ctime_ns"):
                setattr(a, k, getattr(st, k))
            a.st_ino = ino
            a.attr_timeout = a.entry_timeout = timeout
            return a

        async def lookup(self, parent, name, ctx=None):
            try:
                return self._attr(os.path.join(self.paths[parent], os.fsdecode(name)))
            except FileNotFoundError:
                raise pyfuse3.FUSEError(errno.ENOENT)

        async def getattr(self, ino, ctx=None):
            return self._attr(self.paths[ino])

        async def open(self, ino, flags, ctx):
            if mode == "plain":
                fd = os.open(self.paths[ino], os.O_RDONLY)
                self.fds[fd] = fd
                return pyfuse3.FileInfo(fh=fd, keep_cache=True)
            b = self.backing.get(ino)
            if b is None:
                fd = os.open(self.paths[ino], os.O_RDONLY)
                b = self.backing[ino] = [fd, pyfuse3.passthrough_open(fd), 0]
                if mode == "fast":
                    pyfuse3.fast_mark(ino, b[1])   # kept: the next opens never reach Python
            b[2] += 1
            return pyfuse3.FileInfo(fh=ino, keep_cache=False, backing_id=b[1], noflush=True)

        async def read(self, fh, off, size):
            return os.pread(fh, size, off)

        async def release(self, fh):
            if mode == "plain":
                os.close(self.fds.pop(fh))
                return
            b = self.backing[fh]
            b[2] -= 1
            if b[2] == 0 and mode == "pt":
                del self.backing[fh]
                pyfuse3.passthrough_close(b[1])
                os.close(b[0])

    pyfuse3.init(Passthrough(), mnt, {"fsname=floor", "default_permissions"})
    try:
        trio.run(pyfuse3.main)
    finally:
        if mode == "fast":
            print("floor (fast path): opens, releases answered inside pyfuse3:", pyfuse3.fast_stats(), file=sys.stderr)
        pyfuse3.close()


def read_tree(files: list[str]) -> float:
    t0 = time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        while os.read(fd, 1 << 20):
            pass
        os.close(fd)
    return len(files) / (time.perf_counter() - t0)


def wait_mounted(mnt: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.ismount(mnt):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{mnt} did not mount")
        time.sleep(0.05)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3], float(sys.argv[4]) if len(sys.argv) > 4 else 1.0,
              sys.argv[5] if len(sys.argv) > 5 else "plain")
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="floor-")
    store, mnt = os.path.join(work, "store"), os.path.join(work, "mnt")
    os.makedirs(store)
    os.makedirs(mnt)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", store], check=True)
    results: dict[str, list[float]] = {"bindfs": [], "pyfuse3-floor": [], "hintfs": []}
    try:
        rng = random.Random(0)
        rel = []
        for i in range(args.files):
            r = f"tree/d{i % 50}/f{i}"
            os.makedirs(os.path.dirname(os.path.join(store, r)), exist_ok=True)
            with open(os.path.join(store, r), "wb") as f:
                f.write(rng.randbytes(rng.randint(4 << 10, 64 << 10)))
            rel.append(r)
        cfg = os.path.join(work, "hintfs.toml")
        with open(cfg, "w") as f:
            f.write(f'[store]\nuri = "file://{store}"\n[logging]\nfile = "{work}/hintfs.log"\n')
        files = [os.path.join(mnt, r) for r in rel]
        for _ in range(args.repeats):
            for name in results:
                if name == "bindfs":
                    if not shutil.which("bindfs"):
                        continue
                    subprocess.run(["bindfs", store, mnt], check=True)
                    proc = None
                elif name == "hintfs":
                    subprocess.run([sys.executable, "-m", "hintfs.cli", "mount", cfg, mnt], check=True,
                                   cwd=REPO, stdout=subprocess.DEVNULL)
                    proc = None
                else:
                    proc = subprocess.Popen([sys.executable, __file__, "--serve", store, mnt])
                try:
                    wait_mounted(mnt)
                    results[name].append(read_tree(files))   # fresh mount: lookups + first reads
                finally:
                    if name == "hintfs":
                        subprocess.run([sys.executable, "-m", "hintfs.cli", "umount", mnt], cwd=REPO)
                    subprocess.run(["fusermount3", "-u", mnt], capture_output=True)
                    if proc is not None:
                        proc.wait(timeout=20)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
        subprocess.run(["umount", store], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in results.items() if v}
    out = {"files": args.files, "repeats": args.repeats, "files_per_s": results, "median": med,
           "ratios": {"hintfs/bindfs": med["hintfs"] / med["bindfs"] if "bindfs" in med else None,
                      "floor/bindfs": med["pyfuse3-floor"] / med["bindfs"] if "bindfs" in med else None,
                      "hintfs/floor": med["hintfs"] / med["pyfuse3-floor"]}}
    print("| mount | files/s (median) |\n|---|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:,.0f} |")
    print(json.dumps(out["ratios"], indent=1))
    (REPO / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (REPO / "bench" / "results" / "pyfuse3_floor.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

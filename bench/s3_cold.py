#!/usr/bin/env python3
"""Cold reads from S3, side by side in one run (issue 39, part 1): pyarrow direct (one stream per
file, and N parallel ranged reads: the limit is the better of the two), hintfs (with its host
cache), s3fs-fuse (Debian `s3fs`, `-o use_path_request_style`) and rclone mount (`--vfs-cache-mode
off`), all against JuiceFS's S3 gateway on loopback (tests/helpers/s3server.py).

Optional system `hintfs-nocache` (`--systems ...,hintfs-nocache`): no host cache, the store reader's
own read-ahead (`[store] read_ahead_bytes`); `hintfs-glibcmalloc`: the defaults with glibc's own malloc
thresholds (`GLIBC_TUNABLES=glibc.malloc.perturb=0`, so the daemon leaves malloc alone:
docs/operations.md "Memory"); `hintfs-unmapped`: `[cache] fetch_mapped = false` (each block's GET read
into a fetch thread's buffer, then pwrite: the default since the late night of 2026-12-06);
`hintfs-mapped`: `fetch_mapped = true` (each block's GET read into a mapping of the cache file);
`hintfs-sdk`: `fetch_mapped = false`, `fetch_buffered = false` (blocks read through pyarrow and written
with pwrite, as before either). hintfs runs twice: with the defaults, and as "hintfs-immutable" with `[cache] immutable_globs = ["*"]`
(the data set declared immutable: names and attributes kept, as s3fs (stat cache, 15 min) and rclone
(dir cache, 5 min) keep them by default).

Cases:
  seq   : one object of `--seq-mib` (1 GiB) read sequentially, 1 MiB reads
  par8  : 8 readers at once, each its own object of `--par-mib` (256 MiB); GB/s = all bytes / time
          to the last one done
  small : `--small` (2,000) objects of 4-64 KiB (fixed seed) in one folder, listed then each read
          whole by 8 reader threads (direct: the same 8 threads, one HEAD+GET each)
  again : the seq object read again through the same hintfs mount (its host cache, FUSE
          passthrough) vs a local direct read of a copy beside it, both from the page cache
The gateway's bucket is on the disk (`--base`), so dropping the page cache makes the server cold;
hintfs's host cache is on a tmpfs, standing for the client's own local disk (with
`--cache-on-disk` it shares the gateway's disk: its 1-2 GiB of writes then compete with the
gateway's cold reads, an artifact of one VM, not of S3).
The data is read once after the upload (JuiceFS compacts an object's slices at its first read, which
would cost whichever system came first). Cold: before every (case, system) measurement the gateway is stopped, the page cache dropped
(`echo 3 > /proc/sys/vm/drop_caches`), the gateway started again and the mount made fresh (an
empty host cache for hintfs). Systems are interleaved (the order rotates each repeat).
Reported per measurement: the gateway's CPU seconds (utime+stime of its process group: it shares
the 2 cores) and fetched / read (the bytes the gateway wrote, /proc/PID/io wchar: what it sent on
its sockets, over the bytes the reader got).

Run as root:  flock /tmp/bench.lock .venv/bin/python bench/s3_cold.py [--quick]
Writes bench/results/s3_cold.json (--quick: s3_cold_quick.json; or --out) and prints a table.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tests.helpers.s3server import JuiceFSGateway  # noqa: E402
from tests.helpers.procs import proc_cpu_s, wait_mounted  # noqa: E402

MiB = 1 << 20
SEED = 20261205
BUCKET = "cold"
READ = MiB
PAR = 8
SYSTEMS = ["direct1", "directN", "hintfs", "hintfs-immutable", "s3fs", "rclone"]
RESULTS = os.path.join(REPO, "bench", "results", "s3_cold.json")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


DROPPED = {"ok": True}    # False once /proc/sys/vm/drop_caches refused a write (a container): not cold


def drop_caches() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as err:
        if DROPPED["ok"]:
            log(f"page cache NOT dropped ({err}): the gateway's bucket may be read from memory")
        DROPPED["ok"] = False


# -- the gateway's own counters -----------------------------------------------------------------
def group_pids(pgid: int) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:
                    pids.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return pids


def proc_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) of process `pid` so far; 0 for None."""
    return 0.0 if pid is None else proc_cpu_s(pid)


def gateway_counters(gw: JuiceFSGateway) -> tuple[float, int]:
    """(CPU seconds, bytes written) of the gateway's processes."""
    assert gw.proc is not None
    cpu, wchar = 0.0, 0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in group_pids(gw.proc.pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / tick
            with open(f"/proc/{pid}/io") as f:
                for line in f:
                    if line.startswith("wchar:"):
                        wchar += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return cpu, wchar


# -- data -------------------------------------------------------------------------------------
def small_sizes(n: int) -> list[int]:
    rnd = random.Random(SEED)
    return [rnd.randint(4 << 10, 64 << 10) for _ in range(n)]


def upload(fs, path: str, size: int, seed: int, local: str | None = None) -> None:
    rnd = random.Random(seed)
    block = rnd.randbytes(4 * MiB)
    out_local = open(local, "wb") if local else None
    try:
        with fs.open_output_stream(path) as out:
            left = size
            i = 0
            while left:
                n = min(left, len(block))
                chunk = block[:n] if i % 2 == 0 else block[n - 1::-1]   # not one repeated block
                out.write(chunk)
                if out_local:
                    out_local.write(chunk)
                left -= n
                i += 1
    finally:
        if out_local:
            out_local.close()


def populate(fs, args, local_copy: str) -> None:
    fs.create_dir(BUCKET)
    t0 = time.monotonic()
    upload(fs, f"{BUCKET}/seq.bin", args.seq_mib * MiB, 1, local_copy)
    for i in range(PAR):
        upload(fs, f"{BUCKET}/par/{i}.bin", args.par_mib * MiB, 100 + i)
    with cf.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda a: _put(fs, f"{BUCKET}/small/{a[0]:05d}.bin", os.urandom(a[1])),
                      enumerate(small_sizes(args.small))))
    # JuiceFS compacts an object's slices at its first read (the gateway writes it all again, here
    # ~2x the bytes and the CPU): read everything once now, so no system pays for it.
    direct_ranges(fs, [f"{BUCKET}/seq.bin"] + [f"{BUCKET}/par/{i}.bin" for i in range(PAR)], 8, 8 * MiB)
    direct(fs, "small", True, args)
    log(f"data uploaded (and read once) in {time.monotonic() - t0:.1f}s")


def _put(fs, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as out:
        out.write(data)


# -- readers ----------------------------------------------------------------------------------
def read_file(path: str) -> int:
    n = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            b = os.read(fd, READ)
            if not b:
                return n
            n += len(b)
    finally:
        os.close(fd)


def mount_seq(root: str) -> int:
    return read_file(os.path.join(root, "seq.bin"))


def mount_par(root: str) -> int:
    with cf.ThreadPoolExecutor(PAR) as pool:
        return sum(pool.map(read_file, [os.path.join(root, "par", f"{i}.bin") for i in range(PAR)]))


def mount_small(root: str) -> int:
    d = os.path.join(root, "small")
    names = sorted(os.listdir(d))
    with cf.ThreadPoolExecutor(PAR) as pool:
        return sum(pool.map(lambda n: read_file(os.path.join(d, n)), names))


def direct_stream(fs, path: str) -> int:
    n = 0
    with fs.open_input_stream(path) as f:
        while True:
            b = f.read(READ)
            if not b:
                return n
            n += len(b)


def direct_ranges(fs, paths: list[str], threads: int, chunk: int) -> int:
    """Every object read as ranged reads of `chunk` bytes, `threads` in flight over all of them."""
    jobs = []
    files = {}
    for p in paths:
        f = fs.open_input_file(p)
        files[p] = f
        jobs += [(f, off, min(chunk, f.size() - off)) for off in range(0, f.size(), chunk)]
    try:
        with cf.ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(lambda j: len(j[0].read_at(j[2], j[1])), jobs))
    finally:
        for f in files.values():
            f.close()


def direct(fs, case: str, parallel: bool, args) -> int:
    if case == "seq":
        p = f"{BUCKET}/seq.bin"
        return direct_ranges(fs, [p], args.threads, args.chunk_mib * MiB) if parallel else direct_stream(fs, p)
    if case == "par8":
        paths = [f"{BUCKET}/par/{i}.bin" for i in range(PAR)]
        if parallel:
            return direct_ranges(fs, paths, args.threads * 2, args.chunk_mib * MiB)
        with cf.ThreadPoolExecutor(PAR) as pool:
            return sum(pool.map(lambda p: direct_stream(fs, p), paths))
    import pyarrow.fs as pafs
    infos = fs.get_file_info(pafs.FileSelector(f"{BUCKET}/small"))
    paths = sorted(i.path for i in infos if i.type == pafs.FileType.File)

    def one(p: str) -> int:
        if parallel:   # (open_input_file: HEAD, read: GET)
            with fs.open_input_file(p) as f:
                return len(f.read())
        return direct_stream(fs, p)
    with cf.ThreadPoolExecutor(PAR) as pool:
        return sum(pool.map(one, paths))


# -- mounts -----------------------------------------------------------------------------------
class Mounts:
    def __init__(self, base: str, gw: JuiceFSGateway):
        self.base = base
        self.gw = gw
        self.seq = 0
        self.hintfs = os.path.join(os.path.dirname(sys.executable), "hintfs")
        self.notes: list[str] = []
        self.last_stats: dict = {}
        self.cache_extra = ""     # more [cache] keys of the hintfs mounts (--hintfs-cache)
        self.mount_extra = ""     # more [mount] keys of the hintfs mounts (--hintfs-mount)

    def available(self, system: str) -> bool:
        if system == "s3fs":
            return shutil.which("s3fs") is not None
        if system == "rclone":
            return shutil.which("rclone") is not None
        if system.startswith("hintfs"):
            return os.access(self.hintfs, os.X_OK)
        return True

    @contextlib.contextmanager
    def mount(self, system: str, cache_dir: str):
        self.seq += 1
        mnt = os.path.join(self.base, f"mnt-{system}-{self.seq}")
        os.makedirs(mnt)
        proc = None
        gw = self.gw
        try:
            if system.startswith("hintfs"):
                cfg = os.path.join(self.base, f"hintfs-{self.seq}.toml")
                imm = 'immutable_globs = ["*"]\n' if system == "hintfs-immutable" else ""
                imm += self.cache_extra
                if system in ("hintfs-unmapped", "hintfs-sdk"):
                    imm += "fetch_mapped = false\n"
                if system == "hintfs-mapped":
                    imm += "fetch_mapped = true\n"
                if system == "hintfs-sdk":
                    imm += "fetch_buffered = false\n"
                cache_line = "" if system == "hintfs-nocache" else f'dir = "{cache_dir}"\n'
                with open(cfg, "w") as f:
                    f.write(gw.store_toml(BUCKET) + "\n"
                            f'[cache]\nspool_dir = "{os.path.join(self.base, "spool")}"\n{cache_line}{imm}\n'
                            f'[mount]\npassthrough = "auto"\n{self.mount_extra}\n'
                            f'[logging]\nfile = "{os.path.join(self.base, f"hintfs-{self.seq}.log")}"\n')
                env = ({**os.environ, "GLIBC_TUNABLES": "glibc.malloc.perturb=0"}
                       if system == "hintfs-glibcmalloc" else None)
                r = run([self.hintfs, "mount", cfg, mnt], timeout=60, env=env)
                if r.returncode != 0:
                    raise RuntimeError(f"hintfs mount failed: {r.stdout.strip()[-300:]}")
            elif system == "s3fs":
                pw = os.path.join(self.base, "s3fs.passwd")
                with open(pw, "w") as f:
                    f.write(f"{gw.access_key}:{gw.secret_key}\n")
                os.chmod(pw, 0o600)
                r = run(["s3fs", BUCKET, mnt, "-o", f"url=http://{gw.endpoint}", "-o", "use_path_request_style",
                         "-o", f"passwd_file={pw}", "-o", "endpoint=us-east-1"], timeout=60)
                if r.returncode != 0:
                    raise RuntimeError(f"s3fs failed: {r.stdout.strip()[-300:]}")
            elif system == "rclone":
                env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
                env.update({"RCLONE_CONFIG_COLD_TYPE": "s3", "RCLONE_CONFIG_COLD_PROVIDER": "Minio",
                            "RCLONE_CONFIG_COLD_ENDPOINT": f"http://{gw.endpoint}",
                            "RCLONE_CONFIG_COLD_ACCESS_KEY_ID": gw.access_key,
                            "RCLONE_CONFIG_COLD_SECRET_ACCESS_KEY": gw.secret_key,
                            "RCLONE_CONFIG_COLD_REGION": "us-east-1"})
                conf = os.path.join(self.base, "rclone.conf")
                open(conf, "a").close()
                logf = open(os.path.join(self.base, f"rclone-{self.seq}.log"), "wb")
                proc = subprocess.Popen(["rclone", "mount", f"cold:{BUCKET}", mnt, "--vfs-cache-mode", "off",
                                         "--config", conf, "--log-level", "NOTICE"], env=env,
                                        stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
                logf.close()
            wait_mounted(mnt, proc, system)
            yield mnt
            if system.startswith("hintfs"):
                with open(os.path.join(mnt, ".hintfs", "stats")) as f:
                    self.last_stats = json.load(f)
        finally:
            self.unmount(system, mnt, proc)

    def unmount(self, system: str, mnt: str, proc) -> None:
        if system.startswith("hintfs") and os.path.ismount(mnt):
            r = run([self.hintfs, "umount", mnt], timeout=90)
            if r.returncode != 0:
                self.notes.append(f"hintfs umount: {r.stdout.strip()[-200:]}")
        for _ in range(3):
            if not os.path.ismount(mnt):
                break
            r = run(["fusermount3" if system != "s3fs" else "fusermount", "-u", mnt], timeout=30)
            if r.returncode != 0:
                time.sleep(0.5)
        if os.path.ismount(mnt):
            run(["umount", "-l", mnt], timeout=30)
        if proc is not None:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            os.rmdir(mnt)


# -- one measurement --------------------------------------------------------------------------
def measure(gw: JuiceFSGateway, mounts: Mounts, fs_factory, system: str, case: str, args,
            cache_dir: str, local_copy: str, again: dict) -> dict:
    gw.stop()
    drop_caches()
    gw.start()
    shutil.rmtree(cache_dir, ignore_errors=True)
    total = {"seq": args.seq_mib * MiB, "par8": PAR * args.par_mib * MiB}.get(case)
    if system.startswith("direct"):
        fs = fs_factory()
        fs.get_file_info(BUCKET)   # (the client's connection set up, as a mount's is)
        cpu0, w0 = gateway_counters(gw)
        c0 = proc_cpu(os.getpid())
        t0 = time.perf_counter()
        n = direct(fs, case, system == "directN", args)
        dt = time.perf_counter() - t0
        client_cpu = proc_cpu(os.getpid()) - c0
        cpu1, w1 = gateway_counters(gw)
        del fs
    else:
        with mounts.mount(system, cache_dir) as mnt:
            os.stat(mnt)
            daemon = None
            if system.startswith("hintfs"):
                with open(os.path.join(mnt, ".hintfs", "stats")) as f:
                    daemon = json.load(f)["pid"]
            d0 = proc_cpu(daemon)
            cpu0, w0 = gateway_counters(gw)
            t0 = time.perf_counter()
            n = {"seq": mount_seq, "par8": mount_par, "small": mount_small}[case](mnt)
            dt = time.perf_counter() - t0
            cpu1, w1 = gateway_counters(gw)
            daemon_cpu = proc_cpu(daemon) - d0
            if system in ("hintfs", "hintfs-immutable") and case == "seq":
                again.update(reread(mnt, local_copy, args))
    if total is not None and n != total:
        raise RuntimeError(f"{system} {case}: read {n} bytes, not {total}")
    value = (args.small / dt) if case == "small" else n / dt / 1e9
    rec = {"value": round(value, 4), "s": round(dt, 3), "bytes": n, "gateway_cpu_s": round(cpu1 - cpu0, 2),
           "fetched_over_read": round((w1 - w0) / n, 3) if n else None}
    if system.startswith("direct"):
        rec["client_cpu_s"] = round(client_cpu, 2)   # (the pyarrow client's threads, in this process)
    if system.startswith("hintfs"):
        rec["daemon_cpu_s"] = round(daemon_cpu, 2)
        c = mounts.last_stats.get("counters", {})
        rec["hintfs"] = {k: c.get(k) for k in ("hostcache_fetches", "hostcache_fetched_bytes", "hostcache_hits",
                                               "hostcache_partial_reads", "hostcache_whole", "hostcache_read_waits",
                                               "hostcache_fetch_jumps", "read_thread",
                                               "read_nowait_hit", "stat_from_listing", "store_heads",
                                               "store_gets", "store_lists", "store_list_windows", "stat_from_relisting", "get_opens", "get_open_misses",
                                               "stat_dir_by_child", "store_gets_into", "store_gets_into_refused")
                         if k in c}
        rec["hintfs"]["ops"] = {k: v.get("count") for k, v in mounts.last_stats.get("ops", {}).items()
                                if k in ("lookup", "getattr", "open", "read", "readdir", "release")}
    return rec


def reread(mnt: str, local_copy: str, args) -> dict:
    """The seq object again through the same mount (host cache), against the local copy; both read
    once first (page cache), then interleaved."""
    path = os.path.join(mnt, "seq.bin")
    deadline = time.monotonic() + 120
    st_path = os.path.join(mnt, ".hintfs", "stats")
    while True:   # the host cache's fetch done
        with open(st_path) as f:
            if json.load(f)["counters"].get("hostcache_fetches", 0) >= 1:
                break
        if time.monotonic() > deadline:
            return {"error": "the host cache did not complete its fetch in 120 s"}
        time.sleep(0.05)
    read_file(local_copy)
    read_file(path)
    d, h = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        n = read_file(local_copy)
        d.append(n / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        n = read_file(path)
        h.append(n / (time.perf_counter() - t0) / 1e9)
    with open(st_path) as f:
        hits = json.load(f)["counters"].get("hostcache_hits", 0)
    return {"direct": statistics.median(d), "hintfs": statistics.median(h), "hostcache_hits": hits}


# -- main -------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="256 MiB / 8x32 MiB / 300 small, n=1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq-mib", type=int, default=1024)
    ap.add_argument("--par-mib", type=int, default=256)
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=8, help="directN: ranged reads in flight (x2 for par8)")
    ap.add_argument("--chunk-mib", type=int, default=8, help="directN: bytes per ranged read")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--cases", default="seq,par8,small")
    ap.add_argument("--base", default="/var/tmp", help="where the bucket, host cache and mounts go (a disk)")
    ap.add_argument("--out", default=None, help="default: results/s3_cold.json (--quick: s3_cold_quick.json)")
    ap.add_argument("--cache-on-disk", action="store_true",
                    help="the host cache on the disk the gateway reads its bucket from (default: a tmpfs, "
                    "standing for a local disk of its own)")
    ap.add_argument("--hintfs-cache", default="", help="more [cache] keys for hintfs, e.g. 'fetch_threads = 16'")
    ap.add_argument("--hintfs-mount", default="", help="more [mount] keys for hintfs, e.g. 'read_ahead_kb = 128'")
    args = ap.parse_args()
    if args.quick:
        args.seq_mib, args.par_mib, args.small, args.repeats = 256, 32, 300, 1
    if args.out is None:
        args.out = RESULTS.replace(".json", "_quick.json") if args.quick else RESULTS
    if os.geteuid() != 0:
        log("run as root (drop_caches, FUSE mounts)")
        return 2
    systems = [s for s in args.systems.split(",") if s]
    cases = [c for c in args.cases.split(",") if c]
    if not cases or set(cases) - {"seq", "par8", "small"}:
        log(f"--cases: a comma-separated list of seq, par8, small (got {args.cases!r}; "
            "the re-read from the host cache runs with seq)")
        return 2
    def stop(_sig, _frame):   # (a timeout's SIGTERM: unmount and stop the gateway on the way out)
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    base = tempfile.mkdtemp(prefix="s3cold-", dir=args.base)
    gw = None
    raw: dict = {c: {s: [] for s in systems} for c in cases}
    again: list[dict] = []
    t_start = time.monotonic()
    try:
        gw = JuiceFSGateway(os.path.join(base, "gw"))
        gw.start()
        mounts = Mounts(base, gw)
        mounts.cache_extra = "".join(f"{kv.strip()}\n" for kv in args.hintfs_cache.split(";") if kv.strip())
        mounts.mount_extra = "".join(f"{kv.strip()}\n" for kv in args.hintfs_mount.split(";") if kv.strip())
        local = base
        if not args.cache_on_disk:   # the host cache (and the local copy it is compared with) on a tmpfs
            local = os.path.join(base, "local")
            os.makedirs(local)
            r = run(["mount", "-t", "tmpfs", "-o", "size=6g,mode=0700", "tmpfs", local])
            if r.returncode != 0:
                raise RuntimeError(f"tmpfs: {r.stdout.strip()}")
        local_copy = os.path.join(local, "seq-local.bin")
        populate(gw.filesystem(), args, local_copy)
        cache_dir = os.path.join(local, "hostcache")
        systems = [s for s in systems if mounts.available(s)]
        for rep in range(args.repeats):
            order = systems[rep % len(systems):] + systems[:rep % len(systems)]
            for case in cases:
                for system in order:
                    a: dict = {}
                    try:
                        rec = measure(gw, mounts, gw.filesystem, system, case, args, cache_dir, local_copy, a)
                    except Exception as e:   # a peer that fails is n/a, noted
                        mounts.notes.append(f"{system} {case} rep {rep}: {e}")
                        log(f"  {system} {case}: FAILED {e}")
                        continue
                    raw[case][system].append(rec)
                    if a:
                        again.append(a)
                    log(f"  rep {rep} {case:<5} {system:<8} {rec['value']:8.3f} "
                        f"{'files/s' if case == 'small' else 'GB/s'}  gateway CPU {rec['gateway_cpu_s']:5.2f}s  "
                        f"fetched/read {rec['fetched_over_read']}  ({time.monotonic() - t_start:.0f}s)")
    except KeyboardInterrupt:   # (SIGTERM: what was measured is still written, with a note)
        mounts.notes.append(f"stopped early after {time.monotonic() - t_start:.0f} s (SIGTERM)")
        log("  stopped early: writing what was measured")
    finally:
        for d in os.listdir(base):
            if d.startswith("mnt-") and os.path.ismount(os.path.join(base, d)):
                run(["umount", "-l", os.path.join(base, d)])
        if gw is not None:
            gw.close()
        if os.path.ismount(os.path.join(base, "local")):
            run(["umount", os.path.join(base, "local")])
        shutil.rmtree(base, ignore_errors=True)
    out = summarize(raw, again, args, systems, mounts.notes, time.monotonic() - t_start, gw.name)  # type: ignore[union-attr]
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(table(out))
    return 0


def med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def summarize(raw: dict, again: list[dict], args, systems: list[str], notes: list[str], wall: float,
              server: str) -> dict:
    key = {"seq": "seq_gbps", "par8": "par8_gbps", "small": "small_files_s"}
    out: dict = {"issue": 39, "sizes": {"seq_bytes": args.seq_mib * MiB, "par8_bytes_each": args.par_mib * MiB,
                                        "small_files": args.small, "small_bytes": "4-64 KiB"},
                 "repeats": args.repeats, "s3_server": server, "hintfs_cache_extra": args.hintfs_cache, "hintfs_mount_extra": args.hintfs_mount,
                 "host_cache_on": "the gateway's disk" if args.cache_on_disk else "a tmpfs (a local disk of its own)", "machine": machine(), "wall_s": round(wall, 1),
                 "direct_parallel": {"threads": args.threads, "chunk_bytes": args.chunk_mib * MiB},
                 "notes": notes, "page_cache_dropped": DROPPED["ok"], "goals": []}
    for case, per in raw.items():
        m = {s: med([r["value"] for r in recs]) for s, recs in per.items()}
        best = max([v for s, v in m.items() if s.startswith("direct") and v] or [0]) or None
        out[key[case]] = {"direct": best, "direct_one_stream": m.get("direct1"), "direct_parallel": m.get("directN"),
                          "hintfs": m.get("hintfs"), "hintfs_immutable": m.get("hintfs-immutable"),
                          "hintfs_glibcmalloc": m.get("hintfs-glibcmalloc"),
                          "hintfs_unmapped": m.get("hintfs-unmapped"), "hintfs_sdk": m.get("hintfs-sdk"),
                          "hintfs_mapped": m.get("hintfs-mapped"),
                          "s3fs": m.get("s3fs"), "rclone": m.get("rclone"),
                          "daemon_cpu_s": {s: med([r["daemon_cpu_s"] for r in v]) for s, v in per.items()
                                           if s.startswith("hintfs")},
                          "n": {s: len(v) for s, v in per.items()},
                          "gateway_cpu_s": {s: med([r["gateway_cpu_s"] for r in v]) for s, v in per.items()},
                          "fetched_over_read": {s: med([r["fetched_over_read"] for r in v if r["fetched_over_read"]])
                                                for s, v in per.items()},
                          "raw": per}
        for name in ("hintfs", "hintfs-immutable"):
            h = m.get(name)
            if h is None:
                continue
            out["goals"].append(goal(f"{key[case]}: {name} / best direct", h, best, 0.9))
            if case == "small":
                out["goals"].append(goal(f"{key[case]}: {name} / s3fs", h, m.get("s3fs"), 2.0))
    if again:
        d = med([a["direct"] for a in again if "direct" in a])
        h = med([a["hintfs"] for a in again if "hintfs" in a])
        out["reread_hostcache_gbps"] = {"direct_local": d, "hintfs": h, "n": len(again), "raw": again}
        out["goals"].append(goal("re-read from the host cache: hintfs / local direct", h, d, 0.8))
    return out


def goal(name: str, num, den, minimum: float) -> dict:
    ratio = round(num / den, 3) if num and den else None
    return {"goal": name, "min_ratio": minimum, "ratio": ratio, "met": ratio >= minimum if ratio else None}


def machine() -> dict:
    s3fs_v = run(["s3fs", "--version"]).stdout.splitlines()[0] if shutil.which("s3fs") else None
    rclone_v = run(["rclone", "version"]).stdout.splitlines()[0] if shutil.which("rclone") else None
    import pyarrow
    return {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "pyarrow": pyarrow.__version__, "s3fs": s3fs_v, "rclone": rclone_v}


def table(out: dict) -> str:
    lines = ["| case | best direct | direct 1 stream | direct N | hintfs | hintfs immutable | hintfs unmapped | "
             "hintfs mapped | hintfs sdk | s3fs | rclone |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in ("seq_gbps", "par8_gbps", "small_files_s"):
        r = out.get(k)
        if r:
            lines.append(f"| {k} | " + " | ".join(str(r.get(s)) for s in ("direct", "direct_one_stream",
                                                                         "direct_parallel", "hintfs", "hintfs_immutable",
                                                                         "hintfs_unmapped", "hintfs_mapped", "hintfs_sdk",
                                                                         "s3fs", "rclone")) + " |")
    lines += [""] + [f"- {g['goal']}: {g['ratio']} (goal >= {g['min_ratio']}): "
                     f"{'met' if g['met'] else 'MISSED' if g['met'] is False else 'n/a'}" for g in out["goals"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

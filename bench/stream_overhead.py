"""What streaming behind a writer costs the writer (issue 15's goal: training-side write throughput
with streaming >= 0.95x without), for the building block `fusefs/stream/streamer.py` on its own: no mount,
no network. A writer process (the job) writes a file in 1 MiB `write()`s into a tmpfs folder; in
the "stream" runs this process trails it with a `Streamer` stepping every `--poll-ms` (reading each
whole chunk back with `pread` and computing its CRC, then publishing with the final CRCs) into a
transport that counts bytes and holds each chunk for its time on the link (`--link-mbit`, 400 as
in bench/cross_dc_eval.py; 0: no link, the streamer reads and checksums as fast as it can, the
worst case for the writer). Runs alternate (plain, stream, plain, ...); the writer's
throughput is its bytes over its own time from the first write to the close. The bytes the
streamer sent and re-sent are checked: each chunk once, as on the happy path.

What it does not include: the Flight calls and the WAN (the real sender's network cost is in
the same process as the mount, not the job), the mount between the job and the staging file.

  python bench/stream_overhead.py [--size-mib 512] [--reps 5] [--link-mbit 400] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fusefs.stream.streamer import PublishAnswer, PutAnswer, Streamer  # noqa: E402

MiB = 1 << 20
WRITER = textwrap.dedent("""
    import os, sys, time
    path, size = sys.argv[1], int(sys.argv[2])
    buf = os.urandom(1 << 20)
    sys.stdin.readline()                       # go
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for _ in range(size >> 20):
        os.write(fd, buf)
    os.close(fd)
    print(time.perf_counter() - t0, flush=True)
""")


class CountingTransport:
    """The streamer's `Transport` without a tier: counts the bytes it is given, and holds each put
    for its time on the link."""
    def __init__(self, link_bytes_s: float = 0.0):
        self.bytes = 0
        self.puts = 0
        self.link_bytes_s = link_bytes_s

    def open(self, sid, gen, path, chunk, job=None):
        return {}, ()

    def _take(self, chunks) -> None:
        n = sum(len(data) for _, data, _ in chunks)
        if self.link_bytes_s and n:
            time.sleep(n / self.link_bytes_s)   # a blocking send on a link of that rate
        self.bytes += n

    def put(self, sid, gen, chunks, opening=None, seen=None, urgent=False):
        self._take(chunks)
        self.puts += 1
        return PutAnswer(named=() if opening else None)

    def publish(self, sid, gen, path, size, mtime_ns, crcs, record=None, chunks=(), opening=None):
        self._take(chunks)
        return PublishAnswer("ready")

    def abort(self, sid):
        pass


def one(folder: str, size: int, stream: bool, chunk: int, poll_s: float, link_bytes_s: float = 0.0) -> dict:
    path = os.path.join(folder, "staging")
    open(path, "wb").close()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, path, str(size)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    transport = CountingTransport(link_bytes_s)
    done = threading.Event()
    t_follow = 0.0

    def follow():
        nonlocal t_follow
        streamer = Streamer(transport, chunk, max_chunks_per_step=1 << 20)
        fd = os.open(path, os.O_RDONLY)
        try:
            fs = streamer.start("ckpt/x", fd)
        finally:
            os.close(fd)
        while not done.is_set():
            streamer.step(fs)
            time.sleep(poll_s)
        t0 = time.perf_counter()
        streamer.published(fs, os.path.getsize(path), 0)
        while not streamer.step(fs):
            pass
        t_follow = time.perf_counter() - t0

    th = threading.Thread(target=follow) if stream else None
    if th is not None:
        th.start()
    writer.stdin.write("go\n")
    writer.stdin.flush()
    write_s = float(writer.stdout.readline())
    writer.wait(60)
    done.set()
    if th is not None:
        th.join(120)
    os.unlink(path)
    out = {"write_gb_s": size / write_s / 1e9, "write_s": write_s}
    if stream:
        out.update({"streamed_bytes": transport.bytes, "puts": transport.puts,
                    "publish_s": round(t_follow, 4)})
        if transport.bytes != size:
            raise RuntimeError(f"streamed {transport.bytes} bytes of {size}: sent twice or lost")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunk-mib", type=int, default=4)
    ap.add_argument("--poll-ms", type=float, default=20.0)
    ap.add_argument("--link-mbit", type=float, default=400.0, help="0: no link (worst case for the writer)")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "stream_overhead.json"))
    a = ap.parse_args()
    size = a.size_mib * MiB
    runs: dict[str, list[dict]] = {"plain": [], "stream": []}
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="hintfs-stream-") as folder:
        one(folder, 64 * MiB, False, a.chunk_mib * MiB, a.poll_ms / 1000)     # warm-up
        for _ in range(a.reps):
            for mode in ("plain", "stream"):
                r = one(folder, size, mode == "stream", a.chunk_mib * MiB, a.poll_ms / 1000,
                        a.link_mbit * 1e6 / 8)
                runs[mode].append(r)
                print(mode, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}),
                      flush=True)
    med = {m: statistics.median(r["write_gb_s"] for r in rs) for m, rs in runs.items()}
    result = {"config": {"size_mib": a.size_mib, "reps": a.reps, "chunk_mib": a.chunk_mib, "poll_ms": a.poll_ms,
                         "link_mbit": a.link_mbit,
                         "dir": "tmpfs" if a.dir == "/dev/shm" else (a.dir or "default temp"),
                         "cpus": os.cpu_count()},
              "write_gb_s_median": {m: round(v, 3) for m, v in med.items()},
              "stream_over_plain": round(med["stream"] / med["plain"], 3),
              "goal_ge_0_95": med["stream"] / med["plain"] >= 0.95,
              "publish_s_median": statistics.median(r["publish_s"] for r in runs["stream"]),
              "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("write_gb_s_median", "stream_over_plain", "goal_ge_0_95",
                                              "publish_s_median")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

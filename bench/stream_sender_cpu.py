"""What the stream sender costs in CPU per byte (issue 15: the training write with streaming is
CPU-bound on the bench's VM), through the real path: the hooks (`fusefs.stream.hooks.StreamFront`) over a `ThreadSink` and its
`Streamer`s in this process, Flight calls to a tier agent in a child process, across
`tests/helpers/wan.py`'s relay (100 ms RTT, 400 Mbit/s, another child: the link is not the sender's CPU).

A writer thread of this process writes each checkpoint as `--files` files one after another in
1 MiB `write()`s into tmpfs, paced to `--rate-mb-s`, and hooks them to the tap as the mount does
(`started` at create, `published` at close). The sender's CPU is this process's CPU time
(`time.process_time`: every thread, gRPC's included) minus the writer thread's own, from the
first write until the tier holds every file. The first checkpoint of each arm is a warm-up and is
not counted (`--reps` more follow). Arms (`--arm NAME=JSON`: `[stream]` keys over the defaults)
alternate checkpoint by checkpoint, each with a tap of its own.

  python bench/stream_sender_cpu.py                     # defaults against call_bytes = chunk_bytes (one chunk a call)
  python bench/stream_sender_cpu.py --arm 'defaults={}' --arm 'poll 60 ms={"poll_interval_s": 0.06}'
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MiB = 1 << 20


def serve_tier(folder: str) -> None:
    """(child) A tier agent over `folder`/store, its port on stdout."""
    from hintfs.agent.server import AgentServer
    from mountconfig import parse_config
    from hintfs.stores.local import LocalStore
    cfg = {"store": {"uri": f"file://{folder}/store"},
           "agent": {"data_dir": f"{folder}/tier", "auth": "none", "stream_prefixes": ["ckpt"]}}
    parsed = parse_config(cfg)
    server = AgentServer(LocalStore(f"{folder}/store"), parsed.agent, peers=parsed.agents, follow=parsed.follow,
                         transform_load=parsed.transform_load, location="grpc://127.0.0.1:0")
    print(server.port, flush=True)
    server.serve()


def serve_relay(port: int, delay_s: float, bytes_s: float) -> None:
    """(child) The WAN relay in front of the tier, its port on stdout; ends when stdin closes."""
    from tests.helpers.wan import Relay
    relay = Relay(("127.0.0.1", port), delay_s, bytes_s)
    print(relay.start(), flush=True)
    sys.stdin.read()
    relay.stop()


def child(*args: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise SystemExit(f"bench child {args[0]} did not start")
    return proc, int(line)


class Arm:
    def __init__(self, name: str, keys: dict, agent: str):
        from fusefs.stats import Stats
        from fusefs.stream.flight import build_streamers
        from fusefs.stream.hooks import StreamFront
        from fusefs.stream.threads import ThreadSink
        from mountconfig.schema import StreamConfig
        self.name = name
        sc = StreamConfig(prefixes=["ckpt"], agents=[agent], **keys)
        self.tap = StreamFront(sc, lambda finished: ThreadSink(sc, build_streamers(sc, None, None), Stats(), finished))
        self.cpu: list[float] = []

    def checkpoint(self, folder: str, tag: str, files: int, size: int, rate: float, key0: int) -> float:
        """Write one checkpoint behind the tap; the sender's CPU seconds for it."""
        from hintfs.stores.base import Stat
        block = os.urandom(MiB)
        per = max(1, size // files // MiB)
        keys = list(range(key0, key0 + files))
        os.makedirs(f"{folder}/store/ckpt/job/{tag}", exist_ok=True)
        cpu0, writer0 = time.process_time(), time.thread_time()
        for key in keys:
            path = f"ckpt/job/{tag}/__{key - key0}_0.distcp"
            fd = os.open(f"{folder}/store/{path}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                self.tap.started(key, path, fd)
                t0 = time.monotonic()
                for i in range(per):
                    os.write(fd, block)
                    ahead = t0 + (i + 1) * MiB / rate - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)
                st = os.fstat(fd)
                self.tap.published(key, path, Stat(mode=0o100644, size=st.st_size, mtime_ns=st.st_mtime_ns,
                                                   ctime_ns=st.st_mtime_ns), None, True)
            finally:
                os.close(fd)
        writer = time.thread_time() - writer0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with self.tap.lock:
                if not any(k in self.tap.live for k in keys):
                    break
            time.sleep(0.002)
        else:
            raise SystemExit(f"{self.name}: the tier never got checkpoint {tag}")
        return time.process_time() - cpu0 - writer


def main(argv: list[str]) -> int:
    if argv[:1] == ["tier"]:
        serve_tier(argv[1])
        return 0
    if argv[:1] == ["relay"]:
        serve_relay(int(argv[1]), float(argv[2]), float(argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=28, help="one checkpoint (the cross-DC bench's is 28.6 MB)")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10, help="checkpoints counted per arm")
    ap.add_argument("--rate-mb-s", type=float, default=60.0, help="the writer's pace")
    ap.add_argument("--delay-ms", type=float, default=50.0, help="one way")
    ap.add_argument("--bandwidth-mbit", type=float, default=400.0)
    ap.add_argument("--arm", action="append", default=None, metavar="NAME=JSON")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    arms_given = a.arm or ['defaults={}', 'one chunk a call={"call_bytes": 1048576}']
    folder = tempfile.mkdtemp(prefix="hintfs-sendcpu-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    procs = []
    try:
        tier, tier_port = child("tier", folder)
        procs.append(tier)
        relay, relay_port = child("relay", str(tier_port), str(a.delay_ms / 1000), str(a.bandwidth_mbit * 1e6 / 8))
        procs.append(relay)
        agent = f"grpc://127.0.0.1:{relay_port}"
        arms = []
        for spec in arms_given:
            name, _, keys = spec.partition("=")
            arms.append(Arm(name, json.loads(keys or "{}"), agent))
        time.sleep(1.0)                        # the taps' warm-up (connections, send threads)
        size, rate = a.size_mib * MiB, a.rate_mb_s * 1e6
        key = 1
        for rep in range(a.reps + 1):
            for arm in arms:
                cpu = arm.checkpoint(folder, f"{arm.name.replace(' ', '_')}_{rep}", a.files, size, rate, key)
                key += a.files
                if rep > 0:                    # the first is the warm-up
                    arm.cpu.append(cpu)
                print(f"{arm.name} checkpoint {rep}: sender CPU {cpu:.3f} s", flush=True)
        result = {"size_mib": a.size_mib, "files": a.files, "rate_mb_s": a.rate_mb_s, "delay_ms": a.delay_ms,
                  "bandwidth_mbit": a.bandwidth_mbit, "arms": {}}
        for arm in arms:
            med = statistics.median(arm.cpu)
            result["arms"][arm.name] = {"n": len(arm.cpu), "sender_cpu_s_median": round(med, 4),
                                        "sender_cpu_s_mean": round(statistics.mean(arm.cpu), 4),
                                        "mb_per_cpu_s": round(size / med / 1e6, 1), "cpu_s": arm.cpu}
            print(f"{arm.name}: sender CPU median {med:.3f} s per {a.size_mib} MiB (n = {len(arm.cpu)}), "
                  f"{size / med / 1e6:.0f} MB per CPU second")
            arm.tap.close()
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

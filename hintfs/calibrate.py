"""`hintfs calibrate`: measure the safe load of one replica.

Closed-loop readers (each sends its next read when the previous one returns) read random
blocks of one file from one agent. The reader count doubles from 1; the safe load is the
largest count whose p99 latency stays within 2x its p50 and whose p50 stays within 2x the single
reader's p50 — past that knee the replica queues. Both tests are needed: a replica that queues
its requests fairly slows every request alike (p50 grows, p99/p50 does not), one that queues
unfairly shows it in the tail.
The result is what `replicas.safe_readers_per_replica` should be set to.
"""
from __future__ import annotations

import random
import threading
import time

from hintfs.agent.client import AgentClient


def measure(location: str, path: str, size: int, readers: int, seconds: float, block: int,
            token: str | None, tls_root: bytes | None = None) -> list[float]:
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def loop(seed: int) -> None:
        c = AgentClient(location, token=token, tls_root=tls_root)
        rng = random.Random(seed)
        mine = []
        while time.monotonic() < stop:
            off = rng.randrange(0, max(1, size - block))
            t0 = time.perf_counter()
            c.read(path, off, block, compress=False)   # (the agent as it serves bytes that do not compress)
            mine.append(time.perf_counter() - t0)
        c.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(latencies)


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def calibrate(location: str, path: str, size: int, max_readers: int = 256, seconds: float = 2.0,
              block: int = 1 << 20, token: str | None = None, tls_root: bytes | None = None) -> dict:
    """`tls_root`: the CA a grpc+tls agent's certificate is checked against (`[agents] tls_root_file`)."""
    rows = []
    safe = 1
    n = 1
    alone_p50 = None
    while n <= max_readers:
        lat = measure(location, path, size, n, seconds, block, token, tls_root)
        p50, p99 = _pct(lat, 0.50), _pct(lat, 0.99)
        rows.append({"readers": n, "reads": len(lat), "p50_ms": round(p50 * 1e3, 3), "p99_ms": round(p99 * 1e3, 3),
                     "reads_per_s": round(len(lat) / seconds, 1)})
        if alone_p50 is None:
            alone_p50 = p50
        if p99 > 2 * p50 or p50 > 2 * alone_p50:
            break
        safe = n
        n *= 2
    return {"safe_readers_per_replica": safe, "levels": rows}

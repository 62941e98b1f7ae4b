"""Per-operation counters and latency histograms, shared by `.hintfs/stats`, `hintfs status`
and the Prometheus endpoint (which reads the same numbers through a collector).

Recording is on the hot path of every FUSE request, so it is a dict lookup and two additions:
latencies go into fixed log-spaced buckets (4 per octave, from 1 µs), enough for percentiles
within ~19% without keeping samples.
"""
from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Callable

_SUB = 4                       # buckets per power of two
_NBUCKETS = 40 * _SUB          # 1 µs .. ~2^40 µs
_LOG_SCALE = _SUB / math.log(2)


def _bucket(us: float) -> int:
    if us <= 1.0:
        return 0
    b = int(math.log(us) * _LOG_SCALE) + 1
    return b if b < _NBUCKETS else _NBUCKETS - 1


def _bucket_upper_us(b: int) -> float:
    return math.exp(b / _LOG_SCALE)


class OpStats:
    __slots__ = ("count", "errors", "total_ns", "max_ns", "buckets")

    def __init__(self) -> None:
        self.count = 0
        self.errors = 0
        self.total_ns = 0
        self.max_ns = 0
        self.buckets = [0] * _NBUCKETS

    def record(self, ns: int) -> None:
        self.count += 1
        self.total_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns
        self.buckets[_bucket(ns / 1000.0)] += 1

    def percentile_us(self, q: float) -> float:
        if not self.count:
            return 0.0
        rank = q * self.count
        seen = 0
        for b, n in enumerate(self.buckets):
            seen += n
            if seen >= rank and n:
                return min(_bucket_upper_us(b), self.max_ns / 1000.0)
        return self.max_ns / 1000.0


class Stats:
    def __init__(self, queued_reads: Callable[[], int | None] | None = None) -> None:
        self.started = time.time()
        self.ops: dict[str, OpStats] = defaultdict(OpStats)
        self.counters: dict[str, int] = defaultdict(int)
        self.passthrough = "off"   # FUSE passthrough: "on", or why not (set by the filesystem)
        # Requests the FUSE loop read while queued, without a wait (patched pyfuse3: fusefs.fuse)
        self.queued_reads: Callable[[], int | None] = queued_reads or (lambda: None)

    def record(self, op: str, ns: int) -> None:
        self.ops[op].record(ns)

    def error(self, op: str, code: int) -> None:
        self.ops[op].errors += 1
        self.counters[f"errno.{code}"] += 1

    def add(self, counter: str, n: int = 1) -> None:
        self.counters[counter] += n

    def snapshot(self, usage: dict | None = None) -> dict:
        """Everything `.hintfs/stats` shows; `usage`: what each user holds of what users may
        create (`fusefs.mount.usage_by_uid`)."""
        ops = {}
        for name, s in sorted(self.ops.items()):
            ops[name] = {
                "count": s.count,
                "errors": s.errors,
                "mean_us": round(s.total_ns / s.count / 1000.0, 1) if s.count else 0.0,
                "p50_us": round(s.percentile_us(0.50), 1),
                "p90_us": round(s.percentile_us(0.90), 1),
                "p99_us": round(s.percentile_us(0.99), 1),
                "max_us": round(s.max_ns / 1000.0, 1),
            }
        c = self.counters
        return {
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 3),
            "ops": ops,
            "bytes": {"read": c.get("bytes_read", 0), "written": c.get("bytes_written", 0),
                      "uploaded": c.get("bytes_uploaded", 0)},
            "cache": {
                "read_hits_inline": c.get("read_nowait_hit", 0),
                "read_misses_thread": c.get("read_thread", 0),
                "opens_keep_cache": c.get("open_keep_cache", 0),
                "opens_invalidated": c.get("open_invalidate", 0),
            },
            "passthrough": {"state": self.passthrough,
                            **{k[len("passthrough_"):]: v for k, v in sorted(c.items())
                               if k.startswith("passthrough_")}},
            "requests_read_queued": self.queued_reads(),
            "usage": usage or {},
            "errors": {k.split(".", 1)[1]: v for k, v in sorted(c.items()) if k.startswith("errno.")},
            "counters": {k: v for k, v in sorted(c.items()) if not k.startswith("errno.")},
        }

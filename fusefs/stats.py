"""Per-operation counters and latency histograms, shared by `.hintfs/stats`, `hintfs status`
and the Prometheus endpoint (which reads the same numbers through a collector); and the log line
of each errno counted (`ErrnoLog`: one per errno and operation a minute, at most).

Recording is on the hot path of every FUSE request, so it is a dict lookup and two additions:
latencies go into fixed log-spaced buckets (4 per octave, from 1 µs), enough for percentiles
within ~19% without keeping samples.
"""
from __future__ import annotations

import errno as errno_mod
import logging
import math
import os
import stat as stat_mod
import sys
import time
from collections import defaultdict
from collections.abc import Callable

from hintfs.common.refusals import RefusalLog

# Failures a healthy mount answers all day (a shell's or a loader's lookups of absent names,
# mkdir -p, rmdir of a non-empty folder): logged at INFO; every other errno at WARNING.
ROUTINE_ERRNOS = frozenset({errno_mod.ENOENT, errno_mod.EEXIST, errno_mod.ENOTEMPTY})
ERRNO_LOG_WINDOW_S = 60.0

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


class ErrnoLog:
    """The log line of the errnos the mount answers (each is counted in `hintfs status`): the first
    failure of an (errno, operation) pair is logged at once, the next ones of the same pair within
    `window_s` only counted, and the first one after the window logged with how many were not.
    `with_paths`: the line names an example path and the error's own text (which may name one);
    only where the log is the mount owner's alone (`log_is_private`): never in the stats, the
    metrics or `hintfs status`, which other users can read. `clock`: monotonic seconds (a test
    injects its own)."""

    def __init__(self, logger: logging.Logger | None = None, window_s: float = ERRNO_LOG_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic, with_paths: bool = True) -> None:
        self.log = logger or logging.getLogger("hintfs.ops")
        self.window_s = window_s
        self.with_paths = with_paths
        self._lines = RefusalLog(window_s, clock)   # per (errno, operation): a line, or counted

    def note(self, op: str, code: int, where: Callable[[], str | None] | None = None,
             detail: str | None = None) -> bool:
        """One failure of `op` with `code`; True if it was logged. `where`: the example path, asked
        only for a line that is written; `detail`: the error's text."""
        held = self._lines.note((code, op))
        if held is None:
            return False
        name = errno_mod.errorcode.get(code, str(code))
        line = f"{op}: {name} ({os.strerror(code)})"
        if self.with_paths:
            path = where() if where is not None else None
            if path is not None:
                line += f" on {path!r}"
            if detail:
                line += f": {detail}"
        if held:
            line += f"; {held} more not logged in the {self.window_s:.0f} s before"
        line += f" (one line per errno and operation per {self.window_s:.0f} s; all counted in hintfs status)"
        self.log.log(logging.INFO if code in ROUTINE_ERRNOS else logging.WARNING, "%s", line)
        return True


def log_is_private() -> bool:
    """Whether this process's log can be read only by its own user (and root): the file of the
    root logger's handler, or stderr (a terminal, or the journal under systemd, are the owner's
    or the administrator's); False for a regular file another user could read, or that another
    user owns."""
    fd = None
    for handler in logging.getLogger().handlers:
        stream = getattr(handler, "stream", None)
        if stream is not None and hasattr(stream, "fileno"):
            try:
                fd = stream.fileno()
            except (OSError, ValueError):
                continue
            break
    if fd is None:
        fd = sys.stderr.fileno() if sys.stderr is not None else 2
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    if not stat_mod.S_ISREG(st.st_mode):
        return True
    return st.st_uid == os.geteuid() and not st.st_mode & 0o077


class Stats:
    def __init__(self, queued_reads: Callable[[], int | None] | None = None,
                 errno_log: ErrnoLog | None = None, spun_reads: Callable[[], int | None] | None = None) -> None:
        self.started = time.time()
        self.ops: dict[str, OpStats] = defaultdict(OpStats)
        self.counters: dict[str, int] = defaultdict(int)
        self.passthrough = "off"   # FUSE passthrough: "on", or why not (set by the filesystem)
        # Requests the FUSE loop read while queued, without a wait (patched pyfuse3: fusefs.fuse)
        self.queued_reads: Callable[[], int | None] = queued_reads or (lambda: None)
        # ... and those it read while spinning after the one before (`[mount] request_spin_us`)
        self.spun_reads: Callable[[], int | None] = spun_reads or (lambda: None)
        self.errno_log = errno_log or ErrnoLog()
        # Where this mount's metrics are served (`fusefs.metrics`): shown in the stats, never a series.
        self.metrics: dict = {}
        # The fast path's table (`fusefs.fastpath.FastPath.snapshot`, set by the filesystem).
        self.fast_path: Callable[[], dict] = dict
        self.fast_lookups: Callable[[], dict] = dict
        self.kept_listings: Callable[[], dict] = dict   # (`fusefs.listings.Listings.snapshot`)

    def record(self, op: str, ns: int) -> None:
        self.ops[op].record(ns)

    def error(self, op: str, code: int, where: Callable[[], str | None] | None = None,
              detail: str | None = None) -> None:
        """A failed request: counted, and logged through `errno_log` (rate-limited)."""
        self.ops[op].errors += 1
        self.counters[f"errno.{code}"] += 1
        self.errno_log.note(op, code, where, detail)

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
            "fast_path": self.fast_path(),
            "fast_lookups": self.fast_lookups(),
            "kept_listings": self.kept_listings(),
            "requests_read_queued": self.queued_reads(),
            "requests_read_spinning": self.spun_reads(),
            "usage": usage or {},
            **({"metrics": dict(self.metrics)} if self.metrics else {}),
            "errors": {k.split(".", 1)[1]: v for k, v in sorted(c.items()) if k.startswith("errno.")},
            "counters": {k: v for k, v in sorted(c.items()) if not k.startswith("errno.")},
        }

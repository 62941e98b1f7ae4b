"""A mount's live stats (`.hintfs/stats`): reading them and the text `hintfs status` and
`hintfs demo` print."""
from __future__ import annotations

import errno
import json
import os


class StatsUnavailable(Exception):
    """The path is not a hintfs mount, or its stats cannot be read (one line)."""


def read_stats(mountpoint: str) -> dict:
    path = os.path.join(mountpoint, ".hintfs", "stats")
    try:
        with open(path) as f:
            stats: dict = json.load(f)
            return stats
    except FileNotFoundError:
        raise StatsUnavailable(f"{mountpoint} is not a hintfs mount") from None
    except OSError as err:
        raise StatsUnavailable(f"cannot read {path}: {err.strerror}") from None


def format_status(snap: dict) -> str:
    lines = [f"hintfs pid {snap['pid']}, up {snap['uptime_s']:.0f}s",
             f"bytes read {snap['bytes']['read']:,}  written {snap['bytes']['written']:,}  "
             f"uploaded {snap['bytes']['uploaded']:,}",
             "cache: " + ", ".join(f"{k} {v:,}" for k, v in snap["cache"].items())]
    # The kernel serves passthrough files' bytes (not in the byte counts above); what the fast path
    # and fast lookups answer inside pyfuse3 is not in the op table below.
    for key, label in (("passthrough", "passthrough"), ("fast_path", "fast path"), ("fast_lookups", "fast lookups")):
        part = snap.get(key)
        if part:
            counts = {k: v for k, v in part.items() if k != "state"}
            lines.append(f"{label}: {part['state']}" + "".join(f", {k} {v:,}" for k, v in counts.items()))
    if snap.get("requests_read_queued") is not None:   # the patched pyfuse3's loop reads these without a wait
        lines.append(f"requests read while queued: {snap['requests_read_queued']:,}"
                     + (f", while spinning: {snap['requests_read_spinning']:,}"
                        if snap.get("requests_read_spinning") is not None else ""))
    metrics = snap.get("metrics")
    if metrics:   # the host's endpoint (fusefs.exporter): this mount's, another mount's, or none
        if metrics.get("url"):
            who = ("served by this mount" if metrics.get("this_mount_serves")
                   else f"served by the mount of pid {metrics.get('served_by_pid')}")
            lines.append(f"metrics: {metrics['url']} ({who}; this mount's series have "
                         f"mount={json.dumps(metrics.get('mount'))})")
        else:
            lines.append(f"metrics: not served: {metrics.get('problem')}")
    if snap.get("errors"):
        lines.append("errors by errno: " + ", ".join(
            f"{errno.errorcode.get(int(k), k)} {v:,}" for k, v in snap["errors"].items()))
        lines.append("  (each is logged: one line per errno and operation a minute, in the mount's log)")
        if str(errno.ENOENT) in snap["errors"]:
            lines.append("  (ENOENT counts lookups of names that do not exist: normal for cp, shells, loaders)")
    lines.append(f"{'op':<12}{'count':>10}{'errors':>8}{'p50 µs':>10}{'p99 µs':>10}{'max µs':>12}")
    for name, o in snap["ops"].items():
        lines.append(f"{name:<12}{o['count']:>10,}{o['errors']:>8}{o['p50_us']:>10.1f}{o['p99_us']:>10.1f}"
                     f"{o['max_us']:>12.1f}")
    return "\n".join(lines)

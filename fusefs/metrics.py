"""Prometheus metrics (opt-in): a collector that reads the same `Stats` the mount keeps, served by
the host's exporter (`fusefs.exporter`: one endpoint per host and port for every mount, each
series labelled `mount`).

Only counts and states are series: no configuration value (a port, a size limit) is exported as
a counter; where the endpoint is goes in `.hintfs/stats` (`metrics`) and `hintfs status`."""
from __future__ import annotations

import errno
import logging
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fusefs.exporter import HostExporter, MetricsDirError, default_dir
from fusefs.stats import Stats
from mountconfig.schema import MetricsConfig

log = logging.getLogger("hintfs.metrics")

# Counters of `Stats.counters` that are levels, not counts: exported as gauges of their own.
GAUGES = {"hostcache_bytes": "Bytes of whole files the host cache holds",
          "hostcache_files": "Files the host cache holds"}


class StatsCollector:
    def __init__(self, stats: Stats, usage: Callable[[], dict] = dict):
        self.stats = stats
        self.usage = usage    # what each user holds (fusefs.mount.usage_by_uid)

    def collect(self):
        ops = CounterMetricFamily("hintfs_fuse_ops", "FUSE requests handled", labels=["op"])
        errs = CounterMetricFamily("hintfs_fuse_errors", "FUSE requests that failed", labels=["op"])
        lat = GaugeMetricFamily("hintfs_fuse_latency_seconds", "FUSE request latency quantiles",
                                labels=["op", "quantile"])
        for name, s in list(self.stats.ops.items()):
            ops.add_metric([name], s.count)
            errs.add_metric([name], s.errors)
            for q in (0.5, 0.9, 0.99):
                lat.add_metric([name, str(q)], s.percentile_us(q) / 1e6)
        yield ops
        yield errs
        yield lat
        c = CounterMetricFamily("hintfs_events", "Mount event counters", labels=["event"])
        by_errno = CounterMetricFamily("hintfs_errors", "FUSE requests answered with each errno", labels=["errno"])
        levels = {}
        for name, v in list(self.stats.counters.items()):
            if name in GAUGES:
                levels[name] = v
            elif name.startswith("errno."):
                code = name.split(".", 1)[1]
                by_errno.add_metric([_errno_name(code)], v)
            else:
                c.add_metric([name], v)
        yield c
        yield by_errno
        for name, doc in GAUGES.items():
            if name in levels:
                g = GaugeMetricFamily(f"hintfs_{name}", doc)
                g.add_metric([], levels[name])
                yield g
        fast = self.stats.fast_path()
        if fast.get("state") == "on":   # requests answered inside pyfuse3: never in hintfs_fuse_ops
            answers = CounterMetricFamily("hintfs_fast_path_answers", "Requests the fast path answered "
                                          "inside pyfuse3 (docs/fastpath.md)", labels=["request"])
            for request, key in (("open", "opens"), ("release", "releases"), ("getattr", "getattrs")):
                answers.add_metric([request], fast[key])
            yield answers
            marked = GaugeMetricFamily("hintfs_fast_path_inodes", "Files marked for the fast path")
            marked.add_metric([], fast["inodes"])
            yield marked
        names = self.stats.fast_lookups()
        if names.get("state") == "on":   # lookups answered inside pyfuse3: never in hintfs_fuse_ops
            served = CounterMetricFamily("hintfs_fast_lookups", "Lookups answered inside pyfuse3 from "
                                         "kept listings (docs/fastpath.md)")
            served.add_metric([], names["lookups"])
            yield served
        jobs = GaugeMetricFamily("hintfs_job_files", "Control job files each user holds", labels=["uid", "folder"])
        usage = self.usage()
        for uid, per_folder in usage.get("job_files_by_uid", {}).items():
            for folder, n in per_folder.items():
                jobs.add_metric([str(uid), folder], n)
        yield jobs
        reps = GaugeMetricFamily("hintfs_hint_replicas", "Ready replicas the hints of each user made", labels=["uid"])
        for uid, n in usage.get("replicas_by_uid", {}).items():
            reps.add_metric([str(uid)], n)
        yield reps


def _errno_name(code: str) -> str:
    try:
        return errno.errorcode.get(int(code), code)
    except ValueError:
        return code


def start_metrics(stats: Stats, usage: Callable[[], dict], cfg: MetricsConfig, mountpoint: str) -> HostExporter | None:
    """This mount's series in the host's exporter (serving the port if no other mount of this
    user does); None, after one line, if the metrics folder cannot be used: the mount runs on
    without metrics."""
    try:
        exporter = HostExporter(cfg.dir or default_dir(), cfg.bind, cfg.port, mountpoint,
                                StatsCollector(stats, usage).collect, state=stats.metrics)
    except MetricsDirError as err:
        log.warning("metrics: %s; this mount runs on without them", err)
        stats.metrics.update({"url": None, "problem": str(err)})
        return None
    exporter.start()
    return exporter


__all__ = ["start_metrics", "StatsCollector", "GAUGES"]

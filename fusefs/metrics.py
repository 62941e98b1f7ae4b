"""Prometheus endpoint (opt-in): a collector that reads the same `Stats` the mount keeps."""
from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, REGISTRY

from fusefs.stats import Stats

log = logging.getLogger("hintfs.metrics")


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
        for name, v in list(self.stats.counters.items()):
            c.add_metric([name], v)
        yield c
        jobs = GaugeMetricFamily("hintfs_job_files", "Control job files each user holds", labels=["uid", "folder"])
        usage = self.usage()
        for uid, per_folder in usage.get("job_files_by_uid", {}).items():
            for folder, n in per_folder.items():
                jobs.add_metric([uid, folder], n)
        yield jobs
        reps = GaugeMetricFamily("hintfs_hint_replicas", "Ready replicas the hints of each user made", labels=["uid"])
        for uid, n in usage.get("replicas_by_uid", {}).items():
            reps.add_metric([uid], n)
        yield reps


def start_metrics(stats: Stats, usage: Callable[[], dict], bind: str, port: int) -> int:
    """Serve /metrics on bind:port in a background thread; return the bound port."""
    REGISTRY.register(StatsCollector(stats, usage))
    server, _thread = start_http_server(port, addr=bind)
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", bind, bound)
    return bound


__all__ = ["start_metrics", "StatsCollector"]

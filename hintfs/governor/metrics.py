"""Prometheus gauges of the ledgers, collected on scrape (no background task)."""

from __future__ import annotations

from prometheus_client import start_http_server
from prometheus_client.core import REGISTRY, GaugeMetricFamily


class _LedgerCollector:
    def __init__(self, daemon) -> None:
        self.daemon = daemon

    def collect(self):
        g = GaugeMetricFamily("hintfs_governor_bytes", "GPU bytes by kind", labels=["gpu", "kind"])
        f = GaugeMetricFamily("hintfs_governor_free_bytes", "free GPU bytes in the ledger",
                              labels=["gpu"])
        for idx, st in self.daemon.gpus.items():
            for kind, v in st.ledger.by_kind().items():
                g.add_metric([str(idx), kind], v)
            f.add_metric([str(idx)], st.ledger.free_bytes())
        yield g
        yield f


def start_metrics(port: int, daemon) -> None:
    REGISTRY.register(_LedgerCollector(daemon))
    start_http_server(port, addr="127.0.0.1")

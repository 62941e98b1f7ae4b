"""Prometheus gauges of the ledgers, collected on scrape (no background task). One governor per
host: its own endpoint on `metrics_port` (127.0.0.1). A port another program holds is one WARNING
line and the governor runs on without metrics (docs/operations.md, Metrics)."""

from __future__ import annotations

import errno
import logging

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("hintfs.governor")


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


def start_metrics(port: int, daemon, bind: str = "127.0.0.1") -> int | None:
    """Serve the ledgers' gauges on bind:port; the bound port, or None after one line if the port
    cannot be had (the governor runs on without metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_LedgerCollector(daemon))
    try:
        server, _thread = start_http_server(port, addr=bind, registry=registry)
    except OSError as err:
        why = ("is in use by another program" if err.errno == errno.EADDRINUSE
               else f"cannot be listened on ({err.strerror})")
        log.warning("metrics: %s:%d %s: set metrics_port to a free port, or leave it unset; the governor "
                    "runs on without metrics", bind, port, why)
        return None
    bound: int = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", bind, bound)
    return bound

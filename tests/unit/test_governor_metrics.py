"""The governor's metrics endpoint: its ledgers' gauges, and a port another program holds is one
WARNING line with what to set, not a traceback (the governor runs on without metrics)."""
import logging
import socket
import urllib.request
from types import SimpleNamespace

from hintfs.governor.metrics import start_metrics


class _Ledger:
    def by_kind(self):
        return {"weights": 100}

    def free_bytes(self):
        return 900


def test_busy_port_is_one_line_and_a_free_one_serves_the_ledgers(caplog):
    daemon = SimpleNamespace(gpus={0: SimpleNamespace(ledger=_Ledger())})
    caplog.set_level(logging.INFO, logger="hintfs.governor")
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        assert start_metrics(other.getsockname()[1], daemon) is None
    lines = [r for r in caplog.records if "metrics" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and lines[0].exc_info is None
    assert "in use by another program: set metrics_port" in lines[0].getMessage()
    port = start_metrics(0, daemon)
    assert port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'hintfs_governor_bytes{gpu="0",kind="weights"} 100.0' in body
    assert 'hintfs_governor_free_bytes{gpu="0"} 900.0' in body

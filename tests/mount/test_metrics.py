"""The Prometheus endpoint is opt-in and reports the mount's own counters."""
import json
import urllib.request

from tests.conftest import DAEMON_DATA_PATH, needs_fuse

pytestmark = needs_fuse


def test_metrics_endpoint_opt_in(mount_factory):
    off = mount_factory(name="off")
    assert "metrics_port" not in off.stats()["counters"]
    on = mount_factory(name="on", extra=DAEMON_DATA_PATH + '\n[metrics]\nenabled = true\nport = 0\n')
    (on.mnt / "f").write_bytes(b"x" * 100)
    (on.mnt / "f").read_bytes()
    port = on.stats()["counters"]["metrics_port"]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'hintfs_fuse_ops_total{op="write"}' in body
    assert 'hintfs_fuse_latency_seconds{op="lookup",quantile="0.99"}' in body
    assert 'hintfs_events_total{event="bytes_written"} 100.0' in body
    assert json.loads((on.mnt / ".hintfs" / "config").read_text())["metrics"]["enabled"] is True

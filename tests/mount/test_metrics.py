"""Metrics are opt-in and served by one endpoint per host and port for every mount (the first mount
serves, the others hand it snapshots; another takes over when it goes), each series labelled
`mount`; a port another program holds is one log line and the mount runs on; no configuration
value is a series; every errno answered is logged, rate-limited, with an example path
(docs/operations.md, Metrics)."""
import errno
import json
import os
import re
import signal
import socket
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from fusefs.exporter import SNAPSHOT_S
from mountconfig.schema import MountConfig
from tests.conftest import DAEMON_DATA_PATH, needs_fuse, wait_for
from tests.helpers.ports import free_port

pytestmark = needs_fuse


def metrics_cfg(port: int, folder) -> str:
    return DAEMON_DATA_PATH + f'\n[metrics]\nenabled = true\nport = {port}\ndir = "{folder}"\n'


def scrape(url: str) -> dict:
    """{(sample name, frozenset(labels)): value} of one scrape."""
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def config_key_names(model=MountConfig) -> set[str]:
    """Every key name of the mount config, at any depth."""
    names = set()
    for name, field in model.model_fields.items():
        names.add(name)
        ann = field.annotation
        for t in (ann, *getattr(ann, "__args__", ())):
            if isinstance(t, type) and hasattr(t, "model_fields"):
                names |= config_key_names(t)
    return names


def test_metrics_endpoint_opt_in(mount_factory, tmp_path):
    off = mount_factory(name="off")
    assert "metrics" not in off.stats()
    on = mount_factory(name="on", extra=metrics_cfg(0, tmp_path / "metrics"))
    (on.mnt / "f").write_bytes(b"x" * 100)
    (on.mnt / "f").read_bytes()
    m = on.stats()["metrics"]
    assert m["this_mount_serves"] is True and m["served_by_pid"] == on.pid
    body = urllib.request.urlopen(m["url"], timeout=10).read().decode()
    label = f'mount="{on.mnt}"'
    assert f'hintfs_fuse_ops_total{{{label},op="write"}}' in body or f'hintfs_fuse_ops_total{{op="write",{label}}}' in body
    s = scrape(m["url"])
    assert value(s, "hintfs_events_total", event="bytes_written", mount=str(on.mnt)) == 100.0
    assert value(s, "hintfs_fuse_latency_seconds", op="lookup", quantile="0.99", mount=str(on.mnt)) is not None
    assert json.loads((on.mnt / ".hintfs" / "config").read_text())["metrics"]["enabled"] is True
    # No configuration value is a series: the port is in the stats, not a counter.
    assert "metrics_port" not in body and "metrics_port" not in on.stats()["counters"]
    keys = config_key_names()
    events = {dict(labels)["event"] for (name, labels) in s if name == "hintfs_events_total"}
    assert events and not events & keys, events & keys
    for (name, labels) in s:
        assert not re.search(r"_(port|bytes_limit|budget)\b", name), name


def test_two_mounts_share_one_endpoint_with_mount_labels_and_survive_the_serving_one(mount_factory, tmp_path):
    folder, port = tmp_path / "metrics", free_port()
    a = mount_factory(name="a", extra=metrics_cfg(port, folder))
    b = mount_factory(name="b", extra=metrics_cfg(port, folder))   # used to die: port busy
    (a.mnt / "fa").write_bytes(b"a" * 10)
    (b.mnt / "fb").write_bytes(b"b" * 20)
    url = f"http://127.0.0.1:{port}/metrics"
    assert a.stats()["metrics"]["this_mount_serves"] is True
    assert b.stats()["metrics"] == {"mount": str(b.mnt), "url": url, "served_by_pid": a.pid, "this_mount_serves": False}

    def both_counted():
        s = scrape(url)
        return (value(s, "hintfs_events_total", event="bytes_written", mount=str(a.mnt)) == 10.0
                and value(s, "hintfs_events_total", event="bytes_written", mount=str(b.mnt)) == 20.0)
    wait_for(both_counted, timeout=15)
    s = scrape(url)
    assert {dict(labels).get("mount") for (_n, labels) in s} == {str(a.mnt), str(b.mnt)}
    assert "already in use" not in b.log.read_text() and "in use by another program" not in b.log.read_text()
    # The serving mount dies (SIGKILL: nothing of it runs to hand over): the kernel drops its lock,
    # the other takes the port over within a tick, serves itself, and removes the dead one's file.
    os.kill(a.pid, signal.SIGKILL)
    wait_for(lambda: b.stats()["metrics"].get("this_mount_serves") is True, timeout=15)
    s = scrape(url)
    assert value(s, "hintfs_events_total", event="bytes_written", mount=str(b.mnt)) == 20.0
    assert not any(dict(labels).get("mount") == str(a.mnt) for (_n, labels) in s)
    assert len([n for n in os.listdir(folder / str(port)) if n.endswith(".json")]) == 1   # a's snapshot removed


def test_a_port_another_program_holds_is_one_line_and_the_mount_runs_on(mount_factory, tmp_path):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        m = mount_factory(extra=metrics_cfg(port, tmp_path / "metrics"))
        (m.mnt / "f").write_bytes(b"still works")
        assert (m.store / "f").read_bytes() == b"still works"
        st = m.stats()["metrics"]
        assert st["url"] is None and "in use by another program" in st["problem"]
        assert "set [metrics] port" in st["problem"]
        time.sleep(SNAPSHOT_S + 0.5)   # another tick tried the port: still one line
        lines = [ln for ln in m.log.read_text().splitlines() if "in use by another program" in ln]
        assert len(lines) == 1, lines
        assert "Traceback" not in m.log.read_text()
    # The program went away: the mount takes the port at a later tick.
    wait_for(lambda: m.stats()["metrics"].get("this_mount_serves") is True, timeout=15)
    assert value(scrape(f"http://127.0.0.1:{port}/metrics"), "hintfs_events_total", event="bytes_written",
                 mount=str(m.mnt)) == 11.0


def test_each_errno_is_logged_once_per_window_with_an_example_path(mount_factory, tmp_path):
    """A log only the mount's user can read gets the path; a log other users can read does not."""
    # `hintfs mount` creates its log 0600; an admin's older log file (or one made 0644 on purpose)
    # is kept as it is, and then the paths stay out of it
    (tmp_path / "open").mkdir()
    os.close(os.open(tmp_path / "open" / "mount.log", os.O_CREAT | os.O_WRONLY, 0o644))
    os.chmod(tmp_path / "open" / "mount.log", 0o644)
    for m, private in ((mount_factory(name="m"), True), (mount_factory(name="open"), False)):
        assert oct(os.stat(m.log).st_mode & 0o777) == ("0o600" if private else "0o644")
        (m.mnt / "d").mkdir()
        (m.mnt / "d" / "x").write_bytes(b"x")
        for _ in range(3):
            try:
                os.rmdir(m.mnt / "d")
            except OSError:
                pass
        assert m.stats()["errors"].get(str(errno.ENOTEMPTY)) == 3    # counted each time
        text = m.log.read_text()
        lines = [ln for ln in text.splitlines() if "rmdir: ENOTEMPTY" in ln]
        assert len(lines) == 1, lines
        assert " INFO " in lines[0]
        assert ("'d'" in lines[0]) is private, lines[0]
        assert ("readable by other users" in text) is not private
        assert "'d'" not in json.dumps(m.stats()) and "d/x" not in json.dumps(m.stats())

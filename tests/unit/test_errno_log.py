"""The errno log line (`fusefs.stats.ErrnoLog`): once per (errno, operation) per window, with an
injected clock; the example path only where the log is private; and the host exporter's reading
of other mounts' snapshots (`fusefs.exporter.HostCollector`)."""
import errno
import json
import logging
import os

from prometheus_client.core import CounterMetricFamily

from fusefs.exporter import SNAPSHOT_VERSION, STALE_S, HostCollector, families_to_json, snapshot_name
from fusefs.stats import ErrnoLog, Stats


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_one_line_per_errno_and_operation_per_window(caplog):
    clock = Clock()
    elog = ErrnoLog(logging.getLogger("hintfs.test.errno"), window_s=60, clock=clock)
    stats = Stats(errno_log=elog)
    caplog.set_level(logging.DEBUG, logger="hintfs.test.errno")
    for _ in range(5):
        stats.error("read", errno.EBADF, lambda: "data/t.parquet", "not open for reading")
    stats.error("write", errno.EBADF, lambda: "w.bin")          # another operation: its own line
    stats.error("lookup", errno.ENOENT, lambda: "nope")         # routine: INFO
    lines = [r for r in caplog.records if r.name == "hintfs.test.errno"]
    assert [r.getMessage().split(" (")[0] for r in lines] == [
        "read: EBADF", "write: EBADF", "lookup: ENOENT"]
    assert "'data/t.parquet': not open for reading" in lines[0].getMessage()
    assert [r.levelno for r in lines] == [logging.WARNING, logging.WARNING, logging.INFO]
    assert stats.snapshot()["errors"] == {str(errno.ENOENT): 1, str(errno.EBADF): 6}   # all counted
    clock.t += 59.9
    stats.error("read", errno.EBADF, lambda: "data/t.parquet")
    assert len([r for r in caplog.records if r.name == "hintfs.test.errno"]) == 3    # still in the window
    clock.t += 0.2
    stats.error("read", errno.EBADF, lambda: "other.parquet")
    last = [r for r in caplog.records if r.name == "hintfs.test.errno"][-1].getMessage()
    assert last.startswith("read: EBADF") and "'other.parquet'" in last
    assert "5 more not logged" in last          # 4 of the first burst + 1 later in the window


def test_no_path_and_no_error_text_where_other_users_can_read_the_log(caplog):
    asked = []
    elog = ErrnoLog(logging.getLogger("hintfs.test.errno2"), with_paths=False, clock=Clock())
    caplog.set_level(logging.DEBUG, logger="hintfs.test.errno2")
    elog.note("open", errno.EACCES, lambda: asked.append(1) or "secret/path", "secret/path: denied")
    (rec,) = [r for r in caplog.records if r.name == "hintfs.test.errno2"]
    assert "secret" not in rec.getMessage() and rec.getMessage().startswith("open: EACCES")
    assert asked == []          # the path is not even looked up


def _write(folder, mount, pid, written, value=1, version=SNAPSHOT_VERSION):
    fam = CounterMetricFamily("hintfs_events", "Mount event counters", labels=["event"])
    fam.add_metric(["bytes_written"], value)
    doc = {"version": version, "mount": mount, "pid": pid, "written": written, "families": families_to_json([fam])}
    (folder / snapshot_name(mount)).write_text(json.dumps(doc))


def test_the_exporter_serves_live_mounts_and_drops_dead_stale_and_foreign_snapshots(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hintfs.metrics")
    now = 5000.0
    own = CounterMetricFamily("hintfs_events", "Mount event counters", labels=["event"])
    own.add_metric(["bytes_written"], 7)
    _write(tmp_path, "/mnt/b", os.getpid(), now - 1, value=20)           # live
    _write(tmp_path, "/mnt/stale", os.getpid(), now - STALE_S - 1)       # hung: age only
    _write(tmp_path, "/mnt/dead", 2 ** 22 + 12345, now - 1)              # no such pid: removed
    _write(tmp_path, "/mnt/newer", os.getpid(), now - 1, version=SNAPSHOT_VERSION + 1)   # said once, left out
    (tmp_path / "bad.json").write_text('{"version": 1, "mount": "/x", "pid": 1, "written": 1, "families": [["evil name"]]}')
    (tmp_path / "x.json").write_text("not json")
    c = HostCollector(str(tmp_path), "/mnt/a", lambda: [own], snapshot_name("/mnt/a"), clock=lambda: now)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in c.collect() for s in fam.samples}
    assert samples[("hintfs_events_total", (("event", "bytes_written"), ("mount", "/mnt/a")))] == 7
    assert samples[("hintfs_events_total", (("event", "bytes_written"), ("mount", "/mnt/b")))] == 20
    assert not any(dict(k[1]).get("mount") in ("/mnt/stale", "/mnt/dead", "/x", "/mnt/newer")
                   for k in samples if k[0] == "hintfs_events_total")
    assert samples[("hintfs_mount_snapshot_age_seconds", (("mount", "/mnt/stale"),))] > STALE_S
    assert not (tmp_path / snapshot_name("/mnt/dead")).exists()
    list(c.collect())
    said = [r.getMessage() for r in caplog.records if "snapshot version" in r.getMessage()]
    assert len(said) == 1 and f"version {SNAPSHOT_VERSION + 1}" in said[0]


def test_a_metrics_folder_another_user_could_write_is_refused_in_one_line(tmp_path, caplog):
    """Whatever is in the folder is served: a symlink, or another user's folder, is refused (one
    line) and the mount runs on without metrics; one of ours open to others is made 0700."""
    from fusefs.metrics import start_metrics
    from mountconfig.schema import MetricsConfig
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    caplog.set_level(logging.INFO, logger="hintfs")
    stats = Stats()
    assert start_metrics(stats, dict, MetricsConfig(enabled=True, port=0, dir=str(tmp_path / "link")), "/mnt/x") is None
    assert stats.metrics["url"] is None and "link cannot be used" in stats.metrics["problem"]
    if os.geteuid() == 0:
        (tmp_path / "theirs").mkdir()
        os.chown(tmp_path / "theirs", 65534, 65534)
        stats = Stats()
        assert start_metrics(stats, dict, MetricsConfig(enabled=True, port=0, dir=str(tmp_path / "theirs")),
                             "/mnt/x") is None
        assert "owned by uid 65534" in stats.metrics["problem"]
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    stats = Stats()
    exporter = start_metrics(stats, dict, MetricsConfig(enabled=True, port=0, dir=str(tmp_path / "open")), "/mnt/x")
    try:
        assert exporter is not None and stats.metrics["this_mount_serves"] is True
        assert os.stat(tmp_path / "open").st_mode & 0o777 == 0o700
    finally:
        exporter.stop()
    assert not [n for n in os.listdir(tmp_path / "open" / "0") if n.endswith(".json")]   # removed at stop

"""The host's metrics exporter: one HTTP endpoint per host and port serves every mount's series,
each with a `mount` label (its mountpoint). docs/operations.md ("Metrics") is the design.

A folder of the host (`[metrics] dir`; `/run/hintfs/metrics` as root, else
`<tmp>/hintfs-metrics-<uid>`; the mount user's, 0700: `hintfs.common.owndir`) holds one folder per port, `<dir>/<port>/`:

- `<id>.json`, one per mount with metrics on: its series, mountpoint, pid and the time written
  (and the format's `SNAPSHOT_VERSION`),
  rewritten every `SNAPSHOT_S` by a thread of the mount (never its trio loop), removed at unmount;
- `serve.lock`: flock'd by the mount that serves the port, with its pid and URL inside.

Every mount with metrics on runs the same `HostExporter`: each tick it writes its snapshot and, if
nobody holds the lock, takes it and binds the port. So the first mount serves, the others only
write snapshots, and when the serving mount exits (unmounted, or killed: the kernel drops its
flock) another takes the port over at its next tick. The serving mount answers a scrape with its
own series read live and every other live mount's snapshot (a dead pid's file is removed; one
older than `STALE_S` is left out and shows as `hintfs_mount_snapshot_age_seconds`).

A port that is busy although nobody holds the lock is another program's (or a hintfs mount of
another user or folder): one WARNING line says what to set, and the mount runs on without an
endpoint, trying the port again each tick (taking it if it frees).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import stat as stat_mod
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

from hintfs.common.errors import HintfsError
from hintfs.common.owndir import make_own_dir
from hintfs.common.procs import pid_alive

log = logging.getLogger("hintfs.metrics")

SNAPSHOT_S = 2.0            # how often a mount rewrites its snapshot and looks for the port
STALE_S = 60.0              # a snapshot older than this is left out (a hung mount)
MAX_SNAPSHOT_BYTES = 8 << 20
LOCK = "serve.lock"
# The snapshot's format (docs/versions.md): a serving mount leaves out, with one line, the series
# of a mount that writes another version (a rolling upgrade: both are served again once upgraded).
SNAPSHOT_VERSION = 1
_NAME = re.compile(r"hintfs_[a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_TYPES = frozenset({"counter", "gauge", "untyped", "summary", "histogram", "info", "stateset"})

Collect = Callable[[], Iterable[Metric]]


class MetricsDirError(Exception):
    """The metrics folder cannot be used safely (one line)."""


def default_dir() -> str:
    if os.geteuid() == 0:
        return "/run/hintfs/metrics"
    return os.path.join(tempfile.gettempdir(), f"hintfs-metrics-{os.geteuid()}")


def private_dir(path: str) -> str:
    """`path` made if missing and checked by the rule of a daemon's own folders
    (`hintfs.common.owndir`: a folder, not a symlink, of this user, made 0700): whatever is in it
    is served, so no other user may write there. MetricsDirError (one line) otherwise."""
    try:
        fd = make_own_dir(path, f"[metrics] dir {path}", "keep this host's metrics there")
    except HintfsError as err:
        raise MetricsDirError(err.strerror) from None
    os.close(fd)
    return path


def snapshot_name(mount: str) -> str:
    return hashlib.sha256(mount.encode("utf-8", "surrogateescape")).hexdigest()[:16] + ".json"


def families_to_json(families: Iterable[Metric]) -> list:
    return [[m.name, m.documentation, m.type, [[s.name, dict(s.labels), s.value] for s in m.samples]]
            for m in families]


def _valid(doc) -> bool:
    """A snapshot as a mount writes it (the folder is this user's alone; checked all the same)."""
    if not (isinstance(doc, dict) and isinstance(doc.get("mount"), str) and isinstance(doc.get("pid"), int)
            and isinstance(doc.get("written"), (int, float)) and isinstance(doc.get("families"), list)):
        return False
    for fam in doc["families"]:
        if not (isinstance(fam, list) and len(fam) == 4 and isinstance(fam[0], str) and _NAME.match(fam[0])
                and isinstance(fam[1], str) and fam[2] in _TYPES and isinstance(fam[3], list)):
            return False
        for s in fam[3]:
            if not (isinstance(s, list) and len(s) == 3 and isinstance(s[0], str) and _NAME.match(s[0])
                    and isinstance(s[1], dict) and all(isinstance(k, str) and _LABEL.match(k) and k != "mount"
                                                       and isinstance(v, str) for k, v in s[1].items())
                    and isinstance(s[2], (int, float)) and not isinstance(s[2], bool)):
                return False
    return True


class HostCollector:
    """What the serving mount answers: its own series (live) and every other mount's snapshot in
    the port's folder, each sample with its `mount` label."""

    def __init__(self, folder: str, own_mount: str, own_collect: Collect, own_file: str,
                 clock: Callable[[], float] = time.time):
        self.folder = folder
        self.own_mount = own_mount
        self.own_collect = own_collect
        self.own_file = own_file
        self.clock = clock
        self._warned: set[str] = set()   # files of another version, said once

    def snapshots(self) -> list[dict]:
        """The other mounts' snapshots that are alive (a dead pid's file is removed)."""
        out: list[dict] = []
        try:
            names = sorted(os.listdir(self.folder))
        except OSError:
            return out
        for name in names:
            if not name.endswith(".json") or name == self.own_file:
                continue
            path = os.path.join(self.folder, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
                try:
                    st = os.fstat(fd)
                    if not stat_mod.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > MAX_SNAPSHOT_BYTES:
                        continue
                    raw = os.read(fd, MAX_SNAPSHOT_BYTES + 1)
                finally:
                    os.close(fd)
                doc = json.loads(raw)
            except (OSError, ValueError):
                continue       # (being replaced, or not one of ours)
            if isinstance(doc, dict) and doc.get("version") != SNAPSHOT_VERSION:
                if name not in self._warned:
                    self._warned.add(name)
                    log.warning("metrics: the mount of pid %s writes metrics snapshot version %s, this one reads "
                                "version %d: its series are left out until both run the same hintfs",
                                doc.get("pid"), doc.get("version"), SNAPSHOT_VERSION)
                continue
            if not _valid(doc):
                log.debug("metrics: %s is not a mount's snapshot: left out", name)
                continue
            if not pid_alive(doc["pid"]):
                with contextlib.suppress(OSError):
                    os.unlink(path)     # a mount killed before it could remove its own
                continue
            out.append(doc)
        return out

    def collect(self):
        merged: dict[str, Metric] = {}

        def add(mount: str, name: str, doc: str, typ: str, samples) -> None:
            fam = merged.get(name)
            if fam is None:
                fam = merged[name] = Metric(name, doc, typ)
            elif fam.type != typ:
                return
            for sname, labels, value in samples:
                fam.add_sample(sname, {**labels, "mount": mount}, value)

        age = GaugeMetricFamily("hintfs_mount_snapshot_age_seconds", "Age of the series of each mount this "
                                "endpoint serves (0: the serving mount's own, read live)", labels=["mount"])
        age.add_metric([self.own_mount], 0.0)
        for m in self.own_collect():
            add(self.own_mount, m.name, m.documentation, m.type,
                [(s.name, s.labels, s.value) for s in m.samples])
        now = self.clock()
        for doc in self.snapshots():
            if doc["mount"] == self.own_mount:
                continue
            a = max(0.0, now - doc["written"])
            age.add_metric([doc["mount"]], a)
            if a > STALE_S:
                continue
            for name, docstr, typ, samples in doc["families"]:
                add(doc["mount"], name, docstr, typ, samples)
        yield from merged.values()
        yield age


class HostExporter:
    """This mount's part in the host's exporter (the module's docstring): its snapshot, and the
    endpoint while it holds the port. `state`: a dict the mount shows in `.hintfs/stats`
    (`metrics`: url, who serves, the problem if none does). Nothing here runs on the trio loop."""

    def __init__(self, folder: str, bind: str, port: int, mount: str, collect: Collect,
                 state: dict | None = None, interval_s: float = SNAPSHOT_S):
        self.root = private_dir(folder)
        self.folder = private_dir(os.path.join(folder, str(port)))
        self.bind, self.port, self.mount = bind, port, mount
        self.collect = collect
        self.state = state if state is not None else {}
        self.interval_s = interval_s
        self.own_file = snapshot_name(mount)
        self._lock_fd: int | None = None
        self._server: Any = None     # the HTTP server (prometheus_client's WSGI server) while serving
        self._said_busy = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def serving(self) -> bool:
        return self._server is not None

    # -- the loop ------------------------------------------------------------------------------
    def start(self) -> None:
        """The first tick now (the endpoint is up, or its owner known, when the mount is), then a
        thread. A failure here (the folder's filesystem full) is one line: the thread tries again."""
        try:
            self.tick()
        except OSError as err:
            log.warning("metrics: cannot write to %s (%s); trying again every %.0f s", self.folder, err.strerror,
                        self.interval_s)
        self._thread = threading.Thread(target=self._run, name="hintfs-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:   # never the mount's end: the next tick tries again
                log.exception("metrics: tick failed")

    def tick(self) -> None:
        self.write_snapshot()
        if not self.serving:
            self.try_serve()

    def stop(self) -> None:
        """At unmount: stop serving (another mount takes the port at its next tick) and remove
        this mount's snapshot."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._lock_fd, 0)
            os.close(self._lock_fd)
            self._lock_fd = None
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.folder, self.own_file))

    # -- the snapshot --------------------------------------------------------------------------
    def write_snapshot(self) -> None:
        doc = {"version": SNAPSHOT_VERSION, "mount": self.mount, "pid": os.getpid(), "written": time.time(),
               "families": families_to_json(self.collect())}
        data = json.dumps(doc, separators=(",", ":")).encode()
        fd, tmp = tempfile.mkstemp(prefix=".snap-", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, os.path.join(self.folder, self.own_file))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    # -- the endpoint --------------------------------------------------------------------------
    def _url(self, port: int) -> str:
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"http://{host}:{port}/metrics"

    def try_serve(self) -> bool:
        """Take the port if no mount of this folder serves it; True if this mount serves now."""
        fd = os.open(os.path.join(self.folder, LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._served_by_other(fd)
            os.close(fd)
            return False
        registry = CollectorRegistry(auto_describe=False)
        registry.register(HostCollector(self.folder, self.mount, self.collect, self.own_file))
        try:
            server, _thread = start_http_server(self.port, addr=self.bind, registry=registry)
        except OSError as err:
            os.close(fd)      # (the lock with it)
            self._port_refused(err)
            return False
        self._server, self._lock_fd = server, fd
        port = server.server_address[1]
        url = self._url(port)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "url": url, "mount": self.mount}).encode(), 0)
        self.state.clear()
        self.state.update({"mount": self.mount, "url": url, "served_by_pid": os.getpid(), "this_mount_serves": True})
        log.info("metrics of every mount of this host on port %s: %s (this mount serves them)", self.port, url)
        self._said_busy = False
        return True

    def _served_by_other(self, fd: int) -> None:
        try:
            owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (OSError, ValueError):
            owner = {}
        url, pid = owner.get("url"), owner.get("pid")
        if (self.state.get("served_by_pid"), self.state.get("url"), self.state.get("this_mount_serves")) != (
                pid, url, False):
            self.state.clear()
            self.state.update({"mount": self.mount, "url": url, "served_by_pid": pid, "this_mount_serves": False})
            log.info("metrics of this mount served by the mount of pid %s at %s", pid, url)

    def _port_refused(self, err: OSError) -> None:
        where = f"{self.bind}:{self.port}"
        if err.errno == errno.EADDRINUSE:
            problem = (f"{where} is in use by another program (not a hintfs mount of this user and "
                       f"[metrics] dir): set [metrics] port to a free port, the same on every mount of "
                       f"this host, or enabled = false")
        else:
            problem = f"cannot listen on {where} ({err.strerror}): set [metrics] bind and port, or enabled = false"
        self.state.clear()
        self.state.update({"mount": self.mount, "url": None, "served_by_pid": None, "this_mount_serves": False, "problem": problem})
        if not self._said_busy:
            log.warning("metrics: %s; this mount runs on without them (it takes the port if it frees)", problem)
            self._said_busy = True


__all__ = ["HostExporter", "HostCollector", "MetricsDirError", "default_dir", "private_dir", "STALE_S"]

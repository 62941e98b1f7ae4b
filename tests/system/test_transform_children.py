"""A mount's transform workers, forkserver and resource tracker die with its daemon, also when
the daemon is killed with SIGKILL (issue 12, safe operations): nothing of it lives on."""
from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from hintfs.common.mounts import mount_at
from tests.conftest import needs_fuse, run_hintfs, wait_for
from tests.helpers.media import jpeg_file

pytestmark = needs_fuse
pytest.importorskip("av")

RULES = '''
[transform_load]
workers = 2
fallback = false

[[transforms]]
glob = "imgs/*.jpg"
kind = "image"
params = { size = 32 }
'''


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_workers_forkserver_and_tracker_die_with_a_killed_daemon(mount_factory, tmp_path):
    m = mount_factory(extra=f'\n[agent]\ndata_dir = "{tmp_path / "rep"}"\n{RULES}')
    (m.store / "imgs").mkdir()
    for i in range(4):
        jpeg_file(m.store / "imgs" / f"{i}.jpg", seed=i)
    for i in range(4):
        assert len((m.mnt / "imgs" / f"{i}.jpg.tensor").read_bytes()) > 0
    daemon = psutil.Process(m.pid)
    children = daemon.children(recursive=True)
    lines = [" ".join(c.cmdline()) for c in children]
    assert any("forkserver" in cmd for cmd in lines), lines
    assert any("resource_tracker" in cmd for cmd in lines), lines
    workers = [c for c in children if c.ppid() != daemon.pid]        # forked by the forkserver
    assert len(workers) >= 1, lines
    # kill it while its workers are busy: readers of samples not made yet
    for i in range(4, 40):
        jpeg_file(m.store / "imgs" / f"{i}.jpg", seed=i, w=1600, h=1200)
    stop = threading.Event()

    def read_more() -> None:
        for i in range(4, 40):
            if stop.is_set():
                return
            try:
                (m.mnt / "imgs" / f"{i}.jpg.tensor").read_bytes()
            except OSError:
                return

    readers = [threading.Thread(target=read_more, daemon=True) for _ in range(2)]
    for t in readers:
        t.start()
    time.sleep(0.5)                          # transforms in flight
    children = daemon.children(recursive=True)
    os.kill(daemon.pid, signal.SIGKILL)
    stop.set()
    try:
        assert wait_for(lambda: not _alive(children), timeout=5), \
            [(p.pid, " ".join(p.cmdline())) for p in _alive(children)]
    finally:
        for p in _alive(children):          # only what this test's mount started
            p.kill()
        r = run_hintfs("umount", m.mnt)       # the dead mount
        assert r.returncode == 0, r.stderr
    assert mount_at(str(m.mnt)) is None
    for t in readers:
        t.join(timeout=5)

"""Unmounting while files are open for writing (issue 12, safe operations): the daemon keeps
serving for `mount.unmount_timeout_s` so a writer can finish; what is still open then is
abandoned (never published), named in the log and by `hintfs umount`, which exits non-zero.

The writers are child processes, and the test process never holds a file of the mount open: a
FUSE file is flushed (here: published) on every close of any copy of its descriptor, including
the copies a fork makes and its exec closes."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from hintfs.common.mounts import mount_at
from tests.conftest import HINTFS, REPO, needs_fuse, wait_for

pytestmark = needs_fuse

TIMEOUT = '\n[mount]\nunmount_timeout_s = {t}\n'

WRITER = r"""
import os, sys, time
flag, go, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
fds = [os.open(p, os.O_WRONLY | os.O_CREAT, 0o644) for p in paths]
for fd in fds:
    os.write(fd, b"a" * 100_000)
open(flag, "w").write("written")
for _ in range(600):                    # at most 60 s; the test kills it sooner
    if os.path.exists(go):
        break
    time.sleep(0.1)
for fd in fds:
    os.write(fd, b"b" * 100_000)
    os.close(fd)
"""


def _writer(tmp_path, *paths) -> subprocess.Popen:
    w = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "flag"), str(tmp_path / "go"),
                          *map(str, paths)], stderr=subprocess.DEVNULL)
    assert wait_for(lambda: (tmp_path / "flag").exists(), timeout=20)
    return w


def _umount(m) -> subprocess.Popen:
    return subprocess.Popen(HINTFS + ["umount", str(m.mnt)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(timeout=10)


def test_umount_waits_for_a_writer_that_closes_in_time(mount_factory, tmp_path):
    m = mount_factory(extra=TIMEOUT.format(t=20))
    w = _writer(tmp_path, m.mnt / "model.bin")
    try:
        u = _umount(m)
        assert wait_for(lambda: "waiting up to 20s for 1 files" in m.log.read_text(), timeout=10)
        (tmp_path / "go").write_text("")                 # the mount still serves the writer
        assert w.wait(timeout=20) == 0
        out, err = u.communicate(timeout=30)
    finally:
        _stop(w)
    assert u.returncode == 0, err
    assert "abandoned" not in err
    assert (m.store / "model.bin").read_bytes() == b"a" * 100_000 + b"b" * 100_000
    assert mount_at(str(m.mnt)) is None


def test_umount_reports_writes_still_open_after_the_timeout(mount_factory, tmp_path):
    m = mount_factory(extra=TIMEOUT.format(t=1))
    (m.store / "sub").mkdir()
    (m.store / "old.bin").write_bytes(b"previous")
    w = _writer(tmp_path, m.mnt / "sub" / "part.bin", m.mnt / "old.bin")
    try:
        t0 = time.monotonic()
        u = _umount(m)
        out, err = u.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        _stop(w)
    assert u.returncode == 1, err
    assert 1.0 <= took < 15, took
    line = err.strip().splitlines()[-1]
    assert "2 files still open for writing were abandoned" in line, err
    assert "old.bin" in line and "sub/part.bin" in line, err
    log = m.log.read_text()
    assert "unmount abandoned: 2 files" in log and '"sub/part.bin"' in log
    # none of their bytes were published: a new file does not appear, an existing file keeps
    # its previous content
    assert not (m.store / "sub" / "part.bin").exists()
    assert (m.store / "old.bin").read_bytes() == b"previous"
    assert mount_at(str(m.mnt)) is None and os.listdir(m.mnt) == []


def test_umount_without_open_writes_does_not_wait(mount_factory):
    m = mount_factory(extra=TIMEOUT.format(t=30))
    (m.mnt / "done.bin").write_bytes(b"z")
    t0 = time.monotonic()
    out, err = _umount(m).communicate(timeout=30)
    assert time.monotonic() - t0 < 10
    assert "waiting up to" not in m.log.read_text() and "abandoned" not in err
    assert (m.store / "done.bin").read_bytes() == b"z" and mount_at(str(m.mnt)) is None

"""`hintfs mount` refuses layouts that would hang (a mountpoint in its own store, a store under its
mountpoint), also through symlinks and bind mounts, and replaces a dead hintfs mount but no
other dead mount (issue 12, safe operations)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hintfs.common.mounts import mount_at
from tests.conftest import REPO, force_unmount, needs_fuse, run_hintfs, wait_for, write_config

pytestmark = needs_fuse


def _refused(r: subprocess.CompletedProcess, *words: str) -> str:
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr
    return r.stderr.strip()


def _try_mount(cfg: Path, mnt: Path) -> subprocess.CompletedProcess:
    """`hintfs mount`, bounded: a hang fails the test instead of stalling the suite; whatever
    it mounted is detached afterwards."""
    try:
        return run_hintfs("mount", cfg, mnt, timeout=20)
    finally:
        entry = mount_at(str(mnt))
        if entry is not None and entry.is_hintfs:
            force_unmount(mnt)
            pytest.fail(f"{mnt} was mounted")


def _store(tmp_path: Path) -> tuple[Path, Path]:
    store = tmp_path / "store"
    store.mkdir()
    (store / "f").write_bytes(b"x")
    return store, write_config(tmp_path / "c.toml", f"file://{store}", log=tmp_path / "log")


def test_mountpoint_equal_to_the_store_root_is_refused(tmp_path):
    store, cfg = _store(tmp_path)
    _refused(_try_mount(cfg, store), "is the store root", "hang")


def test_mountpoint_inside_the_store_is_refused_also_through_a_symlink(tmp_path):
    store, cfg = _store(tmp_path)
    (store / "sub" / "mnt").mkdir(parents=True)
    _refused(_try_mount(cfg, store / "sub" / "mnt"), "inside the store root")
    (tmp_path / "link").symlink_to(store)
    _refused(_try_mount(cfg, tmp_path / "link" / "sub" / "mnt"), "inside the store root")
    # a store named through a symlink, the mountpoint by its real path
    cfg2 = write_config(tmp_path / "c2.toml", f"file://{tmp_path / 'link'}")
    _refused(_try_mount(cfg2, store / "sub" / "mnt"), "inside the store root")


def test_mountpoint_inside_the_store_through_a_bind_mount_is_refused(tmp_path):
    store, cfg = _store(tmp_path)
    (store / "mnt").mkdir()
    view = tmp_path / "view"
    view.mkdir()
    subprocess.run(["mount", "--bind", str(store), str(view)], check=True)
    try:
        msg = _refused(_try_mount(cfg, view / "mnt"), "inside the store root")
        assert f"through {view}" in msg               # found by device and inode, not by name
    finally:
        subprocess.run(["umount", str(view)], check=False)


def test_store_root_inside_the_mountpoint_is_refused(tmp_path):
    mnt = tmp_path / "mnt"
    store = mnt / "data" / "store"
    store.mkdir(parents=True)
    cfg = write_config(tmp_path / "c.toml", f"file://{store}")
    _refused(_try_mount(cfg, mnt), "is inside mountpoint", "hide")


def test_the_daemon_itself_refuses_too(tmp_path):
    # `python -I -m fusefs` (what hintfs mount starts, and what systemd runs through --foreground)
    store, cfg = _store(tmp_path)
    (store / "mnt").mkdir()
    try:
        r = subprocess.run([sys.executable, "-I", "-m", "fusefs", str(cfg), str(store / "mnt")], cwd=REPO,
                           capture_output=True, text=True, timeout=20)
    finally:
        if mount_at(str(store / "mnt")) is not None:
            force_unmount(store / "mnt")
            pytest.fail("mounted")
    _refused(r, "inside the store root")


def test_mount_over_a_dead_hintfs_mount_replaces_it(mount_factory):
    m = mount_factory()
    (m.store / "f").write_bytes(b"data")
    old = m.pid
    os.kill(old, signal.SIGKILL)
    assert wait_for(lambda: not os.path.exists(m.mnt / ".hintfs"), timeout=5)     # ENOTCONN now
    r = run_hintfs("mount", m.config, m.mnt, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "dead hintfs mount" in r.stderr and "detached it lazily" in r.stderr
    assert m.pid != old and (m.mnt / "f").read_bytes() == b"data"
    assert mount_at(str(m.mnt)).is_hintfs
    # and the same through the foreground path, which logs it
    os.kill(m.pid, signal.SIGKILL)
    assert wait_for(lambda: not os.path.exists(m.mnt / ".hintfs"), timeout=5)
    p = subprocess.Popen([sys.executable, "-m", "hintfs.cli", "mount", str(m.config), str(m.mnt), "--foreground"],
                         cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: _readable(m.mnt / "f"), timeout=20)
        assert "dead hintfs mount" in m.log.read_text()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_dead_mount_that_is_not_hintfs_is_left_alone(tmp_path):
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    cfg = write_config(tmp_path / "c.toml", f"file://{src}")
    bindfs = subprocess.Popen(["bindfs", "-f", str(src), str(mnt)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: mount_at(str(mnt)) is not None, timeout=10)
        bindfs.kill()
        bindfs.wait()
        assert wait_for(lambda: not os.path.exists(mnt / "x") and _enotconn(mnt), timeout=5)
        fstype = mount_at(str(mnt)).fstype
        assert fstype != "fuse.hintfs"
        _refused(run_hintfs("mount", cfg, mnt, timeout=20), "dead", "not a hintfs mount")
        _refused(run_hintfs("umount", mnt, timeout=20), "not a hintfs mount")
        assert mount_at(str(mnt)).fstype == fstype           # untouched
    finally:
        if bindfs.poll() is None:
            bindfs.kill()
            bindfs.wait()
        if mount_at(str(mnt)) is not None:      # dead: os.path.ismount cannot tell, so not force_unmount
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


def _enotconn(path: Path) -> bool:
    try:
        os.statvfs(path)          # statfs always asks the daemon (stat may be answered from cache)
        return False
    except OSError as err:
        return err.errno in (107, 103)     # ENOTCONN, ECONNABORTED


def _readable(path: Path) -> bool:
    try:
        return path.read_bytes() is not None
    except OSError:
        return False

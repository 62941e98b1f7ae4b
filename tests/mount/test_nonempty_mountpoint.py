"""A mountpoint folder that holds files is refused in one line (the mount would hide them: on a
training host, checkpoints written locally while the mount was down), unless `--nonempty` or
`[mount] nonempty = true`; a dead hintfs mount left by a killed daemon is not "non-empty"."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
from pathlib import Path

from tests.conftest import force_unmount, needs_fuse, run_hintfs, wait_for, write_config
from tests.helpers.cli import one_clean_line

pytestmark = needs_fuse


def _setup(tmp_path: Path, extra: str = ""):
    store, mnt = tmp_path / "store", tmp_path / "mnt"
    store.mkdir()
    mnt.mkdir()
    (store / "in-store.txt").write_text("store")
    (mnt / "step_100.pt").write_text("written while the mount was down")
    return store, mnt, write_config(tmp_path / "c.toml", f"file://{store}", extra, log=tmp_path / "log")


def _refused(r: subprocess.CompletedProcess, mnt: Path) -> str:
    line = one_clean_line(r)
    assert line.startswith("hintfs mount: ") and "is not empty" in line and "'step_100.pt'" in line, line
    assert "--nonempty" in line
    assert not os.path.ismount(mnt) and (mnt / "step_100.pt").read_text() == "written while the mount was down"
    return line


def test_background_mount_over_files_is_refused(tmp_path):
    _, mnt, cfg = _setup(tmp_path)
    try:
        _refused(run_hintfs("mount", cfg, mnt), mnt)
    finally:
        force_unmount(mnt)


def test_foreground_mount_over_files_is_refused(tmp_path):
    # what the systemd unit runs: the daemon's own check, before it mounts
    _, mnt, cfg = _setup(tmp_path)
    try:
        _refused(run_hintfs("mount", cfg, mnt, "--foreground", timeout=30), mnt)
    finally:
        force_unmount(mnt)


def _mounted_over(mnt: Path, r: subprocess.CompletedProcess) -> None:
    try:
        assert r.returncode == 0, r.stderr
        assert sorted(os.listdir(mnt)) == ["in-store.txt"]          # the folder's own file hidden
        # `hintfs umount` still knows the daemon started with --nonempty (its command line)
        u = run_hintfs("umount", mnt)
        assert u.returncode == 0 and u.stderr == "", u.stderr
    finally:
        force_unmount(mnt)
    assert (mnt / "step_100.pt").exists()                           # and back, untouched


def test_nonempty_flag_mounts_over_files(tmp_path):
    _, mnt, cfg = _setup(tmp_path)
    _mounted_over(mnt, run_hintfs("mount", cfg, mnt, "--nonempty"))


def test_nonempty_config_key_mounts_over_files(tmp_path):
    _, mnt, cfg = _setup(tmp_path, "\n[mount]\nnonempty = true\n")
    _mounted_over(mnt, run_hintfs("mount", cfg, mnt))


def _enotconn(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as err:
        return err.errno == errno.ENOTCONN
    return False


def test_remount_over_a_dead_hintfs_mount(tmp_path):
    _, mnt, cfg = _setup(tmp_path)
    (mnt / "step_100.pt").unlink()
    r = run_hintfs("mount", cfg, mnt)
    assert r.returncode == 0, r.stderr
    try:
        pid = json.loads((mnt / ".hintfs" / "stats").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: _enotconn(mnt), timeout=10)
        r = run_hintfs("mount", cfg, mnt)
        assert r.returncode == 0, r.stderr
        assert "dead hintfs mount" in r.stderr and "not empty" not in r.stderr
        assert sorted(os.listdir(mnt)) == ["in-store.txt"]
    finally:
        run_hintfs("umount", mnt)
        force_unmount(mnt)

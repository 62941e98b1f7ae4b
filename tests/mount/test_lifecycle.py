"""Mount lifecycle: background and foreground, the ways to unmount, crashes, bad input."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import HINTFS, REPO, force_unmount, needs_fuse, run_hintfs, wait_for, write_config

pytestmark = needs_fuse


def _dirs(tmp_path: Path):
    store, mnt = tmp_path / "store", tmp_path / "mnt"
    store.mkdir()
    mnt.mkdir()
    return store, mnt, write_config(tmp_path / "c.toml", f"file://{store}", log=tmp_path / "log")


def _one_clean_line(r: subprocess.CompletedProcess):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r.stderr.strip()


def _foreground(cfg, mnt, env=None):
    return subprocess.Popen(HINTFS + ["mount", str(cfg), str(mnt), "--foreground"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _stop(p: subprocess.Popen, mnt: Path) -> None:
    """Whatever the test saw: no daemon and no mount left behind."""
    if p.poll() is None:
        p.kill()
        p.wait()
    force_unmount(mnt)


def _signal_and_check_clean_exit(cfg, mnt, sig, ready, interval=0.05):
    """Start a foreground mount, signal it once `ready()`, expect exit status 0 and no mount."""
    p = _foreground(cfg, mnt)
    try:
        assert wait_for(ready, timeout=20, interval=interval)
        p.send_signal(sig)
        assert p.wait(timeout=20) == 0
        assert not os.path.ismount(mnt)
    finally:
        _stop(p, mnt)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_foreground_mount_unmounts_cleanly_on_signal(tmp_path, sig):
    store, mnt, cfg = _dirs(tmp_path)
    (store / "f").write_bytes(b"1")
    _signal_and_check_clean_exit(cfg, mnt, sig, lambda: os.path.ismount(mnt) and (mnt / "f").exists())


def test_signal_while_mount_is_still_announcing_itself(tmp_path):
    # A signal that stops the FUSE loop while the readiness probe (a stat of the mount from a
    # worker thread, answered by that same loop) is pending once hung the daemon forever.
    store, mnt, cfg = _dirs(tmp_path)
    for _ in range(3):
        _signal_and_check_clean_exit(cfg, mnt, signal.SIGTERM, lambda: os.path.ismount(mnt), interval=0.001)


def test_fusermount_u_stops_the_daemon(tmp_path):
    store, mnt, cfg = _dirs(tmp_path)
    # Unmount once the daemon said READY: before that its own probe (a stat through the mount,
    # from a thread) may still be in flight, and the kernel refuses the unmount with EBUSY (seen
    # under load: 2 runs of this module in 10 beside a full test run).
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(20)
    p = _foreground(cfg, mnt, env={**os.environ, "NOTIFY_SOCKET": sock_path})
    try:
        assert sock.recv(4096).decode() == "READY=1"
        assert os.path.ismount(mnt) and (mnt / ".hintfs" / "stats").exists()
        subprocess.run(["fusermount3", "-u", str(mnt)], check=True)
        assert p.wait(timeout=20) == 0
    finally:
        sock.close()
        _stop(p, mnt)


def test_background_mount_and_hintfs_umount(tmp_path):
    store, mnt, cfg = _dirs(tmp_path)
    r = run_hintfs("mount", cfg, mnt)
    try:
        assert r.returncode == 0, r.stderr
        assert os.path.ismount(mnt)
        (mnt / "x").write_bytes(b"data")
        r = run_hintfs("umount", mnt)
        assert r.returncode == 0, r.stderr
        assert not os.path.ismount(mnt)
        assert (store / "x").read_bytes() == b"data"
    finally:
        force_unmount(mnt)


def test_systemd_notify_ready_only_when_mount_answers(tmp_path):
    store, mnt, cfg = _dirs(tmp_path)
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(20)
    p = _foreground(cfg, mnt, env={**os.environ, "NOTIFY_SOCKET": sock_path})
    try:
        msg = sock.recv(4096).decode()
        assert msg == "READY=1"
        # At the moment READY arrives the mount already serves requests.
        assert os.path.ismount(mnt) and (mnt / ".hintfs" / "stats").exists()
        p.terminate()
        assert sock.recv(4096).decode() == "STOPPING=1"
        assert p.wait(timeout=20) == 0
    finally:
        sock.close()
        _stop(p, mnt)


def test_kill_mid_write_leaves_no_partial_file_and_restart_serves_same_data(tmp_path):
    store, mnt, cfg = _dirs(tmp_path)
    (store / "model.bin").write_bytes(b"old" * 1000)
    r = run_hintfs("mount", cfg, mnt)
    assert r.returncode == 0, r.stderr
    pid = int(__import__("json").loads((mnt / ".hintfs" / "stats").read_text())["pid"])
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys,time\n"
        "f=open(sys.argv[1],'wb')\n"
        "f.write(b'new'*500000); f.flush()\n"
        "open(sys.argv[2],'w').write('written')\n"
        "time.sleep(60)\n"), str(mnt / "model.bin"), str(tmp_path / "flag")])
    try:
        assert wait_for(lambda: (tmp_path / "flag").exists(), timeout=20)
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: not Path(f"/proc/{pid}").exists() or
                        open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z", timeout=10)
    finally:
        writer.kill()
        writer.wait()
        force_unmount(mnt)
    # The store still holds exactly the old file; the staging file is hidden by its name.
    assert (store / "model.bin").read_bytes() == b"old" * 1000
    leftovers = [n for n in os.listdir(store) if n != "model.bin"]
    assert all(n.startswith(".hintfs-tmp.") for n in leftovers)
    r = run_hintfs("mount", cfg, mnt)
    try:
        assert r.returncode == 0, r.stderr
        assert (mnt / "model.bin").read_bytes() == b"old" * 1000
        assert sorted(os.listdir(mnt)) == ["model.bin"]
    finally:
        run_hintfs("umount", mnt)
        force_unmount(mnt)


def test_stale_staging_of_a_dead_daemon_is_reaped(tmp_path):
    from hintfs.stores import local as localstore
    store, mnt, cfg = _dirs(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = store / f".hintfs-tmp.{dead.pid}.0.{localstore._HOST}"
    stale.write_bytes(b"x")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    live = store / f".hintfs-tmp.{os.getpid()}.0.{localstore._HOST}"
    live.write_bytes(b"y")
    os.utime(live, (old, old))
    s = localstore.LocalStore(str(store))
    assert list(s.iter_dir("")) == []
    assert not stale.exists()     # its writer is gone: reaped
    assert live.exists()          # a live process may still publish it: kept


def test_missing_mountpoint(tmp_path):
    store, mnt, cfg = _dirs(tmp_path)
    line = _one_clean_line(run_hintfs("mount", cfg, tmp_path / "nope"))
    assert "does not exist" in line


def test_busy_mountpoint(tmp_path, mount_factory):
    m = mount_factory()
    line = _one_clean_line(run_hintfs("mount", m.config, m.mnt))
    assert "busy" in line
    assert (m.mnt / ".hintfs" / "stats").exists()   # the first mount is untouched


def test_unreachable_store(tmp_path):
    _, mnt, _ = _dirs(tmp_path)
    cfg = write_config(tmp_path / "bad.toml", f"file://{tmp_path}/missing-store")
    line = _one_clean_line(run_hintfs("mount", cfg, mnt))
    assert "missing-store does not exist" in line and "[store] uri" in line
    cfg = write_config(tmp_path / "s3.toml", "s3://bucket",
                       'endpoint_override = "127.0.0.1:9"\nscheme = "http"\naccess_key = "a"\n'
                       'secret_key = "b"\nconnect_timeout_s = 1\nrequest_timeout_s = 2\n'
                       'region = "us-east-1"\n')
    text = cfg.read_text().replace('uri = "s3://bucket"\n', 'uri = "s3://bucket"\n', 1)
    cfg.write_text(text)
    line = _one_clean_line(run_hintfs("mount", cfg, mnt, timeout=120))
    assert "not reachable" in line
    assert not os.path.ismount(mnt)


def test_no_dev_fuse(tmp_path):
    if not shutil.which("unshare"):
        pytest.skip("unshare not installed")
    store, mnt, cfg = _dirs(tmp_path)
    # A private mount namespace where /dev is an empty tmpfs: as on a host without fuse.
    script = f"mount -t tmpfs tmpfs /dev && exec {sys.executable} -m hintfs.cli mount {cfg} {mnt}"
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    line = _one_clean_line(r)
    assert "/dev/fuse does not exist" in line

"""`hintfs umount` acts on hintfs mounts only, and cleans up a dead one (issue 12)."""
from __future__ import annotations

import os
import signal
import subprocess

from hintfs.common.mounts import mount_at
from tests.conftest import needs_fuse, run_hintfs, wait_for

pytestmark = needs_fuse


def test_umount_refuses_a_mount_that_is_not_hintfs(tmp_path):
    target = tmp_path / "tmpfs"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(target)], check=True)
    try:
        r = run_hintfs("umount", target)
        assert r.returncode != 0
        assert "not a hintfs mount" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert mount_at(str(target)).fstype == "tmpfs"    # still mounted
    finally:
        subprocess.run(["umount", str(target)], check=False)
    r = run_hintfs("umount", target)
    assert r.returncode != 0 and "is not mounted" in r.stderr


def test_umount_detaches_a_dead_hintfs_mount(mount_factory):
    m = mount_factory()
    assert mount_at(str(m.mnt)).is_hintfs
    os.kill(m.pid, signal.SIGKILL)
    assert wait_for(lambda: not os.path.exists(m.mnt / ".hintfs"), timeout=5)   # ENOTCONN
    r = run_hintfs("umount", m.mnt)
    assert r.returncode == 0, r.stderr
    assert "daemon not answering" in r.stderr
    assert mount_at(str(m.mnt)) is None and m.mnt.is_dir()

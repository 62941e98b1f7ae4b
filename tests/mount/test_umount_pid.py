"""Issue 34, finding 11: `hintfs umount` sent SIGTERM to whatever pid a `fuse.hintfs` mount's
`.hintfs/stats` named. A fake FUSE filesystem with that subtype (a few lines of pyfuse3: the
mount table cannot tell it from hintfs) got a root process killed.

Now the pid is signalled only if its uid is the mount's `user_id` (mountinfo), it is a hintfs
daemon (its executable a Python, its command line hintfs's mount entry point) and it serves that
mountpoint (its command line names it); otherwise the mount is unmounted without a signal, in one
line. The fake mount is made by a process whose real uid is 65534 (libfuse writes the real uid as
the mount's `user_id`, as fusermount3 would for that user), or by root.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hintfs.common.mounts import mount_at
from tests.conftest import force_unmount, needs_fuse, run_hintfs, wait_for
from tests.helpers.security import NOBODY, SETPRIV

pytestmark = [needs_fuse, pytest.mark.timeout(120)]

FAKE = textwrap.dedent("""
    import errno, json, os, stat, sys
    import pyfuse3, trio

    class Fake(pyfuse3.Operations):
        def __init__(self, stats):
            super().__init__()
            self.stats = stats

        def _attr(self, inode):
            a = pyfuse3.EntryAttributes()
            a.st_ino = inode
            a.st_mode = (stat.S_IFDIR | 0o755) if inode in (1, 2) else (stat.S_IFREG | 0o444)
            a.st_size = len(self.stats) if inode == 3 else 0
            a.st_nlink = 1
            a.st_uid, a.st_gid = os.getuid(), os.getgid()
            return a

        async def getattr(self, inode, ctx=None):
            if inode not in (1, 2, 3):
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._attr(inode)

        async def lookup(self, parent, name, ctx=None):
            child = {(1, b".hintfs"): 2, (2, b"stats"): 3}.get((parent, name))
            if child is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._attr(child)

        async def open(self, inode, flags, ctx):
            if inode != 3:
                raise pyfuse3.FUSEError(errno.EISDIR)
            return pyfuse3.FileInfo(fh=3)

        async def read(self, fh, off, size):
            return self.stats[off:off + size]

    mnt, pid = sys.argv[1], int(sys.argv[2])
    pyfuse3.init(Fake(json.dumps({"pid": pid}).encode()), mnt, {"fsname=fake", "subtype=hintfs", "allow_other"})
    print("ready", flush=True)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=False)
""")


class FakeHintfs:
    """A FUSE filesystem of type `fuse.hintfs` at `mnt` whose `.hintfs/stats` names `pid`; made by
    a process of real uid `uid` (the mount's `user_id`). Stopped by its pid."""

    def __init__(self, base: Path, mnt: Path, pid: int, uid: int = 0) -> None:
        script = base / "fake_hintfs.py"
        script.write_text(FAKE)
        cmd = [sys.executable, "-I", str(script), str(mnt), str(pid)]
        if uid:      # real uid `uid`, effective uid 0 (to open /dev/fuse and mount)
            cmd = [SETPRIV, f"--ruid={uid}", f"--rgid={uid}", "--keep-groups", *cmd]
        self.mnt = mnt
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        assert self.p.stdout is not None and self.p.stdout.readline().strip() == "ready", self.p.stderr
        assert mount_at(str(mnt)).is_hintfs

    def close(self) -> None:
        force_unmount(self.mnt)
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(10)
        for f in (self.p.stdout, self.p.stderr):
            if f is not None:
                f.close()


def _victim() -> subprocess.Popen:
    """A root process that must survive."""
    return subprocess.Popen(["sleep", "300"])


def _umount_leaves_alive(fake: FakeHintfs, victim_pid: int) -> str:
    r = run_hintfs("umount", fake.mnt)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "without signalling" in lines[0] and str(victim_pid) in lines[0], r.stderr
    assert mount_at(str(fake.mnt)) is None                         # unmounted all the same
    assert wait_for(lambda: fake.p.poll() is not None, timeout=10)  # (the fake saw its unmount)
    return lines[0]


@pytest.mark.skipif(SETPRIV is None or os.geteuid() != 0, reason="needs root and setpriv")
def test_a_fake_hintfs_mount_of_another_user_does_not_get_a_root_process_signalled(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    victim = _victim()
    fake = FakeHintfs(tmp_path, mnt, victim.pid, uid=NOBODY)
    try:
        assert "user_id=65534" in Path("/proc/self/mountinfo").read_text()
        line = _umount_leaves_alive(fake, victim.pid)
        assert f"uid {NOBODY}" in line                             # the mount's user, said
        assert victim.poll() is None
    finally:
        fake.close()
        victim.kill()
        victim.wait(10)


def test_a_fake_hintfs_mount_of_root_does_not_get_a_process_that_is_no_hintfs_daemon_signalled(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    victim = _victim()
    fake = FakeHintfs(tmp_path, mnt, victim.pid)
    try:
        _umount_leaves_alive(fake, victim.pid)
        assert victim.poll() is None
    finally:
        fake.close()
        victim.kill()
        victim.wait(10)


def test_a_fake_hintfs_mount_does_not_get_the_daemon_of_another_hintfs_mount_signalled(tmp_path, mount_factory):
    real = mount_factory(name="real")
    (tmp_path / "fake").mkdir()
    fake = FakeHintfs(tmp_path, tmp_path / "fake", real.pid)
    try:
        _umount_leaves_alive(fake, real.pid)
        assert (real.mnt / ".hintfs" / "stats").exists() and real.stats()["pid"] > 0   # still serving
    finally:
        fake.close()


def test_the_daemon_of_a_foreground_mount_started_with_relative_paths_is_signalled(tmp_path):
    """The systemd form (`hintfs mount CONFIG MNT --foreground`), here with relative paths: the
    daemon re-executes itself with absolute ones, and `hintfs umount` recognises and stops it."""
    from tests.conftest import HINTFS, write_config
    (tmp_path / "store").mkdir()
    (tmp_path / "mnt").mkdir()
    write_config(tmp_path / "c.toml", f"file://{tmp_path / 'store'}", log=tmp_path / "log")
    p = subprocess.Popen(HINTFS + ["mount", "c.toml", "mnt", "--foreground"], cwd=tmp_path,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: (tmp_path / "mnt" / ".hintfs" / "stats").exists(), timeout=30)
        r = run_hintfs("umount", tmp_path / "mnt")
        assert r.returncode == 0 and "without signalling" not in r.stderr, r.stderr
        assert p.wait(timeout=30) == 0                     # it had the SIGTERM: a clean exit
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
        force_unmount(tmp_path / "mnt")


@pytest.mark.parametrize("argv, mp", [
    (["/usr/bin/python3", "-I", "-m", "fusefs", "/etc/c.toml", "/mnt/x", "--ready-fd", "5"], "/mnt/x"),
    (["python3", "-I", "-m", "hintfs.cli", "mount", "/etc/c.toml", "/mnt/x", "--foreground"], "/mnt/x"),
    (["python3", "/usr/local/bin/hintfs", "mount", "c.toml", "mnt", "-f"], "mnt"),    # an older daemon
    (["python3", "-mfusefs", "c.toml", "/mnt/x"], "/mnt/x"),
    (["python3", "-I", "-m", "hintfs.cli", "--debug", "mount", "/c.toml", "/mnt/x", "-f", "--debug"], "/mnt/x"),
    (["python3", "-I", "-m", "hintfs.cli", "mount", "/etc/c.toml", "/mnt/x"], None),   # the parent, not it
    (["python3", "-c", "import fusefs", "-m", "fusefs", "c", "/mnt/x"], None),
    (["python3", "-m", "fusefs", "/mnt/x"], None),
    (["sleep", "300"], None),
])
def test_the_mountpoint_a_daemons_command_line_names(argv, mp):
    from hintfs.common.mounts import _daemon_mountpoint
    assert _daemon_mountpoint(argv) == mp

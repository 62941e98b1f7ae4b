"""Shared fixtures: real FUSE mounts under a temp dir, always unmounted afterwards."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parent.parent
HINTFS = [sys.executable, "-m", "hintfs.cli"]


def have_fuse() -> bool:
    return os.path.exists("/dev/fuse") and os.geteuid() == 0


needs_fuse = pytest.mark.skipif(not have_fuse(), reason="needs root and /dev/fuse")


def run_hintfs(*args, timeout=60, check=False, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(HINTFS + [str(a) for a in args], capture_output=True, text=True,
                          timeout=timeout, check=check, cwd=REPO, **kw)


def _in_mount_table(mnt: Path) -> bool:
    """`mnt` is a mount point (also a dead FUSE mount, whose stat fails: os.path.ismount says no)."""
    target = os.path.abspath(mnt).replace(" ", "\\040")
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f if len(line.split()) > 1)


def force_unmount(mnt: Path) -> None:
    if os.path.ismount(mnt) or _in_mount_table(mnt):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str = "256k") -> Iterator[Path]:
    """A small tmpfs at `path` (a new folder, e.g. inside a store, to fill it: ENOSPC), unmounted
    at the end."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        unmount_tmpfs(path)


def check_fsync_publishes_a_whole_file(m: "Mounted", name: str = "s.bin") -> None:
    """fsync publishes what was written; writes after it are staged again (the published file
    stays whole) until close publishes them too."""
    with open(m.mnt / name, "wb") as f:
        f.write(b"part1")
        f.flush()
        os.fsync(f.fileno())
        assert (m.store / name).read_bytes() == b"part1"
        f.write(b"part2")
        f.flush()
        assert (m.store / name).read_bytes() == b"part1"
    assert (m.store / name).read_bytes() == b"part1part2"


def unmount_tmpfs(path: Path, timeout: float = 10.0) -> None:
    """Unmount a tmpfs a test mounted (inside a store): the daemon may still hold a file there
    for a moment after close() (FUSE's release is asynchronous), so retry, then detach it lazily."""
    deadline = time.monotonic() + timeout
    while subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        if not os.path.ismount(path):
            return
        if time.monotonic() > deadline:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
            return
        time.sleep(0.1)


@dataclass
class Mounted:
    store: Path
    mnt: Path
    config: Path
    log: Path

    @property
    def pid(self) -> int:
        return self.stats()["pid"]

    def stats(self) -> dict:
        return json.loads((self.mnt / ".hintfs" / "stats").read_text())

    def umount(self) -> None:
        """`hintfs umount`, run in this process: the same code as the command (tests of the
        command itself run it), without starting an interpreter per mount (~0.6 s each here).
        The daemon is not this process's child (the mount command started it), so its exit is
        seen as the command sees it."""
        if os.path.ismount(self.mnt):
            from hintfs.cli.umount import cmd_umount
            cmd_umount(argparse.Namespace(mountpoint=str(self.mnt), timeout=None))
        force_unmount(self.mnt)

    def remount(self) -> None:
        self.umount()
        r = run_hintfs("mount", self.config, self.mnt)
        assert r.returncode == 0, r.stderr + self.log.read_text()


def mount_in_process(cfg: Path, mnt: Path, log: Path) -> None:
    """`hintfs mount CFG MNT`, run in this process: the same code as the command (which starts
    the daemon in a session of its own and waits for its "ok"; tests of the command itself run
    it), without an interpreter start per mount (~0.6 s each here). The daemon is then this
    process's child: once it exits it is a zombie until reaped, which `hintfs umount` counts as
    gone (common.procs.pid_alive), and the subprocess module reaps it later."""
    from hintfs.cli.base import UserError
    from hintfs.cli.mount import cmd_mount
    try:
        cmd_mount(argparse.Namespace(config=str(cfg), mountpoint=str(mnt), foreground=False, ready_fd=None))
    except UserError as err:
        pytest.fail(f"hintfs mount {mnt}: {err}\n" + (log.read_text() if log.exists() else ""))


# For tests of what the daemon itself does with each read and write (counters, its page-cache
# choices, a slow store): FUSE passthrough (the default where available) hands those to the kernel.
DAEMON_DATA_PATH = '\n[mount]\npassthrough = "off"\n'


def write_config(path: Path, store_uri: str, extra: str = "", log: Path | None = None,
                 store_extra: str = "") -> Path:
    text = f'[store]\nuri = "{store_uri}"\n{store_extra}'
    if log is not None:
        text += f'\n[logging]\nfile = "{log}"\nlevel = "DEBUG"\n'
    path.write_text(text + extra)
    return path


@pytest.fixture
def mount_factory(tmp_path):
    mounted: list[Mounted] = []

    def make(extra: str = "", store_uri: str | None = None, name: str = "m", store_extra: str = "") -> Mounted:
        base = tmp_path / name
        store = base / "store"
        mnt = base / "mnt"
        store.mkdir(parents=True, exist_ok=True)
        mnt.mkdir(parents=True, exist_ok=True)
        log = base / "mount.log"
        cfg = write_config(base / "hintfs.toml", store_uri or f"file://{store}", extra, log, store_extra)
        mount_in_process(cfg, mnt, log)
        m = Mounted(store, mnt, cfg, log)
        mounted.append(m)
        return m

    yield make
    for m in mounted:
        try:
            m.umount()
        finally:
            force_unmount(m.mnt)


@pytest.fixture
def mounted(mount_factory) -> Mounted:
    return mount_factory()


def wait_for(pred, timeout=10.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()

"""Starting real FUSE mounts of hintfs and taking them down: the config file, `hintfs mount` run
in this process, `hintfs umount`, and a forced unmount of whatever is left."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterator

from tests.helpers.procs import run_hintfs


def have_fuse() -> bool:
    return os.path.exists("/dev/fuse") and os.geteuid() == 0


class MountError(RuntimeError):
    """`hintfs mount` refused or failed; the message has its reason and the mount's log."""


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
    gone (hintfs.common.procs.pid_alive), and the subprocess module reaps it later. MountError (with
    the mount's log) if the command fails."""
    from hintfs.cli.base import UserError
    from hintfs.cli.mount import cmd_mount
    try:
        cmd_mount(argparse.Namespace(config=str(cfg), mountpoint=str(mnt), foreground=False, ready_fd=None))
    except UserError as err:
        raise MountError(f"hintfs mount {mnt}: {err}\n" + (log.read_text() if log.exists() else "")) from None


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


@contextlib.contextmanager
def world_mount(setup: Callable[[Path], str], prefix: str = "hintfs-world-", store_uri: str = "",
                store_extra: str = "") -> Iterator[Mounted]:
    """A mount of a `file://` store (or of `store_uri`, with `store_extra` in its [store]) in a
    fresh folder every user may traverse (0755; pytest's tmp_path is 0700 under root's name), for
    tests that act as another user. `setup(base)` fills `base / "store"` (made, empty) and returns
    the config's extra text; unmounted and removed at the end."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        base.chmod(0o755)
        store, mnt = base / "store", base / "mnt"
        store.mkdir()
        mnt.mkdir()
        log = base / "mount.log"
        cfg = write_config(base / "hintfs.toml", store_uri or f"file://{store}", setup(base), log, store_extra)
        mount_in_process(cfg, mnt, log)
        m = Mounted(store, mnt, cfg, log)
        try:
            yield m
        finally:
            m.umount()
    finally:
        shutil.rmtree(base, ignore_errors=True)

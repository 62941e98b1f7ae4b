"""The fallback when FUSE passthrough is unavailable: today's path, said once in the log and in
the stats (`hintfs status`). No kernel support needed: the filesystem is driven directly."""
from __future__ import annotations

import errno
import logging
import os
import types

import pyfuse3
import trio

from fusefs import fuse as fuse_mod
from fusefs.filesystem import Filesystem
from fusefs.handles import PassthroughRead, StoreRead
from mountconfig import MountConfig
from stores.local import LocalStore


class RefusingBacking:
    """Registering a backing file fails as it does without CAP_SYS_ADMIN."""
    def __init__(self):
        self.calls = 0

    def open(self, fd: int) -> int:
        self.calls += 1
        raise PermissionError(errno.EPERM, "Operation not permitted")

    def close(self, backing_id: int) -> None:
        raise AssertionError("nothing was registered")


class CountingBacking:
    def __init__(self):
        self.live: set[int] = set()
        self.next = 0

    def open(self, fd: int) -> int:
        os.fstat(fd)
        self.next += 1
        self.live.add(self.next)
        return self.next

    def close(self, backing_id: int) -> None:
        self.live.remove(backing_id)


def make_fs(tmp_path) -> Filesystem:
    (tmp_path / "f").write_bytes(b"hello")
    cfg = MountConfig.model_validate({"store": {"uri": f"file://{tmp_path}"}})
    return Filesystem(LocalStore(str(tmp_path)), cfg)


async def lookup_open(fs: Filesystem, flags=os.O_RDONLY):
    attrs = await fs.lookup(1, b"f")
    return attrs.st_ino, await fs.open(attrs.st_ino, flags)


def test_refused_registration_falls_back_once_and_says_so(tmp_path, caplog):
    fs = make_fs(tmp_path)
    backing = RefusingBacking()
    fs.set_passthrough((backing, "on"))

    async def main():
        _, f1 = await lookup_open(fs)
        assert f1.backing_id == 0 and isinstance(fs.handles[f1.fh], StoreRead)
        assert await fs.read(f1.fh, 0, 5) == b"hello"
        await fs.release(f1.fh)
        _, f2 = await lookup_open(fs)
        assert f2.backing_id == 0
        await fs.release(f2.fh)

    with caplog.at_level(logging.INFO, logger="hintfs.ops"):
        trio.run(main)
    assert backing.calls == 1                       # tried once, then off for the mount
    snap = fs.stats.snapshot()
    assert snap["passthrough"]["state"].startswith("unavailable (registering a backing file failed")
    assert snap["passthrough"]["failed"] == 1
    assert snap["bytes"]["read"] == 5               # today's path: the daemon served the bytes
    assert sum("FUSE passthrough: unavailable" in r.message for r in caplog.records) == 1


def test_backing_registered_once_per_inode_and_released_on_last_close(tmp_path):
    fs = make_fs(tmp_path)
    backing = CountingBacking()
    fs.set_passthrough((backing, "on"))

    async def main():
        ino, a = await lookup_open(fs)
        _, b = await lookup_open(fs)
        assert a.backing_id == b.backing_id == 1 and not a.keep_cache
        assert isinstance(fs.handles[a.fh], PassthroughRead)
        await fs.release(a.fh)
        assert backing.live == {1}
        await fs.release(b.fh)
        assert backing.live == set()
        _, w = await lookup_open(fs, os.O_WRONLY)   # a writer: the staging file is the backing file
        assert w.backing_id == 2
        await fs.flush(w.fh)
        await fs.release(w.fh)
        assert backing.live == set()

    trio.run(main)
    assert (tmp_path / "f").read_bytes() == b"hello"   # published unchanged


def test_backend_reports_why_passthrough_is_unavailable(monkeypatch):
    assert fuse_mod.passthrough_backend("off", True)[1].startswith("off")
    assert "not on this host" in fuse_mod.passthrough_backend("auto", False)[1]
    assert "writeback_cache" in fuse_mod.passthrough_backend("auto", True, writeback_cache=True)[1]
    stock = types.SimpleNamespace()                  # a pyfuse3 without the patch
    monkeypatch.setattr(fuse_mod, "pyfuse3", stock)
    backend, state = fuse_mod.passthrough_backend("auto", True)
    assert backend is None and "make passthrough-libs" in state
    if hasattr(pyfuse3, "passthrough_supported"):
        monkeypatch.setattr(fuse_mod, "pyfuse3", types.SimpleNamespace(
            passthrough_supported=lambda: True, passthrough_enabled=lambda: False))
        backend, state = fuse_mod.passthrough_backend("auto", True)
        assert backend is None and "kernel did not grant" in state


def test_writeback_cache_mounts_without_passthrough_and_says_why(mount_factory):
    # The kernel grants FUSE passthrough or the writeback cache, not both.
    m = mount_factory('\n[mount]\nwriteback_cache = true\n')
    assert "writeback_cache" in m.stats()["passthrough"]["state"]
    (m.mnt / "w.bin").write_bytes(b"x" * 100_000)
    assert (m.store / "w.bin").read_bytes() == b"x" * 100_000
    assert (m.mnt / "w.bin").read_bytes() == b"x" * 100_000

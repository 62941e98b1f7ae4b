"""The fallback when FUSE passthrough is unavailable: today's path, said once in the log and in
the stats (`hintfs status`). No kernel support needed: the filesystem is driven directly."""
from __future__ import annotations

import errno
import logging
import os
import threading
import types

import pyfuse3
import trio
import trio.testing

from fusefs import fuse as fuse_mod
from fusefs.filesystem import Filesystem
from fusefs.handles import PassthroughRead, PassthroughWrite, StoreRead
from hintfs.stores.local import LocalStore
from tests.helpers.backing import CountingBacking


class RefusingBacking:
    """Registering a backing file fails as it does without CAP_SYS_ADMIN."""
    def __init__(self):
        self.calls = 0

    def open(self, fd: int) -> int:
        self.calls += 1
        raise PermissionError(errno.EPERM, "Operation not permitted")

    def close(self, backing_id: int) -> None:
        raise AssertionError("nothing was registered")


def make_fs(tmp_path) -> Filesystem:
    (tmp_path / "f").write_bytes(b"hello")
    return Filesystem(LocalStore(str(tmp_path)))


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


class GatedStore(LocalStore):
    """A store whose commit or discard (named in `gated`) waits for `go`, in a worker thread: a
    release then awaits there while other requests arrive, as on a disk that is slow for once."""
    def __init__(self, root: str, gated: str):
        super().__init__(root)
        self.gated, self.entered, self.go = gated, threading.Event(), threading.Event()
        self.armed = False

    def new_staging(self, rel: str, copy_existing: bool, source=None):
        staging = super().new_staging(rel, copy_existing, source)
        staging.inline_io = False          # a thread, as on a disk (tmpfs would run it inline)
        return staging

    def _wait(self, name: str) -> None:
        if name == self.gated and self.armed:
            self.entered.set()
            assert self.go.wait(10)

    def commit(self, staging, rel: str, keep: bool = False):
        self._wait("commit")
        return super().commit(staging, rel, keep)

    def discard(self, staging) -> None:
        self._wait("discard")
        super().discard(staging)


def gated_fs(tmp_path, gated: str) -> Filesystem:
    (tmp_path / "f").write_bytes(b"hello")
    return Filesystem(GatedStore(str(tmp_path), gated))


async def while_released(fs: Filesystem, fh: int, then) -> None:
    """Release `fh`; while its release waits in the store, start `then()`; once every task waits
    (`then` on the release's publish lock, or done), let the release finish; then `then` ends."""
    fs.store.armed = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fs.release, fh)
        await trio.to_thread.run_sync(fs.store.entered.wait, 10)
        try:
            nursery.start_soon(then)
            await trio.testing.wait_all_tasks_blocked(cushion=0.01)
        finally:
            fs.store.go.set()


def test_an_open_during_the_last_writers_release_still_passes_through(tmp_path):
    # The kernel detached the closed file before it sent RELEASE: an open that arrives while that
    # release waits must get passthrough too (it got today's path, and the daemon served the bytes).
    fs = gated_fs(tmp_path, "discard")
    backing = CountingBacking()
    fs.set_passthrough((backing, "on"))
    opened = {}

    async def reopen():
        _, opened["rw"] = await lookup_open(fs, os.O_RDWR)
        _, opened["ro"] = await lookup_open(fs)

    async def main():
        _, w = await lookup_open(fs, os.O_WRONLY)
        await fs.flush(w.fh)
        await while_released(fs, w.fh, reopen)
        rw, ro = opened["rw"], opened["ro"]
        assert rw.backing_id and rw.backing_id == ro.backing_id
        assert isinstance(fs.handles[rw.fh], PassthroughWrite) and isinstance(fs.handles[ro.fh], PassthroughRead)
        await fs.release(ro.fh)
        await fs.flush(rw.fh)
        await fs.release(rw.fh)

    trio.run(main)
    assert backing.live == set() and fs.stats.snapshot()["bytes"]["read"] == 0
    assert (tmp_path / "f").read_bytes() == b"hello"


def test_a_writer_opened_while_the_last_one_publishes_waits_and_loses_nothing(tmp_path):
    # The last write handle's release publishes writes that came after its flush (mmap writeback);
    # a new writer opened meanwhile waits for that publish (the publish lock), then writes on
    # what it published: nothing of either is lost, and no staging is used after its close.
    fs = gated_fs(tmp_path, "commit")
    opened = {}

    async def reopen():
        _, opened["rw"] = await lookup_open(fs, os.O_RDWR)

    async def main():
        _, w = await lookup_open(fs, os.O_WRONLY | os.O_TRUNC)
        assert await fs.write(w.fh, 0, b"first") == 5
        await fs.flush(w.fh)
        assert await fs.write(w.fh, 5, b"+late") == 5    # after the flush: published at release
        await while_released(fs, w.fh, reopen)
        rw = opened["rw"].fh
        assert await fs.write(rw, 10, b"+second") == 7
        await fs.flush(rw)
        await fs.release(rw)

    trio.run(main)
    assert (tmp_path / "f").read_bytes() == b"first+late+second"

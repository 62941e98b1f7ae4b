"""The one publish rule (docs/semantics.md, "The publish rule") on every store kind: every byte
written through any descriptor of an open file is published (a shell redirect's dup'ed descriptor
included), the final state is never a prefix or an empty stand-in, and a write that failed is
never published: the previous version stays and the writer learns it at close.

Store kinds: file:// with FUSE passthrough (the default where this host has it) and without,
S3 (a real S3 server on loopback) without and with the host cache (whose writes go through
passthrough from the spool file). The stream to a tier is in tests/system/test_stream_mount.py
(`test_a_shell_redirect_reaches_the_tier_whole`)."""
from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import DAEMON_DATA_PATH, Mounted, needs_fuse, tiny_tmpfs, wait_for
from tests.helpers.s3 import s3_server as _s3_server
from tests.helpers.s3 import s3fs, store_extra

pytestmark = needs_fuse

BUCKET = "publish"
KINDS = ["file-passthrough", "file-daemon", "s3", "s3-hostcache"]


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    yield from _s3_server(tmp_path_factory.mktemp("s3"))


class View:
    """A mount of one store kind, and a way to read what its store holds (not through the mount)."""

    def __init__(self, m: Mounted, fs=None, prefix: str = ""):
        self.m, self.fs, self.prefix = m, fs, prefix

    def stored(self, rel: str) -> bytes | None:
        if self.fs is None:
            p = self.m.store / rel
            return p.read_bytes() if p.exists() else None
        import pyarrow.fs as pafs
        path = f"{self.prefix}/{rel}"
        if self.fs.get_file_info(path).type != pafs.FileType.File:
            return None
        with self.fs.open_input_stream(path) as f:
            return f.read()

    def passthrough(self) -> bool:
        return self.m.stats()["passthrough"]["state"] == "on"


def _view(kind: str, request, mount_factory, tmp_path) -> View:
    if kind == "file-passthrough":
        return View(mount_factory(name=kind))
    if kind == "file-daemon":
        return View(mount_factory(name=kind, extra=DAEMON_DATA_PATH))
    server = request.getfixturevalue("s3_server")
    fs = s3fs(server)
    bucket = f"{BUCKET}{abs(hash(tmp_path)) % 10**8}"
    fs.create_dir(bucket)
    extra = f'\n[cache]\nspool_dir = "{tmp_path / "spool"}"\n'
    if kind == "s3-hostcache":
        extra += f'dir = "{tmp_path / "hostcache"}"\n'
    m = mount_factory(name=kind, extra=extra, store_uri=f"s3://{bucket}", store_extra=store_extra(server))
    return View(m, fs, bucket)


def _sh(script: str) -> None:
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_every_descriptor_of_a_redirect_is_published(kind, request, mount_factory, tmp_path):
    v = _view(kind, request, mount_factory, tmp_path)
    mnt = v.m.mnt
    uploaded0 = v.m.stats()["bytes"]["uploaded"]
    # bash opens the file, dup2()s it onto stdout and closes the first descriptor (a FLUSH
    # before any byte is written), then writes through the dup.
    _sh(f"echo hello > {mnt}/echo.txt")
    _sh(f"exec 3>{mnt}/exec.txt; echo a >&3; echo b >&3; exec 3>&-")
    _sh(f"head -c 3000000 /dev/zero > {mnt}/head.bin")
    _sh(f"echo replaced > {mnt}/echo.txt")          # an overwrite through a redirect
    # Two descriptors of one open file in one process: write, close one, write through the other.
    fd = os.open(mnt / "dup.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    fd2 = os.dup(fd)
    os.write(fd, b"first ")
    os.close(fd)
    os.write(fd2, b"second")
    os.close(fd2)
    want = {"echo.txt": b"replaced\n", "exec.txt": b"a\nb\n", "head.bin": bytes(3000000),
            "dup.bin": b"first second"}
    for rel, data in want.items():
        assert wait_for(lambda: v.stored(rel) == data, timeout=10), (kind, rel, (v.stored(rel) or b"")[:40])
        assert (mnt / rel).read_bytes() == data
    # Every byte published is counted, whatever path the writes took (passthrough included).
    assert wait_for(lambda: v.m.stats()["bytes"]["uploaded"] - uploaded0 >= sum(map(len, want.values())), 10)


@pytest.mark.parametrize("kind", KINDS)
def test_writes_after_the_first_close_of_a_dup_are_published_at_the_last_release(kind, request,
                                                                                 mount_factory, tmp_path):
    """A descriptor still open after the last close(2) of the others (here: inherited by a child
    that writes after its parent closed) is published by the last release."""
    v = _view(kind, request, mount_factory, tmp_path)
    target = v.m.mnt / "late.txt"
    # The child keeps the descriptor, the parent closes its own at once; the child writes later.
    _sh(f"exec 3>{target}; (sleep 0.3; echo late >&3) & exec 3>&-; wait")
    assert wait_for(lambda: v.stored("late.txt") == b"late\n", timeout=10), v.stored("late.txt")


def _fill(path: Path, total: int) -> OSError | None:
    """Write `total` bytes into `path` (1 MiB writes, stopping at the first failed one), then close
    it: the error close() raised, or None."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(total >> 20):
            os.write(fd, b"\x07" * (1 << 20))
    except OSError:
        pass
    try:
        os.close(fd)
    except OSError as err:
        return err
    return None


@pytest.mark.parametrize("mode", ["passthrough-checked", "daemon"])
def test_a_full_file_store_publishes_nothing_and_keeps_the_previous_version(mode, mount_factory, tmp_path):
    """A 30 MiB write into a 20 MiB store: close() fails with ENOSPC or EIO and the store keeps what
    it had (a new file: nothing; an O_TRUNC overwrite: the old content), with passthrough (the
    publish checks the free space: a write may have failed unseen) and without (the daemon saw
    the failed write)."""
    base = tmp_path / "full"
    base.mkdir()
    with tiny_tmpfs(base / "store", size="20m") as store:
        extra = '\n[mount]\npassthrough_min_free_mb = 8\n' if mode == "passthrough-checked" else DAEMON_DATA_PATH
        cfg = base / "hintfs.toml"
        from tests.conftest import mount_in_process, write_config
        mnt = base / "mnt"
        mnt.mkdir()
        log = base / "mount.log"
        write_config(cfg, f"file://{store}", extra, log)
        mount_in_process(cfg, mnt, log)
        m = Mounted(store, mnt, cfg, log)
        try:
            if mode == "passthrough-checked" and not m.stats()["passthrough"]["state"] == "on":
                pytest.skip("FUSE passthrough is not available on this host: " + m.stats()["passthrough"]["state"])
            (store / "old.bin").write_bytes(b"previous version")
            for name in ("new.bin", "old.bin"):
                err = _fill(mnt / name, 30 << 20)
                assert err is not None and err.errno in (errno.ENOSPC, errno.EIO), (name, err)
            assert not (store / "new.bin").exists()
            assert (store / "old.bin").read_bytes() == b"previous version"
            # and no staging file is left behind once the writer is released
            assert wait_for(lambda: sorted(os.listdir(store)) == ["old.bin"], 10), os.listdir(store)
            # The daemon keeps serving, and a write that fits is published.
            (mnt / "small.txt").write_bytes(b"fits")
            assert (store / "small.txt").read_bytes() == b"fits"
            assert "not publishing" in log.read_text() or "failed" in log.read_text()
        finally:
            m.umount()


def test_a_full_spool_publishes_nothing_on_s3_with_a_host_cache(s3_server, mount_factory, tmp_path):
    fs = s3fs(s3_server)
    bucket = f"{BUCKET}full"
    fs.create_dir(bucket)
    spool = tmp_path / "spoolfs"
    with tiny_tmpfs(spool, size="20m"):
        extra = (f'\n[cache]\nspool_dir = "{spool / "s"}"\ndir = "{tmp_path / "hostcache"}"\n'
                 '\n[mount]\npassthrough_min_free_mb = 8\n')
        m = mount_factory(name="s3full", extra=extra, store_uri=f"s3://{bucket}", store_extra=store_extra(s3_server))
        v = View(m, fs, bucket)
        with fs.open_output_stream(f"{bucket}/old.bin") as f:
            f.write(b"previous version")
        for name in ("new.bin", "old.bin"):
            err = _fill(m.mnt / name, 30 << 20)
            assert err is not None and err.errno in (errno.ENOSPC, errno.EIO), (name, err)
        assert v.stored("new.bin") is None
        assert v.stored("old.bin") == b"previous version"
        m.umount()

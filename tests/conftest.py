"""Shared fixtures: real FUSE mounts under a temp dir, always unmounted afterwards.

The harness itself (ports, mounts, agents, the S3 server, the WAN relay) is `tests/helpers/`,
which the benches import too; the names below stay importable from here for the tests."""
from __future__ import annotations

import os

import pytest

from tests.helpers.mounts import (DAEMON_DATA_PATH, Mounted, force_unmount, have_fuse,  # noqa: F401
                                  mount_in_process, tiny_tmpfs, unmount_tmpfs, write_config)
from tests.helpers.procs import HINTFS, REPO, run_hintfs, wait_for  # noqa: F401

needs_fuse = pytest.mark.skipif(not have_fuse(), reason="needs root and /dev/fuse")


def check_fsync_publishes_a_whole_file(m: Mounted, name: str = "s.bin") -> None:
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


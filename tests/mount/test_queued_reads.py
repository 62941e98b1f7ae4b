"""The patched pyfuse3 loop (patches/pyfuse3-queued-reads.patch) reads a queued request without a
pass through the event loop, and still lets tasks beside it run: a flood of requests whose
handlers never suspend does not starve a 5 ms timer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pyfuse3
import pytest

from tests.conftest import REPO, force_unmount, needs_fuse, wait_for

pytestmark = [needs_fuse, pytest.mark.skipif(
    not hasattr(pyfuse3, "queued_reads"),
    reason="stock pyfuse3 (without patches/pyfuse3-queued-reads.patch): run make passthrough-libs")]


def test_queued_requests_are_read_at_once_and_a_timer_beside_the_loop_still_runs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    p = subprocess.Popen([sys.executable, "tests/helpers/tick_fs.py", str(mnt)], cwd=REPO)
    try:
        assert wait_for(lambda: os.path.ismount(mnt), timeout=20)
        stop = time.monotonic() + 1.5
        counts = []

        def flood() -> None:      # every stat is a getattr request: the attributes are never cached
            n = 0
            while time.monotonic() < stop:
                os.stat(mnt / "f")
                n += 1
            counts.append(n)

        threads = [threading.Thread(target=flood) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ticks = json.loads((mnt / "ticks").read_bytes())
        assert sum(counts) > 1000, counts
        assert ticks["queued_reads"] > 0, ticks          # the kernel had requests queued
        # 16 requests at most between passes through the event loop: a few ms, not the flood's 1.5 s
        # (the bound is half the flood: a starved timer would wait all of it; a loaded 2-vCPU VM
        # has descheduled the whole daemon for 0.33 s)
        assert ticks["max_gap_s"] < 0.75, ticks
    finally:
        force_unmount(mnt)
        p.wait(timeout=20)


def test_a_hintfs_mount_counts_the_requests_it_read_while_queued(mount_factory):
    from hintfs.status import format_status
    m = mount_factory()
    for i in range(200):
        (m.store / f"f{i}").write_bytes(bytes([i % 256]) * 4096)

    def read_all(k: int) -> None:
        for i in range(k, 200, 4):
            assert (m.mnt / f"f{i}").read_bytes() == bytes([i % 256]) * 4096

    threads = [threading.Thread(target=read_all, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = m.stats()
    assert isinstance(snap["requests_read_queued"], int) and snap["requests_read_queued"] > 0, snap
    assert f"requests read while queued: {snap['requests_read_queued']:,}" in format_status(snap)

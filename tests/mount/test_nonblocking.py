"""The trio loop never blocks: a slow store read of one file does not delay reads of another."""
import os
import subprocess
import sys
import threading
import time

from tests.conftest import DAEMON_DATA_PATH, REPO, force_unmount, needs_fuse, wait_for, write_config

pytestmark = needs_fuse


def test_slow_read_of_one_file_does_not_delay_another(tmp_path):
    store, mnt = tmp_path / "store", tmp_path / "mnt"
    store.mkdir()
    mnt.mkdir()
    (store / "slow.bin").write_bytes(b"s" * 4096)
    (store / "fast.bin").write_bytes(b"f" * 4096)
    cfg = write_config(tmp_path / "c.toml", f"file://{store}", DAEMON_DATA_PATH, log=tmp_path / "log")
    slow_s = 3.0
    p = subprocess.Popen([sys.executable, "tests/helpers/slow_store_mount.py", str(cfg), str(mnt), str(slow_s)],
                         cwd=REPO)
    try:
        assert wait_for(lambda: os.path.ismount(mnt) and (mnt / "fast.bin").exists(), timeout=20)
        done = {}

        def slow_reader():
            t0 = time.monotonic()
            data = (mnt / "slow.bin").read_bytes()
            done["slow"] = (time.monotonic() - t0, data)

        t = threading.Thread(target=slow_reader)
        t.start()
        time.sleep(0.3)  # the slow read is now outstanding in a store thread
        latencies = []
        for i in range(50):
            t0 = time.monotonic()
            # A fresh open and read each time, so every iteration goes through the daemon.
            fd = os.open(mnt / "fast.bin", os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            assert os.pread(fd, 4096, 0) == b"f" * 4096
            os.close(fd)
            latencies.append(time.monotonic() - t0)
            os.stat(mnt / "fast.bin")
        assert "slow" not in done, "the slow read finished early: the test did not overlap"
        assert max(latencies) < 1.0, latencies
        t.join(timeout=30)
        assert done["slow"][1] == b"s" * 4096 and done["slow"][0] >= slow_s * 0.9
    finally:
        p.terminate()
        p.wait(timeout=20)
        force_unmount(mnt)

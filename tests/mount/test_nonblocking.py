"""The trio loop never blocks: a slow store read of one file does not delay reads of another."""
import json
import os
import subprocess
import sys
import threading

from tests.conftest import DAEMON_DATA_PATH, REPO, force_unmount, needs_fuse, wait_for, write_config

pytestmark = needs_fuse


def test_slow_read_of_one_file_does_not_delay_another(tmp_path):
    """A read of `slow.bin` hangs in a store thread for 60 s; 50 fresh opens and reads of another
    file all finish while it still hangs. No time is measured against a bound: the proof is the
    order (a loop blocked by the slow read would serve the others only after it)."""
    store, mnt = tmp_path / "store", tmp_path / "mnt"
    store.mkdir()
    mnt.mkdir()
    (store / "slow.bin").write_bytes(b"s" * 4096)
    (store / "fast.bin").write_bytes(b"f" * 4096)
    cfg = write_config(tmp_path / "c.toml", f"file://{store}", DAEMON_DATA_PATH, log=tmp_path / "log")
    slow_s = 60.0
    p = subprocess.Popen([sys.executable, "tests/helpers/slow_store_mount.py", str(cfg), str(mnt), str(slow_s)],
                         cwd=REPO)
    done = {}

    def slow_reader():
        try:
            done["slow"] = (mnt / "slow.bin").read_bytes()
        except OSError as err:            # the mount is killed under it at the end
            done["error"] = err

    def reads_in_threads() -> int:
        return json.loads((mnt / ".hintfs" / "stats").read_text())["cache"]["read_misses_thread"]

    t = threading.Thread(target=slow_reader, daemon=True)
    try:
        assert wait_for(lambda: os.path.ismount(mnt) and (mnt / "fast.bin").exists(), timeout=20)
        t.start()
        assert wait_for(lambda: reads_in_threads() >= 1, timeout=20)   # the slow read hangs in a store thread
        for _ in range(50):
            # A fresh open and read each time, so every iteration goes through the daemon.
            fd = os.open(mnt / "fast.bin", os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            assert os.pread(fd, 4096, 0) == b"f" * 4096
            os.close(fd)
            os.stat(mnt / "fast.bin")
        assert t.is_alive() and not done, "the slow read finished: the test did not overlap"
    finally:
        p.kill()               # (a daemon whose store thread hangs would not exit in time on SIGTERM)
        p.wait(timeout=20)
        force_unmount(mnt)
        t.join(timeout=30)

"""bench/cross_dc_eval.py's `--hold-staging` diagnostic (`tests/helpers/staging_holder.py`): it holds
each staging file a mount opens, and only those, until released, so their pages outlive the
mount's unlink."""
import os
import time

import pytest

from tests.helpers.procs import wait_for
from tests.helpers.staging_holder import StagingHolder


def test_the_holder_keeps_each_staging_file_and_no_other(tmp_path):
    staging = tmp_path / ".hintfs-tmp.abc"
    other = tmp_path / "data.bin"
    staging.write_bytes(b"x" * 4096)
    other.write_bytes(b"y")
    # This process stands in for the mount: the holder reads its descriptors.
    holder = StagingHolder(os.getpid())
    fd_s, fd_o = os.open(staging, os.O_RDONLY), os.open(other, os.O_RDONLY)
    try:
        assert wait_for(lambda: len(holder.held) == 1, 5)
        time.sleep(0.05)                     # more polls: the same file is not held twice
        (held_fd,) = holder.held.values()
        assert os.fstat(held_fd).st_ino == staging.stat().st_ino
    finally:
        os.close(fd_s)
        os.close(fd_o)
    staging.unlink()                         # as the mount does after the upload
    assert os.fstat(held_fd).st_nlink == 0   # ...the holder still has the inode and its pages
    assert holder.release() == 1
    with pytest.raises(OSError):           # closed by the release
        os.fstat(held_fd)


def test_a_holder_of_no_process_holds_nothing():
    holder = StagingHolder(None)
    assert holder.release() == 0

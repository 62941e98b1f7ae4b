"""The spool folder of a remote store (`[cache] spool_dir`: where writes stage until close uploads
them, hintfs/stores/arrow.py) is the daemon's own, as `[cache] dir` is (hintfs.common.owndir, issue 34 finding
12): a folder owned by the daemon's user, not a symlink, not open to others. The daemon makes it
0700; one made by another user, or a symlink, is refused at mount time with one line; a folder
swapped in later is refused at the next write, and nothing is staged in it.

The attacks run as uid 65534 in a folder every user may write (as /tmp). Before the fix the
mount accepted a spool folder uid 65534 made 0777 and staged root's writes in it."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from hintfs.common.errors import HintfsError
from fusefs.mount import MountError, open_checked_store
from mountconfig import parse_config
from hintfs.stores.arrow import ArrowStore
from tests.helpers.security import NOBODY, WorldDir, as_nobody, can_run_as_nobody

needs_nobody = pytest.mark.skipif(not can_run_as_nobody(), reason="needs root, setpriv and a Python uid 65534 can run")


@pytest.fixture
def shared_tmp():
    """A folder every user may write, sticky, as /tmp."""
    d = WorldDir()
    d.path.chmod(0o1777)
    try:
        yield d.path
    finally:
        d.close()


def s3_config(spool: Path | str):
    """An S3 store (never reached: no startup check) whose writes stage in `spool`."""
    return parse_config({"store": {"uri": "s3://bucket/data", "endpoint_override": "http://127.0.0.1:9",
                                   "access_key": "k", "secret_key": "s", "startup_check": False},
                         "cache": {"spool_dir": str(spool)}})


def mock_store(spool: Path) -> ArrowStore:
    fs = pafs._MockFileSystem()
    fs.create_dir("bucket")
    return ArrowStore(fs, "bucket", str(spool), "mem://bucket")


def nobody_makes(path: Path, how: str) -> None:
    got = as_nobody(f"""
        import json, os
        p = {str(path)!r}
        if {how!r} == "dir":
            os.mkdir(p)
            os.chmod(p, 0o777)
        else:
            os.symlink({how!r}, p)
        print(json.dumps({{"uid": os.lstat(p).st_uid}}))
    """)
    assert got == {"uid": NOBODY}


@needs_nobody
def test_a_spool_folder_another_user_made_is_refused_at_mount_time(shared_tmp):
    spool = shared_tmp / "spool"
    nobody_makes(spool, "dir")
    with pytest.raises(MountError) as exc:
        open_checked_store(s3_config(spool))
    line = str(exc.value)
    assert "\n" not in line and f"cache.spool_dir {spool}" in line and f"owned by uid {NOBODY}" in line, line
    assert os.listdir(spool) == []


@needs_nobody
def test_a_symlinked_spool_folder_is_refused_at_mount_time(shared_tmp, tmp_path):
    mine = tmp_path / "mine"                 # a folder of root's: the link would lead root's writes there
    mine.mkdir(mode=0o700)
    spool = shared_tmp / "spool"
    nobody_makes(spool, str(mine))
    with pytest.raises(MountError) as exc:
        open_checked_store(s3_config(spool))
    assert "cache.spool_dir" in str(exc.value) and "\n" not in str(exc.value)
    assert os.listdir(mine) == []


def test_the_daemon_makes_its_spool_folder_0700_and_tightens_its_own(tmp_path, caplog):
    spool = tmp_path / "a" / "spool"
    open_checked_store(s3_config(spool))
    st = os.stat(spool)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    open_checked_store(s3_config(loose))
    assert stat.S_IMODE(os.stat(loose).st_mode) == 0o700
    assert f"cache.spool_dir {loose} was mode 777: made 0700" in caplog.text


def test_a_relative_spool_folder_is_refused(tmp_path):
    from mountconfig.load import ConfigError
    with pytest.raises(ConfigError) as exc:      # by the config's schema, naming the key
        s3_config("spool")
    assert "cache.spool_dir" in str(exc.value) and "absolute" in str(exc.value)


@needs_nobody
def test_a_spool_folder_swapped_after_mount_is_refused_at_the_next_write(shared_tmp):
    spool = shared_tmp / "spool"
    store = mock_store(spool)
    staging = store.new_staging("f", copy_existing=False)      # the daemon's own folder: fine
    staging.close()
    os.rename(spool, shared_tmp / "old-spool")                  # (as a cleaner of /tmp might)
    nobody_makes(spool, "dir")
    with pytest.raises(HintfsError) as exc:
        store.new_staging("g", copy_existing=False)
    assert exc.value.errno == errno.EACCES and f"owned by uid {NOBODY}" in exc.value.strerror
    assert os.listdir(spool) == []

"""A local store's listings on the event loop through the FUSE library's C lister
(`LocalStore.refuse_device(st_dev, statx_dir)`, patches/pyfuse3-statdir.patch): the same entries
and attributes as the ctypes statx path, the same rules (staging files hidden, the mount's own
device left out, an entry gone meanwhile skipped, any other error raised)."""
from __future__ import annotations

import errno
import os

import pytest

from hintfs.common.paths import STAGING_PREFIX
from hintfs.stores.local import LocalStore


def _tree(root):
    (root / "d").mkdir()
    (root / "f").write_bytes(b"x" * 100)
    (root / "g").write_bytes(b"")
    os.link(root / "f", root / "hard")
    (root / "l").symlink_to("f")
    os.mkfifo(root / "p")
    (root / f"{STAGING_PREFIX}x.1.1.otherhost").write_bytes(b"staged")
    os.close(os.open(os.fsencode(root) + b"/bad\xff name", os.O_CREAT | os.O_WRONLY, 0o600))   # not UTF-8
    for i in range(150):                       # more than one chunk of the lister
        (root / "d" / f"n{i:03d}").write_bytes(b"y" * i)


def _listing(store: LocalStore, rel: str) -> dict:
    return dict(store.iter_dir(rel))


def test_the_c_lister_and_the_ctypes_statx_list_the_same(tmp_path):
    import pyfuse3
    if not hasattr(pyfuse3, "StatxDir"):
        pytest.skip("pyfuse3 without patches/pyfuse3-statdir.patch (make setup builds it)")
    _tree(tmp_path)
    plain, fast = LocalStore(str(tmp_path)), LocalStore(str(tmp_path))
    other_dev = os.stat(tmp_path).st_dev + 12345     # a device no entry is on
    plain.refuse_device(other_dev)
    fast.refuse_device(other_dev, pyfuse3.StatxDir)
    for rel in ("", "d"):
        want, got = _listing(plain, rel), _listing(fast, rel)
        assert got == want and len(got) == (7 if rel == "" else 150)
        assert not any(n.startswith(STAGING_PREFIX) for n in got)
    assert got["n149"].size == 149 and "bad\udcff name" in _listing(fast, "")


class _Lister:
    """A stand-in for pyfuse3.StatxDir: the given entries, two at a time."""

    def __init__(self, entries):
        self.entries, self.closed = list(entries), False

    def next(self, most):
        chunk, self.entries = self.entries[:2], self.entries[2:]
        return chunk

    def close(self):
        self.closed = True


def test_the_c_listers_entries_follow_the_stores_rules(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    st = os.stat(tmp_path / "f")
    fields = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink, st.st_uid, st.st_gid,
              st.st_atime_ns, st.st_dev, st.st_ino, st.st_rdev)
    mine = st.st_dev + 1
    own = (fields[:8] + (mine,) + fields[9:])
    made: list[_Lister] = []

    def factory(entries):
        def make(fd):
            os.fstat(fd)                          # (a folder's fd, open while listed)
            made.append(_Lister(entries))
            return made[-1]
        return make

    store = LocalStore(str(tmp_path))
    store.refuse_device(mine, factory([("f", 0, fields), ("gone", errno.ENOENT, None), ("self", 0, own),
                                       (f"{STAGING_PREFIX}y", 0, fields)]))
    got = dict(store.iter_dir(""))
    assert list(got) == ["f"] and got["f"].size == 3 and got["f"].ino == st.st_ino
    assert made[-1].closed
    store.refuse_device(mine, factory([("f", 0, fields), ("locked", errno.EACCES, None)]))
    with pytest.raises(PermissionError):
        dict(store.iter_dir(""))
    assert made[-1].closed
    # off the loop (a worker thread's listing) and by type only, the lister is not used
    n = len(made)
    assert set(dict(store.iter_dir_in_thread(""))) == {"f"} and len(made) == n

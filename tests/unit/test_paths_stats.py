"""Pure pieces: path rules (nothing escapes the store) and latency percentiles."""
import errno

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hintfs.common import paths
from hintfs.common.errors import HintfsError
from hintfs.stores.errors import errno_of
from fusefs.stats import OpStats, Stats


@pytest.mark.parametrize("name", [b"", b".", b"..", b"a/b", b"a\0b"])
def test_child_refuses_names_that_could_escape(name):
    with pytest.raises(HintfsError) as exc:
        paths.child("dir", name)
    assert exc.value.errno == errno.EINVAL


def test_child_joins():
    assert paths.child("", b"a") == "a"
    assert paths.child("a/b", b"c") == "a/b/c"


@pytest.mark.parametrize("root, path, rel", [
    ("/mnt/h", "/mnt/h", ""),
    ("/mnt/h", "/mnt/h/ckpt/s1", "ckpt/s1"),
    ("/mnt/h/", "/mnt/h/./ckpt//s1/", "ckpt/s1"),
    ("/mnt/h", "/mnt/h/..data/x", "..data/x"),      # a folder named `..data` is inside
    ("/mnt/h", "/mnt/h/...", "..."),
    ("/mnt/h", "/mnt/h/a/../b", "b"),
    ("/mnt/h", "/mnt", None),
    ("/mnt/h", "/mnt/h/../other", None),
    ("/mnt/h", "/mnt/hx", None),                     # a sibling with the same prefix
    ("/", "/etc", "etc"),
])
def test_inside_is_the_one_rule_of_inside_the_mount(root, path, rel):
    assert paths.inside(root, path) == rel


def test_inside_takes_relative_paths_from_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert paths.inside(str(tmp_path), "d/f") == "d/f"
    assert paths.inside("d", str(tmp_path / "e")) is None
    assert paths.inside("d", "d/..e") == "..e"


@pytest.mark.parametrize("link, target, ok", [
    ("a/l", "b", True),
    ("a/l", "../b", True),
    ("a/l", "../../b", False),
    ("l", "../etc/passwd", False),
    ("a/l", "/etc/passwd", False),
    ("a/b/l", "./../../x", True),
    ("a/l", "b/../../../x", False),
    ("a/l", "", False),
])
def test_symlink_targets(link, target, ok):
    assert paths.symlink_target_ok(link, target) is ok


@given(st.lists(st.sampled_from(["a", "b", "..", "."]), min_size=1, max_size=8),
       st.lists(st.sampled_from(["x", "y"]), min_size=0, max_size=3))
def test_accepted_symlinks_never_leave_the_root(parts, base):
    import posixpath
    target = "/".join(parts)
    link = "/".join(base + ["l"])
    if paths.symlink_target_ok(link, target):
        # Resolve step by step, as the kernel would, and never climb above the root.
        depth = len(base)
        for p in target.split("/"):
            depth += -1 if p == ".." else (0 if p in (".", "") else 1)
            assert depth >= 0
        assert not posixpath.isabs(target)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=1_000, max_value=10_000_000_000), min_size=20, max_size=500))
def test_percentiles_are_within_a_bucket_of_exact(samples):
    s = OpStats()
    for ns in samples:
        s.record(ns)
    for q in (0.5, 0.9, 0.99):
        exact = np.percentile(np.array(samples) / 1000.0, q * 100, method="inverted_cdf")
        got = s.percentile_us(q)
        assert exact * 0.8 <= got <= exact * 1.25 + 1.0, (q, exact, got)


def test_snapshot_shape():
    s = Stats()
    s.record("read", 5000)
    s.error("read", errno.EIO)
    s.add("bytes_read", 10)
    snap = s.snapshot()
    assert snap["ops"]["read"]["count"] == 1 and snap["ops"]["read"]["errors"] == 1
    assert snap["bytes"]["read"] == 10
    assert snap["errors"] == {str(errno.EIO): 1}


@pytest.mark.parametrize("exc, code", [
    (FileNotFoundError(), errno.ENOENT),
    (PermissionError(), errno.EACCES),
    (OSError(errno.ENOSPC, "full"), errno.ENOSPC),
    (OSError("When reading information for key 'x': AWS Error ACCESS_DENIED"), errno.EACCES),
    (OSError("AWS Error NO_SUCH_KEY: NoSuchKey"), errno.ENOENT),
    (OSError("something odd"), errno.EIO),
])
def test_errno_mapping(exc, code):
    assert errno_of(exc) == code


_seg = st.sampled_from(["a", "b", ".hintfs", ".hintfs-journal", "jr", "ab"])


@given(folder=st.lists(_seg, max_size=3), name=_seg, journal=st.lists(_seg, min_size=1, max_size=3))
@settings(max_examples=500, deadline=None)
def test_a_folder_said_to_hold_no_reserved_name_holds_none(folder, name, journal):
    """`may_hold_reserved` lets the naming of a folder's entries skip `reserved` per name: it must
    never say False of a folder where some name is reserved."""
    f, j = "/".join(folder), "/".join(journal)
    if paths.reserved(f"{f}/{name}" if f else name, j):
        assert paths.may_hold_reserved(f, j)
    assert paths.may_hold_reserved("", j)

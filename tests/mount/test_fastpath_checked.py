"""Checked marks (docs/fastpath.md, "Checked marks"; patches/pyfuse3-fastverify.patch): on a
file:// store, files not declared immutable are marked for the fast path too, and each open
pyfuse3 answers first checks that the path, resolved beneath the store root, still names the
marked file: close-to-open as the store's own check makes it under passthrough. Whatever changes
in the store outside the mount, an open reads what a Python open would: the new file at the
name, ENOENT for none, never a file outside the root, never one a symlink leads to."""
from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from tests.conftest import needs_fuse
from tests.helpers.mounts import world_mount
from tests.helpers.security import can_run_as_nobody, nobody_read_files

pytestmark = needs_fuse


def _fast(m) -> dict:
    return m.stats()["fast_path"]


def _ops(m) -> dict:
    return {k: v["count"] for k, v in m.stats()["ops"].items()}


def _checked_on(m) -> None:
    f = _fast(m)
    if f["state"] != "on" or "opens_checked" not in f:
        pytest.skip(f"fast path {f['state']} (needs FUSE passthrough and the patched pyfuse3)")


def _files(m, n: int, folder: str = "plain") -> list[str]:
    (m.store / folder).mkdir(exist_ok=True)
    for i in range(n):
        (m.store / folder / f"f{i:03d}").write_bytes(bytes([i]) * (1000 + i))
    return [f"f{i:03d}" for i in range(n)]


def test_later_opens_of_a_plain_file_are_answered_in_pyfuse3_each_checked(mount_factory):
    m = mount_factory("")
    _checked_on(m)
    names = _files(m, 10)
    for i, name in enumerate(names):                        # first opens: Python, marked checked
        assert (m.mnt / "plain" / name).read_bytes() == bytes([i]) * (1000 + i)
    f0, before = _fast(m), _ops(m)
    assert f0["inodes"] == 10 and f0["inodes_checked"] == 10
    for _ in range(3):
        for i, name in enumerate(names):
            assert (m.mnt / "plain" / name).read_bytes() == bytes([i]) * (1000 + i)
    f1, after = _fast(m), _ops(m)
    assert after["open"] - before["open"] <= 2, (before, after)    # (the stats file's own)
    assert f1["opens"] - f0["opens"] == 30 and f1["opens_checked"] - f0["opens_checked"] == 30
    assert f1["opens_check_missed"] == f0["opens_check_missed"] == 0
    assert f1["getattrs"] == f0["getattrs"] == 0      # a checked mark's attributes stay Python's


def test_a_file_replaced_in_the_store_is_opened_anew_by_python(mount_factory):
    m = mount_factory("")
    _checked_on(m)
    _files(m, 1)
    f, raw = m.mnt / "plain" / "f000", m.store / "plain" / "f000"
    assert f.read_bytes() == b"\0" * 1000 and _fast(m)["inodes_checked"] == 1
    with open(f, "rb") as old:                               # a reader of the old file, fast
        (raw.parent / "new").write_bytes(b"the new file")
        os.replace(raw.parent / "new", raw)                  # another host's publish: a new inode
        before = _fast(m)
        assert f.read_bytes() == b"the new file"             # pyfuse3's check sent it to Python
        after = _fast(m)
        assert after["opens_check_missed"] - before["opens_check_missed"] >= 1
        assert m.stats()["counters"].get("opens_renewed", 0) >= 1
        assert old.read() == b"\0" * 1000                    # the old reader reads its own file
    for _ in range(2):                                       # the new file is marked, and fast
        assert f.read_bytes() == b"the new file"
    assert _fast(m)["opens"] > after["opens"]


def test_a_file_changed_in_place_in_the_store_is_the_same_file(mount_factory):
    """In place is the same file (dev, ino) to the store's check too: read through passthrough,
    the open sees the new bytes."""
    m = mount_factory("")
    _checked_on(m)
    _files(m, 1)
    f, raw = m.mnt / "plain" / "f000", m.store / "plain" / "f000"
    f.read_bytes()
    with open(raw, "r+b") as w:
        w.write(b"xyz")
    before = _fast(m)
    assert f.read_bytes()[:4] == b"xyz\0"
    assert _fast(m)["opens"] - before["opens"] == 1 and _fast(m)["opens_check_missed"] == 0


def test_a_file_removed_from_the_store_is_enoent_and_a_folder_moved_away_is_not_followed(mount_factory):
    m = mount_factory("")
    _checked_on(m)
    _files(m, 2)
    a, b = m.mnt / "plain" / "f000", m.mnt / "plain" / "f001"
    a.read_bytes(), b.read_bytes()
    os.unlink(m.store / "plain" / "f000")
    with pytest.raises(FileNotFoundError):
        a.read_bytes()
    # The folder moved away and another put at its name: the marked file is no longer at the path.
    os.rename(m.store / "plain", m.store / "moved")
    (m.store / "plain").mkdir()
    (m.store / "plain" / "f001").write_bytes(b"not the marked file")
    assert b.read_bytes() == b"not the marked file"
    assert _fast(m)["opens_check_missed"] >= 2


def _world(files: dict[str, bytes], pub_mode: int, cfg: str = ""):
    """A mount in a folder every user may traverse: `files` (0644) in the store's `pub` folder
    (`pub_mode`), and a file `outside/a` beside the store, outside it."""
    def setup(base: Path) -> str:
        (base / "store" / "pub").mkdir()
        (base / "store").chmod(0o755)
        (base / "store" / "pub").chmod(pub_mode)
        for name, data in files.items():
            (base / "store" / "pub" / name).write_bytes(data)
            (base / "store" / "pub" / name).chmod(0o644)
        (base / "outside").mkdir()
        (base / "outside" / "a").write_bytes(b"outside the store")
        (base / "outside" / "a").chmod(0o644)
        return cfg

    return world_mount(setup, prefix="hintfs-checked-")


@pytest.fixture
def world():
    with _world({"a": b"public a"}, 0o777) as m:
        yield m


@pytest.mark.skipif(not can_run_as_nobody(), reason="needs root and setpriv")
def test_a_symlink_swapped_in_the_store_never_leads_a_fast_open_out(world):
    """A user who may write the store's folder swaps a marked file, then its folder, for symlinks
    to a file outside the store: the opens that follow read neither that file nor the marked
    one's bytes through the mark. A symlink in the store is a symlink in the mount, refused where
    it points out (EACCES); a folder that leads out of the root is EACCES too, or EIO where the
    kernel still held the name's folder as a folder (a folder turned symlink is a stale inode)."""
    m = world
    _checked_on(m)
    pub = m.mnt / "pub"
    outside = m.store.parent / "outside"
    assert nobody_read_files([str(pub / "a")])[str(pub / "a")] == "public a"   # marked by 65534's open
    nobody_read_files([str(pub / "a")])
    assert _fast(m)["inodes_checked"] == 1 and _fast(m)["opens"] >= 1
    os.unlink(m.store / "pub" / "a")
    os.symlink(outside / "a", m.store / "pub" / "a")
    got = nobody_read_files([str(pub / "a")])[str(pub / "a")]
    assert got == f"errno {errno.EACCES}", got
    assert _fast(m)["opens_check_missed"] >= 1
    os.unlink(m.store / "pub" / "a")
    os.rename(m.store / "pub", m.store / "pub.old")
    os.symlink(outside, m.store / "pub")                      # the folder itself leads out
    got = nobody_read_files([str(pub / "a")])[str(pub / "a")]
    assert got != "outside the store", got
    assert got.startswith("errno"), got
    assert int(got.split()[1]) in (errno.EACCES, errno.EIO), got


def test_checked_marks_off_marks_only_immutable_paths(mount_factory):
    m = mount_factory("\n[mount]\nfast_checked_opens = false\n")
    _checked_on(m)
    names = _files(m, 3)
    for _ in range(2):
        for name in names:
            (m.mnt / "plain" / name).read_bytes()
    f = _fast(m)
    assert f["inodes"] == 0 and f["opens"] == 0 and f["marked"] == 0


def test_a_reader_going_through_a_folder_gets_its_files_marked_at_their_lookups(mount_factory):
    """Once `fast_opens_ahead` (2) files of a folder got checked marks at their first opens, the
    lookups of its other files mark them (`Filesystem._mark_at_lookup`), or, once the folder's
    names are registered (`_name_checked`), they are marked ahead: their first opens and
    releases are answered in pyfuse3 too, each checked, and read their own bytes. A folder whose
    files are only looked up (`stat`) is never marked."""
    m = mount_factory("")
    _checked_on(m)
    names = _files(m, 12)
    stat_only = _files(m, 6, folder="statted")
    for name in stat_only:
        os.stat(m.mnt / "statted" / name)
    before = _ops(m)
    for i, name in enumerate(names):
        assert (m.mnt / "plain" / name).read_bytes() == bytes([i]) * (1000 + i)
    after, f = _ops(m), _fast(m)
    assert after["open"] - before["open"] <= 2 + 2, (before, after)    # (the stats file's own)
    assert f["opens"] == 10 and f["opens_checked"] == 10, f
    # (each marked at its lookup, or ahead once the folder's names were registered, if first)
    assert f["marked_at_lookup"] + f["marked_ahead"] == 10 and f["inodes"] == 12, f
    (m.store / "plain" / "f011").write_bytes(b"changed in the store")     # a new file, in place
    assert (m.mnt / "plain" / "f011").read_bytes() == b"changed in the store"


def test_readahead_through_an_open_pyfuse3_answered_is_answered_from_the_mark(mount_factory):
    """posix_fadvise(WILLNEED) on an open answered inside pyfuse3 makes the kernel READ the FUSE
    file's own pages through the daemon with that open's handle: answered from the mark's backing
    file (it was an error: no such handle in Python)."""
    m = mount_factory("")
    _checked_on(m)
    data = os.urandom(300_000)
    (m.store / "ra.bin").write_bytes(data)
    assert (m.mnt / "ra.bin").read_bytes() == data                       # marked
    fd = os.open(m.mnt / "ra.bin", os.O_RDONLY)                          # answered in pyfuse3
    try:
        assert _fast(m)["opens"] == 1
        os.posix_fadvise(fd, 0, len(data), os.POSIX_FADV_WILLNEED)
        assert os.pread(fd, len(data), 0) == data
    finally:
        os.close(fd)
    s = m.stats()
    assert s["ops"].get("read", {}).get("errors", 0) == 0, s["ops"].get("read")
    assert s["counters"].get("passthrough_daemon_reads", 0) >= 1         # the kernel did ask


ZERO = "\n[cache]\nattr_timeout_s = 0\nentry_timeout_s = 0\n"


def _registered(m, names: list[str], folder: str = "plain") -> None:
    """Read the files in order until the folder's names are registered (`_name_checked` runs
    beside the reads, after the second open)."""
    for name in names:
        (m.mnt / folder / name).read_bytes()
    for _ in range(200):
        if m.stats()["fast_lookups"].get("folders_named", 0) >= 1:
            return
        time.sleep(0.01)
    raise AssertionError(m.stats()["fast_lookups"])


def test_checked_names_answer_lookups_in_pyfuse3_with_the_attributes_of_now(mount_factory):
    """A folder a reader goes through has its names registered in pyfuse3, each LOOKUP checked:
    with no kernel caching (timeouts 0), every stat is a LOOKUP, answered inside pyfuse3 with the
    size, mode and times the store has now; a file replaced, removed or turned symlink in the
    store goes to Python, which answers as it always did."""
    m = mount_factory(ZERO)
    _checked_on(m)
    names = _files(m, 8)
    _registered(m, names)
    f0 = _fast(m)
    for i in (3, 4):
        assert os.stat(m.mnt / "plain" / names[i]).st_size == 1000 + i
    assert _fast(m)["lookups_checked"] - f0["lookups_checked"] >= 2
    raw = m.store / "plain"
    with open(raw / names[3], "ab") as w:                              # changed in place
        w.write(b"more")
    os.chmod(raw / names[3], 0o600)
    st = os.stat(m.mnt / "plain" / names[3])
    assert st.st_size == 1007 and st.st_mode & 0o777 == 0o600
    assert (m.mnt / "plain" / names[3]).read_bytes() == bytes([3]) * 1003 + b"more"
    os.unlink(raw / names[5])                                          # removed
    with pytest.raises(FileNotFoundError):
        os.stat(m.mnt / "plain" / names[5])
    os.unlink(raw / names[6])
    os.symlink(names[0], raw / names[6])                               # a symlink now
    assert os.path.islink(m.mnt / "plain" / names[6])
    (raw / "n").write_bytes(b"a new file")
    os.replace(raw / "n", raw / names[4])                              # replaced (its open renews
    assert os.stat(m.mnt / "plain" / names[4]).st_size == 10            # the name: the folder's
    assert (m.mnt / "plain" / names[4]).read_bytes() == b"a new file"  # names go then)
    f1 = _fast(m)
    assert f1["lookups_check_missed"] - f0["lookups_check_missed"] >= 3, f1
    assert m.stats()["ops"].get("lookup", {}).get("errors", 0) >= 1      # (the ENOENT)


@pytest.fixture
def world_zero():
    """`world`'s, with no kernel caching, six readable files."""
    with _world({f"f{i:03d}": b"open %d" % i for i in range(6)}, 0o755, ZERO) as m:
        yield m


@pytest.mark.skipif(not can_run_as_nobody(), reason="needs root and setpriv")
def test_a_mode_changed_in_the_store_is_what_the_kernel_checks_after_a_checked_lookup(world_zero):
    """The kernel's permission check uses the attributes of the LOOKUP: a checked name's are read
    at that lookup, so a file the store made private since its registration is refused to
    another user at once, and one made public again is readable."""
    m = world_zero
    _checked_on(m)
    pub = m.mnt / "pub"
    names = [f"f{i:03d}" for i in range(6)]
    got = nobody_read_files([str(pub / n) for n in names])             # uid 65534 goes through them
    assert all(got[str(pub / n)] == "open %d" % i for i, n in enumerate(names)), got
    for _ in range(200):
        if m.stats()["fast_lookups"].get("folders_named", 0) >= 1:
            break
        time.sleep(0.01)
    assert m.stats()["fast_lookups"]["folders_named"] >= 1
    os.chmod(m.store / "pub" / "f004", 0o600)
    before = _fast(m)["lookups_checked"]
    got = nobody_read_files([str(pub / "f004"), str(pub / "f005")])
    assert got[str(pub / "f004")] == f"errno {errno.EACCES}", got
    assert got[str(pub / "f005")] == "open 5"
    assert _fast(m)["lookups_checked"] > before
    os.chmod(m.store / "pub" / "f004", 0o644)
    assert nobody_read_files([str(pub / "f004")])[str(pub / "f004")] == "open 4"


def test_files_marked_before_their_first_open_are_opened_by_pyfuse3_each_checked(mount_factory):
    """Lazy marks (docs/fastpath.md, "Lazy marks"; patches/pyfuse3-fastlazy.patch): once a reader
    opened two files of a folder, its other files are marked with no open; pyfuse3 opens each at
    its first open, beneath the store root and only if it is still the marked file, and answers
    it. Files replaced, removed or swapped for a symlink out of the store before their first open
    read what a Python open reads: the new file, ENOENT, never the outside file."""
    m = mount_factory("")
    _checked_on(m)
    names = _files(m, 8)
    outside = m.store.parent / "outside-lazy"
    outside.write_bytes(b"outside the store")
    _registered(m, names[:2])
    for _ in range(200):
        if _fast(m)["marked_lazy"] >= 6:
            break
        time.sleep(0.01)
    f0, before = _fast(m), _ops(m)
    assert f0["marked_lazy"] == 6 and f0["inodes_lazy"] == 6, f0
    (m.store / "plain" / "f005.new").write_bytes(b"a new five")     # (another inode: the old one still is)
    os.replace(m.store / "plain" / "f005.new", m.store / "plain" / "f005")
    os.unlink(m.store / "plain" / "f006")
    os.symlink(outside, m.store / "plain" / "f006")
    os.unlink(m.store / "plain" / "f007")
    for i in (2, 3, 4):
        assert (m.mnt / "plain" / names[i]).read_bytes() == bytes([i]) * (1000 + i)
    assert (m.mnt / "plain" / "f005").read_bytes() == b"a new five"
    with pytest.raises(OSError) as err:
        (m.mnt / "plain" / "f006").read_bytes()
    assert err.value.errno == errno.EACCES
    assert not (m.mnt / "plain" / "f007").exists()
    f1, after = _fast(m), _ops(m)
    assert f1["lazy_first_opens"] - f0["lazy_first_opens"] == 3, f1     # (f002-f004, in pyfuse3)
    assert f1["lazy_adopted"] == f1["lazy_first_opens"]                 # (handed over: the stats' open)
    assert after["open"] - before["open"] <= 1 + 2, (before, after)     # (f005's, and the stats files')
    for i in (2, 3, 4):                                                 # (again: a checked mark's opens)
        assert (m.mnt / "plain" / names[i]).read_bytes() == bytes([i]) * (1000 + i)
    assert _fast(m)["opens"] - f1["opens"] == 3


@pytest.mark.skipif(not can_run_as_nobody(), reason="needs root and setpriv")
def test_a_lazy_mark_root_made_opens_for_another_user_only_what_its_mode_allows():
    """Root's reads of a folder mark its other files lazily; uid 65534's first opens of them are
    the ones pyfuse3 answers: a 0600 file stays EACCES (the kernel's check comes before the OPEN),
    a 0644 one reads its bytes."""
    files = {f"f{i}": bytes([65 + i]) * 10 for i in range(4)}
    with _world(files, 0o755) as m:
        _checked_on(m)
        (m.store / "pub" / "f2").chmod(0o600)
        for name in ("f0", "f1"):
            (m.mnt / "pub" / name).read_bytes()
        for _ in range(200):
            if _fast(m)["marked_lazy"] >= 2:
                break
            time.sleep(0.01)
        assert _fast(m)["marked_lazy"] == 2
        got = nobody_read_files([str(m.mnt / "pub" / "f2"), str(m.mnt / "pub" / "f3")])
        assert got == {str(m.mnt / "pub" / "f2"): f"errno {errno.EACCES}",
                       str(m.mnt / "pub" / "f3"): "D" * 10}, got
        assert _fast(m)["lazy_first_opens"] == 1

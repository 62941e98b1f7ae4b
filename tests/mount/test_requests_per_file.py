"""Requests the daemon answers per small file (`.hintfs/stats` ops): a listing pre-fills the
kernel's lookups (pyfuse3 answers readdir with readdirplus), read-only opens send no FLUSH
(noflush), and with passthrough the reads never reach the daemon."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.conftest import needs_fuse

pytestmark = needs_fuse

N = 50


def _ops(m) -> dict:
    return {k: v["count"] for k, v in m.stats()["ops"].items()}


def test_a_listed_folder_is_read_with_an_open_and_a_release_per_file(mount_factory):
    m = mount_factory('\n[cache]\nimmutable_globs = ["d/*"]\n')
    (m.store / "d").mkdir()
    for i in range(N):
        (m.store / "d" / f"f{i:03d}").write_bytes(bytes([i]) * (4096 + i))
    names = sorted(os.listdir(m.mnt / "d"))          # readdirplus: entries and attributes
    assert len(names) == N
    before = _ops(m)
    for i, name in enumerate(names):
        assert (m.mnt / "d" / name).read_bytes() == bytes([i]) * (4096 + i)
    after = _ops(m)
    per_op = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    # (reading the stats file between the two snapshots costs a few requests of its own)
    assert per_op.get("lookup", 0) <= 3, per_op      # the listing's entries served every lookup
    assert per_op.get("flush", 0) == 0, per_op       # noflush on read-only opens
    assert N <= per_op["open"] <= N + 1 and per_op.get("release", 0) >= N - 1
    if m.stats()["passthrough"]["state"] == "on":
        assert per_op.get("read", 0) <= 2, per_op    # the stats file's own: the kernel read the store files
    total = sum(v for k, v in per_op.items() if k != "forget")
    assert total <= 2 * N + 12, per_op   # (plus the stats reads: about 10 requests)


def test_the_kernel_keeps_the_listing_of_an_immutable_folder_until_this_mount_changes_it(mount_factory):
    """A folder matching `immutable_globs` is opened with FOPEN_CACHE_DIR (the patched pyfuse3):
    a second listing never reaches the daemon; a file created through the mount is listed at
    once (the kernel drops the kept listing); a folder not declared immutable is listed by the
    daemon every time."""
    import pyfuse3
    m = mount_factory('\n[cache]\nimmutable_globs = ["d", "d/*"]\n')
    for folder in ("d", "e"):
        (m.store / folder).mkdir()
        for i in range(N):
            (m.store / folder / f"f{i:03d}").write_bytes(b"x")
    assert len(os.listdir(m.mnt / "d")) == N and len(os.listdir(m.mnt / "e")) == N
    before = _ops(m)
    assert len(os.listdir(m.mnt / "d")) == N
    between = _ops(m)
    assert len(os.listdir(m.mnt / "e")) == N
    after = _ops(m)
    if hasattr(pyfuse3, "cache_dir_supported"):
        assert between.get("readdir", 0) == before.get("readdir", 0), (before, between)
    assert after.get("readdir", 0) > between.get("readdir", 0)      # not immutable: the daemon lists it
    (m.mnt / "d" / "new").write_bytes(b"y")                          # a change through this mount
    assert "new" in os.listdir(m.mnt / "d")
    (m.mnt / "d" / "f000").unlink()
    assert "f000" not in os.listdir(m.mnt / "d") and len(os.listdir(m.mnt / "d")) == N


def test_a_walk_gets_files_by_name_until_it_stats_them(mount_factory):
    """`fusefs.walks`: a thread that lists more than WALK_AFTER folders gets the files of the
    next ones by name (no inode made, no lookup counted); what it sees is the same; once it
    looks up a file of such a folder, its listings have attributes again. Another process's
    single listing (`ls -l`) has attributes."""
    import pyfuse3
    from fusefs.walks import WALK_AFTER
    m = mount_factory()
    folders = WALK_AFTER + 6
    for d in range(folders):
        (m.store / f"d{d:02d}").mkdir()
        (m.store / f"d{d:02d}" / "sub").mkdir()
        for i in range(5):
            (m.store / f"d{d:02d}" / f"f{i}").write_bytes(b"x" * (d + i))

    def by_name() -> int:
        return m.stats()["counters"].get("listings_by_name", 0)

    for d in range(WALK_AFTER + 3):
        with os.scandir(m.mnt / f"d{d:02d}") as it:
            seen = {(e.name, e.is_dir(), e.is_file()) for e in it}
        assert seen == {("sub", True, False)} | {(f"f{i}", False, True) for i in range(5)}
    if not hasattr(pyfuse3, "cache_dir_supported"):
        assert by_name() == 0
        return
    assert by_name() == 3
    last = m.mnt / f"d{WALK_AFTER + 2:02d}"
    assert os.stat(last / "f4").st_size == WALK_AFTER + 2 + 4      # a name listed plain: a lookup
    os.listdir(m.mnt / f"d{WALK_AFTER + 3:02d}")                  # this thread stats: attributes
    assert by_name() == 3
    r = subprocess.run(["ls", "-l", str(m.mnt / f"d{WALK_AFTER + 4:02d}")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.count("\n-") == 5 and by_name() == 3


def test_a_walk_lists_a_folder_bigger_than_the_kernels_buffer_by_name(mount_factory):
    """A walking thread's listing of a folder whose names fill the kernel's buffer several times:
    runs of files go by name in batches (the patched pyfuse3's `readdir_names`), cut where the
    buffer is full and resumed at the next request; every name comes once, with its type,
    folders among them with their attributes."""
    import pyfuse3
    from fusefs.walks import WALK_AFTER
    m = mount_factory()
    for d in range(WALK_AFTER + 1):
        (m.store / f"w{d:02d}").mkdir()
    big = m.store / "big"
    big.mkdir()
    want = set()
    for i in range(900):
        if i % 97 == 0:
            (big / f"sub-{i:04d}").mkdir()
            want.add((f"sub-{i:04d}", True, False))
        elif i % 89 == 0:
            (big / f"link-{i:04d}").symlink_to("nowhere")
            want.add((f"link-{i:04d}", False, False))
        else:
            name = f"file-{i:04d}-" + "n" * 40
            (big / name).write_bytes(b"")
            want.add((name, False, True))
    for d in range(WALK_AFTER + 1):
        os.listdir(m.mnt / f"w{d:02d}")
    with os.scandir(m.mnt / "big") as it:
        seen = [(e.name, e.is_dir(follow_symlinks=False), e.is_file(follow_symlinks=False)) for e in it]
    assert len(seen) == len(want) and set(seen) == want
    if hasattr(pyfuse3, "cache_dir_supported"):
        assert m.stats()["counters"].get("listings_by_name", 0) >= 1
        assert m.stats()["ops"]["readdir"]["count"] >= 3     # more than one buffer, and the end


def _list_then_seek_back(folder, back_to: int) -> tuple[list[str], list[str]]:
    """readdir(3) a folder to its end, then seekdir(3) back to the position before entry
    `back_to` and read on: (every name, the names read after the seek)."""
    import ctypes
    import ctypes.util

    class Dirent(ctypes.Structure):
        _fields_ = [("d_ino", ctypes.c_uint64), ("d_off", ctypes.c_int64), ("d_reclen", ctypes.c_ushort),
                    ("d_type", ctypes.c_ubyte), ("d_name", ctypes.c_char * 256)]

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.opendir.restype = ctypes.c_void_p
    libc.readdir.restype = ctypes.POINTER(Dirent)
    libc.readdir.argtypes = [ctypes.c_void_p]
    libc.telldir.restype = ctypes.c_long
    libc.telldir.argtypes = [ctypes.c_void_p]
    libc.seekdir.argtypes = [ctypes.c_void_p, ctypes.c_long]
    libc.closedir.argtypes = [ctypes.c_void_p]
    d = libc.opendir(os.fsencode(folder))
    assert d, os.strerror(ctypes.get_errno())

    def read_on() -> list[str]:
        out = []
        while e := libc.readdir(d):
            name = e.contents.d_name.decode()
            if name not in (".", ".."):
                out.append(name)
        return out

    try:
        names, marks = [], []
        while True:
            mark = libc.telldir(d)
            e = libc.readdir(d)
            if not e:
                break
            if e.contents.d_name not in (b".", b".."):
                names.append(e.contents.d_name.decode())
                marks.append(mark)
        libc.seekdir(d, marks[back_to])
        return names, read_on()
    finally:
        libc.closedir(d)


def test_a_listing_given_to_its_end_is_finished_by_pyfuse3(mount_factory):
    """The patched pyfuse3 answers a listing's last READDIR (the kernel asks once more, to find
    nothing) and its RELEASEDIR itself once the daemon gave the listing whole; the daemon takes
    the handle back later (within a second when idle). A listing read again through the same
    descriptor (rewinddir), or from a position before its end (seekdir), still reaches the daemon
    and gives the same names."""
    import pyfuse3
    m = mount_factory()
    for d in range(6):
        (m.store / f"d{d}").mkdir()
        for i in range(d * 7):
            (m.store / f"d{d}" / f"f{i}").write_bytes(b"x")
    for d in range(6):
        assert sorted(os.listdir(m.mnt / f"d{d}")) == sorted(f"f{i}" for i in range(d * 7))
    fd = os.open(m.mnt / "d5", os.O_RDONLY | os.O_DIRECTORY)
    try:
        first = os.listdir(fd)
        assert sorted(os.listdir(fd)) == sorted(first) and len(first) == 35
    finally:
        os.close(fd)
    names, rest = _list_then_seek_back(m.mnt / "d5", 20)
    assert len(names) == 35 and rest == names[20:]      # a READDIR before the end: the daemon's
    names, rest = _list_then_seek_back(m.mnt / "d5", 0)
    assert rest == names
    if not hasattr(pyfuse3, "dir_ended"):
        return
    ops = m.stats()["ops"]
    assert "releasedir" not in ops and ops["readdir"]["count"] >= 7
    counters: dict = {}
    for _ in range(100):
        counters = m.stats()["counters"]
        if counters.get("listings_released_by_pyfuse3", 0) >= 7:
            break
        time.sleep(0.05)
    assert counters["listings_ended"] >= 7 and counters["listings_released_by_pyfuse3"] >= 7, counters


def test_a_file_created_in_an_immutable_folder_is_listed_once_closed(mount_factory):
    """A created file's name appears at its close (publish on close); the kernel may have kept
    the folder's listing from while it was open (FOPEN_CACHE_DIR): the publish makes it drop
    that listing. (Found by the model-based test with every path immutable: `rename(d0, d0)`, which
    the kernel answers itself, kept the listing from being read again.)"""
    m = mount_factory('\n[cache]\nimmutable_globs = ["*"]\n')
    os.mkdir(m.mnt / "d0")
    fd = os.open(m.mnt / "d0" / "f1", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        assert os.listdir(m.mnt / "d0") == []       # not published yet
        os.rename(m.mnt / "d0", m.mnt / "d0")
        os.write(fd, b"x")
    finally:
        os.close(fd)
    for _ in range(200):                            # the RELEASE comes after close() returned
        if (m.store / "d0" / "f1").exists():
            break
        time.sleep(0.01)
    assert os.listdir(m.store / "d0") == ["f1"]
    assert os.listdir(m.mnt / "d0") == ["f1"]


def test_a_truncate_by_path_in_an_immutable_folder_is_seen_at_once(mount_factory):
    """A truncate by path through the mount publishes a new version: a stat after it, and an open
    after it, see the new size, not the one the folder's kept listing said (found by the
    model-based test with every path immutable)."""
    m = mount_factory('\n[cache]\nimmutable_globs = ["*"]\n')
    os.mkdir(m.mnt / "d1")
    (m.mnt / "d1" / "f0").write_bytes(b"")
    assert os.listdir(m.mnt / "d1") == ["f0"]           # the folder's listing, kept
    with open(m.mnt / "d1" / "f0", "rb"):               # a reader open across the truncate
        os.truncate(m.mnt / "d1" / "f0", 3)
        with open(m.mnt / "d1" / "f0", "rb") as f:
            assert os.fstat(f.fileno()).st_size == 3
    assert os.stat(m.mnt / "d1" / "f0").st_size == 3 == (m.store / "d1" / "f0").stat().st_size


def test_a_file_published_by_fsync_is_listed_after_a_lookup_of_its_folder(mount_factory):
    """The folder's entry in its parent's kept listing has the folder's mtime from before the
    publish: a lookup of the folder answered from it (here by an `mkdir` of it, EEXIST) gave the
    kernel that mtime, against which it checked its kept (empty) listing of the folder and took
    it for current. Found by the model-based test with every path immutable (seed 200047)."""
    m = mount_factory('\n[cache]\nimmutable_globs = ["*"]\n')
    os.makedirs(m.mnt / "d0" / "e")
    fd = os.open(m.mnt / "d0" / "e" / "f0", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert os.listdir(m.mnt / "d0" / "e") == []     # not published yet
        assert os.listdir(m.mnt / "d0") == ["e"]        # kept, with e's mtime of now
        os.fsync(fd)                                    # published
        with pytest.raises(FileExistsError):
            os.mkdir(m.mnt / "d0" / "e")                # a lookup of e, with LOOKUP_EXCL
        assert os.listdir(m.mnt / "d0" / "e") == ["f0"]
    finally:
        os.close(fd)

"""The fast path (fusefs/fastpath.py, patches/pyfuse3-fastpath.patch): later read-only opens of a
plain store file declared immutable are answered inside pyfuse3. It must never serve what the
mount's rules would route elsewhere or refuse: a file outside `immutable_globs`, a file being
written, a file changed through this mount, a control file, a `.tensor`, a mount with hint
replicas; nor let a user open what the kernel's permission check refuses."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tests.conftest import needs_fuse
from tests.helpers.media import jpeg_file
from tests.helpers.mounts import world_mount
from tests.helpers.security import can_run_as_nobody, nobody_read_files

pytestmark = needs_fuse

IMMUTABLE = '\n[cache]\nimmutable_globs = ["data/*"]\n'


@pytest.fixture(params=["immutable", "checked"])
def marks(request) -> str:
    """The rules that end a mark or never let one start hold for both kinds of mark: a path
    declared immutable, and one that is not (each open checked in pyfuse3: "Checked marks")."""
    return IMMUTABLE if request.param == "immutable" else ""


def _fast(m) -> dict:
    return m.stats()["fast_path"]


def _ops(m) -> dict:
    return {k: v["count"] for k, v in m.stats()["ops"].items()}


def _skip_unless_on(m) -> None:
    state = _fast(m)["state"]
    if state != "on":
        pytest.skip(f"fast path {state} (needs FUSE passthrough and the patched pyfuse3)")


def _files(m, n: int, folder: str = "data") -> list:
    (m.store / folder).mkdir(exist_ok=True)
    out = []
    for i in range(n):
        p = m.store / folder / f"f{i:03d}"
        p.write_bytes(bytes([i]) * (1000 + i))
        out.append(p.name)
    return out


def test_second_opens_of_an_immutable_file_never_reach_python_and_read_the_same(mount_factory):
    m = mount_factory(IMMUTABLE)
    _skip_unless_on(m)
    names = _files(m, 20)
    for i, name in enumerate(names):                     # first pass: opens through Python, marked
        assert (m.mnt / "data" / name).read_bytes() == bytes([i]) * (1000 + i)
    before, fast0 = _ops(m), _fast(m)
    assert fast0["inodes"] == 20 and fast0["marked"] == 20
    for _ in range(3):                                   # later passes: answered in pyfuse3
        for i, name in enumerate(names):
            assert (m.mnt / "data" / name).read_bytes() == bytes([i]) * (1000 + i)
    after, fast1 = _ops(m), _fast(m)
    # (each read of the stats file between the snapshots is an open and a release of its own)
    assert after["open"] - before["open"] <= 2, (before, after)
    assert fast1["opens"] - fast0["opens"] == 60 and fast1["releases"] - fast0["releases"] == 60
    # Each passthrough read drops the atime the kernel caches, so each later fstat asks GETATTR
    # again: answered in pyfuse3 from the mark's attributes too.
    assert after.get("getattr", 0) - before.get("getattr", 0) <= 10, (before, after)   # (60 without)
    assert fast1["getattrs"] - fast0["getattrs"] >= 40
    assert os.stat(m.mnt / "data" / names[5]).st_size == 1005


def test_files_outside_the_immutable_globs_are_marked_only_with_each_open_checked(mount_factory):
    """(tests/mount/test_fastpath_checked.py: what the check does)"""
    m = mount_factory(IMMUTABLE)
    _skip_unless_on(m)
    names = _files(m, 5, folder="other")
    for _ in range(2):
        for name in names:
            (m.mnt / "other" / name).read_bytes()
    f = _fast(m)
    assert f["inodes"] == f["inodes_checked"] == 5 and f["opens_checked"] == f["opens"] >= 5
    assert f["getattrs"] == 0


def test_a_write_through_the_mount_ends_the_mark_and_later_reads_see_the_new_bytes(mount_factory, marks):
    m = mount_factory(marks)
    _skip_unless_on(m)
    _files(m, 1)
    f = m.mnt / "data" / "f000"
    assert f.read_bytes() == b"\0" * 1000 and _fast(m)["inodes"] == 1
    f.write_bytes(b"new")                                  # O_TRUNC: Python, unmarked first
    assert _fast(m)["inodes"] == 0 and _fast(m)["unmarked"] == 1
    assert f.read_bytes() == b"new"                        # marked again, from the new file
    assert f.read_bytes() == b"new" and _fast(m)["opens"] >= 1
    with open(f, "ab") as w:                               # O_APPEND is a write: never fast
        w.write(b"+")
    assert f.read_bytes() == b"new+" and (m.store / "data" / "f000").read_bytes() == b"new+"


def test_a_writer_waits_for_nothing_but_is_refused_while_a_fast_open_is_still_open(mount_factory, marks):
    """A write open while a reader is open through passthrough is ETXTBSY (the kernel serves one
    inode from one backing file): the same with the reader's open answered by the fast path."""
    m = mount_factory(marks)
    _skip_unless_on(m)
    _files(m, 1)
    f = m.mnt / "data" / "f000"
    f.read_bytes()                                         # marked
    with open(f, "rb") as reader:                          # a fast open, held
        assert _fast(m)["opens"] == 1
        with pytest.raises(OSError) as e:
            open(f, "r+b")
        assert e.value.errno == errno.ETXTBSY
        assert _fast(m)["inodes"] == 0 and _fast(m)["draining"] == 1
        assert reader.read() == b"\0" * 1000               # the open reader reads on
    with open(f, "r+b") as w:                              # its release came: the hold is let go
        w.write(b"x")
    assert _fast(m)["draining"] == 0
    assert f.read_bytes() == b"x" + b"\0" * 999


def test_unlink_and_rename_through_the_mount_end_the_mark(mount_factory, marks):
    m = mount_factory(marks)
    _skip_unless_on(m)
    _files(m, 2)
    a, b = m.mnt / "data" / "f000", m.mnt / "data" / "f001"
    a.read_bytes(), b.read_bytes()
    assert _fast(m)["inodes"] == 2
    a.unlink()
    assert _fast(m)["inodes"] == 1
    with pytest.raises(FileNotFoundError):
        a.read_bytes()
    (m.store / "data" / "f000").write_bytes(b"another file")    # a new file at the name
    assert a.read_bytes() == b"another file"
    os.rename(b, m.mnt / "data" / "g")
    assert (m.mnt / "data" / "g").read_bytes() == b"\1" * 1001
    os.rename(m.mnt / "data" / "g", a)                      # over a marked file
    assert a.read_bytes() == b"\1" * 1001 and a.read_bytes() == b"\1" * 1001


def test_a_truncate_by_path_ends_the_mark(mount_factory, marks):
    m = mount_factory(marks)
    _skip_unless_on(m)
    _files(m, 1)
    f = m.mnt / "data" / "f000"
    f.read_bytes()
    os.truncate(f, 10)
    assert f.read_bytes() == b"\0" * 10 and (m.store / "data" / "f000").stat().st_size == 10


def test_control_files_and_staging_files_are_never_fast(mount_factory, marks):
    m = mount_factory(marks.replace('"data/*"', '"*"'))
    _skip_unless_on(m)
    for _ in range(3):
        (m.mnt / ".hintfs" / "stats").read_bytes()
    # A writer's staging file beside its target, in the store: never a name of the mount.
    with open(m.mnt / "w", "wb") as w:
        w.write(b"being written")
        w.flush()
        staging = [n for n in os.listdir(m.store) if n.startswith(".hintfs-tmp.")]
        assert staging, os.listdir(m.store)
        for name in staging:
            for _ in range(2):
                with pytest.raises(OSError):
                    (m.mnt / name).read_bytes()
        assert (m.mnt / "w").read_bytes() == b"being written"    # the writer's staged data
        assert _fast(m)["marked"] == 0                            # (a file being written)
    assert _fast(m)["marked"] == 0


def test_a_hints_first_replica_ends_the_mark_and_reads_go_to_the_replica(mount_factory, tmp_path, marks):
    from hintfs import client
    m = mount_factory(marks + f'\n[agent]\ndata_dir = "{tmp_path / "rep"}"\n')
    _skip_unless_on(m)
    _files(m, 2)
    f = m.mnt / "data" / "f000"
    f.read_bytes()
    assert _fast(m)["inodes"] == 1                           # no replica of it: marked
    client.set_replication_hints(str(m.mnt), "job", {"data/f000": 64}, ttl_s=60, deadline_s=30)
    assert client.wait_for_replicas(str(m.mnt), "job", timeout_s=30)["ready"]
    assert _fast(m)["inodes"] == 0 and _fast(m)["unmarked"] == 1
    opened = _ops(m)["open"]
    assert f.read_bytes() == b"\0" * 1000 and _ops(m)["open"] > opened     # through Python again
    assert m.stats()["counters"].get("passthrough_replica_opens", 0) >= 1    # from the replica
    assert _fast(m)["inodes"] == 0


def test_the_table_is_bounded(mount_factory):
    m = mount_factory(IMMUTABLE.replace("[cache]", "[mount]\nfast_path_inodes = 8\n[cache]"))
    _skip_unless_on(m)
    names = _files(m, 12)
    for name in names:
        (m.mnt / "data" / name).read_bytes()
    f = _fast(m)
    assert f["limit"] == 8 and f["inodes"] == 8 and f["given_up_for_room"] == 4   # the oldest first
    for i, name in enumerate(names):                        # still the same bytes, marked or not
        assert (m.mnt / "data" / name).read_bytes() == bytes([i]) * (1000 + i)


@pytest.fixture
def world():
    """A mount in a folder every user may traverse: `imgs/*` immutable, with an image transform."""
    def setup(base: Path) -> str:
        store = base / "store"
        (store / "imgs").mkdir()
        store.chmod(0o755)
        jpeg_file(store / "imgs" / "open.jpg", seed=1)
        jpeg_file(store / "imgs" / "secret.jpg", seed=2)
        (store / "imgs" / "secret.jpg").chmod(0o600)
        (store / "imgs" / "open.jpg").chmod(0o644)
        return ('\n[cache]\nimmutable_globs = ["imgs/*"]\n'
                '[[transforms]]\nglob = "imgs/*.jpg"\nkind = "image"\nparams = { size = 32 }\n')

    with world_mount(setup, prefix="hintfs-fast-") as m:
        yield m


@pytest.mark.skipif(not can_run_as_nobody(), reason="needs root and setpriv")
def test_a_mark_made_by_root_lets_no_other_user_read_what_the_file_refuses(world):
    """The access rule of a plain read is the kernel's (`default_permissions`), checked before any
    OPEN is sent: a file root marked stays closed to a user its mode refuses, and readable to
    one it allows; a `.tensor` of a marked file is never fast and grants what its source grants."""
    m = world
    _skip_unless_on(m)
    for name in ("secret.jpg", "open.jpg"):
        (m.mnt / "imgs" / name).read_bytes()               # root's opens mark both
    assert _fast(m)["inodes"] == 2
    got = nobody_read_files([str(m.mnt / "imgs" / n) for n in
                             ("secret.jpg", "open.jpg", "secret.jpg.tensor", "open.jpg.tensor")])
    assert got[str(m.mnt / "imgs" / "secret.jpg")] == f"errno {errno.EACCES}"
    assert got[str(m.mnt / "imgs" / "secret.jpg.tensor")] == f"errno {errno.EACCES}"
    assert got[str(m.mnt / "imgs" / "open.jpg")].encode("latin-1") == (m.store / "imgs" / "open.jpg").read_bytes()
    assert len(got[str(m.mnt / "imgs" / "open.jpg.tensor")]) > 0
    before = _fast(m)
    for _ in range(3):
        assert len((m.mnt / "imgs" / "open.jpg.tensor").read_bytes()) > 0
    assert _fast(m)["marked"] == before["marked"] == 2        # tensors: never marked
    # A chmod through the mount ends the mark: the kernel's next check sees the new mode, not the
    # attributes the mark was made with.
    os.chmod(m.mnt / "imgs" / "open.jpg", 0o600)
    (m.mnt / "imgs" / "open.jpg").read_bytes()
    (m.mnt / "imgs" / "open.jpg").read_bytes()
    assert os.stat(m.mnt / "imgs" / "open.jpg").st_mode & 0o777 == 0o600
    got = nobody_read_files([str(m.mnt / "imgs" / "open.jpg")])
    assert got[str(m.mnt / "imgs" / "open.jpg")] == f"errno {errno.EACCES}"

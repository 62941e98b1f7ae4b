"""Checked marks without a kernel (docs/fastpath.md, "Checked marks"): what a plain path's mark
gives pyfuse3 to check at each open, that an open pyfuse3 sent back is checked in Python, and
that a mark never keeps a file the store removed allocated past the next sweep."""
from __future__ import annotations

import errno
import os

import pytest
import trio
import trio.testing

from fusefs.attrs import ROOT_INODE
from tests.fs.test_filesystem_api import CTX, make_fs
from tests.helpers.backing import CountingBacking, FakeFastTable


def _checked_fs(tmp_path, **mount):
    fs = make_fs(tmp_path, mount=mount)
    backing, fast = CountingBacking(), FakeFastTable()
    fs.set_passthrough((backing, "on"), fast)
    root = tmp_path / "store"
    (root / "d").mkdir()
    for i in range(3):
        (root / "d" / f"f{i}").write_bytes(b"x" * (i + 1))
    return fs, root, backing, fast


async def _read(fs, name: str) -> int:
    d = await fs.lookup(ROOT_INODE, b"d", CTX)
    ino = (await fs.lookup(d.st_ino, name.encode(), CTX)).st_ino
    h = await fs.open(ino, os.O_RDONLY, CTX)
    await fs.release(h.fh)
    return ino


def test_a_plain_files_mark_carries_the_check_of_its_store_path(tmp_path):
    fs, root, backing, fast = _checked_fs(tmp_path)

    async def test():
        ino = await _read(fs, "f1")
        st = os.stat(root / "d" / "f1")
        assert ino in fs.fast.checked and fast.check[ino][1:] == (b"d/f1", st.st_dev, st.st_ino)
        root_fd = fast.check[ino][0]
        assert os.path.samestat(os.fstat(root_fd), os.stat(root))
        assert fast.serving[ino] in backing.live
    trio.run(test)


def test_checked_marks_off_leaves_plain_files_unmarked(tmp_path):
    fs, _root, _backing, fast = _checked_fs(tmp_path, fast_checked_opens=False)

    async def test():
        await _read(fs, "f1")
        assert not fs.fast.marked and not fast.serving
    trio.run(test)


def test_an_open_pyfuse3_sent_back_is_checked_and_renews_a_replaced_name(tmp_path):
    """pyfuse3 sends an open of a checked mark to Python when the path names another file: the
    Python open makes the store's check (an immutable mark's would skip it), the name becomes a
    new inode (ESTALE: the kernel looks it up again) and the old mark goes."""
    fs, root, _backing, _fast = _checked_fs(tmp_path)

    async def test():
        ino = await _read(fs, "f1")
        (root / "d" / "new").write_bytes(b"new bytes")
        os.replace(root / "d" / "new", root / "d" / "f1")
        try:
            await fs.open(ino, os.O_RDONLY, CTX)
        except OSError as err:
            assert err.errno == 116                       # ESTALE
        else:
            raise AssertionError("the replaced file was opened as the marked one")
        assert ino not in fs.fast.marked and ino not in fs.fast.checked
        assert await _read(fs, "f1") != ino              # the new file, a new inode, marked anew
    trio.run(test)


def test_marks_of_files_the_store_removed_go_at_the_next_sweep(tmp_path):
    """Removed or replaced outside the mount, a marked file has no link left: the sweep lets its
    mark go (and its backing id, its fd), the others stay."""
    fs, root, backing, _fast = _checked_fs(tmp_path)

    async def test():
        inos = [await _read(fs, f"f{i}") for i in range(3)]
        assert set(fs.fast.marked) == set(inos) and len(backing.live) == 3
        assert await fs.let_go_removed_marks() == 0
        os.unlink(root / "d" / "f0")
        (root / "d" / "n").write_bytes(b"n")
        os.replace(root / "d" / "n", root / "d" / "f2")
        assert await fs.let_go_removed_marks() == 2
        assert set(fs.fast.marked) == {inos[1]} and len(backing.live) == 1
        assert fs.fast.snapshot()["let_go_removed"] == 2
    trio.run(test)


def test_a_folder_too_big_for_checked_names_is_left_to_marks_at_lookup(tmp_path, monkeypatch):
    """Two opens in a folder of more than CHECKED_NAMES_MAX files register none of its names and
    mark nothing ahead (the up-front work a reader of two files could cause is bounded); the
    lookups of its other files still mark them."""
    import fusefs.filesystem as filesystem
    from tests.fs.test_metadata_cache import _FakeNames
    monkeypatch.setattr(filesystem, "CHECKED_NAMES_MAX", 2)
    fs, _root, _backing, _fast = _checked_fs(tmp_path)          # 3 files in d
    names = fs.names.backend = _FakeNames()

    async def test():
        await _read(fs, "f0")
        await _read(fs, "f1")
        await trio.testing.wait_all_tasks_blocked()
        assert not names.folders and fs.fast.counts["marked_ahead"] == 0
        await _read(fs, "f2")
        assert fs.fast.counts["marked_at_lookup"] == 1
    trio.run(test)


@pytest.mark.parametrize("batch", [True, False], ids=["opened_in_one_call", "opened_each_by_path"])
def test_a_folder_read_by_a_reader_gets_checked_names_and_its_files_marked_ahead(tmp_path, batch):
    """Marked ahead the same whether the store opens a chunk's files in one call
    (`LocalStore.open_readers_in`) or each by its path (`open_reader`, for a store without it)."""
    from tests.fs.test_metadata_cache import _FakeNames
    fs, root, _backing, _fast = _checked_fs(tmp_path)
    names = fs.names.backend = _FakeNames()
    if not batch:
        fs.store.open_readers_in = None

    async def test():
        await _read(fs, "f0")
        await _read(fs, "f1")
        await trio.testing.wait_all_tasks_blocked()
        (parent,) = names.folders
        assert set(names.folders[parent]) == {b"f2"}             # (f0 and f1 are marked already)
        check = names.checks[parent][b"f2"]
        st = os.stat(root / "d" / "f2")
        assert check[1:] == (b"d/f2", st.st_dev, st.st_ino)
        assert fs.fast.counts["marked_ahead"] == 1 and len(fs.fast.checked) == 3
    trio.run(test)


def test_a_local_stores_readers_opened_in_a_folder_are_what_open_reader_opens(tmp_path):
    """`LocalStore.open_readers_in` (the opens of `_open_ahead`): each name in the folder resolved
    beneath the root once; a name that is a symlink (ELOOP), not a regular file (a FIFO: EINVAL,
    never blocking) or not one component (EINVAL, not opened) is that name's error alone; a
    folder that leads out of the store is refused whole (EACCES)."""
    from hintfs.stores.local import LocalStore
    root, outside = tmp_path / "store", tmp_path / "outside"
    (root / "d").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    (root / "d" / "a").write_bytes(b"aa")
    os.symlink(outside / "secret", root / "d" / "link")
    os.mkfifo(root / "d" / "fifo")
    (root / "d" / "sub").mkdir()
    (root / "d" / "sub" / "b").write_bytes(b"b")
    os.symlink(outside, root / "out")
    store = LocalStore(str(root))
    got = store.open_readers_in("d", ["a", "link", "fifo", "sub/b", "..", "missing"])
    reader, st = got[0]
    try:
        assert reader.read(0, 10) == b"aa" and st.size == 2 and st.ino == os.stat(root / "d" / "a").st_ino
    finally:
        reader.close()
    assert [e.errno for e in got[1:]] == [errno.ELOOP, errno.EINVAL, errno.EINVAL, errno.EINVAL, errno.ENOENT]
    with pytest.raises(OSError) as err:
        store.open_readers_in("out", ["secret"])
    assert err.value.errno == errno.EACCES


def test_files_swapped_before_they_are_marked_ahead_are_not_marked(tmp_path):
    """Between a folder's names and the marks made ahead of its files, the store swaps one file
    for a symlink out of it and another for a FIFO: neither is marked (nor is the outside file),
    the others are, each with the check of the file it holds."""
    from tests.fs.test_metadata_cache import _FakeNames
    fs, root, _backing, fast = _checked_fs(tmp_path)
    for i in range(3, 6):
        (root / "d" / f"f{i}").write_bytes(b"z")
    (tmp_path / "secret").write_bytes(b"secret")
    fs.names.backend = _FakeNames()
    real = fs._open_ahead

    async def swapped_first(folder, uid):
        os.unlink(root / "d" / "f2")
        os.symlink(tmp_path / "secret", root / "d" / "f2")
        os.unlink(root / "d" / "f3")
        os.mkfifo(root / "d" / "f3")
        await real(folder, uid)
    fs._open_ahead = swapped_first

    async def test():
        await _read(fs, "f0")
        await _read(fs, "f1")
        await trio.testing.wait_all_tasks_blocked()
        marked = {fs.inodes[ino].path for ino in fs.fast.marked}
        assert marked == {"d/f0", "d/f1", "d/f4", "d/f5"} and fs.fast.counts["marked_ahead"] == 2
        secret = os.stat(tmp_path / "secret")
        for ino in fs.fast.marked:
            _fd, rel, dev, st_ino = fast.check[ino]
            assert (dev, st_ino) == (os.stat(root / os.fsdecode(rel)).st_dev, os.stat(root / os.fsdecode(rel)).st_ino)
            assert st_ino != secret.st_ino
    trio.run(test)



@pytest.mark.parametrize("change,call", [("unlink", "unlink"), ("rename", "rename"), ("truncate", "commit"),
                                         ("link", "link")])
def test_no_mark_is_made_while_a_change_is_in_the_store(tmp_path, change, call):
    """The store calls of an unlink, a rename, a truncate or a link run in a worker thread, so the
    loop may try to mark the file meanwhile (ahead of a folder's opens, at a lookup or at a first
    open): such a mark would be of the file as it was and outlive the change, and later opens
    would be answered from a file no longer at its name, or GETATTRs from attributes from before.
    `Filesystem._changing` refuses it until the change is over (the unlink and rename once ended
    the marks before their store call only, and the truncate and link not even again: a mark made
    meanwhile outlived them). The store call is held here while the mark is tried."""
    import threading
    from types import SimpleNamespace
    from tests.fs.test_filesystem_api import fields
    fs, _root, backing, fast = _checked_fs(tmp_path)
    fs.meta_inline = False    # (a local store's link runs on the loop; an object store's does not)
    entered, go = threading.Event(), threading.Event()
    real = getattr(fs.store, call)

    def held(*args):
        entered.set()
        assert go.wait(10)
        return real(*args)
    setattr(fs.store, call, held)

    async def test():
        ino = await _read(fs, "f1")
        assert ino in fs.fast.marked
        d = (await fs.lookup(ROOT_INODE, b"d", CTX)).st_ino
        node = fs.inodes[ino]
        async with trio.open_nursery() as nursery:
            if change == "unlink":
                nursery.start_soon(fs.unlink, d, b"f1", CTX)
            elif change == "rename":
                nursery.start_soon(fs.rename, d, b"f1", d, b"g1", 0, CTX)
            elif change == "truncate":
                nursery.start_soon(fs.setattr, ino, SimpleNamespace(st_size=1), fields(update_size=True), None, CTX)
            else:
                nursery.start_soon(fs.link, ino, d, b"h1", CTX)
            await trio.to_thread.run_sync(entered.wait)
            assert ino not in fs.fast.marked and node.changing == 1    # (ended before the store call)
            assert not await fs._mark_ahead(node, 0)                    # (tried meanwhile: refused)
            assert ino not in fs.fast.marked and ino not in fast.serving
            go.set()
        assert node.changing == 0
        assert ino not in fs.fast.marked and ino not in fast.serving and not backing.live
        if change != "unlink":     # (a later first open marks it again, as the file is now)
            assert await fs._mark_ahead(node, 0) and ino in fs.fast.marked
    trio.run(test)


def _lazy_fs(tmp_path, n=4):
    """A checked-marks filesystem whose pyfuse3 makes lazy marks (`FakeLazyTable`), a folder of `n`
    files, and pyfuse3's names (`_FakeNames`)."""
    from tests.fs.test_metadata_cache import _FakeNames
    from tests.helpers.backing import FakeLazyTable
    fs = make_fs(tmp_path)
    backing, fast = CountingBacking(), FakeLazyTable()
    fs.set_passthrough((backing, "on"), fast)
    fs.names.backend = _FakeNames()
    root = tmp_path / "store"
    (root / "d").mkdir()
    for i in range(n):
        (root / "d" / f"f{i}").write_bytes(bytes([i]) * (i + 1))
    return fs, root, backing, fast


def _first_open_in_pyfuse3(fs, fast, backing, ino: int) -> int:
    """What pyfuse3 does at a lazy mark's first open (patches/pyfuse3-fastlazy.patch): the checked
    path opened beneath the root, checked to be the marked file, registered as a backing file."""
    root_fd, rel, dev, st_ino = fast.lazy_marks[ino]
    fd = os.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=root_fd)
    st = os.fstat(fd)
    assert (st.st_dev, st.st_ino) == (dev, st_ino)
    bid = backing.open(fd)
    fast.first_open(ino, fd, bid)
    return bid


def test_a_folder_read_by_a_reader_gets_lazy_marks_that_hold_nothing_until_pyfuse3_opens_them(tmp_path):
    """With a pyfuse3 that opens marks itself (docs/fastpath.md, "Lazy marks"), the other files of
    a folder a reader goes through are marked without being opened: each mark carries the check
    of its name and holds the inode (one open) but no fd and no backing id. pyfuse3's first open
    of one hands its fd and backing id over, and they are the mark's hold from then on: a Python
    open shares that backing id, and the end of the mark lets both go."""
    fs, root, backing, fast = _lazy_fs(tmp_path)

    async def test():
        await _read(fs, "f0")
        await _read(fs, "f1")
        await trio.testing.wait_all_tasks_blocked()
        lazy = {fs.inodes[ino].path: ino for ino in fs.fast.lazy}
        assert set(lazy) == {"d/f2", "d/f3"} and fs.fast.counts["marked_ahead"] == 2
        assert len(backing.live) == 2                        # (f0's and f1's marks only)
        for path, ino in lazy.items():
            st = os.stat(root / path)
            assert fast.lazy_marks[ino][1:] == (path.encode(), st.st_dev, st.st_ino)
            assert fs.inodes[ino].opens == 1 and fs.inodes[ino].pt_refs == 0
        ino = lazy["d/f2"]
        bid = _first_open_in_pyfuse3(fs, fast, backing, ino)
        node = fs.inodes[ino]
        h = await fs.open(ino, os.O_RDONLY, CTX)              # (adopts what pyfuse3 opened, then shares it)
        assert h.backing_id == bid and node.pt_refs == 2 and ino not in fs.fast.lazy
        assert os.pread(node.pt_reader.fd, 10, 0) == b"\x02" * 3
        await fs.release(h.fh)
        fast.open[ino] = 0                                   # (pyfuse3's open released)
        fs._fast_off(node)
        assert bid not in backing.live and node.pt_refs == 0 and node.opens == 0
    trio.run(test)


def test_a_lazy_mark_pyfuse3_could_not_open_ends_at_the_open_python_gets(tmp_path):
    """pyfuse3 sends a lazy mark's first open to Python when the path no longer names the marked
    file: the mark ends (its hold, no fd) and the open is a first open of what the name holds now,
    whose backing is the only one the inode gets."""
    fs, root, backing, fast = _lazy_fs(tmp_path)

    async def test():
        await _read(fs, "f0")
        await _read(fs, "f1")
        await trio.testing.wait_all_tasks_blocked()
        ino = next(i for i in fs.fast.lazy if fs.inodes[i].path == "d/f3")
        os.unlink(root / "d" / "f3")
        (root / "d" / "f3").write_bytes(b"replaced")
        h = await fs.open(ino, os.O_RDONLY, CTX)
        node = fs.inodes[ino]
        assert ino not in fast.lazy_marks and ino not in fs.fast.lazy
        assert node.pt_refs >= 1 and os.pread(node.pt_reader.fd, 20, 0) == b"replaced"
        await fs.release(h.fh)
    trio.run(test)


def test_lazy_marks_end_with_the_names_and_with_changes(tmp_path):
    """A lazy mark never opened ends like any mark: when the folder's names go (`_unname`: the
    kernel never looked it up) and at an unlink through the mount, its hold let go with nothing
    to close."""
    fs, root, backing, fast = _lazy_fs(tmp_path, n=6)
    d_ino = []

    async def test():
        await _read(fs, "f0")
        await _read(fs, "f1")
        await trio.testing.wait_all_tasks_blocked()
        lazy = {fs.inodes[ino].path: ino for ino in fs.fast.lazy}
        assert len(lazy) == 4
        d_ino.append((await fs.lookup(ROOT_INODE, b"d", CTX)).st_ino)
        f5 = fs.inodes[lazy["d/f5"]]
        f5.lookups += 1    # (the kernel looked it up: the unlink, not the names, ends it)
        await fs.unlink(d_ino[0], b"f5", CTX)
        assert f5.ino not in fs.fast and f5.opens == 0 and f5.ino not in fast.lazy_marks
        assert not fs.names.folders                          # (the unlink dropped the folder's names)
        assert not fs.fast.lazy and not fast.lazy_marks       # (the others were never looked up)
        assert len(backing.live) == 2
    trio.run(test)


def test_a_file_of_a_folder_too_big_for_names_gets_a_lazy_mark_at_its_lookup(tmp_path, monkeypatch):
    """With lazy marks, a lookup in a folder a reader goes through but too big for its names to
    be registered marks the file without opening it, with the check of the file the lookup found;
    the open that follows is pyfuse3's (played here), and its fd becomes the mark's hold."""
    import fusefs.filesystem as filesystem
    monkeypatch.setattr(filesystem, "CHECKED_NAMES_MAX", 2)
    fs, root, backing, fast = _lazy_fs(tmp_path, n=3)

    async def test():
        await _read(fs, "f0")
        await _read(fs, "f1")
        await trio.testing.wait_all_tasks_blocked()
        assert not fs.names.folders and fs.fast.counts["marked_ahead"] == 0
        d = (await fs.lookup(ROOT_INODE, b"d", CTX)).st_ino
        ino = (await fs.lookup(d, b"f2", CTX)).st_ino
        st = os.stat(root / "d" / "f2")
        assert fs.fast.counts["marked_at_lookup"] == 1 and fs.fast.lazy == {ino}
        assert fast.lazy_marks[ino][1:] == (b"d/f2", st.st_dev, st.st_ino) and len(backing.live) == 2
        bid = _first_open_in_pyfuse3(fs, fast, backing, ino)
        fs.fast.take_opened()
        assert fs.inodes[ino].pt_id == bid and not fs.fast.lazy
    trio.run(test)


def test_no_lazy_mark_for_a_path_whose_reads_may_go_elsewhere(tmp_path):
    """A lazy mark is the one the file's first open would make, and that open is never a fast
    one where the read may go elsewhere than the store's file: a hinted path with replicas (the
    kind is a replica read) or a routed path (the tier decides at the open) gets no lazy mark; the
    other files of the folder do."""
    from types import SimpleNamespace
    fs, _root, _backing, fast = _lazy_fs(tmp_path, n=5)
    fs.reads.replicas = SimpleNamespace(has_replicas=lambda path: path == "d/f2")
    fs.reads.routes = SimpleNamespace(routes_path=lambda path: path == "d/f3")

    async def test():
        await _read(fs, "f0")
        await _read(fs, "f1")
        await trio.testing.wait_all_tasks_blocked()
        assert {fs.inodes[ino].path for ino in fs.fast.lazy} == {"d/f4"}
    trio.run(test)

"""POSIX pieces of the filesystem class without a kernel mount (issue 12): what object stores
refuse (one documented errno per operation) and the inode table's hard links."""
from __future__ import annotations

import errno
import os
import stat as stat_mod
from types import SimpleNamespace

import pyarrow.fs as pafs
import pytest
import trio

from fusefs.attrs import ROOT_INODE
from fusefs.filesystem import Filesystem
from fusefs.inodes import InodeTable
from hintfs.stores.arrow import ArrowStore
from tests.fs.test_filesystem_api import CTX, make_fs, write_file


def object_fs(tmp_path) -> Filesystem:
    """A Filesystem over an object store (pyarrow's in-memory mock filesystem, as S3 is used)."""
    mock = pafs._MockFileSystem()
    mock.create_dir("bucket")
    return Filesystem(ArrowStore(mock, "bucket", str(tmp_path / "spool"), "mem://bucket"))


def setattr_fields(**set_) -> SimpleNamespace:
    names = ["update_size", "update_mode", "update_uid", "update_gid", "update_atime", "update_mtime"]
    return SimpleNamespace(**{n: set_.get(n, False) for n in names})


# operation on an object store -> the errno the kernel gets (docs/semantics.md, "Object stores")
UNSUPPORTED = {
    "mknod-fifo": lambda fs, ino: fs.mknod(ROOT_INODE, b"p", stat_mod.S_IFIFO | 0o644, 0, CTX),
    "mknod-socket": lambda fs, ino: fs.mknod(ROOT_INODE, b"s", stat_mod.S_IFSOCK | 0o644, 0, CTX),
    "link": lambda fs, ino: fs.link(ino, ROOT_INODE, b"second", CTX),
    "symlink": lambda fs, ino: fs.symlink(ROOT_INODE, b"l", b"f", CTX),
    "chmod": lambda fs, ino: fs.setattr(ino, SimpleNamespace(st_mode=0o600), setattr_fields(update_mode=True), None, CTX),
    "chown": lambda fs, ino: fs.setattr(ino, SimpleNamespace(st_uid=1, st_gid=1),
                                        setattr_fields(update_uid=True, update_gid=True), None, CTX),
}


@pytest.mark.parametrize("op", sorted(UNSUPPORTED))
def test_object_stores_refuse_with_one_errno(tmp_path, op):
    fs = object_fs(tmp_path)

    async def main():
        ino = await write_file(fs, ROOT_INODE, "f", b"data")
        with pytest.raises(OSError) as exc:
            await UNSUPPORTED[op](fs, ino)
        assert exc.value.errno == errno.EPERM
        assert (await fs.getattr(ino, CTX)).st_size == 4   # and the store still serves

    trio.run(main)


def test_object_store_accepts_and_ignores_utime(tmp_path):
    fs = object_fs(tmp_path)

    async def main():
        ino = await write_file(fs, ROOT_INODE, "f", b"data")
        attr = SimpleNamespace(st_atime_ns=1, st_mtime_ns=2)
        await fs.setattr(ino, attr, setattr_fields(update_atime=True, update_mtime=True), None, CTX)

    trio.run(main)


def test_hard_links_share_an_inode_and_survive_unlink_and_rename(tmp_path):
    fs = make_fs(tmp_path)

    async def main():
        ino = await write_file(fs, ROOT_INODE, "a", b"x")
        b = await fs.link(ino, ROOT_INODE, b"b", CTX)
        assert b.st_ino == ino and b.st_nlink == 2
        await fs.rename(ROOT_INODE, b"b", ROOT_INODE, b"c", 0, CTX)
        await fs.unlink(ROOT_INODE, b"a", CTX)
        c = await fs.lookup(ROOT_INODE, b"c", CTX)
        assert c.st_ino == ino and c.st_nlink == 1
        assert fs.inodes[ino].path == "c" and not fs.inodes[ino].unlinked
        # a link made in the store itself is found as the same inode
        os.link(tmp_path / "store" / "c", tmp_path / "store" / "d")
        assert (await fs.lookup(ROOT_INODE, b"d", CTX)).st_ino == ino

    trio.run(main)


def test_inode_table_forgets_every_name_of_a_linked_inode():
    t = InodeTable()
    a = t.ensure("a")
    t.alias(a, "b")
    t.set_backing(a, (1, 2))
    a.lookups = 1
    t.forget(a.ino, 1)
    assert t.by_path_get("a") is None and t.by_path_get("b") is None and t.linked((1, 2)) is None


def test_a_folder_renamed_over_forgets_the_folders_and_idle_files_known_beneath_it():
    """rename(2) replaces only an empty folder: names the table still knows beneath one renamed
    over are another host's, changed since. Its folders and the files with nothing open go (a
    lookup there makes a new inode; those inodes keep their paths and are not taken for
    unlinked); a file with a handle open stays known at its path (a new file made there later
    renews the name); the renamed folder's own names move beneath the new name."""
    t = InodeTable()
    old_d0, old_e, old_f = t.ensure("d0"), t.ensure("d0/e"), t.ensure("d0/e/f0")
    old_e.kind, old_f.kind = stat_mod.S_IFDIR, stat_mod.S_IFREG
    read = t.ensure("d0/e/r")
    read.kind, read.opens = stat_mod.S_IFREG, 1
    d1, d1_g = t.ensure("d1"), t.ensure("d1/g")
    t.move("d1", "d0")
    assert t.by_path_get("d0") is d1 and t.by_path_get("d0/g") is d1_g and d1_g.path == "d0/g"
    assert t.by_path_get("d0/e") is None and t.by_path_get("d0/e/f0") is None
    assert t.by_path_get("d0/e/r") is read and not read.unlinked
    assert old_d0.unlinked and not old_e.unlinked and not old_f.unlinked
    assert (old_e.path, old_f.path) == ("d0/e", "d0/e/f0")
    assert t.ensure("d0/e") is not old_e


def test_mkdir_mknod_give_exact_modes_whatever_the_daemon_umask(tmp_path):
    fs = make_fs(tmp_path)
    ctx = SimpleNamespace(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), umask=0)

    async def main():
        old = os.umask(0o077)
        try:
            d = await fs.mkdir(ROOT_INODE, b"d", stat_mod.S_IFDIR | 0o1777, ctx)
            p = await fs.mknod(ROOT_INODE, b"p", stat_mod.S_IFIFO | 0o666, 0, ctx)
        finally:
            os.umask(old)
        assert stat_mod.S_IMODE(d.st_mode) == 0o1777 and stat_mod.S_ISFIFO(p.st_mode)
        assert stat_mod.S_IMODE(p.st_mode) == 0o666

    trio.run(main)

"""The filesystem class driven directly, with no kernel mount (like s3ql's t3_fs_api.py).

`fusefs.filesystem.Filesystem` over a `file://` store in tmp_path, each test one `trio.run`:
no root, no /dev/fuse. Errors arrive as OSError with the errno the kernel would get.
"""
from __future__ import annotations

import errno
import json
import os
import stat as stat_mod
from types import SimpleNamespace

import pytest
import trio

from fusefs.attrs import RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INODE, Attributes, DirEntry, Refused
from fusefs.control import ControlDir
from fusefs.filesystem import Filesystem
from fusefs.hints import HintsManager
from fusefs.mount import build_control
from fusefs.stats import Stats
from mountconfig import parse_config
from hintfs.stores.local import LocalStore

CTX = SimpleNamespace(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), umask=0o022)


def make_fs(tmp_path, **cfg_extra) -> Filesystem:
    root = tmp_path / "store"
    root.mkdir(exist_ok=True)
    cfg = parse_config({"store": {"uri": f"file://{root}"}, **cfg_extra})
    stats = Stats()
    control = build_control(ControlDir(".hintfs"), stats, b"{}\n")
    hints = HintsManager(cfg.replicas, ["grpc://127.0.0.1:1"], {}, stats)
    control.add_dir(hints.control_dir())
    return Filesystem(LocalStore(str(root)), options=cfg.mount, cache=cfg.cache, journal_dir=cfg.journal.dir,
                      stats=stats, control_root=control)


def run(tmp_path, test, **cfg_extra):
    """Run `test(fs, store_root)` in a fresh trio loop over a fresh filesystem."""
    fs = make_fs(tmp_path, **cfg_extra)
    trio.run(test, fs, tmp_path / "store")
    return fs


def errno_of(excinfo) -> int:
    return excinfo.value.errno


async def resolve(fs: Filesystem, path: str) -> Attributes:
    ino, attrs = ROOT_INODE, None
    for name in path.split("/"):
        attrs = await fs.lookup(ino, name.encode(), CTX)
        ino = attrs.st_ino
    return attrs


async def write_file(fs: Filesystem, parent: int, name: str, data: bytes, mode: int = 0o644) -> int:
    fi, attrs = await fs.create(parent, name.encode(), stat_mod.S_IFREG | mode, os.O_WRONLY | os.O_CREAT, CTX)
    assert await fs.write(fi.fh, 0, data) == len(data)
    await fs.flush(fi.fh)
    await fs.release(fi.fh)
    return attrs.st_ino


async def read_file(fs: Filesystem, ino: int, size: int = 1 << 20) -> bytes:
    fi = await fs.open(ino, os.O_RDONLY, CTX)
    try:
        return await fs.read(fi.fh, 0, size)
    finally:
        await fs.release(fi.fh)


async def listdir(fs: Filesystem, ino: int, take: int = 1 << 30) -> list[DirEntry]:
    fh = await fs.opendir(ino, CTX)
    got: list[DirEntry] = []

    def reply(entry: DirEntry) -> bool:
        if len(got) >= take:
            return False
        got.append(entry)
        return True

    await fs.readdir(fh, 0, reply)
    await fs.releasedir(fh)
    return got


def fields(**set_) -> SimpleNamespace:
    names = ("update_size", "update_mode", "update_uid", "update_gid", "update_atime", "update_mtime")
    return SimpleNamespace(**{n: set_.get(n, False) for n in names})


# -- namespace ------------------------------------------------------------------------------------
def test_lookup_and_getattr_of_store_files(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "d").mkdir()
    (tmp_path / "store" / "d" / "f.bin").write_bytes(b"x" * 1000)

    async def test(fs, root):
        d = await fs.lookup(ROOT_INODE, b"d", CTX)
        assert stat_mod.S_ISDIR(d.st_mode)
        f = await fs.lookup(d.st_ino, b"f.bin", CTX)
        assert stat_mod.S_ISREG(f.st_mode) and f.st_size == 1000 and f.st_blocks == 2
        again = await fs.getattr(f.st_ino, CTX)
        assert (again.st_ino, again.st_size, again.st_mtime_ns) == (f.st_ino, 1000, f.st_mtime_ns)
        assert fs.inodes[f.st_ino].lookups == 1
        fs.forget([(f.st_ino, 1)])
        assert fs.inodes.get(f.st_ino) is None
    run(tmp_path, test)


def test_missing_names_and_unknown_inodes_are_errnos(tmp_path):
    async def test(fs, root):
        with pytest.raises(OSError) as e:
            await fs.lookup(ROOT_INODE, b"nope", CTX)
        assert errno_of(e) == errno.ENOENT
        with pytest.raises(Refused) as e:
            await fs.getattr(424242, CTX)
        assert errno_of(e) == errno.ESTALE
        with pytest.raises(OSError) as e:
            await fs.lookup(ROOT_INODE, b"a" * 300, CTX)
        assert errno_of(e) == errno.ENAMETOOLONG
    fs = run(tmp_path, test)
    assert fs.inodes.get(424242) is None


def test_create_write_flush_publishes_and_read_back(tmp_path):
    async def test(fs, root):
        fi, attrs = await fs.create(ROOT_INODE, b"new.txt", stat_mod.S_IFREG | 0o640, os.O_WRONLY | os.O_CREAT, CTX)
        assert fi.keep_cache and stat_mod.S_IMODE(attrs.st_mode) == 0o640 & ~CTX.umask
        assert await fs.write(fi.fh, 0, b"hello ") == 6
        assert await fs.write(fi.fh, 6, b"world") == 5
        assert not (root / "new.txt").exists()          # nothing published before close
        await fs.flush(fi.fh)
        assert (root / "new.txt").read_bytes() == b"hello world"
        await fs.release(fi.fh)
        assert await read_file(fs, attrs.st_ino) == b"hello world"
        assert fs.stats.counters["commits"] == 1
        assert fs.stats.counters["bytes_written"] == 11
    run(tmp_path, test)


def test_reader_opened_during_a_write_sees_the_staged_bytes(tmp_path):
    async def test(fs, root):
        fi, attrs = await fs.create(ROOT_INODE, b"f", 0o100644, os.O_RDWR | os.O_CREAT, CTX)
        await fs.write(fi.fh, 0, b"staged")
        rd = await fs.open(attrs.st_ino, os.O_RDONLY, CTX)
        assert await fs.read(rd.fh, 0, 100) == b"staged"
        await fs.flush(fi.fh)
        await fs.release(fi.fh)                # the writer is gone: the reader falls back to the store
        assert await fs.read(rd.fh, 2, 100) == b"aged"
        await fs.release(rd.fh)
    run(tmp_path, test)


def test_open_for_write_with_truncate_and_close_to_open(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "f").write_bytes(b"old content")

    async def test(fs, root):
        ino = (await fs.lookup(ROOT_INODE, b"f", CTX)).st_ino
        first = await fs.open(ino, os.O_RDONLY, CTX)
        assert not first.keep_cache                     # nothing cached yet
        await fs.release(first.fh)
        second = await fs.open(ino, os.O_RDONLY, CTX)
        assert second.keep_cache                        # same (size, mtime): keep the pages
        await fs.release(second.fh)
        w = await fs.open(ino, os.O_WRONLY | os.O_TRUNC, CTX)
        await fs.write(w.fh, 0, b"new")
        assert await fs.read(w.fh, 0, 10) == b"new"       # a write handle reads its staging
        await fs.flush(w.fh)
        await fs.release(w.fh)
        assert (root / "f").read_bytes() == b"new"
        third = await fs.open(ino, os.O_RDONLY, CTX)
        assert third.keep_cache                         # the mount's own write: the cache has it
        await fs.release(third.fh)
        (root / "f").write_bytes(b"changed behind the mount")
        fourth = await fs.open(ino, os.O_RDONLY, CTX)
        assert fourth.keep_cache is False               # changed elsewhere: drop the pages
        await fs.release(fourth.fh)
        assert fs.stats.counters["open_invalidate"] == 1
    run(tmp_path, test)


def test_write_on_a_read_handle_is_ebadf(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "f").write_bytes(b"data")

    async def test(fs, root):
        ino = (await fs.lookup(ROOT_INODE, b"f", CTX)).st_ino
        fi = await fs.open(ino, os.O_RDONLY, CTX)
        with pytest.raises(Refused) as e:
            await fs.write(fi.fh, 0, b"x")
        assert errno_of(e) == errno.EBADF
        assert await fs.read(fi.fh, 1, 2) == b"at"
        await fs.release(fi.fh)
        assert fs.stats.counters["read_nowait_hit"] + fs.stats.counters.get("read_thread", 0) >= 1
    run(tmp_path, test)


def test_readdir_lists_store_entries_and_hides_the_control_names(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    for name in ("a", "b", "c"):
        (store / name).write_text(name)
    (store / ".hintfs").mkdir()   # a store folder named like the control dir stays hidden

    async def test(fs, root):
        entries = await listdir(fs, ROOT_INODE)
        assert sorted(e.name for e in entries) == [b"a", b"b", b"c"]
        assert [e.next_id for e in entries] == sorted(e.next_id for e in entries)
        for e in entries:   # an entry the kernel took counts as a lookup
            assert fs.inodes[e.attrs.st_ino].lookups == 1
    run(tmp_path, test)


def test_readdir_counts_only_entries_the_kernel_took(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    for i in range(5):
        (store / f"f{i}").write_text("x")

    async def test(fs, root):
        taken = await listdir(fs, ROOT_INODE, take=2)
        assert len(taken) == 2
        known = [p for p in fs.inodes.by_path if p]
        assert sorted(known) == sorted(e.name.decode() for e in taken)   # the refused one was dropped
        # Continue from an offset the kernel gives back.
        fh = await fs.opendir(ROOT_INODE, CTX)
        rest: list[DirEntry] = []
        await fs.readdir(fh, taken[-1].next_id, lambda e: rest.append(e) is None)
        await fs.releasedir(fh)
        assert len(taken) + len(rest) == 5
    run(tmp_path, test)


def test_mkdir_rmdir_and_enotdir(tmp_path):
    async def test(fs, root):
        d = await fs.mkdir(ROOT_INODE, b"sub", stat_mod.S_IFDIR | 0o750, CTX)
        assert stat_mod.S_ISDIR(d.st_mode) and (root / "sub").is_dir()
        f = await write_file(fs, d.st_ino, "x", b"1")
        with pytest.raises(OSError) as e:
            await fs.opendir(f, CTX)
        assert errno_of(e) == errno.ENOTDIR
        with pytest.raises(OSError) as e:
            await fs.rmdir(ROOT_INODE, b"sub", CTX)
        assert errno_of(e) == errno.ENOTEMPTY
        await fs.unlink(d.st_ino, b"x", CTX)
        await fs.rmdir(ROOT_INODE, b"sub", CTX)
        assert not (root / "sub").exists()
    run(tmp_path, test)


def test_rename_moves_inodes_and_honours_flags(tmp_path):
    async def test(fs, root):
        a = await write_file(fs, ROOT_INODE, "a", b"A")
        await write_file(fs, ROOT_INODE, "b", b"B")
        with pytest.raises(OSError) as e:
            await fs.rename(ROOT_INODE, b"a", ROOT_INODE, b"b", RENAME_NOREPLACE, CTX)
        assert errno_of(e) == errno.EEXIST
        with pytest.raises(Refused) as e:
            await fs.rename(ROOT_INODE, b"a", ROOT_INODE, b"b", RENAME_EXCHANGE, CTX)
        assert errno_of(e) == errno.EINVAL
        await fs.rename(ROOT_INODE, b"a", ROOT_INODE, b"c", 0, CTX)
        assert fs.inodes[a].path == "c" and (root / "c").read_bytes() == b"A"
        assert (await fs.lookup(ROOT_INODE, b"c", CTX)).st_ino == a
    run(tmp_path, test)


def test_rename_of_a_file_still_open_moves_what_was_written(tmp_path):
    async def test(fs, root):
        fi, attrs = await fs.create(ROOT_INODE, b"tmp", 0o100644, os.O_WRONLY | os.O_CREAT, CTX)
        await fs.write(fi.fh, 0, b"partial")
        await fs.rename(ROOT_INODE, b"tmp", ROOT_INODE, b"final", 0, CTX)
        assert (root / "final").read_bytes() == b"partial"
        await fs.release(fi.fh)
    run(tmp_path, test)


def test_unlink_of_store_file_and_of_a_file_only_staged(tmp_path):
    async def test(fs, root):
        await write_file(fs, ROOT_INODE, "gone", b"x")
        await fs.unlink(ROOT_INODE, b"gone", CTX)
        assert not (root / "gone").exists()
        with pytest.raises(OSError) as e:
            await fs.unlink(ROOT_INODE, b"gone", CTX)
        assert errno_of(e) == errno.ENOENT
        fi, _ = await fs.create(ROOT_INODE, b"staged", 0o100644, os.O_WRONLY | os.O_CREAT, CTX)
        await fs.write(fi.fh, 0, b"never published")
        await fs.unlink(ROOT_INODE, b"staged", CTX)      # exists only as staging: fine
        await fs.flush(fi.fh)
        await fs.release(fi.fh)
        assert not (root / "staged").exists()            # written to a name that no longer exists
    run(tmp_path, test)


def test_symlink_readlink_and_escape_refused(tmp_path):
    async def test(fs, root):
        await write_file(fs, ROOT_INODE, "target", b"t")
        link = await fs.symlink(ROOT_INODE, b"link", b"target", CTX)
        assert stat_mod.S_ISLNK(link.st_mode)
        assert await fs.readlink(link.st_ino, CTX) == b"target"
        with pytest.raises(Refused) as e:
            await fs.symlink(ROOT_INODE, b"out", b"../../etc/passwd", CTX)
        assert errno_of(e) == errno.EPERM
        os.symlink("/etc/passwd", root / "planted")       # made behind the mount's back
        planted = await fs.lookup(ROOT_INODE, b"planted", CTX)
        with pytest.raises(Refused) as e:
            await fs.readlink(planted.st_ino, CTX)
        assert errno_of(e) == errno.EACCES
    run(tmp_path, test)


def test_setattr_truncate_chmod_utime_and_chown(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "f").write_bytes(b"0123456789")

    async def test(fs, root):
        ino = (await fs.lookup(ROOT_INODE, b"f", CTX)).st_ino
        attr = SimpleNamespace(st_size=4, st_mode=0o600, st_uid=0, st_gid=0, st_atime_ns=0, st_mtime_ns=10**18)
        got = await fs.setattr(ino, attr, fields(update_size=True), None, CTX)
        assert got.st_size == 4 and (root / "f").read_bytes() == b"0123"
        got = await fs.setattr(ino, attr, fields(update_mode=True), None, CTX)
        assert stat_mod.S_IMODE(got.st_mode) == 0o600
        got = await fs.setattr(ino, attr, fields(update_mtime=True), None, CTX)
        assert got.st_mtime_ns == 10**18 == (root / "f").stat().st_mtime_ns
        owner = SimpleNamespace(**{**vars(attr), "st_uid": 65534, "st_gid": 65534})
        if os.geteuid() == 0:   # file:// stores change owners as the backing filesystem does
            got = await fs.setattr(ino, owner, fields(update_uid=True, update_gid=True), None, CTX)
            assert (got.st_uid, got.st_gid) == (65534, 65534)
            assert ((root / "f").stat().st_uid, (root / "f").stat().st_gid) == (65534, 65534)
        else:                   # ... and refuse as it does
            with pytest.raises(OSError) as e:
                await fs.setattr(ino, owner, fields(update_uid=True), None, CTX)
            assert errno_of(e) == errno.EPERM
    run(tmp_path, test)


def test_statfs_reports_the_store_filesystem(tmp_path):
    async def test(fs, root):
        sv = await fs.statfs(CTX)
        real = os.statvfs(root)
        assert sv.f_bsize == real.f_bsize and sv.f_namemax == real.f_namemax
    run(tmp_path, test)


def test_hidden_and_control_names_refused_in_the_store_namespace(tmp_path):
    async def test(fs, root):
        with pytest.raises(Refused) as e:
            await fs.create(ROOT_INODE, b".hintfs-tmp.x", 0o100644, os.O_WRONLY | os.O_CREAT, CTX)
        assert errno_of(e) == errno.EACCES
        ctl = await fs.lookup(ROOT_INODE, b".hintfs", CTX)
        for call in (fs.mkdir(ctl.st_ino, b"d", 0o755, CTX), fs.unlink(ctl.st_ino, b"stats", CTX),
                     fs.rename(ctl.st_ino, b"stats", ROOT_INODE, b"s", 0, CTX)):
            with pytest.raises(Refused) as e:
                await call
            assert errno_of(e) == errno.EPERM
    run(tmp_path, test)


# -- control files --------------------------------------------------------------------------------
def test_control_stats_file_renders_the_counters(tmp_path):
    async def test(fs, root):
        await write_file(fs, ROOT_INODE, "f", b"abc")
        ctl = await fs.lookup(ROOT_INODE, b".hintfs", CTX)
        assert stat_mod.S_ISDIR(ctl.st_mode)
        names = {e.name for e in await listdir(fs, ctl.st_ino)}
        assert {b"stats", b"config", b"loglevel", b"hints"} <= names
        st = await fs.lookup(ctl.st_ino, b"stats", CTX)
        assert st.st_size == 0 and st.attr_timeout == 0
        fi = await fs.open(st.st_ino, os.O_RDONLY, CTX)
        assert fi.direct_io
        doc = json.loads(await fs.read(fi.fh, 0, 1 << 20))
        await fs.release(fi.fh)
        assert doc["counters"]["commits"] == 1
        with pytest.raises(Refused) as e:                 # read-only
            await fs.open(st.st_ino, os.O_WRONLY, CTX)
        assert errno_of(e) == errno.EACCES
        with pytest.raises(Refused) as e:
            await fs.open(ctl.st_ino, os.O_RDONLY, CTX)
        assert errno_of(e) == errno.EISDIR
    run(tmp_path, test)


def test_refused_hint_write_is_einval_and_explained_in_dot_error(tmp_path):
    async def test(fs, root):
        ctl = await fs.lookup(ROOT_INODE, b".hintfs", CTX)
        hints = await fs.lookup(ctl.st_ino, b"hints", CTX)
        fi, attrs = await fs.create(hints.st_ino, b"job1", 0o100644, os.O_WRONLY | os.O_CREAT, CTX)
        assert stat_mod.S_IMODE(attrs.st_mode) == 0o644
        await fs.write(fi.fh, 0, b'{"no such key": 1}')
        with pytest.raises(Refused) as e:
            await fs.flush(fi.fh)
        assert errno_of(e) == errno.EINVAL
        await fs.release(fi.fh)                            # already applied (refused): nothing again
        err = await fs.lookup(hints.st_ino, b"job1.error", CTX)
        reason = await read_file(fs, err.st_ino)
        assert b"files: Field required" in reason
        assert fs.stats.counters["control_refused"] == 1
        with pytest.raises(Refused) as e:                  # not a job name
            await fs.create(hints.st_ino, b".hidden", 0o100644, os.O_WRONLY | os.O_CREAT, CTX)
        assert errno_of(e) == errno.EINVAL
    run(tmp_path, test)


def test_oversized_control_write_is_efbig_and_refused_at_close(tmp_path):
    async def test(fs, root):
        ctl = await fs.lookup(ROOT_INODE, b".hintfs", CTX)
        ll = await fs.lookup(ctl.st_ino, b"loglevel", CTX)
        fi = await fs.open(ll.st_ino, os.O_WRONLY, CTX)
        with pytest.raises(Refused) as e:
            await fs.write(fi.fh, 64 << 20, b"x")
        assert errno_of(e) == errno.EFBIG
        await fs.release(fi.fh)                            # release applies it: refused, swallowed
        err = await fs.lookup(ctl.st_ino, b"loglevel.error", CTX)
        assert b"EFBIG" in await read_file(fs, err.st_ino)
    run(tmp_path, test)


def test_control_truncate_then_write_applies_the_document(tmp_path):
    import logging
    before = logging.getLogger("hintfs").level

    async def test(fs, root):
        ctl = await fs.lookup(ROOT_INODE, b".hintfs", CTX)
        ll = await fs.lookup(ctl.st_ino, b"loglevel", CTX)
        fi = await fs.open(ll.st_ino, os.O_WRONLY, CTX)
        await fs.write(fi.fh, 0, b"garbage that will be cut")
        size0 = SimpleNamespace(st_size=0)
        await fs.setattr(ll.st_ino, size0, fields(update_size=True), fi.fh, CTX)   # `>` truncates
        await fs.write(fi.fh, 0, b'{"level": "ERROR"}')
        await fs.flush(fi.fh)
        await fs.release(fi.fh)
        assert logging.getLogger("hintfs").level == logging.ERROR
        assert fs.stats.counters["control_applied"] == 1
        with pytest.raises(Refused) as e:
            await fs.setattr(ll.st_ino, size0, fields(update_mode=True), None, CTX)
        assert errno_of(e) == errno.EPERM
    try:
        run(tmp_path, test)
    finally:
        logging.getLogger("hintfs").setLevel(before)


def test_abandon_open_writes_drops_unclosed_writes(tmp_path):
    async def test(fs, root):
        fi, _ = await fs.create(ROOT_INODE, b"open", 0o100644, os.O_WRONLY | os.O_CREAT, CTX)
        await fs.write(fi.fh, 0, b"torn")
        assert fs.abandon_open_writes() == 1
        assert not (root / "open").exists()
    run(tmp_path, test)

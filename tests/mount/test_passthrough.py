"""FUSE passthrough on real mounts (file:// store): the kernel serves the bytes of open files from
the store file or the staging file; the daemon sees opens and closes (docs/semantics.md).

Skipped with the reason where this host cannot do passthrough (kernel, libfuse/pyfuse3, root);
the fallback path is tested without a skip in test_passthrough_fallback.py and below."""
from __future__ import annotations

import errno
import mmap
import os
import threading

import pytest

from tests.conftest import check_fsync_publishes_a_whole_file, needs_fuse, tiny_tmpfs, wait_for

pytestmark = needs_fuse


@pytest.fixture
def pt(mount_factory):
    # (Checked marks off: these tests count passthrough's own backing registrations and their
    # release at the last close, which a fast-path mark holds on purpose: tests/mount/test_fastpath*.py.)
    m = mount_factory('\n[mount]\npassthrough = "auto"\nfast_checked_opens = false\n')
    state = m.stats()["passthrough"]["state"]
    if state != "on":
        m.umount()
        pytest.skip(f"FUSE passthrough not available here: {state}")
    return m


def counters(m) -> dict:
    s = m.stats()
    return {**s["passthrough"], "bytes_read": s["bytes"]["read"], "bytes_written": s["bytes"]["written"]}


def released(m) -> bool:
    c = counters(m)
    return c.get("backing_open", 0) == c.get("backing_close", 0)


def test_reads_writes_and_mmap_pass_through_with_the_same_bytes(pt):
    data = os.urandom(3 << 20)
    (pt.store / "r.bin").write_bytes(data)
    assert (pt.mnt / "r.bin").read_bytes() == data
    with open(pt.mnt / "r.bin", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert mm[:4096] == data[:4096] and mm[-10:] == data[-10:]
    # a new file, written through the kernel into the staging file, published on close
    new = os.urandom(5 << 20)
    (pt.mnt / "w.bin").write_bytes(new)
    assert (pt.store / "w.bin").read_bytes() == new
    # partial overwrite, append, truncate, read-your-writes while open
    with open(pt.mnt / "w.bin", "r+b") as f:
        f.seek(10)
        f.write(b"XYZ")
        f.flush()
        assert (pt.mnt / "w.bin").read_bytes()[8:15] == new[8:10] + b"XYZ" + new[13:15]
        assert (pt.store / "w.bin").read_bytes() == new        # not published before close
    with open(pt.mnt / "w.bin", "ab") as f:
        f.write(b"tail")
    expect = new[:10] + b"XYZ" + new[13:] + b"tail"
    assert (pt.store / "w.bin").read_bytes() == expect
    os.truncate(pt.mnt / "w.bin", 100)
    assert (pt.store / "w.bin").read_bytes() == expect[:100]
    # a shared writable mapping is published at close
    (pt.mnt / "m.bin").write_bytes(b"\0" * 8192)
    with open(pt.mnt / "m.bin", "r+b") as f, mmap.mmap(f.fileno(), 8192) as mm:
        mm[100:105] = b"hello"
        mm.flush()
    assert wait_for(lambda: (pt.store / "m.bin").read_bytes()[100:105] == b"hello", 5)
    c = counters(pt)
    # the daemon saw none of these bytes: the kernel moved them
    assert c["bytes_read"] < len(data) and c["bytes_written"] < len(new)
    assert c["opens"] >= 6
    assert wait_for(lambda: released(pt), 5)


def test_publish_on_close_stays_atomic_for_store_readers(pt):
    old, new = b"o" * (8 << 20), b"n" * (8 << 20)
    (pt.store / "a.bin").write_bytes(old)
    seen = set()
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            d = (pt.store / "a.bin").read_bytes()
            seen.add((len(d), d[:1], d[-1:]))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(3):
            with open(pt.mnt / "a.bin", "wb") as f:
                for i in range(0, len(new), 1 << 20):
                    f.write(new[i:i + (1 << 20)])
            with open(pt.mnt / "a.bin", "wb") as f:
                f.write(old)
    finally:
        stop.set()
        t.join()
    assert seen <= {(len(old), b"o", b"o"), (len(new), b"n", b"n")}, seen


def test_backing_ids_are_released_after_many_opens(pt):
    (pt.store / "s.bin").write_bytes(b"s" * 4096)
    for i in range(200):
        with open(pt.mnt / "s.bin", "rb") as f:
            assert f.read() == b"s" * 4096
        if i % 20 == 0:
            (pt.mnt / f"n{i}").write_bytes(b"x" * i)
    # two opens at once share one backing id
    with open(pt.mnt / "s.bin", "rb") as a, open(pt.mnt / "s.bin", "rb") as b:
        assert a.read(1) == b.read(1) == b"s"
    assert wait_for(lambda: released(pt), 5), counters(pt)
    c = counters(pt)
    assert c["backing_open"] <= c["opens"] - 1       # the shared open registered nothing
    assert c["backing_open"] >= 200


def test_unlinked_while_writing_is_not_published_and_writer_conflicts_are_etxtbsy(pt):
    with open(pt.mnt / "gone.bin", "wb") as f:
        f.write(b"data")
        os.unlink(pt.mnt / "gone.bin")
        f.write(b"more")
        f.flush()
        assert os.fstat(f.fileno()).st_size == 8
    assert wait_for(lambda: released(pt), 5)
    assert not (pt.store / "gone.bin").exists()
    # the release (sent by the kernel after close returned) removes the staging file last
    assert wait_for(lambda: not [n for n in os.listdir(pt.store) if n.startswith(".hintfs-tmp.")], 5)
    # open for reading through passthrough: a writer of the same file is refused (docs/semantics.md)
    (pt.store / "busy.bin").write_bytes(b"old")
    with open(pt.mnt / "busy.bin", "rb") as r:
        with pytest.raises(OSError) as err:
            open(pt.mnt / "busy.bin", "r+b")
        assert err.value.errno == errno.ETXTBSY
        assert r.read() == b"old"
    (pt.mnt / "busy.bin").write_bytes(b"new")    # closed: writable again
    assert (pt.store / "busy.bin").read_bytes() == b"new"
    # a reader opened while the writer is open sees its writes (same backing: the staging)
    with open(pt.mnt / "busy.bin", "r+b") as w:
        w.write(b"NEW!")
        w.flush()
        assert (pt.mnt / "busy.bin").read_bytes() == b"NEW!"


def _replace_in_store(m, name: str, data: bytes) -> None:
    tmp = m.store / (name + ".tmp")
    tmp.write_bytes(data)
    os.rename(tmp, m.store / name)


def test_close_to_open_sees_a_file_replaced_in_the_store(pt):
    (pt.store / "c.bin").write_bytes(b"one")
    assert (pt.mnt / "c.bin").read_bytes() == b"one"
    _replace_in_store(pt, "c.bin", b"two!")
    # at once, even if the kernel's release of the first open has not reached the daemon yet
    assert (pt.mnt / "c.bin").read_bytes() == b"two!"
    # replaced while a reader holds the old file open: a new open reads the new file (ESTALE
    # inside open(2) makes the kernel look the name up again), the old open keeps the old one
    with open(pt.mnt / "c.bin", "rb") as old:
        _replace_in_store(pt, "c.bin", b"three")
        with open(pt.mnt / "c.bin", "rb") as new:
            assert new.read() == b"three"
        assert old.read() == b"two!"
        assert os.stat(pt.mnt / "c.bin").st_size == 5
    assert pt.stats()["passthrough"].get("replaced", 0) >= 1
    assert wait_for(lambda: released(pt), 5), counters(pt)


def test_fsync_and_a_second_writer_keep_the_published_file_whole(pt):
    # fsync publishes a copy: the kernel goes on writing into the private staging file
    check_fsync_publishes_a_whole_file(pt)
    # two writers: the first close publishes what both wrote so far, the second the rest
    a = open(pt.mnt / "two.bin", "wb")
    b = open(pt.mnt / "two.bin", "r+b")
    a.write(b"AAAA")
    a.close()
    assert (pt.store / "two.bin").read_bytes() == b"AAAA"
    b.seek(4)
    b.write(b"BBBB")
    b.flush()
    assert (pt.store / "two.bin").read_bytes() == b"AAAA"
    b.close()
    assert (pt.store / "two.bin").read_bytes() == b"AAAABBBB"
    assert pt.stats()["passthrough"].get("copy_publishes", 0) >= 2
    assert not [n for n in os.listdir(pt.store) if n.startswith(".hintfs-tmp.")]


def test_a_write_error_fails_close_and_nothing_is_published(pt):
    """The publish rule (docs/semantics.md): a store this full is below `passthrough_min_free_mb`,
    so the open goes through the daemon, which sees the failed write; close() fails and nothing is
    published. (A full store under passthrough: tests/mount/test_publish_rule.py.)"""
    with tiny_tmpfs(pt.store / "small") as small:
        fd = os.open(pt.mnt / "small" / "big", os.O_WRONLY | os.O_CREAT, 0o644)
        with pytest.raises(OSError) as exc:
            for _ in range(16):
                os.write(fd, b"z" * (64 << 10))
        assert exc.value.errno == errno.ENOSPC
        with pytest.raises(OSError) as exc:
            os.close(fd)
        assert exc.value.errno in (errno.EIO, errno.ENOSPC)
        assert wait_for(lambda: os.listdir(small) == [], 10), os.listdir(small)
        assert pt.stats()["passthrough"].get("low_space_opens", 0) >= 1


def test_read_only_close_sends_no_flush(pt):
    (pt.store / "r.bin").write_bytes(b"r" * 100)
    before = pt.stats()["ops"].get("flush", {}).get("count", 0)
    for _ in range(20):
        assert (pt.mnt / "r.bin").read_bytes() == b"r" * 100
    assert pt.stats()["ops"].get("flush", {}).get("count", 0) == before


def test_passthrough_off_is_todays_path(mount_factory):
    m = mount_factory('\n[mount]\npassthrough = "off"\n', name="off")
    (m.store / "f").write_bytes(b"z" * 10000)
    assert (m.mnt / "f").read_bytes() == b"z" * 10000
    s = m.stats()
    assert s["passthrough"]["state"].startswith("off")
    assert s["bytes"]["read"] >= 10000
    assert "opens" not in s["passthrough"]


def test_readahead_through_a_passthrough_open_is_answered_not_ebadf(pt):
    """posix_fadvise(WILLNEED) (pyarrow.parquet.read_table does it) on a passthrough open makes the
    kernel read the FUSE file's own pages through the daemon: answered from the backing file (the
    store file, or a writer's staging), where it used to be a counted EBADF with no log line
    (issue 38)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    data = os.urandom(300_000)
    (pt.store / "ra.bin").write_bytes(data)
    fd = os.open(pt.mnt / "ra.bin", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, len(data), os.POSIX_FADV_WILLNEED)
        assert os.pread(fd, len(data), 0) == data
    finally:
        os.close(fd)
    with open(pt.mnt / "w.bin", "wb") as w:   # a writer's staging backs the shared read open
        w.write(data)
        w.flush()
        fd = os.open(pt.mnt / "w.bin", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, len(data), os.POSIX_FADV_WILLNEED)
            assert os.pread(fd, len(data), 0) == data
        finally:
            os.close(fd)
    pq.write_table(pa.table({"a": list(range(1000))}), str(pt.mnt / "t.parquet"))
    assert pq.read_table(str(pt.mnt / "t.parquet")).column("a").to_pylist() == list(range(1000))
    s = pt.stats()
    assert str(errno.EBADF) not in s["errors"], s["errors"]
    assert s["ops"].get("read", {}).get("errors", 0) == 0
    assert s["passthrough"].get("daemon_reads", 0) >= 1    # the kernel did ask (else nothing is tested)

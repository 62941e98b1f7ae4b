"""A tier agent's replica fds (issue 37: a tier of 16,384-file checkpoints kept one open fd per
replica, reached its open-file limit, and every copy after that failed with EMFILE for ever).
The catalog keeps fds open only for the replicas read last (`Catalog.max_open_fds`), pins the
fd of a read running outside its lock, and reopens a replica by name only if its file is still
the one it was made with."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import textwrap

from hintfs.agent import catalog as catalog_mod
from hintfs.agent.catalog import Catalog
from hintfs.common.clock import FakeClock


def _catalog(tmp_path, max_open: int, persistent: bool = False, name: str = "c") -> Catalog:
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    return Catalog(str(folder), 1 << 30, persistent, clock=FakeClock(), max_open_fds=max_open)


def _replica(cat: Catalog, path: str, data: bytes, mtime_ns: int = 1) -> None:
    part = cat.local_name(path) + ".part"
    with open(part, "wb") as f:
        f.write(data)
    assert cat.add_unless_removed(cat.replica_from(part, path, len(data), mtime_ns, 60.0, None))


def _fds(under) -> int:
    """This process's open fds on files under `under` (the whole process's count moves with what
    other tests' threads in the same pytest worker close or open meanwhile: it failed once in a
    fresh-clone `make test`, 334 against 338 before)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += target.startswith(str(under) + "/")
    return n


def test_a_tier_of_many_replicas_holds_few_fds(tmp_path):
    cat = _catalog(tmp_path, max_open=8)
    before = _fds(tmp_path)
    for i in range(200):
        _replica(cat, f"ckpt/step_1/f{i}", b"%05d" % i * 20)
    assert cat.open_fds() == 0 and _fds(tmp_path) == before      # made, not yet read: nothing open
    for _ in range(2):
        for i in range(200):
            rep = cat.get(f"ckpt/step_1/f{i}")
            assert rep is not None
            assert cat.read(rep, 5, 10) == b"%05d" % i * 2
    assert cat.open_fds() == 8 and _fds(tmp_path) <= before + 8
    assert cat.fd_opens == 400                            # each pass reopens (an 8-fd cache)
    hot = cat.get("ckpt/step_1/f7")
    assert hot is not None
    for _ in range(50):                                   # a hot replica stays open
        assert cat.read(hot, 0, 5) == b"00007"
    assert cat.fd_opens == 401
    # the other readers of a replica: a pread under the lock and the fd handed to the mount
    with cat.lock:
        assert cat.pread("ckpt/step_1/f3", (100, 1), 95, 10) == b"00003"
        assert cat.pread("ckpt/step_1/f3", (100, 2), 0, 5) is None     # another version
    fd = cat.local_fd("ckpt/step_1/f4", 100, 1)
    try:
        assert os.pread(fd, 5, 0) == b"00004"
    finally:
        os.close(fd)
    assert cat.open_fds() == 8
    for i in range(200):
        assert cat.drop(f"ckpt/step_1/f{i}")
    assert cat.open_fds() == 0 and _fds(tmp_path) == before


def test_a_dropped_replica_being_read_keeps_its_fd_until_the_read_ends(tmp_path, monkeypatch):
    cat = _catalog(tmp_path, max_open=1)
    _replica(cat, "a", b"A" * 64)
    _replica(cat, "b", b"B" * 64)
    rep = cat.get("a")
    assert rep is not None
    started, go = threading.Event(), threading.Event()
    real = os.pread

    def slow_pread(fd: int, n: int, offset: int) -> bytes:
        started.set()
        assert go.wait(10)
        return real(fd, n, offset)

    monkeypatch.setattr(catalog_mod.os, "pread", slow_pread)
    got: list[bytes | None] = []
    t = threading.Thread(target=lambda: got.append(cat.read(rep, 0, 8)))
    t.start()
    assert started.wait(10)
    monkeypatch.setattr(catalog_mod.os, "pread", real)
    fd = rep.fd
    other = cat.get("b")
    assert other is not None and cat.read(other, 0, 2) == b"BB"   # over the cache's 1: "a" is pinned
    assert rep.fd == fd and cat.open_fds() == 2
    assert cat.drop("a")                                  # dropped while its read runs
    assert not os.path.exists(rep.local)
    os.fstat(fd)                                          # still open: the read holds it
    go.set()
    t.join(10)
    assert got == [b"A" * 8]
    assert rep.fd == -1 and cat.open_fds() == 1           # closed by the read that ended
    assert cat.read(rep, 0, 8) is None                    # a dropped replica is never reopened


def test_a_newer_version_renamed_over_the_name_is_not_read_as_the_older(tmp_path):
    cat = _catalog(tmp_path, max_open=1)
    _replica(cat, "x", b"old!" * 4, mtime_ns=1)
    _replica(cat, "y", b"y" * 16)
    old = cat.get("x")
    assert old is not None
    # a newer version's part renamed over the replica's name before the old one is dropped
    part = cat.local_name("x") + ".part"
    with open(part, "wb") as f:
        f.write(b"new!" * 4)
    newer = cat.replica_from(part, "x", 16, 2, 60.0, None)
    assert cat.read(old, 0, 4) is None                    # not the file it was made with
    assert cat.add_unless_removed(newer)
    assert cat.read(newer, 0, 4) == b"new!"


def test_adopted_replicas_are_read_on_demand(tmp_path):
    old = _catalog(tmp_path, max_open=4, persistent=True, name="old")
    for i in range(20):
        _replica(old, f"f{i}", bytes([65 + i]) * 32)
    rep = old.get("f0")
    assert rep is not None and old.read(rep, 0, 1) == b"A"
    old.close()
    new = _catalog(tmp_path, max_open=4, persistent=True, name="new")
    assert new.adopt(str(tmp_path / "old")) == 20
    assert new.open_fds() == 0
    for i in range(20):
        rep = new.get(f"f{i}")
        assert rep is not None and new.read(rep, 31, 1) == bytes([65 + i])
    assert new.open_fds() == 4
    new.close()
    assert new.open_fds() == 0


def test_out_of_open_files_the_cache_gives_way(tmp_path):
    """A limit lowered under the cache (or other fds taking it): a read closes cached fds and
    opens its own instead of failing with EMFILE."""
    script = textwrap.dedent(f"""
        import os, resource
        from hintfs.agent.catalog import Catalog
        from hintfs.common.clock import FakeClock
        cat = Catalog({str(tmp_path)!r}, 1 << 30, False, clock=FakeClock(), max_open_fds=10_000)
        for i in range(300):
            part = cat.local_name(f"f{{i}}") + ".part"
            with open(part, "wb") as f:
                f.write(b"%04d" % i)
            assert cat.add_unless_removed(cat.replica_from(part, f"f{{i}}", 4, 1, 60.0, None))
        used = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (used + 100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        for _ in range(2):
            for i in range(300):
                assert cat.read(cat.get(f"f{{i}}"), 0, 4) == b"%04d" % i
        assert cat.open_fds() <= 100, cat.open_fds()
        print("ok", cat.open_fds())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")

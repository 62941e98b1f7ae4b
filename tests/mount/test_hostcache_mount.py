"""The host cache of a remote store on a real mount, against a real S3 server on loopback (JuiceFS's S3 gateway):
a second open is served from the cache (by the kernel, with FUSE passthrough where this host has
it), with the same bytes; a file replaced in S3 between opens is read fresh; writes, overwrites
and unlinks through the mount drop the cached copy."""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import itertools
import os
import stat as stat_mod
import sys
import time
from dataclasses import dataclass

import pytest

from hintfs.stores.hostcache import cache_name
from tests.conftest import Mounted, needs_fuse, wait_for
from tests.helpers.mounts import world_mount
from tests.helpers.security import as_nobody, can_run_as_nobody
from tests.helpers.s3 import s3_server as _s3_server
from tests.helpers.s3 import s3fs, store_extra

pytestmark = needs_fuse

BUCKET = "remote"
MiB = 1 << 20


_buckets = itertools.count()


@pytest.fixture(scope="module")
def _module_s3_server(tmp_path_factory):
    yield from _s3_server(tmp_path_factory.mktemp("s3"))


@pytest.fixture
def s3_server(_module_s3_server, monkeypatch):
    """One S3 server for this file's tests (a start is ~1 s); each test has a bucket of its own."""
    monkeypatch.setattr(sys.modules[__name__], "BUCKET", f"remote{next(_buckets)}")
    return _module_s3_server


@dataclass
class HostCacheMount:
    m: Mounted
    fs: object
    cache_dir: str

    def counters(self) -> dict:
        return self.m.stats()["counters"]

    def put(self, rel: str, data: bytes) -> None:
        with self.fs.open_output_stream(f"{BUCKET}/{rel}") as f:
            f.write(data)

    def get(self, rel: str) -> bytes:
        with self.fs.open_input_stream(f"{BUCKET}/{rel}") as f:
            return f.read()

    def fetched(self, n: int) -> bool:
        return wait_for(lambda: self.counters()["hostcache_fetches"] >= n, timeout=30)

    def passthrough(self) -> bool:
        return self.m.stats()["passthrough"]["state"] == "on"

    def released(self) -> bool:
        p = self.m.stats()["passthrough"]
        return p.get("backing_open", 0) == p.get("backing_close", 0)


def _hc_mount(s3_server, mount_factory, tmp_path, cache_extra: str) -> HostCacheMount:
    fs = s3fs(s3_server)
    fs.create_dir(BUCKET)
    cache_dir = tmp_path / "hostcache"
    extra = (f'\n[cache]\nspool_dir = "{tmp_path / "spool"}"\ndir = "{cache_dir}"\n{cache_extra}\n'
             '\n[mount]\npassthrough = "auto"\n')
    m = mount_factory(extra=extra, store_uri=f"s3://{BUCKET}", store_extra=store_extra(s3_server))
    assert "hostcache_hits" in m.stats()["counters"]   # `hintfs mount` wired the host cache
    return HostCacheMount(m, fs, str(cache_dir))


@pytest.fixture
def hc(s3_server, mount_factory, tmp_path):
    return _hc_mount(s3_server, mount_factory, tmp_path, f"fetch_block_bytes = {MiB}")


def test_second_open_is_served_from_the_host_cache(hc):
    data = os.urandom(6 * MiB + 123)
    hc.put("ckpt/shard-0.bin", data)
    path = hc.m.mnt / "ckpt" / "shard-0.bin"
    assert path.read_bytes() == data           # from S3; its first read asks for the whole file
    assert hc.fetched(1), hc.counters()
    c0 = hc.counters()
    s0 = hc.m.stats()
    assert c0["hostcache_fetched_bytes"] == len(data) and c0["hostcache_hits"] == 0
    assert path.read_bytes() == data
    c1 = hc.counters()
    s1 = hc.m.stats()
    assert c1["hostcache_hits"] == 1 and c1["hostcache_fetches"] == 1
    if hc.passthrough():
        # served by the kernel from the cached file: the daemon saw the open, not the bytes
        assert s1["passthrough"]["opens"] > s0["passthrough"].get("opens", 0)
        assert s1["bytes"]["read"] == s0["bytes"]["read"]
    else:
        assert s1["passthrough"]["state"] != "on"   # (the daemon reads the local copy instead)
    # the cache: 0700, one subdirectory per store, files named by a hash of their path
    assert stat_mod.S_IMODE(os.stat(hc.cache_dir).st_mode) == 0o700
    (sub,) = os.listdir(hc.cache_dir)
    assert stat_mod.S_IMODE(os.stat(os.path.join(hc.cache_dir, sub)).st_mode) == 0o700
    assert cache_name("ckpt/shard-0.bin") in os.listdir(os.path.join(hc.cache_dir, sub))
    with open(os.path.join(hc.cache_dir, sub, cache_name("ckpt/shard-0.bin")), "rb") as f:
        assert f.read() == data


def test_a_file_replaced_in_s3_between_opens_is_read_fresh(hc):
    path = hc.m.mnt / "f.bin"
    v1 = os.urandom(3 * MiB)
    hc.put("f.bin", v1)
    assert path.read_bytes() == v1
    assert hc.fetched(1)
    assert path.read_bytes() == v1 and hc.counters()["hostcache_hits"] == 1
    v2 = os.urandom(3 * MiB + 1)                # another size
    hc.put("f.bin", v2)
    assert path.read_bytes() == v2
    assert hc.counters()["hostcache_stale"] == 1
    assert hc.fetched(2)
    assert path.read_bytes() == v2 and hc.counters()["hostcache_hits"] == 2
    # the same size a second later (S3's Last-Modified has whole seconds; the ETag differs too)
    time.sleep(1.1)
    v3 = os.urandom(len(v2))
    hc.put("f.bin", v3)
    assert path.read_bytes() == v3
    assert hc.counters()["hostcache_stale"] == 2


def test_writes_through_the_mount_drop_the_cached_copy(hc):
    path = hc.m.mnt / "w.bin"
    data = os.urandom(2 * MiB)
    path.write_bytes(data)                     # (with passthrough: into the spool file, uploaded at close)
    assert hc.get("w.bin") == data
    assert path.read_bytes() == data
    assert hc.fetched(1)
    assert path.read_bytes() == data and hc.counters()["hostcache_hits"] == 1
    assert wait_for(hc.released, 5)            # (a write open waits for passthrough reads to be released)
    with open(path, "r+b") as f:
        f.seek(10)
        f.write(b"XYZ")
    expect = data[:10] + b"XYZ" + data[13:]
    assert hc.get("w.bin") == expect
    assert hc.counters()["hostcache_invalidations"] >= 1
    assert path.read_bytes() == expect
    with open(path, "ab") as f:
        f.write(b"tail")
    assert hc.get("w.bin") == expect + b"tail"
    assert path.read_bytes() == expect + b"tail"
    assert hc.fetched(2)
    os.unlink(path)
    (sub,) = os.listdir(hc.cache_dir)
    assert cache_name("w.bin") not in os.listdir(os.path.join(hc.cache_dir, sub))
    assert not path.exists()


def test_a_hint_fetches_its_files_into_the_host_cache_before_any_read(hc):
    import json
    data = os.urandom(2 * MiB)
    hc.put("ckpt/hinted.bin", data)
    (hc.m.mnt / ".hintfs" / "hints" / "restart").write_text(json.dumps({"files": {"ckpt/hinted.bin": 8}}))
    assert hc.fetched(1), hc.counters()        # nothing read it yet
    assert (hc.m.mnt / "ckpt" / "hinted.bin").read_bytes() == data
    c = hc.counters()
    assert c["hostcache_hits"] == 1 and c["hostcache_fetches"] == 1


def test_a_cold_read_fetches_each_byte_once_and_a_small_object_in_one_request(hc):
    """Issue 39: the open reads from the cache's fetch (its read-ahead), not from S3 again; a small
    object is read whole at open (one GET) and kept from those bytes, no fetch of its own."""
    big, small = os.urandom(6 * MiB + 5), os.urandom(40 << 10)
    hc.put("ckpt/big.bin", big)
    hc.put("ckpt/small.bin", small)
    assert (hc.m.mnt / "ckpt" / "big.bin").read_bytes() == big
    assert hc.fetched(1), hc.counters()
    c = hc.counters()
    assert c["hostcache_fetched_bytes"] == len(big) and c.get("hostcache_fetch_jumps", 0) == 0
    assert (hc.m.mnt / "ckpt" / "small.bin").read_bytes() == small
    c = hc.counters()
    assert c["whole_object_opens"] == 1 and c["hostcache_whole"] == 1 and c["hostcache_fetches"] == 2
    assert (hc.m.mnt / "ckpt" / "small.bin").read_bytes() == small
    assert hc.counters()["hostcache_hits"] >= 1


def test_the_first_open_of_a_small_object_is_read_by_the_kernel_from_the_copy_just_kept(hc):
    """Issue 39: the open that GETs a small object whole serves it from the host cache's copy of
    those bytes, by passthrough where this host has it: no READ request reaches the daemon."""
    small = os.urandom(48 << 10)
    hc.put("ds/a.bin", small)
    s0 = hc.m.stats()
    with open(hc.m.mnt / "ds" / "a.bin", "rb") as f:
        assert f.read() == small
        assert os.fstat(f.fileno()).st_size == len(small)
    s1 = hc.m.stats()
    assert s1["counters"]["hostcache_whole"] == 1 and s1["counters"]["get_opens"] == 1
    if hc.passthrough():
        assert s1["passthrough"]["opens"] > s0["passthrough"].get("opens", 0)
        assert s1["bytes"]["read"] == s0["bytes"]["read"]
    assert hc.released()


def test_concurrent_opens_of_one_file_share_its_backing(hc):
    """Several threads open the same files at once, first from S3 and then from the host cache:
    every open reads the file's bytes. The kernel serves an inode's opens from one passthrough
    backing file and fails an open without it (EIO): an open that waited for the store while
    another got a backing joins that one (`passthrough_joined`); one whose shared backing was
    released while it waited opens as a first open (it got EBADF)."""
    datas = {f"d/f{i:03d}": os.urandom(1000 + i * 37) for i in range(40)}
    for rel, data in datas.items():
        hc.put(rel, data)
    root = hc.m.mnt
    errors: list[OSError] = []

    def read(rel: str) -> bool:
        try:
            return (root / rel).read_bytes() == datas[rel]
        except OSError as err:
            errors.append(err)
            return False

    for _ in range(3):
        with cf.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(read, [rel for rel in datas for _ in range(4)]))
        assert not errors, errors[:3]
        assert all(got)
    c = hc.counters()
    assert c["hostcache_whole"] == len(datas)
    if hc.passthrough():
        assert c.get("passthrough_failed", 0) == 0
        assert wait_for(hc.released, timeout=10), hc.m.stats()["passthrough"]


@pytest.mark.parametrize("mapped", ["true", "false"])
def test_a_fetch_reads_each_block_by_one_ranged_get_into_the_cache_file(s3_server, mount_factory, tmp_path, mapped):
    """Issue 39 (cold S3 reads): each block of a fetch is one ranged GET of the open's version
    (If-Match) whose body lands in the fetch's mapping of the cache file (`fetch_mapped = true`;
    reads of fetched blocks come from that mapping) or in the fetch thread's buffer, then pwrite
    (the default). The bytes are the object's, by any read size and offset."""
    fs = s3fs(s3_server)
    fs.create_dir(BUCKET)
    cache_dir = tmp_path / "hostcache"
    extra = (f'\n[cache]\nspool_dir = "{tmp_path / "spool"}"\ndir = "{cache_dir}"\nfetch_block_bytes = {MiB}\n'
             f'fetch_mapped = {mapped}\n\n[mount]\npassthrough = "auto"\n')
    m = mount_factory(extra=extra, store_uri=f"s3://{BUCKET}", store_extra=store_extra(s3_server))
    hc = HostCacheMount(m, fs, str(cache_dir))
    data = os.urandom(5 * MiB + 77)
    hc.put("ckpt/mapped.bin", data)
    path = hc.m.mnt / "ckpt" / "mapped.bin"
    with open(path, "rb", buffering=0) as f:
        got = b"".join(iter(lambda: f.read(300_001), b""))
    assert got == data
    assert hc.fetched(1), hc.counters()
    c = hc.counters()
    assert c["store_gets_into"] == 6 and c.get("store_gets_into_refused", 0) == 0, c
    assert c["hostcache_fetched_bytes"] == len(data)
    assert path.read_bytes() == data               # the complete copy, as fetched
    assert hc.get("ckpt/mapped.bin") == data


def test_fetch_buffered_false_reads_blocks_through_pyarrow(s3_server, mount_factory, tmp_path):
    fs = s3fs(s3_server)
    fs.create_dir(BUCKET)
    extra = (f'\n[cache]\nspool_dir = "{tmp_path / "spool"}"\ndir = "{tmp_path / "hc"}"\nfetch_block_bytes = {MiB}\n'
             'fetch_mapped = false\nfetch_buffered = false\n')
    m = mount_factory(extra=extra, store_uri=f"s3://{BUCKET}", store_extra=store_extra(s3_server))
    data = os.urandom(3 * MiB + 1)
    with fs.open_output_stream(f"{BUCKET}/u.bin") as f:
        f.write(data)
    assert (m.mnt / "u.bin").read_bytes() == data
    assert wait_for(lambda: m.stats()["counters"]["hostcache_fetches"] >= 1, timeout=30)
    c = m.stats()["counters"]
    assert c.get("store_gets_into", 0) == 0 and c["hostcache_fetched_bytes"] == len(data)
    assert (m.mnt / "u.bin").read_bytes() == data


@pytest.fixture
def hc_immutable(s3_server, mount_factory, tmp_path):
    """A host-cached S3 mount whose every path is declared immutable (the fast path may mark)."""
    return _hc_mount(s3_server, mount_factory, tmp_path, 'immutable_globs = ["*"]')


def test_a_folder_of_small_objects_read_in_order_is_fetched_ahead(hc_immutable):
    """Issue 39: once `fast_opens_ahead` (2) small objects of a listed folder were opened, the
    folder's other small objects are fetched into the host cache and marked for the fast path
    before their opens (`Filesystem._fetch_ahead`): their opens and releases never reach Python,
    and each object is fetched once. A large object is not fetched ahead."""
    hc = hc_immutable
    datas = {f"f{i:03d}.bin": os.urandom(2000 + 97 * i) for i in range(40)}
    for name, data in datas.items():
        hc.put(f"ds/{name}", data)
    big = os.urandom(3 * MiB)
    hc.put("ds/zbig.bin", big)
    folder = hc.m.mnt / "ds"
    assert sorted(os.listdir(folder)) == sorted([*datas, "zbig.bin"])
    names = sorted(datas)
    for name in names[:2]:
        assert (folder / name).read_bytes() == datas[name]
    if not hc.passthrough():   # (no passthrough on this host: no fast path, every open in Python)
        assert all((folder / n).read_bytes() == datas[n] for n in names)
        assert hc.m.stats()["fast_path"].get("fetched_ahead", 0) == 0
        return
    assert wait_for(lambda: hc.m.stats()["fast_path"]["fetched_ahead"] >= len(names) - 2, timeout=30), \
        hc.m.stats()["fast_path"]
    s0 = hc.m.stats()
    for name in names[2:]:
        assert (folder / name).read_bytes() == datas[name]
    s1 = hc.m.stats()
    # answered in pyfuse3: the only open Python saw since is of the stats file itself
    assert s1["ops"]["open"]["count"] == s0["ops"]["open"]["count"] + 1
    assert s1["fast_path"]["opens"] - s0["fast_path"]["opens"] == len(names) - 2
    c = s1["counters"]
    assert c["store_gets"] == len(names) and c["hostcache_whole"] == len(names)
    assert c["hostcache_fetched_bytes"] == sum(map(len, datas.values()))   # not the big one
    assert (folder / "zbig.bin").read_bytes() == big


def test_a_change_in_the_folder_ends_the_marks_made_ahead(hc_immutable):
    """An object marked ahead and then overwritten through the mount is read as written: the write
    open ends its mark (the fast path never serves a file being written)."""
    hc = hc_immutable
    for i in range(8):
        hc.put(f"ds/f{i}.bin", bytes([i]) * 3000)
    folder = hc.m.mnt / "ds"
    os.listdir(folder)
    for i in range(2):
        (folder / f"f{i}.bin").read_bytes()
    if hc.passthrough():
        assert wait_for(lambda: hc.m.stats()["fast_path"]["fetched_ahead"] >= 6, timeout=30)
    (folder / "f5.bin").write_bytes(b"new")
    assert (folder / "f5.bin").read_bytes() == b"new"
    assert hc.get("ds/f5.bin") == b"new"
    assert (folder / "f6.bin").read_bytes() == bytes([6]) * 3000


def test_a_file_created_in_an_immutable_folder_is_listed_once_published(hc_immutable):
    """The kernel keeps an immutable folder's listing; one taken while a new file was being
    written lacks it (listed only once published). At the publish the daemon drops that listing,
    and since the kernel keeps an empty listing whatever drops its pages, the folder's mtime moves
    too (an S3 folder has none of its own): the file is listed after its close (seed 5700007)."""
    folder = hc_immutable.m.mnt / "new"
    folder.mkdir()
    fd = os.open(folder / "f0", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, b"x" * 100)
        assert os.listdir(folder) == []          # not published yet
    finally:
        os.close(fd)
    assert os.listdir(folder) == ["f0"]
    assert (folder / "f0").read_bytes() == b"x" * 100
    assert hc_immutable.get("new/f0") == b"x" * 100


@pytest.mark.skipif(not can_run_as_nobody(), reason="needs root and setpriv")
def test_another_users_reads_fetch_ahead_within_its_bounds(s3_server):
    """The attack: uid 65534 goes through a folder of small objects on an immutable path, so the
    daemon fetches the rest into the host cache for it. What that user makes the daemon fetch is
    bounded: a quarter of the cache's budget per folder (here 1 MiB: 8 objects of 30,000 bytes),
    its marks are its own (`fast_path.users`), and every byte it reads is the object's."""
    fs = s3fs(s3_server)
    fs.create_dir(BUCKET)
    datas = {f"f{i:03d}.bin": os.urandom(30_000) for i in range(40)}
    for name, data in datas.items():
        with fs.open_output_stream(f"{BUCKET}/ds/{name}") as f:
            f.write(data)

    def setup(base) -> str:
        return (f'\n[cache]\nspool_dir = "{base / "spool"}"\ndir = "{base / "hostcache"}"\n'
                f'budget_bytes = {MiB}\nimmutable_globs = ["*"]\n\n[mount]\npassthrough = "auto"\n')

    with world_mount(setup, prefix="hintfs-fetchahead-", store_uri=f"s3://{BUCKET}",
                     store_extra=store_extra(s3_server)) as m:
        folder = m.mnt / "ds"
        names = sorted(datas)
        got = as_nobody(f"""
            import json, os
            folder = {str(folder)!r}
            names = sorted(os.listdir(folder))
            out = {{"names": names, "same": []}}
            for n in names[:2]:
                with open(os.path.join(folder, n), "rb") as f:
                    out["same"].append(f.read())
            out["same"] = [len(b) for b in out["same"]]
            print(json.dumps(out))
        """)
        assert got["names"] == names and got["same"] == [30_000, 30_000], got
        if m.stats()["passthrough"]["state"] != "on":   # (no passthrough here: no marks, no fetches ahead)
            assert m.stats()["fast_path"].get("fetched_ahead", 0) == 0
            return
        assert wait_for(lambda: m.stats()["fast_path"]["fetched_ahead"] >= 1, timeout=30), m.stats()["fast_path"]
        time.sleep(0.5)   # (what is in flight lands)
        fast, c = m.stats()["fast_path"], m.stats()["counters"]
        assert 1 <= fast["fetched_ahead"] <= (MiB // 4) // 30_000, fast        # a quarter of the budget
        assert c["hostcache_whole"] <= 2 + (MiB // 4) // 30_000, c
        assert fast["users"] == 1, fast                                        # its marks: its own
        read = as_nobody(f"""
            import hashlib, json, os
            folder = {str(folder)!r}
            print(json.dumps({{n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest()
                              for n in sorted(os.listdir(folder))}}))
        """)
        assert read == {n: hashlib.sha256(d).hexdigest() for n, d in datas.items()}

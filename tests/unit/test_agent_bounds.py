"""Bounds of the agent's requests and of what one sender may hold (issue 34, findings 6 and 12):
read offsets, CRC lists, streams per sender and in total, stream bytes inside the budget,
versions checked against the store before a stream is served, and the sample cache per job."""
from __future__ import annotations

import errno
import json

import pyarrow.flight as fl
import pytest

from hintfs.agent import actions, rpc
from hintfs.agent.client import AgentClient
from hintfs.agent.server import start_in_process
from mountconfig import parse_config
from hintfs.stores.local import LocalStore

LAST = (1 << 63) - 1


def _errno(err: fl.FlightServerError) -> int:
    return json.loads(err.extra_info)["errno"]


@pytest.mark.parametrize("offset,length", [(LAST, 100), (LAST - 10, 100), (LAST - (1 << 27), 1 << 28)])
def test_a_read_whose_end_is_past_the_largest_offset_is_einval(offset, length):
    with pytest.raises(fl.FlightServerError) as exc:
        actions.parse_ticket(json.dumps({"path": "f", "offset": offset, "length": min(length, rpc.MAX_READ_BYTES)}).encode())
    assert _errno(exc.value) == errno.EINVAL and "offset" in str(exc.value)


def test_a_prefetch_range_past_the_largest_offset_is_einval():
    with pytest.raises(fl.FlightServerError) as exc:
        actions.parse_action("prefetch", json.dumps({"path": "f", "expect": [10, 1], "ranges": [[LAST, 10]]}).encode())
    assert _errno(exc.value) == errno.EINVAL


def test_an_agent_read_at_the_largest_offset_answers_einval_not_eio(tmp_path):
    """Before the fix: EIO (an OverflowError inside the store reader)."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "f").write_bytes(b"x" * 100)
    cfg = parse_config({"store": {"uri": f"file://{tmp_path / 's'}"}, "agent": {"data_dir": str(tmp_path / "t")}})
    server, loc = start_in_process(LocalStore(str(tmp_path / "s")), cfg.agent)
    try:
        c = AgentClient(loc)
        for offset in (LAST, LAST - 10):
            with pytest.raises(OSError) as exc:
                c.read("f", offset, 100)
            assert exc.value.errno == errno.EINVAL, exc.value
        assert c.read("f", 90, 100) == b"x" * 10
        assert c.read("f", 1 << 40, 100) == b""            # past the end of the file: nothing
    finally:
        server.shutdown()


# -- streams: what one sender may hold (finding 6) ---------------------------------------------------
import logging  # noqa: E402
import os  # noqa: E402

from hintfs.agent.streams import ANYONE, StreamRefused, StreamTier  # noqa: E402
from hintfs.agent.versions import VersionCheck  # noqa: E402
from hintfs.common.clock import FakeClock  # noqa: E402
from policy.stream import Sender, StreamLimits, chunk_crc, crc_count_refusal, crcs_of, stream_refusal  # noqa: E402
from hintfs.stores.base import Stat  # noqa: E402

CHUNK = 8
A, B = Sender("token:t1", "ipv4:10.0.0.1"), Sender("token:t1", "ipv4:10.0.0.2")



class Budget:
    """A StreamBudget of `room` bytes that counts what streams hold."""

    def __init__(self, room: int):
        self.room, self.used = room, 0

    def reserve(self, nbytes: int, path: str) -> None:
        if self.used + nbytes > self.room:
            raise OSError(errno.ENOSPC, f"budget: {path} needs {nbytes} bytes")
        self.used += nbytes

    def release(self, nbytes: int) -> None:
        self.used -= nbytes


def _crcs(data: bytes) -> list[int]:
    return crcs_of([data[i:i + CHUNK] for i in range(0, len(data), CHUNK)])


def _put_all(tier, sid, data, sender=ANYONE):
    for off in range(0, len(data), CHUNK):
        piece = data[off:off + CHUNK]
        tier.put(sid, 0, off, piece, chunk_crc(piece), sender)


def test_the_stream_bounds_are_per_peer_per_token_and_in_total():
    limits = StreamLimits(max_streams=6, per_peer=2, per_token=4)
    c = Sender("token:t2", "ipv4:10.0.0.3")
    assert stream_refusal(limits, [A], A) is None
    assert "peer" in stream_refusal(limits, [A, A], A)
    assert stream_refusal(limits, [A, A], B) is None                  # another host of the fleet
    assert "token" in stream_refusal(limits, [A, A, B, B], Sender("token:t1", "ipv4:10.0.0.9"))
    assert stream_refusal(limits, [A, A, B, B], c) is None
    assert "holds 6 streams" in stream_refusal(limits, [A, A, B, B, c, c], Sender("token:t3", "x"))
    # within the open-file limit: streams take a quarter of it, a peer a quarter of that
    capped = StreamLimits(4096, 512, 4096).capped(512)
    assert (capped.max_streams, capped.per_peer, capped.per_token) == (128, 32, 128)
    assert crc_count_refusal(10, 8, 2) is None and crc_count_refusal(10, 8, 1 << 20) is not None
    assert crc_count_refusal(0, 8, 0) is None and crc_count_refusal(16, 8, 3) is not None


def test_a_peer_past_its_bound_is_refused_eagain_once_logged_and_others_keep_streaming(tmp_path, caplog):
    clock = FakeClock()
    tier = StreamTier(str(tmp_path / "t"), clock, limits=StreamLimits(max_streams=8, per_peer=2, per_token=8))
    caplog.set_level(logging.WARNING, "hintfs.streams")
    for i in range(2):
        tier.open(f"a{i}", 0, f"ckpt/a{i}", CHUNK, sender=A)
    for i in range(5):
        with pytest.raises(StreamRefused) as exc:
            tier.open(f"x{i}", 0, f"ckpt/x{i}", CHUNK, sender=A)
        assert exc.value.errno == errno.EAGAIN
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1     # one line, not five
    clock.advance(11)
    with pytest.raises(StreamRefused):
        tier.open("x9", 0, "ckpt/x9", CHUNK, sender=A)
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 2 and "4 more refused" in lines[1]
    assert tier.open("b0", 0, "ckpt/b0", CHUNK, sender=B) == {}                   # another peer: yes
    usage = tier.usage()
    assert (usage[A.key()].open, usage[A.key()].refused, usage[B.key()].open) == (2, 6, 1)
    # a stream is its opener's: another sender can neither write, publish nor abort it
    with pytest.raises(StreamRefused) as exc:
        tier.put("a0", 0, 0, b"x" * CHUNK, chunk_crc(b"x" * CHUNK), B)
    assert exc.value.errno == errno.EACCES
    with pytest.raises(StreamRefused):
        tier.abort("a0", B)
    assert tier.abort("a0", A)
    assert tier.open("a2", 0, "ckpt/a2", CHUNK, sender=A) == {}                   # room again


def test_stream_bytes_count_in_the_budget_and_leave_it_with_the_stream(tmp_path):
    budget = Budget(room=5 * CHUNK)
    tier = StreamTier(str(tmp_path / "t"), FakeClock(), budget=budget,
                      limits=StreamLimits(peer_bytes=4 * CHUNK))
    data = os.urandom(3 * CHUNK)
    tier.open("s", 0, "ckpt/s", CHUNK, sender=A)
    _put_all(tier, "s", data, A)
    assert budget.used == 3 * CHUNK and tier.usage()[A.key()].bytes == 3 * CHUNK
    tier.put("s", 0, 0, data[:CHUNK], chunk_crc(data[:CHUNK]), A)                # again: counted once
    assert budget.used == 3 * CHUNK
    tier.open("t", 0, "ckpt/t", CHUNK, sender=A)
    tier.put("t", 0, 0, data[:CHUNK], chunk_crc(data[:CHUNK]), A)
    with pytest.raises(StreamRefused) as exc:                                     # past the peer's share
        tier.put("t", 0, CHUNK, data[:CHUNK], chunk_crc(data[:CHUNK]), A)
    assert exc.value.errno == errno.ENOSPC and budget.used == 4 * CHUNK
    tier.open("u", 0, "ckpt/u", CHUNK, sender=B)
    tier.put("u", 0, 0, data[:CHUNK], chunk_crc(data[:CHUNK]), B)
    with pytest.raises(StreamRefused) as exc:                                     # past the tier's budget
        tier.put("u", 0, CHUNK, data[:CHUNK], chunk_crc(data[:CHUNK]), B)
    assert exc.value.errno == errno.ENOSPC and budget.used == 5 * CHUNK
    assert tier.abort("t", A) and budget.used == 4 * CHUNK                        # dropped: released
    v, part = tier.publish("s", 0, "ckpt/s", len(data), 5, _crcs(data), sender=A)
    assert v.state == "ready" and part is not None and budget.used == CHUNK      # handed over: released
    assert tier.usage()[A.key()].bytes == 0 and tier.bounds.bytes_by_peer == {B.peer: CHUNK}


def test_a_publish_names_exactly_one_crc_per_chunk(tmp_path):
    tier = StreamTier(str(tmp_path / "t"), FakeClock())
    data = os.urandom(2 * CHUNK + 1)
    tier.open("s", 0, "ckpt/s", CHUNK)
    _put_all(tier, "s", data)
    for crcs in (_crcs(data) + [0], _crcs(data)[:-1], [0] * 1000):
        with pytest.raises(StreamRefused) as exc:
            tier.publish("s", 0, "ckpt/s", len(data), 5, crcs)
        assert exc.value.errno == errno.EINVAL
    v, part = tier.publish("s", 0, "ckpt/s", len(data), 5, _crcs(data))          # the stream stayed
    assert v.state == "ready" and part is not None


def test_the_wire_refuses_more_crcs_than_the_size_can_have_before_validating_them():
    body = {"stream": "s", "gen": 0, "path": "ckpt/a", "size": 10, "mtime_ns": 1, "crcs": [1, 2]}
    with pytest.raises(fl.FlightServerError) as exc:
        actions.parse_action("stream_publish", json.dumps(body).encode())
    assert _errno(exc.value) == errno.EINVAL and "2 CRCs" in str(exc.value)
    assert actions.parse_action("stream_publish", json.dumps({**body, "crcs": [1]}).encode())[1].crcs == [1]
    with pytest.raises(fl.FlightServerError) as exc:
        actions.parse_action("status", b" " * (rpc.MAX_BODY + 1))
    assert _errno(exc.value) == errno.EINVAL


def test_an_unconfirmed_version_is_never_served_until_the_store_confirms_it(tmp_path):
    tier = StreamTier(str(tmp_path / "t"), FakeClock())
    data = os.urandom(2 * CHUNK + 3)
    version = (len(data), 5)
    tier.open("s", 0, "ckpt/s", CHUNK)
    _put_all(tier, "s", data[:CHUNK])
    v, part = tier.publish("s", 0, "ckpt/s", *version, _crcs(data), meta=("rec", 60.0), confirmed=False)
    assert v.state == "fill" and part is None
    assert tier.state_of("ckpt/s") == ("streaming", None)                         # not "filling"
    assert tier.read_verified("ckpt/s", version, 0, CHUNK) is None
    assert tier.verified_view("ckpt/s", version) == (-1, [])
    assert tier.unconfirmed() == [("ckpt/s", version, 1000.0)]
    _put_all(tier, "s", data)
    assert tier.finish_if_complete("s", 0) is None                                # complete, unconfirmed
    assert tier.confirm("ckpt/s", (version[0], 6)) == []                          # another version
    [(path, got, meta, part)] = tier.confirm("ckpt/s", version, lambda m: ("journal-rec", m[1]))
    assert (path, got, meta) == ("ckpt/s", version, ("journal-rec", 60.0))
    with open(part, "rb") as f:
        assert f.read() == data
    # a version refused: dropped, never served
    tier.open("f", 0, "ckpt/f", CHUNK)
    _put_all(tier, "f", data)
    v, part = tier.publish("f", 0, "ckpt/f", len(data), 4102444800 * 10**9, _crcs(data), confirmed=False)
    assert v.state == "ready" and part is None and tier.state_of("ckpt/f") == ("streaming", None)
    assert tier.refuse("ckpt/f", (len(data), 4102444800 * 10**9), "the store does not have it") == ["f"]
    assert tier.state_of("ckpt/f") is None and tier.unconfirmed() == []


class _Store:
    """A store whose stat answers from `files` (path -> Stat) and whose journal folder lists
    `records` (slice folder -> names); counts the calls."""

    def __init__(self):
        self.files: dict[str, Stat] = {}
        self.records: dict[str, list[str]] = {}
        self.stats = self.lists = 0

    def stat(self, rel):
        self.stats += 1
        if rel not in self.files:
            raise FileNotFoundError(errno.ENOENT, rel)
        return self.files[rel]

    def iter_dir(self, rel):
        self.lists += 1
        name = rel.rsplit("/", 1)[-1]
        if name not in self.records:
            raise FileNotFoundError(errno.ENOENT, rel)
        return iter([(n, Stat(0o100644, 0, 0, 0)) for n in self.records[name]])


def _check(store, clock, journal, wait_s=2.0, wall_ns=lambda: 1_700_000_000 * 10**9):
    got: dict = {"confirmed": [], "refused": []}
    waiting: list = []
    vc = VersionCheck(store, clock, lambda p, v, r: got["confirmed"].append((p, v, r)),
                      lambda p, v, why: got["refused"].append((p, v, why)), lambda: list(waiting),
                      journal, wait_s, 0.01, wall_ns=wall_ns, start=False)
    return vc, got, waiting


def _drain(vc):
    vc.pool.shutdown(wait=True)
    from concurrent.futures import ThreadPoolExecutor
    vc.pool = ThreadPoolExecutor(4)


def test_version_check_takes_the_journal_then_a_batched_stat_and_refuses_what_the_store_lacks():
    from hintfs.common.journal import bucket_of, record_name
    store, clock = _Store(), FakeClock()
    now_ns = 1_700_000_005 * 10**9      # mid-slice: one slice folder is listed
    vc, got, waiting = _check(store, clock, ".hintfs-journal", wall_ns=lambda: now_ns)
    rec = record_name("ckpt/a", 10, 7)
    store.records[bucket_of(now_ns)] = [rec, record_name("ckpt/gone", 0, 0, removed=True)]
    store.files = {"ckpt/b": Stat(0o100644, 20, 9, 9), "ckpt/c": Stat(0o100644, 5, 1, 1)}
    waiting += [("ckpt/a", (10, 7), clock()), ("ckpt/b", (20, 9), clock()), ("ckpt/c", (5, 2), clock()),
                ("ckpt/d", (1, 1), clock())]
    vc.published()
    vc.step()              # lists the journal's current slice; nothing is stat-ed yet
    _drain(vc)
    assert store.lists == 1 and store.stats == 0 and vc.record_of("ckpt/a", (10, 7)) == (True, rec)
    assert vc.record_of("ckpt/gone", (0, 0))[0] is False                     # a removal is no version
    vc.step()
    assert got["confirmed"] == [("ckpt/a", (10, 7), rec)]
    waiting.pop(0)
    clock.advance(2.5)         # no record within stream_record_wait_s: the rest are stat-ed, together
    vc.step()
    _drain(vc)
    assert store.stats == 3
    assert ("ckpt/b", (20, 9), None) in got["confirmed"]
    refused = {p: why for p, _v, why in got["refused"]}
    assert set(refused) == {"ckpt/c", "ckpt/d"}
    assert "does not have version (5, 2)" in refused["ckpt/c"] and "no such file" in refused["ckpt/d"]


def test_version_check_without_a_journal_stats_at_once_and_retries_a_failed_stat():
    store, clock = _Store(), FakeClock()
    vc, got, waiting = _check(store, clock, None)
    store.files["ckpt/a"] = Stat(0o100644, 10, 7, 7)
    waiting.append(("ckpt/a", (10, 7), clock()))
    vc.step()
    _drain(vc)
    assert got["confirmed"] == [("ckpt/a", (10, 7), None)] and store.lists == 0
    broken = _Store()
    broken.stat = lambda rel: (_ for _ in ()).throw(OSError(errno.EIO, "link down"))
    vc2, got2, waiting2 = _check(broken, clock, None)
    waiting2.append(("ckpt/x", (1, 1), clock()))
    vc2.step()
    _drain(vc2)
    assert got2 == {"confirmed": [], "refused": []}                          # not refused on EIO
    vc2.step()
    _drain(vc2)
    assert got2 == {"confirmed": [], "refused": []}                          # not again at once
    broken.files = {"ckpt/x": Stat(0o100644, 1, 1, 1)}
    broken.stat = _Store.stat.__get__(broken)
    clock.advance(1.5)
    vc2.step()
    _drain(vc2)
    assert got2["confirmed"] == [("ckpt/x", (1, 1), None)]


def test_version_check_lists_a_big_slice_no_faster_than_its_bytes_allow():
    # A slice of 2,000 records: each listing is ~0.9 MB on the link. Listed every poll_s (10 ms)
    # while versions wait, that was most of a 400 Mbit/s link (bench/scale_xdc.py); now the next
    # listing waits until the last one's bytes fit in LIST_BYTES_S.
    from hintfs.common.journal import LIST_BYTES_S, bucket_of, listing_gap_s, record_name
    store, clock = _Store(), FakeClock()
    now_ns = 1_700_000_005 * 10**9
    vc, got, waiting = _check(store, clock, ".hintfs-journal", wall_ns=lambda: now_ns)
    names = [record_name(f"ckpt/step_1/__{i}_0.distcp", 4096, i) for i in range(2000)]
    store.records[bucket_of(now_ns)] = names
    waiting.append(("ckpt/late", (1, 1), clock()))    # a version no record confirms yet
    gap = listing_gap_s(names)
    assert gap == (sum(len(n) + 300 for n in names) + 1000) / LIST_BYTES_S and 2.0 < gap < 5.0
    vc.published()
    vc.step()
    _drain(vc)
    assert store.lists == 1
    for _ in range(int(gap / 0.01) - 5):             # poll_s steps inside the gap: no listing
        clock.advance(0.01)
        vc.step()
    _drain(vc)
    assert store.lists == 1
    clock.advance(0.1)                               # past it: the next listing
    vc.step()
    _drain(vc)
    assert store.lists == 2
    # a small slice is listed at poll_s, as before
    store.records[bucket_of(now_ns)] = names[:3]
    clock.advance(gap)
    vc.step()
    _drain(vc)
    clock.advance(0.011)
    vc.step()
    _drain(vc)
    assert store.lists == 4
    # the follower's rounds spend the same budget (`Follower.budget` is the check's): after the
    # follower listed the big slice, the check does not list it again within that listing's wait
    clock.advance(1.0)
    vc.budget.spent(names, clock())
    for _ in range(50):
        clock.advance(0.01)
        vc.step()
    _drain(vc)
    assert store.lists == 4 and vc.budget.wait_s(clock()) > 0
    vc.close()


def test_status_without_the_replica_list_gives_their_number_and_an_older_agent_is_asked_for_all(
        tmp_path, monkeypatch):
    """Issue 37: with tens of thousands of replicas the list was most of the status's cost (the
    bench polls twice a second). `status(replicas=False)` leaves it out and says how many; an
    agent from before the key refuses it (EINVAL) and the client asks again for the whole."""
    (tmp_path / "s").mkdir()
    for i in range(3):
        (tmp_path / "s" / f"f{i}").write_bytes(b"x" * 10)
    cfg = parse_config({"store": {"uri": f"file://{tmp_path / 's'}"}, "agent": {"data_dir": str(tmp_path / "t")}})
    server, loc = start_in_process(LocalStore(str(tmp_path / "s")), cfg.agent)
    try:
        c = AgentClient(loc)
        for i in range(3):
            c.replicate(f"f{i}", ttl_s=600)
        full = c.status()
        assert sorted(full.replicas) == ["f0", "f1", "f2"] and full.replica_count == 3
        short = c.status(replicas=False)
        assert short.replicas == {} and short.replica_count == 3 and short.budget == full.budget
        old = actions.ACTIONS["status"]
        monkeypatch.setitem(actions.ACTIONS, "status", actions.Action(
            rpc.EmptyRequest, lambda a, r, s: a.status(), rpc.StatusReply, old.doc))   # an older agent
        c2 = AgentClient(loc)
        got = c2.status(replicas=False)
        assert sorted(got.replicas) == ["f0", "f1", "f2"] and got.replica_count == 3 and c2._status_whole
    finally:
        server.shutdown()


def test_a_compressed_range_is_bounded_by_the_read_it_answers():
    """A hostile or broken agent's compressed range: a raw size past what was asked, one the
    stream does not inflate to, or a stream that is not zstd: EIO, no allocation past the read."""
    data = b"metadata " * 10_000
    packed = rpc.pack_range(data)
    assert packed is not None and len(packed) < len(data) // 10
    assert rpc.unpack_range(packed, len(data), len(data)) == data
    for raw_size, asked in [(len(data) + 1, len(data) + 1 << 10), (len(data), len(data) - 1),
                            (len(data) - 1, len(data)), (-1, 10)]:
        with pytest.raises(OSError) as exc:
            rpc.unpack_range(packed, raw_size, asked)
        assert exc.value.errno == errno.EIO
    with pytest.raises(OSError) as exc:
        rpc.unpack_range(b"not zstd at all", 100, 100)
    assert exc.value.errno == errno.EIO
    assert rpc.pack_range(bytes(range(256)) * 16) is not None and rpc.pack_range(b"x" * 4095) is None   # (too small to try)


def test_a_compressed_read_is_asked_plainly_of_an_agent_that_refuses_the_key(tmp_path, monkeypatch):
    """An agent from before compressed ranges refuses the `compress` key (EINVAL naming it): the
    client asks again without it, and keeps asking plainly; other EINVALs are not retried."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "f").write_bytes(b"abc" * 5000)
    from hintfs.agent.server import AgentServer
    cfg = parse_config({"store": {"uri": f"file://{tmp_path / 's'}"}, "agent": {"data_dir": str(tmp_path / "a")}})
    server = AgentServer(LocalStore(str(tmp_path / "s")), cfg.agent, location="grpc://127.0.0.1:0")
    loc = f"grpc://127.0.0.1:{server.port}"   # (over TCP: the unix socket of a mount's own agent is asked plainly)
    real = actions.parse_ticket
    asked: list[dict] = []

    def older(body):
        doc = json.loads(body)
        asked.append(doc)
        if "compress" in doc:
            raise rpc.rpc_error(errno.EINVAL, "compress: Extra inputs are not permitted")
        return real(body)

    monkeypatch.setattr(actions, "parse_ticket", older)
    c = AgentClient(loc)
    try:
        assert c.read("f", 0, 15000) == b"abc" * 5000
        assert c.read("f", 3, 3) == b"abc"
        assert ["compress" in d for d in asked] == [True, False, False]
        with pytest.raises(OSError) as exc:
            c.read("f", (1 << 63) - 2, 10)
        assert exc.value.errno == errno.EINVAL
    finally:
        server.shutdown()

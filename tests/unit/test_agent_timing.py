"""The agent's timing logic on a fake clock (hintfs.common.clock.FakeClock), without a Flight server and
without sleeping: a replica's TTL and the eviction order, `tier_stat`'s waits for a publish and for
a file expected in a folder being streamed, and a copy's wait for a stream that would make it
needless. Each test moves the clock by hand and looks at what the part decided."""
from __future__ import annotations

import errno
import threading

import pytest

from hintfs.agent.catalog import Catalog
from hintfs.agent.copier import STREAM_ALIVE_WAIT_S, STREAM_PUBLISH_WAIT_S, Copier
from hintfs.common.refusals import RefusalLog
from hintfs.agent.streams import StreamTier
from hintfs.agent.tier import STREAM_QUIET_S, Arrivals, TierView
from hintfs.common.clock import FakeClock
from hintfs.common.errors import HintfsError
from tests.conftest import wait_for

CHUNK = 4096


class _Calls:
    """Counts the calls of a function (a waiting loop's rounds) and passes them on."""

    def __init__(self, fn):
        self.fn, self.n = fn, 0

    def __call__(self, *args, **kwargs):
        self.n += 1
        return self.fn(*args, **kwargs)


def _tier(tmp_path, clock, budget=1 << 30):
    catalog = Catalog(str(tmp_path), budget, persistent=False, clock=clock)
    streams = StreamTier(str(tmp_path / "streams"), clock, budget=catalog)
    arrivals = Arrivals(catalog)
    return catalog, streams, arrivals, TierView(catalog, arrivals, streams, clock=clock)


def _replica(catalog, tmp_path, path, size, ttl_s=600.0):
    part = tmp_path / f"{abs(hash(path))}.part"
    part.write_bytes(b"x" * size)
    rep = catalog.replica_from(str(part), path, size, 1, ttl_s, None)
    assert catalog.add_unless_removed(rep)
    return rep


def _in_thread(fn, *args, **kwargs):
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(value=fn(*args, **kwargs)), daemon=True)
    t.start()
    return t, out


def test_a_replica_is_reclaimed_at_its_ttl_by_the_clock(tmp_path):
    clock = FakeClock()
    catalog, *_ = _tier(tmp_path, clock)
    _replica(catalog, tmp_path, "ckpt/a", 10, ttl_s=60)
    clock.advance(59)
    assert catalog.expire() == [] and catalog.local_fd("ckpt/a", 10, 1) >= 0
    clock.advance(2)
    assert catalog.local_fd("ckpt/a", 10, 1) == -1             # expired: never handed out
    assert catalog.expire() == ["ckpt/a"] and catalog.replicas == {}


def test_eviction_takes_the_least_recently_used_and_spares_what_the_follower_keeps(tmp_path):
    clock = FakeClock()
    catalog, *_ = _tier(tmp_path, clock, budget=40)
    for path in ("old/s1/a", "busy/s1/a", "new/s1/a", "other/b"):   # used in this order, a second apart
        _replica(catalog, tmp_path, path, 10)
        clock.advance(1)
    catalog.keep(newest=frozenset({"new/s1"}), pinned=frozenset({"busy/s1"}))
    catalog.make_room("x", 10)                                  # the least recently used that may go
    assert set(catalog.replicas) == {"busy/s1/a", "new/s1/a", "other/b"} and catalog.evictions == 1
    catalog.make_room("y", 20)                                  # not a newest checkpoint's first
    assert set(catalog.replicas) == {"busy/s1/a", "new/s1/a"}
    catalog.make_room("z", 30)                                  # then the newest
    assert set(catalog.replicas) == {"busy/s1/a"}
    with pytest.raises(HintfsError) as err:                     # a checkpoint being copied: never
        catalog.make_room("w", 40)
    assert err.value.errno == errno.ENOSPC and set(catalog.replicas) == {"busy/s1/a"}


def test_tier_stat_waits_for_an_unpublished_streams_publish_as_long_as_asked(tmp_path):
    clock = FakeClock()
    _catalog, streams, _arrivals, view = _tier(tmp_path, clock)
    streams.open("s1", 0, "ckpt/s/a", CHUNK)
    view.state = _Calls(view.state)
    t, out = _in_thread(view.stat, "ckpt/s/a", 5.0)
    assert wait_for(lambda: view.state.n >= 2)                  # looking, not answering
    clock.advance(4.9)
    seen = view.state.n
    assert wait_for(lambda: view.state.n > seen + 1) and t.is_alive()
    clock.advance(0.2)
    t.join(10)
    assert out["value"].state == "streaming"


def test_an_absent_file_is_expected_while_its_folder_streams_and_appear_s_waits_for_it(tmp_path):
    clock = FakeClock()
    _catalog, streams, _arrivals, view = _tier(tmp_path, clock)
    streams.open("s1", 0, "ckpt/s/a", CHUNK)                    # the folder's streams are alive
    assert view.stat("ckpt/s/b") == {"state": "absent", "expected": True}
    view.state = _Calls(view.state)
    t, out = _in_thread(view.stat, "ckpt/s/b", 0.0, 2.0)
    assert wait_for(lambda: view.state.n >= 2) and t.is_alive()
    clock.advance(2.1)
    t.join(10)
    assert out["value"] == {"state": "absent", "expected": True}
    clock.advance(STREAM_QUIET_S)                               # no call for that long: not expected
    assert view.stat("ckpt/s/b") == {"state": "absent"}


class _Hints:
    def announce(self, path, version, open_reader=True):
        pass


def _copier(tmp_path, clock):
    catalog, streams, arrivals, view = _tier(tmp_path, clock)
    copier = Copier(None, catalog, arrivals, streams, _Hints(), peers=[], token=None, link=None,
                    link_chunk_bytes=CHUNK, stream_idle_s=120.0, refusals=RefusalLog(10.0, clock), clock=clock)
    return copier, streams, view


def test_a_copy_waits_for_an_unpublished_stream_while_it_is_alive(tmp_path):
    """An unpublished stream may be a newer write: the copy waits STREAM_PUBLISH_WAIT_S for its
    publish, longer while it keeps calling, at most STREAM_ALIVE_WAIT_S; the tier says `copying`
    at the journaled version meanwhile."""
    clock = FakeClock()
    copier, streams, view = _copier(tmp_path, clock)
    streams.open("s1", 0, "ckpt/s/a", CHUNK)
    streams.state_of = _Calls(streams.state_of)
    t, _out = _in_thread(copier.wait_for_stream, "ckpt/s/a", (100, 7))
    assert wait_for(lambda: streams.state_of.n >= 2)
    assert view.stat("ckpt/s/a") == {"state": "copying", "size": 100, "mtime_ns": 7}
    for _ in range(int(STREAM_ALIVE_WAIT_S // 2) - 1):          # the stream keeps calling every 2 s
        clock.advance(2)
        streams.saw("s1", 0, 10)
        seen = streams.state_of.n
        assert wait_for(lambda: streams.state_of.n > seen + 1) and t.is_alive()
    clock.advance(STREAM_ALIVE_WAIT_S)                          # at most that long
    t.join(10)
    assert not t.is_alive() and view.stat("ckpt/s/a") == {"state": "streaming"}


def test_a_copy_stops_waiting_for_a_quiet_unpublished_stream(tmp_path):
    clock = FakeClock()
    copier, streams, _view = _copier(tmp_path, clock)
    streams.open("s1", 0, "ckpt/s/a", CHUNK)
    streams.state_of = _Calls(streams.state_of)
    t, _out = _in_thread(copier.wait_for_stream, "ckpt/s/a", (100, 7))
    assert wait_for(lambda: streams.state_of.n >= 2)
    clock.advance(STREAM_PUBLISH_WAIT_S - 0.5)
    seen = streams.state_of.n
    assert wait_for(lambda: streams.state_of.n > seen + 1) and t.is_alive()
    clock.advance(max(1.0, STREAM_QUIET_S - STREAM_PUBLISH_WAIT_S + 1))   # past both: it gave up
    t.join(10)
    assert not t.is_alive()


def test_a_copy_without_a_stream_or_a_version_does_not_wait(tmp_path):
    copier, _streams, _view = _copier(tmp_path, FakeClock())
    copier.wait_for_stream("ckpt/s/a", None)                     # returns at once (the clock stands still)

"""fusefs/stream/hooks.py: the one place that decides what a hook does to a stream (start, follow,
publish, drop, send again from the store), as a table of hook calls and the sink commands they
give; no threads, no tier."""
from __future__ import annotations

import os

import pytest

from fusefs.stream.hooks import StreamFront
from mountconfig.schema import StreamConfig
from hintfs.stores.base import Stat

CHUNK = 1 << 20
PATH = "ckpt/run/step_1/__0_0.distcp"


def stat(size: int, mtime_ns: int = 7) -> Stat:
    return Stat(mode=0o100644, size=size, mtime_ns=mtime_ns, ctime_ns=mtime_ns)


class Sink:
    """Records the commands it is given; `finished` is the hooks' callback."""

    def __init__(self, finished):
        self.finished = finished
        self.alive = True
        self.calls: list[tuple] = []
        self.copies: list[bytes] = []

    def start(self, key, seq, path, fd):
        self.calls.append(("start", key, seq, path))

    def moved(self, key, path):
        self.calls.append(("moved", key, path))

    def publish(self, key, path, version):
        self.calls.append(("publish", key, path, tuple(version)))

    def drop(self, key):
        self.calls.append(("drop", key))

    def add_published(self, path, fd, version):
        self.copies.append(os.pread(fd, version.size + 1, 0))
        self.calls.append(("restream", path, tuple(version)))

    def close(self, timeout_s):
        self.calls.append(("close",))


def front(store: dict | None = None) -> tuple[StreamFront, Sink]:
    sc = StreamConfig(prefixes=["ckpt/"], agents=["grpc://127.0.0.1:1"], chunk_bytes=CHUNK)
    read_store = None
    if store is not None:
        def read_store(path):
            data, st = store[path]
            return data, st
    hooks = StreamFront(sc, Sink, read_store)
    return hooks, hooks.sink      # type: ignore[return-value]


@pytest.fixture
def fd():
    r, w = os.pipe()
    yield r
    os.close(r)
    os.close(w)


def commands(sink: Sink) -> list[tuple]:
    out, sink.calls = sink.calls, []
    return out


def test_only_paths_under_a_prefix_are_streamed(fd):
    hooks, sink = front()
    assert hooks.wants("ckpt") and hooks.wants("ckpt/x") and not hooks.wants("ckpt2/x") and not hooks.wants("x")
    hooks.started(1, "other/x", fd)
    hooks.published(1, "other/x", stat(3), None, True)
    hooks.released(1)
    assert commands(sink) == []


def test_a_final_publish_publishes_and_the_release_after_it_does_nothing(fd):
    hooks, sink = front()
    hooks.started(1, PATH, fd)
    hooks.published(1, PATH, stat(10), "rec", True)
    hooks.released(1)
    assert commands(sink) == [("start", 1, 1, PATH), ("publish", 1, PATH, (10, 7, "rec"))]


def test_an_fsync_publish_is_remembered_and_published_at_the_release(fd):
    hooks, sink = front()
    hooks.started(1, PATH, fd)
    hooks.published(1, PATH, stat(10), "rec", False)      # fsync: more writes may come
    hooks.published(1, PATH + ".b", stat(12, 8), "rec2", False)
    hooks.released(1)
    hooks.released(1)
    assert commands(sink) == [("start", 1, 1, PATH), ("moved", 1, PATH), ("moved", 1, PATH + ".b"),
                              ("publish", 1, PATH + ".b", (12, 8, "rec2"))]


def test_a_stream_never_published_is_dropped_at_the_release(fd):
    hooks, sink = front()
    hooks.started(1, PATH, fd)
    hooks.released(1)
    assert commands(sink) == [("start", 1, 1, PATH), ("drop", 1)]
    assert not hooks.will_stream_renamed(1, PATH + ".x", CHUNK + 1)   # dropped: it follows no rename


def test_dropped_drops_even_a_published_stream_and_unknown_inodes_are_ignored(fd):
    hooks, sink = front()
    hooks.dropped(9)
    hooks.published(9, PATH, stat(1), None, True)
    hooks.started(1, PATH, fd)
    hooks.published(1, PATH, stat(10), None, True)
    hooks.dropped(1)
    assert commands(sink) == [("start", 1, 1, PATH), ("publish", 1, PATH, (10, 7, None)), ("drop", 1)]


def test_a_start_again_is_a_new_generation_which_an_older_finish_does_not_end(fd):
    hooks, sink = front()
    hooks.started(1, PATH, fd)
    hooks.published(1, PATH, stat(10), None, True)
    hooks.started(1, PATH, fd)                    # truncated and written again
    assert commands(sink) == [("start", 1, 1, PATH), ("publish", 1, PATH, (10, 7, None)), ("start", 1, 2, PATH)]
    sink.finished(1, 1)                           # the sink was done with the first
    assert 1 in hooks.live
    hooks.released(1)
    assert commands(sink) == [("drop", 1)]
    sink.finished(1, 2)
    assert hooks.live == {}
    hooks.published(1, PATH, stat(3), None, True)   # forgotten: nothing more to say
    assert commands(sink) == []


def test_a_file_still_written_follows_its_rename_and_is_not_sent_again(fd):
    store = {PATH + ".x": (b"abc", stat(3))}
    hooks, sink = front(store)
    hooks.started(1, PATH, fd)
    assert hooks.will_stream_renamed(1, PATH + ".x", CHUNK * 10)   # (any size: the stream has it)
    hooks.renamed(1, PATH + ".x", stat(3), None)
    hooks.restreamer.shutdown(wait=True)
    hooks.released(1)
    assert commands(sink) == [("start", 1, 1, PATH), ("moved", 1, PATH + ".x"), ("drop", 1)]


@pytest.mark.parametrize("size, with_store, sent", [
    (CHUNK, True, True),            # at most one chunk: read back from the store, sent again
    (CHUNK + 1, True, False),       # larger: the follower copies it
    (10, False, False),             # no way to read it back
])
def test_a_published_file_renamed_is_sent_again_from_the_store_when_small(size, with_store, sent):
    data = os.urandom(size)
    path = "ckpt/run/step_1/.metadata"
    hooks, sink = front({path: (data, stat(size))} if with_store else None)
    assert hooks.will_stream_renamed(None, path, size) is sent
    hooks.renamed(None, path, stat(size), "rec")
    hooks.restreamer.shutdown(wait=True)
    assert commands(sink) == ([("restream", path, (size, 7, "rec"))] if sent else [])
    assert sink.copies == ([data] if sent else [])


def test_a_rename_whose_store_file_changed_meanwhile_sends_nothing():
    path = "ckpt/run/step_1/.metadata"
    hooks, sink = front({path: (b"newer", stat(5, 9))})
    hooks.renamed(None, path, stat(3), None)
    hooks.restreamer.shutdown(wait=True)
    assert commands(sink) == []


def test_a_sink_that_is_not_alive_turns_streaming_off(fd):
    hooks, sink = front({PATH: (b"abc", stat(3))})
    sink.alive = False
    assert not hooks.wants(PATH)
    assert not hooks.will_stream_renamed(None, PATH, 3)
    hooks.started(1, PATH, fd)
    hooks.renamed(None, PATH, stat(3), None)
    hooks.close(1.0)
    assert commands(sink) == [("close",)]
    assert hooks.live == {}


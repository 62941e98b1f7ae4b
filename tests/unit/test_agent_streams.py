"""hintfs/agent/streams.py, the tier's side of write-time streaming (a building block, not wired into the
agent yet): chunks kept apart until a verified publish, damaged chunks refused, generations,
idle expiry, and adoption of a stopped agent's streams with their progress."""
from __future__ import annotations

import os

import pytest

from hintfs.agent.streams import StreamError, StreamFinished, StreamTier
from hintfs.common.clock import FakeClock
from policy.stream import chunk_crc, crcs_of

CHUNK = 8



def put_all(tier, sid, gen, data, skip=()):
    for off in range(0, len(data), CHUNK):
        if off // CHUNK not in skip:
            piece = data[off:off + CHUNK]
            tier.put(sid, gen, off, piece, chunk_crc(piece))


def crcs(data: bytes) -> list[int]:
    return crcs_of([data[i:i + CHUNK] for i in range(0, len(data), CHUNK)])


def test_a_verified_publish_hands_over_the_exact_bytes(tmp_path):
    tier = StreamTier(str(tmp_path / "t"), FakeClock())
    data = os.urandom(30)
    assert tier.open("s1", 0, "ckpt/a", CHUNK) == {}
    put_all(tier, "s1", 0, data)
    assert tier.streaming("ckpt/a") and not tier.streaming("ckpt/b")
    v, part = tier.publish("s1", 0, "ckpt/a", len(data), 5, crcs(data))
    assert v.state == "ready" and part is not None
    with open(part, "rb") as f:
        assert f.read() == data
    assert not tier.streaming("ckpt/a") and not os.path.exists(part + ".progress")


def test_the_put_that_brings_a_published_streams_last_chunk_makes_it_ready(tmp_path):
    """The sender publishes without waiting for its chunks in flight: the tier answers "fill",
    and the put of the last missing chunk completes the stream (once, with the exact bytes).
    Later calls of that generation are answered as finished, not refused; a new generation of
    the same stream (the file rewritten after its publish) is a stream of its own."""
    tier = StreamTier(str(tmp_path / "t"), FakeClock(), persistent=True, progress_every_s=0)
    data = os.urandom(4 * CHUNK + 3)
    tier.open("s1", 0, "ckpt/a", CHUNK)
    put_all(tier, "s1", 0, data, skip={1, 4})
    v, part = tier.publish("s1", 0, "ckpt/a", len(data), 5, crcs(data), meta=("rec-1", 60.0))
    assert v.state == "fill" and v.fetch == (1, 4) and part is None
    assert tier.put("s1", 0, 4 * CHUNK, data[4 * CHUNK:], chunk_crc(data[4 * CHUNK:])) is False
    assert tier.finish_if_complete("s1", 0) is None          # chunk 1 is still missing
    assert tier.put("s1", 0, CHUNK, data[CHUNK:2 * CHUNK], chunk_crc(data[CHUNK:2 * CHUNK])) is True
    path, version, meta, part = tier.finish_if_complete("s1", 0)
    assert (path, version, meta) == ("ckpt/a", (len(data), 5), ("rec-1", 60.0))
    with open(part, "rb") as f:
        assert f.read() == data
    assert not os.path.exists(part + ".progress") and not tier.streaming("ckpt/a")
    assert tier.finish_if_complete("s1", 0) is None          # finished once
    with pytest.raises(StreamFinished):                        # a late duplicate: "ready"
        tier.put("s1", 0, 0, data[:CHUNK], chunk_crc(data[:CHUNK]))
    again, part = tier.publish("s1", 0, "ckpt/a", len(data), 5, crcs(data))
    assert again.state == "ready" and part is None            # the replica is the caller's already
    with pytest.raises(StreamFinished):
        tier.open("s1", 0, "ckpt/a", CHUNK)
    assert tier.open("s1", 1, "ckpt/a", CHUNK) == {}          # rewritten after its publish: anew


def test_damaged_and_unaligned_chunks_are_refused(tmp_path):
    tier = StreamTier(str(tmp_path / "t"), FakeClock())
    tier.open("s", 0, "p", CHUNK)
    with pytest.raises(StreamError, match="damaged"):
        tier.put("s", 0, 0, b"12345678", chunk_crc(b"12345679"))
    with pytest.raises(StreamError, match="aligned"):
        tier.put("s", 0, 3, b"1", chunk_crc(b"1"))
    with pytest.raises(StreamError, match="generation"):
        tier.put("s", 1, 0, b"1", chunk_crc(b"1"))
    with pytest.raises(StreamError):
        tier.open("../x", 0, "p", CHUNK)


def test_a_rewrite_in_place_is_not_trusted_and_a_new_generation_starts_over(tmp_path):
    tier = StreamTier(str(tmp_path / "t"), FakeClock())
    old = b"a" * 24
    tier.open("s", 0, "p", CHUNK)
    put_all(tier, "s", 0, old)
    new = b"a" * 8 + b"B" * 8 + b"a" * 8          # chunk 1 rewritten after it was sent
    v, part = tier.publish("s", 0, "p", 24, 7, crcs(new))
    assert v.state == "fill" and v.fetch == (1,) and part is None
    assert tier.open("s", 0, "p", CHUNK).keys() == {0, 2}      # resumption: chunk 1 is wanted
    tier.put("s", 0, 8, new[8:16], chunk_crc(new[8:16]))
    v, part = tier.publish("s", 0, "p", 24, 7, crcs(new))
    with open(part, "rb") as f:
        assert v.state == "ready" and f.read() == new
    tier.open("t", 0, "q", CHUNK)
    put_all(tier, "t", 0, old)
    assert tier.open("t", 1, "q", CHUNK) == {}                 # truncated and rewritten: all again
    with pytest.raises(StreamError, match="older"):
        tier.open("t", 0, "q", CHUNK)


def test_a_newer_replica_wins_and_idle_streams_expire(tmp_path):
    clock = FakeClock()
    tier = StreamTier(str(tmp_path / "t"), clock, idle_s=60)
    tier.open("s", 0, "p", CHUNK)
    put_all(tier, "s", 0, b"x" * 8)
    v, part = tier.publish("s", 0, "p", 8, 5, crcs(b"x" * 8), replica_version=(9, 6))
    assert v.state == "stale" and part is None and not tier.streaming("p")
    tier.open("dead", 0, "p2", CHUNK)
    put_all(tier, "dead", 0, b"y" * 16)
    clock.advance(61)
    assert tier.expire() == ["dead"]
    assert os.listdir(tmp_path / "t") == []                     # nothing of it is left
    with pytest.raises(StreamError, match="no stream"):
        tier.put("dead", 0, 0, b"y", chunk_crc(b"y"))


def test_a_restarted_agent_adopts_the_streams_and_their_progress(tmp_path):
    clock = FakeClock()
    old = StreamTier(str(tmp_path / "old"), clock, persistent=True, progress_every_s=0)
    data = os.urandom(40)
    old.open("s", 3, "ckpt/x", CHUNK, job="ckpt")
    put_all(old, "s", 3, data, skip={2})
    # (the agent dies here: nothing is closed; the progress on disk lists what was synced)
    new = StreamTier(str(tmp_path / "new"), clock, persistent=True)
    assert new.adopt(str(tmp_path / "old")) == 1
    held = new.open("s", 3, "ckpt/x", CHUNK)
    assert sorted(held) == [0, 1, 3, 4]
    new.put("s", 3, 16, data[16:24], chunk_crc(data[16:24]))
    v, part = new.publish("s", 3, "ckpt/x", 40, 9, crcs(data))
    with open(part, "rb") as f:
        assert v.state == "ready" and f.read() == data


def test_a_demand_read_does_not_wait_for_a_progress_sync(tmp_path, monkeypatch):
    """A progress save syncs the part (`fdatasync`, tens of ms on a busy disk) while chunks keep
    arriving; demand reads of the published chunks must not queue behind it (they did, under the
    stream's lock: 10-25 ms per read in bench/cross_dc_eval.py)."""
    import threading

    import hintfs.agent.streams as streams_mod
    tier = StreamTier(str(tmp_path / "t"), FakeClock(), persistent=True, progress_every_s=0)
    data = os.urandom(4 * CHUNK)
    tier.open("s1", 0, "ckpt/a", CHUNK)
    put_all(tier, "s1", 0, data, skip={2, 3})
    assert tier.publish("s1", 0, "ckpt/a", len(data), 5, crcs(data))[0].state == "fill"
    syncing, release, synced = threading.Event(), threading.Event(), threading.Event()
    real = os.fdatasync

    def slow_fdatasync(fd):
        syncing.set()
        release.wait(60)
        real(fd)
        synced.set()

    monkeypatch.setattr(streams_mod.os, "fdatasync", slow_fdatasync)
    third = data[2 * CHUNK:3 * CHUNK]           # not the last missing chunk: a progress save follows
    t = threading.Thread(target=tier.put, args=("s1", 0, 2 * CHUNK, third, chunk_crc(third)))
    t.start()
    try:
        assert syncing.wait(10)                  # the put's progress save is in its sync
        assert tier.read_verified("ckpt/a", (len(data), 5), 0, 2 * CHUNK) == data[:2 * CHUNK]
        assert not synced.is_set()               # answered while the sync still runs
    finally:
        release.set()
        t.join(10)
    assert tier.read_verified("ckpt/a", (len(data), 5), 0, 3 * CHUNK) == data[:3 * CHUNK]


def test_the_backlog_counts_every_stream_by_the_best_size_known_or_is_unknown(tmp_path):
    """What is still to come: a published stream by its size, an unpublished one by the journal's
    size or else the size its sender last saw; one with none of them makes the backlog unknown."""
    tier = StreamTier(str(tmp_path / "t"), FakeClock())
    a, b = os.urandom(40), os.urandom(24)
    tier.open("a", 0, "ckpt/a", CHUNK)
    put_all(tier, "a", 0, a, skip={2, 3, 4})                      # 16 of 40 bytes held
    tier.publish("a", 0, "ckpt/a", len(a), 1, crcs(a))
    assert tier.backlog_bytes() == 24
    tier.open("b", 0, "ckpt/b", CHUNK)
    put_all(tier, "b", 0, b[:8])
    assert tier.backlog_bytes() is None                           # b's size is not known yet
    assert tier.backlog_bytes({"ckpt/b": 24}) == 24 + 16          # the journal knows it
    tier.saw("b", 0, 20)                                          # its sender had 20 bytes
    assert tier.backlog_bytes() == 24 + 12
    tier.saw("b", 0, 16)                                          # (never lowered)
    assert tier.backlog_bytes() == 24 + 12

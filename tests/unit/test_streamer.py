"""fusefs/streamer.py against agent/streams.py (the two ends of write-time streaming, building
without a mount or an agent), joined by an in-memory transport that can be cut: bytes sent behind a writer, each once on the happy path; in-place rewrites caught at
publish; a cut link and a restarted tier resume from what the tier holds; a truncate starts a new
generation; an unlinked file leaves nothing at the tier; nothing is ready before publish."""
from __future__ import annotations

import errno
import os

from agent.streams import StreamError, StreamTier
from fusefs.streamer import Streamer

CHUNK = 64 << 10


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


class Link:
    """The tier's calls across a link that a test can cut; tier errors arrive as OSError, as
    the agent's errors do through its client."""

    def __init__(self, tier: StreamTier):
        self.tier = tier
        self.down = False
        self.ready: dict[str, bytes] = {}
        self.bytes = 0
        self.first: dict[str, list[int]] = {}   # path -> chunks the tier names to send first
        self.calls: list[list[int]] = []        # the chunks of each put, in order

    def _call(self, fn, *args):
        if self.down:
            raise ConnectionError(errno.ECONNREFUSED, "link down")
        try:
            return fn(*args)
        except StreamError as err:
            raise OSError(errno.EIO, str(err)) from None

    def open(self, sid, gen, path, chunk, job=None):
        return self._call(self.tier.open, sid, gen, path, chunk, job), self.first.get(path, [])

    def put(self, sid, gen, chunks, opening=None, seen=None):
        if opening is not None:
            self.open(sid, gen, *opening)
        for offset, data, crc in chunks:
            self._call(self.tier.put, sid, gen, offset, bytes(data), crc)
            self.bytes += len(data)
        self.calls.append([offset // CHUNK for offset, _d, _c in chunks])
        if seen is not None:
            self._call(self.tier.saw, sid, gen, seen)

    def publish(self, sid, gen, path, size, mtime_ns, crcs, record=None, chunks=(), opening=None):
        if opening is not None:
            self.open(sid, gen, *opening)
        if chunks:
            self.put(sid, gen, chunks)
        v, part = self._call(self.tier.publish, sid, gen, path, size, mtime_ns, crcs)
        if part is not None:
            with open(part, "rb") as f:
                self.ready[path] = f.read()
            os.unlink(part)
        return v.state, v.fetch

    def abort(self, sid):
        self._call(self.tier.abort, sid)


def setup(tmp_path, persistent=False):
    tier = StreamTier(str(tmp_path / "tier"), Clock(), persistent=persistent, progress_every_s=0)
    link = Link(tier)
    staging = open(tmp_path / "staging", "w+b")
    return tier, link, Streamer(link, CHUNK), staging


def finish(streamer, fs, limit=50):
    for _ in range(limit):
        if streamer.step(fs):
            return True
    return False


def test_bytes_leave_behind_the_writer_once_each_and_are_ready_only_at_publish(tmp_path):
    tier, link, streamer, f = setup(tmp_path)
    fs = streamer.start("ckpt/s1/__0_0.distcp", f.fileno())
    data = os.urandom(10 * CHUNK + 123)
    for off in range(0, len(data), CHUNK // 2):      # the job writes; the streamer trails it
        f.write(data[off:off + CHUNK // 2])
        f.flush()
        streamer.step(fs)
    assert link.bytes == 10 * CHUNK                   # every whole chunk is across before the close
    assert tier.streaming("ckpt/s1/__0_0.distcp") and "ckpt/s1/__0_0.distcp" not in link.ready
    streamer.published(fs, len(data), 1_000)
    assert finish(streamer, fs)
    assert link.ready["ckpt/s1/__0_0.distcp"] == data
    assert link.bytes == len(data)                    # no byte sent twice
    assert fs.fd == -1 and not tier.streaming("ckpt/s1/__0_0.distcp")


def test_a_chunk_rewritten_in_place_after_it_was_sent_is_sent_again(tmp_path):
    _tier, link, streamer, f = setup(tmp_path)
    fs = streamer.start("p", f.fileno())
    data = bytearray(os.urandom(4 * CHUNK))
    f.write(data)
    f.flush()
    streamer.step(fs)
    f.seek(CHUNK + 10)
    f.write(b"REWRITTEN")                             # (with passthrough the daemon never sees it)
    f.flush()
    data[CHUNK + 10:CHUNK + 19] = b"REWRITTEN"
    streamer.published(fs, len(data), 5)
    assert finish(streamer, fs)
    assert link.ready["p"] == bytes(data)
    assert link.bytes == 5 * CHUNK


def test_a_cut_link_resumes_where_the_tier_stands(tmp_path):
    _tier, link, streamer, f = setup(tmp_path)
    fs = streamer.start("p", f.fileno())
    data = os.urandom(8 * CHUNK)
    f.write(data[:3 * CHUNK])
    f.flush()
    streamer.step(fs)
    link.down = True                                  # the link is cut while the job writes on
    f.write(data[3 * CHUNK:])
    f.flush()
    for _ in range(5):
        assert not streamer.step(fs)
    assert fs.errors == 5 and link.bytes == 3 * CHUNK
    link.down = False
    streamer.published(fs, len(data), 7)
    assert finish(streamer, fs)
    assert link.ready["p"] == data and link.bytes == len(data)


def test_a_restarted_tier_adopts_the_stream_and_the_sender_sends_only_the_rest(tmp_path):
    tier, link, streamer, f = setup(tmp_path, persistent=True)
    fs = streamer.start("p", f.fileno())
    data = os.urandom(6 * CHUNK)
    f.write(data[:4 * CHUNK])
    f.flush()
    streamer.step(fs)
    # the tier agent is killed (nothing closed) and a new one adopts its folder
    new = StreamTier(str(tmp_path / "tier2"), Clock(), persistent=True)
    assert new.adopt(str(tmp_path / "tier")) == 1
    link.tier = new
    f.write(data[4 * CHUNK:])
    f.flush()
    streamer.published(fs, len(data), 9)
    assert finish(streamer, fs)
    assert link.ready["p"] == data
    assert link.bytes == len(data)                    # the 4 chunks the tier kept were not resent


def test_a_tier_that_lost_the_stream_gets_it_all_again(tmp_path):
    tier, link, streamer, f = setup(tmp_path)
    fs = streamer.start("p", f.fileno())
    data = os.urandom(3 * CHUNK)
    f.write(data)
    f.flush()
    streamer.step(fs)
    tier.abort(fs.sid)                                # e.g. expired, or a tier without its disk
    streamer.published(fs, len(data), 3)
    assert finish(streamer, fs)
    assert link.ready["p"] == data


def test_a_truncate_starts_a_new_generation(tmp_path):
    tier, link, streamer, f = setup(tmp_path)
    fs = streamer.start("p", f.fileno())
    f.write(os.urandom(3 * CHUNK))
    f.flush()
    streamer.step(fs)
    f.truncate(0)                                     # open(O_TRUNC) again: the mount says restart
    f.seek(0)
    streamer.restart(fs)
    data = os.urandom(2 * CHUNK + 5)
    f.write(data)
    f.flush()
    streamer.published(fs, len(data), 4)
    assert finish(streamer, fs)
    assert link.ready["p"] == data


def test_a_file_unlinked_before_close_leaves_nothing_at_the_tier(tmp_path):
    tier, link, streamer, f = setup(tmp_path)
    fs = streamer.start("p", f.fileno())
    f.write(os.urandom(3 * CHUNK))
    f.flush()
    streamer.step(fs)
    assert tier.streaming("p")
    streamer.drop(fs)
    assert streamer.step(fs)
    assert not tier.streaming("p") and link.ready == {}
    assert os.listdir(tmp_path / "tier") == []


def test_a_chunk_that_lands_while_the_tier_answers_an_announce_is_not_sent_twice(tmp_path):
    """The announce (a publish while chunks are in flight) answers "fill" with the chunks the
    tier lacks at that moment; one that was in flight and lands before the sender reads the
    answer is held by then: it must not be sent again (seen in bench/cross_dc_eval.py as one
    4 MiB chunk crossing the link twice in about one rep of ten)."""
    import threading
    import time
    tier = StreamTier(str(tmp_path / "tier"), Clock(), persistent=False, progress_every_s=0)
    link = Link(tier)
    held_at = 2 * CHUNK                    # this chunk is in flight when the announce is answered
    release = threading.Event()
    streamer = Streamer(link, CHUNK, parallel=4)
    f = open(tmp_path / "staging", "w+b")
    fs = streamer.start("ckpt/s1/__0_0.distcp", f.fileno())
    plain_put, plain_publish = link.put, link.publish

    def put(sid, gen, chunks, opening=None, seen=None):
        if any(offset == held_at for offset, _d, _c in chunks):
            assert release.wait(10)
        plain_put(sid, gen, chunks, opening, seen)

    def publish(*args, **kw):
        answer = plain_publish(*args, **kw)     # computed while the chunk is still in flight
        if not release.is_set():
            release.set()                       # ... which lands before the sender reads it
            deadline = time.monotonic() + 10
            while (held_at // CHUNK) not in fs.sent and time.monotonic() < deadline:
                time.sleep(0.005)
        return answer

    link.put, link.publish = put, publish
    data = os.urandom(6 * CHUNK + 100)
    f.write(data)
    f.flush()
    streamer.step(fs)                           # all chunks handed to the send pool
    deadline = time.monotonic() + 10            # the others land; the held one stays in flight
    while len(fs.sent) < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    streamer.published(fs, len(data), 1_000)
    assert finish(streamer, fs)
    assert link.ready["ckpt/s1/__0_0.distcp"] == data
    assert link.bytes == len(data)              # no chunk crossed twice
    streamer.shutdown()



def test_chunks_eval_reads_want_leave_first_and_the_others_are_held_while_the_file_is_written(tmp_path):
    """The tier names chunks 5 and 6 at the stream's open (eval jobs read them of the last
    checkpoint's file): they leave as soon as they are written, the others at most one call at a
    time while the file is written, and all of the rest at publish; each byte crosses once."""
    import threading
    import time
    tier = StreamTier(str(tmp_path / "tier"), Clock(), persistent=False, progress_every_s=0)
    link = Link(tier)
    path = "ckpt/run/step_2/__0_0.distcp"
    link.first[path] = [5, 6]
    gate = threading.Semaphore(0)                # calls of other chunks wait here until let through
    busy, most = [0], [0]
    plain_put = link.put

    def put(sid, gen, chunks, opening=None, seen=None):
        if chunks[0][0] // CHUNK not in (5, 6):
            busy[0] += 1
            most[0] = max(most[0], busy[0])
            assert gate.acquire(timeout=10)
            busy[0] -= 1
        plain_put(sid, gen, chunks, opening, seen)

    link.put = put
    streamer = Streamer(link, CHUNK, parallel=4, call_bytes=2 * CHUNK, first_by_reads=True, others_in_flight=1)
    f = open(tmp_path / "staging", "w+b")
    fs = streamer.start(path, f.fileno())
    data = os.urandom(8 * CHUNK + 100)
    f.write(data)
    f.flush()
    streamer.step(fs)                            # opens: the tier names 5 and 6
    assert fs.first == {5, 6}
    streamer.step(fs)
    deadline = time.monotonic() + 10
    while not {5, 6} <= set(fs.sent) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert link.calls[:1] == [[5, 6]]            # the named chunks crossed first, in one call
    assert set(fs.sent) == {5, 6}                # ... while one call of the others waits
    assert busy[0] == 1 and len(fs.inflight) == 2
    for _ in range(3):                           # more steps while it waits: still one call
        streamer.step(fs)
    assert busy[0] == 1
    for _ in range(20):
        gate.release()
    streamer.published(fs, len(data), 1_000)
    assert finish(streamer, fs)
    assert link.ready[path] == data
    assert link.bytes == len(data)               # no chunk crossed twice
    assert most[0] >= 1
    streamer.shutdown()


def test_without_named_chunks_nothing_is_held(tmp_path):
    """A first checkpoint (the tier names nothing): every whole chunk leaves while written."""
    import time
    tier = StreamTier(str(tmp_path / "tier"), Clock(), persistent=False, progress_every_s=0)
    link = Link(tier)
    streamer = Streamer(link, CHUNK, parallel=4, call_bytes=CHUNK, first_by_reads=True, others_in_flight=1)
    f = open(tmp_path / "staging", "w+b")
    fs = streamer.start("ckpt/run/step_1/__0_0.distcp", f.fileno())
    data = os.urandom(6 * CHUNK)
    f.write(data)
    f.flush()
    streamer.step(fs)
    deadline = time.monotonic() + 10
    while len(fs.sent) < 6 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert fs.first == frozenset() and len(fs.sent) == 6
    streamer.shutdown()

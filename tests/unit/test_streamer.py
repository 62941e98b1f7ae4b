"""fusefs/stream/streamer.py against hintfs/agent/streams.py (the two ends of write-time streaming, building
without a mount or an agent), joined by an in-memory transport that can be cut: bytes sent behind a writer, each once on the happy path; in-place rewrites caught at
publish; a cut link and a restarted tier resume from what the tier holds; a truncate starts a new
generation; an unlinked file leaves nothing at the tier; nothing is ready before publish."""
from __future__ import annotations

import errno
import os
import time

from hintfs.agent.streams import StreamError, StreamTier
from fusefs.stream.streamer import PublishAnswer, PutAnswer, Streamer
from policy.stream import chunk_crc

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
        except StreamError as err:          # the agent answers ESTALE
            raise OSError(errno.ESTALE, str(err)) from None

    def open(self, sid, gen, path, chunk, job=None):
        return self._call(self.tier.open, sid, gen, path, chunk, job), self.first.get(path, [])

    def put(self, sid, gen, chunks, opening=None, seen=None, urgent=False):
        named = self.open(sid, gen, *opening)[1] if opening is not None else None
        complete = False
        for offset, data, crc in chunks:
            try:
                complete |= self._call(self.tier.put, sid, gen, offset, bytes(data), crc)
            except OSError:
                if self.finished(sid, gen):     # the agent answers such a put "ready"
                    return PutAnswer(named, ready=True)
                raise
            self.bytes += len(data)
        self.calls.append([offset // CHUNK for offset, _d, _c in chunks])
        if seen is not None:
            self._call(self.tier.saw, sid, gen, seen)
        done = self.tier.finish_if_complete(sid, gen) if complete else None
        if done is not None:
            self._take(done[0], done[3])
        return PutAnswer(named, ready=done is not None)

    def finished(self, sid, gen):
        return self.tier.finished.get(sid) == gen

    def _take(self, path, part):
        """A finished part: the replica (as the agent renames it into its catalog)."""
        with open(part, "rb") as f:
            self.ready[path] = f.read()
        os.unlink(part)

    def publish(self, sid, gen, path, size, mtime_ns, crcs, record=None, chunks=(), opening=None):
        named = self.open(sid, gen, *opening)[1] if opening is not None else None
        if chunks:
            self.put(sid, gen, chunks)
        v, part = self._call(self.tier.publish, sid, gen, path, size, mtime_ns, crcs)
        if part is not None:
            self._take(path, part)
        return PublishAnswer(v.state, tuple(v.fetch), named)

    def abort(self, sid):
        self._call(self.tier.abort, sid)


def setup(tmp_path, persistent=False):
    tier = StreamTier(str(tmp_path / "tier"), Clock(), persistent=persistent, progress_every_s=0)
    link = Link(tier)
    staging = open(tmp_path / "staging", "w+b")
    return tier, link, Streamer(link, CHUNK), staging


def pooled(tmp_path):
    """A streamer with a send pool (chunks in flight while a step returns), and its first stream."""
    link = Link(StreamTier(str(tmp_path / "tier"), Clock(), persistent=False, progress_every_s=0))
    streamer = Streamer(link, CHUNK, parallel=4)
    f = open(tmp_path / "staging", "w+b")
    return link, streamer, f, streamer.start("ckpt/s1/__0_0.distcp", f.fileno())


def finish(streamer, fs, limit=50, within_s=10.0):
    """Step `fs` until it is finished, as the pump does: at most `limit` steps that did some
    work, and within `within_s` (a published stream's step does not wait for its chunks in
    flight: it returns, and the next step looks again)."""
    deadline = time.monotonic() + within_s
    while limit > 0 and time.monotonic() < deadline:
        with fs.lock:
            waiting = bool(fs.inflight)
        if streamer.step(fs):
            return True
        if waiting:
            time.sleep(0.005)
        else:
            limit -= 1
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
    link, streamer, f, fs = pooled(tmp_path)
    held_at = 2 * CHUNK                    # this chunk is in flight when the announce is answered
    release = threading.Event()
    plain_put, plain_publish = link.put, link.publish

    def put(sid, gen, chunks, opening=None, seen=None, urgent=False):
        if any(offset == held_at for offset, _d, _c in chunks):
            assert release.wait(10)
        return plain_put(sid, gen, chunks, opening, seen)

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



def test_a_publish_behind_the_writer_does_not_wait_for_the_chunks_in_flight(tmp_path):
    """At the publish of a file whose chunks are still in flight, the sender publishes at once
    (the tier answers "fill") and sends the rest; the put that brings the last missing chunk
    makes the replica, and its answer finishes the stream: one publish, each byte once."""
    import threading
    import time
    link, streamer, f, fs = pooled(tmp_path)
    held_at = 2 * CHUNK                    # this chunk is in flight until the publish was answered
    release = threading.Event()
    plain_put, plain_publish = link.put, link.publish
    publishes, answers = [], []

    def put(sid, gen, chunks, opening=None, seen=None, urgent=False):
        if any(offset == held_at for offset, _d, _c in chunks):
            assert release.wait(10)
        answer = plain_put(sid, gen, chunks, opening, seen)
        answers.append(answer.ready)
        return answer

    def publish(*args, **kw):
        publishes.append(release.is_set())
        answer = plain_publish(*args, **kw)
        release.set()
        return answer

    link.put, link.publish = put, publish
    data = os.urandom(6 * CHUNK + 100)
    f.write(data[:5 * CHUNK])
    f.flush()
    streamer.step(fs)                           # chunks 0-4 handed to the send pool
    deadline = time.monotonic() + 10            # all but the held one land
    while len(fs.sent) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    f.write(data[5 * CHUNK:])                   # the tail: never sent before the publish
    f.flush()
    streamer.published(fs, len(data), 1_000)
    assert finish(streamer, fs)
    assert publishes == [False]                 # once, while chunk 2 was in flight
    assert answers[-1] is True and answers.count(True) == 1
    assert link.ready["ckpt/s1/__0_0.distcp"] == data
    assert link.bytes == len(data)              # no chunk crossed twice
    streamer.shutdown()


def test_a_publish_before_any_put_landed_opens_the_stream_and_does_not_wait_for_them(tmp_path):
    """The writer outran the link: at the publish every put is still in flight and none has
    opened the stream at the tier. The publish goes at once and opens it itself (it waited for
    all of them before: the tier learned the version last, and eval reads of it waited too), and
    the chunks the tier names in its answer serve the next file of that name."""
    import threading
    link = Link(StreamTier(str(tmp_path / "tier"), Clock(), persistent=False, progress_every_s=0))
    streamer = Streamer(link, CHUNK, parallel=4, first_by_reads=True)
    f = open(tmp_path / "staging", "w+b")
    fs = streamer.start("ckpt/s1/__0_0.distcp", f.fileno())
    link.first["ckpt/s1/__0_0.distcp"] = [3]
    release = threading.Event()
    plain_put, plain_publish = link.put, link.publish
    publishes = []

    opened_by_puts = []

    def put(sid, gen, chunks, opening=None, seen=None, urgent=False):
        opened_by_puts.append(opening is not None)
        return plain_put(sid, gen, chunks, opening, seen)

    def publish(sid, gen, path, size, mtime_ns, crcs, record=None, chunks=(), opening=None):
        publishes.append((release.is_set(), opening is not None))
        answer = plain_publish(sid, gen, path, size, mtime_ns, crcs, record, chunks, opening)
        release.set()
        return answer

    link.put, link.publish = put, publish
    for _ in range(4):                          # every send thread busy: the puts wait in its queue
        streamer.pool.submit(release.wait, 10)
    data = os.urandom(5 * CHUNK + 100)
    f.write(data)
    f.flush()
    streamer.step(fs)                           # chunks 0-4 in flight, none landed
    assert not fs.opened and fs.inflight
    streamer.published(fs, len(data), 1_000)
    assert finish(streamer, fs)
    assert publishes == [(False, True)]         # once, at once, opening the stream
    assert not any(opened_by_puts)              # (so the names came with the publish's answer)
    assert link.ready["ckpt/s1/__0_0.distcp"] == data
    assert link.bytes == len(data)              # no chunk crossed twice
    with open(tmp_path / "staging2", "w+b") as g:
        assert streamer.start("ckpt/s2/__0_0.distcp", g.fileno()).first == {3}
    streamer.shutdown()


def test_a_lost_ready_answer_is_asked_again_with_the_publish(tmp_path):
    """The put that completed the stream failed on its way back (the tier made the replica): the
    next step asks with the publish, which answers "ready"; nothing is sent again."""
    tier, link, streamer, f = setup(tmp_path)
    fs = streamer.start("p", f.fileno())
    data = os.urandom(3 * CHUNK + 7)
    f.write(data[:3 * CHUNK])
    f.flush()
    streamer.step(fs)
    f.write(data[3 * CHUNK:])
    f.flush()
    # published with the tail missing (as a sender whose tail was in flight at its publish)
    assert tier.publish(fs.sid, 0, "p", len(data), 2, [chunk_crc(data[i:i + CHUNK])
                                                      for i in range(0, len(data), CHUNK)])[0].state == "fill"
    plain_put = link.put

    def put_then_fail(*args, **kw):
        plain_put(*args, **kw)
        raise ConnectionError(errno.ECONNRESET, "answer lost")

    link.put = put_then_fail
    streamer.published(fs, len(data), 2)
    fs.announced = True                         # (its publish was the one above)
    assert not streamer.step(fs)                # the tail's put lands, its answer is lost
    assert "p" in link.ready and fs.errors == 1
    link.put = plain_put
    sent = link.bytes
    assert finish(streamer, fs)
    assert link.ready["p"] == data and link.bytes == sent


def test_chunks_eval_reads_want_leave_first_and_the_others_yield_while_they_are_on_their_way(tmp_path):
    """The tier names chunks 5 and 6 at the stream's open (eval jobs read them of the last
    checkpoint's file): they leave at once, as an urgent call; while it is on its way at most
    one call of the other chunks is; once it has landed the others go as before. Each byte
    crosses once."""
    import threading
    import time
    tier = StreamTier(str(tmp_path / "tier"), Clock(), persistent=False, progress_every_s=0)
    link = Link(tier)
    path = "ckpt/run/step_2/__0_0.distcp"
    link.first[path] = [5, 6]
    named_gate, others_gate, count = threading.Event(), threading.Semaphore(0), threading.Lock()
    busy, urgent_calls = [0], []
    plain_put = link.put

    def put(sid, gen, chunks, opening=None, seen=None, urgent=False):
        named = chunks[0][0] // CHUNK in (5, 6)
        assert urgent == named                   # named chunks go as urgent calls, the others not
        if named:
            urgent_calls.append([o // CHUNK for o, _d, _c in chunks])
            assert named_gate.wait(10)
        else:
            with count:
                busy[0] += 1
            assert others_gate.acquire(timeout=10)
            with count:
                busy[0] -= 1
        return plain_put(sid, gen, chunks, opening, seen)

    streamer = Streamer(link, CHUNK, parallel=4, call_bytes=2 * CHUNK, first_by_reads=True, others_in_flight=1)
    # step 1's file of the same name: nothing named at its start; the open riding on its first
    # call brings the tier's answer, which the streamer keeps for the next file of that name
    link.first["ckpt/run/step_1/__0_0.distcp"] = [5, 6]
    g = open(tmp_path / "staging1", "w+b")
    fs1 = streamer.start("ckpt/run/step_1/__0_0.distcp", g.fileno())
    assert fs1.first == frozenset()
    g.write(os.urandom(2 * CHUNK))
    g.flush()
    streamer.published(fs1, 2 * CHUNK, 1_000)
    assert finish(streamer, fs1) and fs1.first == {5, 6}

    link.put, link.bytes = put, 0
    f = open(tmp_path / "staging", "w+b")
    fs = streamer.start(path, f.fileno())
    assert fs.first == {5, 6}                    # known at the start: no round trip to wait for
    data = os.urandom(8 * CHUNK + 100)
    f.write(data)
    f.flush()
    streamer.step(fs)
    deadline = time.monotonic() + 10
    while (not urgent_calls or busy[0] < 1) and time.monotonic() < deadline:
        time.sleep(0.005)
    for _ in range(3):                           # more steps while the named chunks are on their way
        streamer.step(fs)
    time.sleep(0.05)
    assert urgent_calls == [[5, 6]] and busy[0] == 1   # one call of the others, no more
    named_gate.set()                             # the named chunks land ...
    while not {5, 6} <= set(fs.sent) and time.monotonic() < deadline:
        time.sleep(0.005)
    streamer.step(fs)                            # ... and the others go as before
    while busy[0] < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert busy[0] == 4                          # [0, 1] still, and now [2, 3], [4], [7]
    for _ in range(20):
        others_gate.release()
    streamer.published(fs, len(data), 1_000)
    assert finish(streamer, fs)
    assert link.ready[path] == data
    assert link.bytes == len(data)               # no chunk crossed twice
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


def _named_streamer(tmp_path, path: str, named: list[int], **options):
    """(link, streamer, staging file, stream) with the tier naming `named` for `path`, known to
    the streamer from a file of the same name streamed before."""
    tier = StreamTier(str(tmp_path / "tier"), Clock(), persistent=False, progress_every_s=0)
    link = Link(tier)
    link.first[path] = named
    link.first["ckpt/run/step_1/__0_0.distcp"] = named
    streamer = Streamer(link, CHUNK, parallel=2, first_by_reads=True, **options)
    with open(tmp_path / "staging1", "w+b") as g:     # step 1's file: its open brings the names
        fs1 = streamer.start("ckpt/run/step_1/__0_0.distcp", g.fileno())
        g.write(b"x" * 2 * CHUNK)
        g.flush()
        streamer.step(fs1)                      # (whole chunks: the open rides on their call)
        streamer.published(fs1, 2 * CHUNK, 1_000)
        assert finish(streamer, fs1)
    link.bytes = 0
    f = open(tmp_path / "staging", "w+b")
    return link, streamer, f, streamer.start(path, f.fileno())


def _settle(streamer, fs, want: int, steps: int = 5) -> None:
    import time
    for _ in range(steps):
        streamer.step(fs)
        time.sleep(0.01)
    deadline = time.monotonic() + 10
    while (len(fs.sent) < want or fs.inflight) and time.monotonic() < deadline:
        time.sleep(0.005)


def test_a_named_tail_leaves_once_the_file_stops_growing_before_its_close(tmp_path):
    """DCP's last tensors are in a file's partial tail, which would otherwise wait for the close
    (and the close for the upload): named, it goes once the file has not grown for two polls."""
    path = "ckpt/run/step_2/__0_0.distcp"
    link, streamer, f, fs = _named_streamer(tmp_path, path, [2])
    data = os.urandom(2 * CHUNK + 100)
    f.write(data)
    f.flush()
    _settle(streamer, fs, 3)
    assert set(fs.sent) == {0, 1, 2}            # the tail too, before any publish
    streamer.published(fs, len(data), 1_000)
    assert finish(streamer, fs)
    assert link.ready[path] == data and link.bytes == len(data)
    streamer.shutdown()


def test_a_named_tail_sent_early_is_sent_again_when_the_file_grows(tmp_path):
    path = "ckpt/run/step_2/__0_0.distcp"
    link, streamer, f, fs = _named_streamer(tmp_path, path, [2])
    data = os.urandom(2 * CHUNK + 100)
    f.write(data[: 2 * CHUNK + 50])
    f.flush()
    _settle(streamer, fs, 3)
    assert 2 in fs.sent                         # the tail as it was then: 50 bytes
    f.write(data[2 * CHUNK + 50:])
    f.flush()
    streamer.published(fs, len(data), 1_000)
    assert finish(streamer, fs)
    assert link.ready[path] == data             # the tier holds the final tail, never the old one
    assert link.bytes == len(data) + 50         # the tail crossed twice
    streamer.shutdown()


def test_without_others_while_writing_only_named_chunks_leave_before_the_close(tmp_path):
    """`others_while_writing = false`: the writer's host sends only what the next merge reads
    while the file is written; the rest crosses after the publish, each byte still once."""
    path = "ckpt/run/step_2/__0_0.distcp"
    link, streamer, f, fs = _named_streamer(tmp_path, path, [1, 4], others_while_writing=False)
    data = os.urandom(6 * CHUNK + 7)
    f.write(data)
    f.flush()
    _settle(streamer, fs, 2)
    assert set(fs.sent) == {1, 4}               # (and stays so however often it is stepped)
    _settle(streamer, fs, 2, steps=10)
    assert set(fs.sent) == {1, 4}
    streamer.published(fs, len(data), 1_000)
    assert finish(streamer, fs)
    assert link.ready[path] == data and link.bytes == len(data)
    streamer.shutdown()


def test_while_a_file_grows_its_chunks_leave_in_full_calls_and_the_rest_once_it_stops(tmp_path):
    """Each call costs the writer's host CPU of its own: while the file grows, chunks nobody
    named leave in calls of the full `call_bytes` (4 chunks here); a shorter run waits for the
    file to grow or to stop growing for a poll; each byte still crosses once."""
    link = Link(StreamTier(str(tmp_path / "tier"), Clock(), persistent=False, progress_every_s=0))
    streamer = Streamer(link, CHUNK, parallel=2, call_bytes=4 * CHUNK)
    f = open(tmp_path / "staging", "w+b")
    fs = streamer.start("ckpt/s1/__0_0.distcp", f.fileno())

    def landed(n: int) -> None:
        deadline = time.monotonic() + 10
        while (len(fs.sent) < n or fs.inflight) and time.monotonic() < deadline:
            time.sleep(0.005)

    data = os.urandom(10 * CHUNK + 5)
    f.write(data[: 6 * CHUNK])
    f.flush()
    streamer.step(fs)                            # grew: one full call, chunks 4 and 5 wait
    landed(4)
    assert link.calls == [[0, 1, 2, 3]]
    f.write(data[6 * CHUNK: 9 * CHUNK])
    f.flush()
    streamer.step(fs)                            # grew again: 4 to 7 make a full call
    landed(8)
    assert link.calls == [[0, 1, 2, 3], [4, 5, 6, 7]]
    streamer.step(fs)                            # not grown since the last poll: chunk 8 goes
    landed(9)
    assert link.calls[-1] == [8]
    f.write(data[9 * CHUNK:])
    f.flush()
    streamer.published(fs, len(data), 1_000)
    assert finish(streamer, fs)
    assert link.ready["ckpt/s1/__0_0.distcp"] == data and link.bytes == len(data)
    streamer.shutdown()


def test_a_named_chunk_and_a_run_that_cannot_grow_leave_at_once_while_the_file_grows(tmp_path):
    """A chunk the tier named (a merge will read it) does not wait for a full call, nor does a
    short run before it (it cannot grow); the short run at the file's growing end waits."""
    path = "ckpt/run/step_2/__0_0.distcp"
    link, streamer, f, fs = _named_streamer(tmp_path, path, [1], call_bytes=4 * CHUNK)
    link.calls.clear()
    f.write(os.urandom(3 * CHUNK))
    f.flush()
    streamer.step(fs)
    deadline = time.monotonic() + 10
    while (len(fs.sent) < 2 or fs.inflight) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sorted(link.calls) == [[0], [1]]      # chunk 2 waits: the file is still growing
    streamer.shutdown()


def test_warm_starts_every_send_thread_with_its_buffer_before_the_first_file(tmp_path):
    """`warm` (at the mount's start): the pool's threads and their read buffers exist before
    the first checkpoint, whose writer would otherwise pay for them; the calls after it reuse
    them (no new thread, no new buffer)."""
    import threading
    from concurrent.futures import wait
    link = Link(StreamTier(str(tmp_path / "tier"), Clock(), persistent=False, progress_every_s=0))
    streamer = Streamer(link, CHUNK, parallel=3, call_bytes=2 * CHUNK)
    streamer.warm()
    deadline = time.monotonic() + 10
    while len(streamer.pool._threads) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    seen, meet = [], threading.Barrier(3, timeout=10)

    def look() -> None:
        seen.append(len(getattr(streamer._local, "buf", b"")))
        meet.wait()                              # one task a thread: each thread is looked at

    wait([streamer.pool.submit(look) for _ in range(3)])
    assert seen == [2 * CHUNK] * 3
    assert len(streamer.pool._threads) == 3
    streamer.shutdown()

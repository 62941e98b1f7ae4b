"""fusefs/stream/threads.py's pump, with a real Streamer and StreamTier joined by the in-memory link of
test_streamer.py: a published stream whose rest is still in flight is stepped again when a call
lands, not in a loop meanwhile (it was: thousands of steps per checkpoint on the writer's CPU),
and not only at the next poll either; with nothing to stream the pump sleeps until a hook wakes it."""
from __future__ import annotations

import os
import threading
import time

import pytest

from hintfs.agent.streams import StreamTier
from fusefs.stats import Stats
from fusefs.stream.hooks import Version
from fusefs.stream.streamer import Streamer
from fusefs.stream.threads import ThreadSink
from mountconfig.schema import StreamConfig
from tests.conftest import wait_for
from tests.unit.test_streamer import CHUNK, Clock, Link

PATH = "ckpt/run/step_1/__0_0.distcp"


def tier_link(tmp_path, name: str = "tier") -> Link:
    link = Link(StreamTier(str(tmp_path / name), Clock(), persistent=False, progress_every_s=0))
    link.client = link                     # the sink's warm-up pings each connection
    link.ping = lambda: None
    return link


@pytest.mark.parametrize("tiers", [1, 2])
def test_a_published_stream_waits_for_its_chunks_to_land_without_spinning(tmp_path, tiers):
    """With two tiers, the second's link is fast: its stream is done at the publish while the
    first's chunks are still in flight (a done stream must not make the entry spin either)."""
    link = tier_link(tmp_path)
    plain_put = link.put
    release = threading.Event()

    def slow_put(sid, gen, chunks, *args, **kw):
        if chunks[0][0] > 0:              # after the first chunk (the stream's open), every call
            assert release.wait(10)       # stays in flight until the publish was sent,
            time.sleep(0.05)              # and then takes its time on the link
        return plain_put(sid, gen, chunks, *args, **kw)

    link.put = slow_put
    links = [link] + [tier_link(tmp_path, f"tier{i}") for i in range(1, tiers)]
    streamers = [Streamer(one, CHUNK, parallel=2, others_in_flight=1) for one in links]
    steps = [0]
    for streamer in streamers:
        def counted_step(fs, plain_step=streamer.step):
            steps[0] += 1
            return plain_step(fs)
        streamer.step = counted_step
    # A poll far longer than the test: only the hooks' and the landings' wakes move the stream.
    cfg = StreamConfig(prefixes=["ckpt"], agents=["grpc://127.0.0.1:1"], poll_interval_s=10.0)
    finished = threading.Event()
    tap = ThreadSink(cfg, streamers, Stats(), on_finished=lambda key, seq: finished.set())
    data = os.urandom(8 * CHUNK + 123)
    with open(tmp_path / "staging", "w+b") as f:
        try:
            f.write(data[:CHUNK])
            f.flush()
            tap.start(1, 1, PATH, f.fileno())  # its step sends chunk 0, which opens the stream
            assert wait_for(lambda: all(fs.sent for fs in tap.entries[1].streams), 5, 0.01)
            f.write(data[CHUNK:])             # the rest is written, then published at once:
            f.flush()                         # its chunks go in flight at the publish
            st = os.fstat(f.fileno())
            tap.publish(1, PATH, Version(len(data), st.st_mtime_ns, None))
            time.sleep(0.2)               # the publish step has run: its chunks wait in the pool
            before = steps[0]
            release.set()
            assert finished.wait(5), "the stream did not finish: a landing did not wake the pump"
            # Eight chunks in calls of one: a step per landing at most, and the publish's own.
            assert steps[0] - before <= 12 * tiers, f"{steps[0] - before} steps while 8 chunks landed"
            for one in links:
                assert one.ready[PATH] == data
                assert one.bytes == len(data)
        finally:
            release.set()
            tap.close(timeout_s=1)
            for streamer in streamers:
                streamer.shutdown()


def test_an_idle_pump_sleeps_until_a_hook_wakes_it(tmp_path):
    link = tier_link(tmp_path)
    streamer = Streamer(link, CHUNK)
    cfg = StreamConfig(prefixes=["ckpt"], agents=["grpc://127.0.0.1:1"], poll_interval_s=0.01)
    tap = ThreadSink(cfg, [streamer], Stats())
    rounds = [0]
    plain = tap._give_up_over_budget

    def counted(now):
        rounds[0] += 1
        return plain(now)

    tap._give_up_over_budget = counted        # (called once per round of the pump)
    try:
        time.sleep(0.3)                       # 30 polls' worth with nothing to stream
        assert rounds[0] <= 2, f"{rounds[0]} rounds of an idle pump"
        with open(tmp_path / "staging", "w+b") as f:
            f.write(os.urandom(CHUNK))
            f.flush()
            tap.start(1, 1, PATH, f.fileno())  # the command wakes it, and it polls while it streams
            wait_for(lambda: tap.entries[1].streams[0].sent, 5, 0.01)
            assert list(tap.entries[1].streams[0].sent) == [0]   # stepped: its whole chunk went
    finally:
        tap.close(timeout_s=1)
        streamer.shutdown()

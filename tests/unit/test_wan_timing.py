"""The WAN relay's timing (tests/helpers/wan.py) on trio's fake clock: its pumps over in-memory
streams, so delays, the token bucket's pace and the shared link are exact and nothing depends on
the machine's load. tests/system/test_wan.py runs the relay on real sockets (bytes, counters,
lower bounds of time only)."""
from __future__ import annotations

import os

import pytest
import trio
import trio.testing

from tests.helpers.wan import RelayStats, TokenBucket, _pump, read_size_for

DELAY_S = 0.05


def _virtual(fn, *args):
    """Run `fn` in trio with a clock that jumps to the next timer whenever every task waits:
    everything here is in memory, so waiting means waiting for time."""
    return trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


def _burst(bw: float) -> int:        # run_relay's default
    return int(max(read_size_for(bw), bw * 0.005))


def _inflight(bw: float) -> int:     # run_relay's default
    return int(min(64 << 20, max(1 << 20, 2 * bw * DELAY_S)))


def _connect(nursery, buckets: tuple[TokenBucket, TokenBucket], stats: RelayStats, bw: float):
    """A client and a server stream joined by the relay's two pumps (up and down)."""
    client, relay_a = trio.testing.memory_stream_pair()
    relay_b, server = trio.testing.memory_stream_pair()
    nursery.start_soon(_pump, relay_a, relay_b, "up", buckets[0], DELAY_S, _inflight(bw), stats)
    nursery.start_soon(_pump, relay_b, relay_a, "down", buckets[1], DELAY_S, _inflight(bw), stats)
    return client, server


def test_rtt_is_twice_the_delay():
    bw = 50e6

    async def main():
        stats = RelayStats()
        async with trio.open_nursery() as n:
            client, server = _connect(n, (TokenBucket(bw, _burst(bw)), TokenBucket(bw, _burst(bw))), stats, bw)

            async def echo():
                while data := await server.receive_some(65536):
                    await server.send_all(data)
            n.start_soon(echo)
            rtts = []
            for i in range(5):
                t0 = trio.current_time()
                await client.send_all(bytes([i]))
                assert await client.receive_some(1) == bytes([i])
                rtts.append(trio.current_time() - t0)
            n.cancel_scope.cancel()
        return rtts

    assert _virtual(main) == pytest.approx([2 * DELAY_S] * 5, abs=1e-6)


@pytest.mark.parametrize("mbit,size", [(64, 3 << 20), (400, 12 << 20)])
def test_one_connection_runs_at_the_bandwidth_although_the_rtt_is_100_ms(mbit, size):
    """Data kept in flight: the rate is the bucket's, not one window per RTT; no sample interval
    carries more than the bandwidth allows beyond one burst; bytes arrive whole and in order."""
    bw = mbit * 1e6 / 8
    payload = os.urandom(size)

    async def main():
        stats = RelayStats(sample_interval_s=0.05)
        arrivals, got = [], bytearray()
        async with trio.open_nursery() as n:
            client, server = _connect(n, (TokenBucket(bw, _burst(bw)), TokenBucket(bw, _burst(bw))), stats, bw)
            stats.started_at = trio.current_time()

            async def sampler():
                while True:
                    await trio.sleep(stats.sample_interval_s)
                    stats.sample(trio.current_time())
            n.start_soon(sampler)
            t0 = trio.current_time()
            await client.send_all(payload)
            await client.send_eof()
            while data := await server.receive_some(1 << 20):
                arrivals.append(trio.current_time() - t0)
                got.extend(data)
            stats.sample(trio.current_time())
            n.cancel_scope.cancel()
        return arrivals, bytes(got), stats.snapshot()

    arrivals, got, stats = _virtual(main)
    assert got == payload and stats["bytes"]["up"] == size
    # the first chunk leaves at once (within the burst) and arrives after the delay; a chunk
    # leaves when its reservation of the link starts, less the burst: the last one when every
    # byte before it has had its time on the link
    rs = read_size_for(bw)
    last = size % rs or rs
    assert arrivals[0] == pytest.approx(DELAY_S, abs=1e-6)
    assert arrivals[-1] == pytest.approx((size - last) / bw - _burst(bw) / bw + DELAY_S, rel=1e-3)
    interval = stats["sample_interval_s"]
    # an interval's own time on the link, the burst, and one chunk stamped on its boundary
    assert max(b for _, b in stats["samples"]["up"]) <= bw * interval + _burst(bw) + rs


def test_connections_share_the_bucket_first_come_first_served():
    """40 connections at once through one link of 8 MB/s: together they take n * size / bw, and
    each gets its bytes across (none starves)."""
    n_conn, size, bw = 40, 32 << 10, 8e6
    buckets = (TokenBucket(bw, _burst(bw)), TokenBucket(bw, _burst(bw)))

    async def main():
        stats = RelayStats()
        done = {}
        async with trio.open_nursery() as n:
            pairs = [_connect(n, buckets, stats, bw) for _ in range(n_conn)]
            t0 = trio.current_time()

            async def one(i, client, server):
                data = bytes([i]) * size
                await client.send_all(data)
                await client.send_eof()
                got = bytearray()
                while chunk := await server.receive_some(65536):
                    got += chunk
                assert bytes(got) == data
                done[i] = trio.current_time() - t0

            async with trio.open_nursery() as conns:
                for i, (client, server) in enumerate(pairs):
                    conns.start_soon(one, i, client, server)
            n.cancel_scope.cancel()
        return done, stats.snapshot()

    done, stats = _virtual(main)
    assert len(done) == n_conn and stats["bytes"]["up"] == n_conn * size
    total = n_conn * size / bw
    assert max(done.values()) == pytest.approx(total - _burst(bw) / bw + DELAY_S, rel=0.02)
    assert min(done.values()) < total / 2          # chunk by chunk in call order: not one after the other


def test_the_bucket_reserves_in_call_order():
    async def main():
        bucket, starts = TokenBucket(1000.0, 0), []

        async def take(i):
            await bucket.take(100)          # 0.1 s of the link each
            starts.append((i, trio.current_time()))
        async with trio.open_nursery() as n:
            for i in range(3):
                n.start_soon(take, i)
                await trio.sleep(0)
        return starts

    assert _virtual(main) == [(0, pytest.approx(0.0)), (1, pytest.approx(0.1)), (2, pytest.approx(0.2))]

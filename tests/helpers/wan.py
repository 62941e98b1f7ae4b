"""WAN emulator: a user-space TCP relay on loopback with per-direction delay and a token bucket.

This kernel has no ``netem`` (nor ``fq``), so cross-DC experiments put this relay between the
eval side and the remote store: every accepted connection is forwarded to ``target``; each
direction ("up": client -> target, "down": target -> client) has

- a shared token bucket (bytes/s) for all connections of that direction: the link's
  serialization; a chunk waits for its tokens *before* it is stamped as sent;
- a fixed one-way propagation delay: each chunk is stamped when it leaves the bucket and is
  written to the other side at ``stamp + delay``. The delay is per chunk, not per connection,
  so a stream with enough bytes in flight runs at the bandwidth, not at one window per RTT.

Bytes keep their order (one FIFO per connection and direction); EOF (half-close) is forwarded
after the same delay. Everything is bounded: bytes in flight per connection and direction,
the number of connections, the samples kept, the connect time. It listens on loopback only.

What it does not model: loss, reordering, jitter, a router's queue (the in-flight limit plays
that role and pushes back on the sender through TCP), or a TCP window smaller than the
kernel's loopback buffers. See docs/cross_dc.md.

Use from trio: ``await nursery.start(run_relay, 0, "127.0.0.1", 9001, 0.05, 50e6)``; from
threads and tests: ``with Relay(("127.0.0.1", 9001), 0.05, 50e6) as r: port = r.port``.
CLI (from the repository's root): ``python -m tests.helpers.wan --listen 127.0.0.1:9000
--target 127.0.0.1:9001 --delay-ms 50 --bandwidth-mbit 400``. Part of the harness the tests and
the benches share (`tests/helpers/`); it imports nothing of hintfs.
"""
from __future__ import annotations

import argparse
import collections
import ipaddress
import json
import logging
import functools
import math
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import trio

log = logging.getLogger("hintfs.wan")

# Bytes read per chunk: 5 ms of the link, between 64 and 256 KiB. Each chunk costs the relay a
# few passes through trio's loop, and the relay shares a CPU with the training side in
# bench/cross_dc_eval.py: at a fixed 64 KiB it spent twice the CPU on a 400 Mbit/s link. Slower
# links keep 64 KiB, so a chunk stays a small part of a sample interval.
READ_SIZE = 64 * 1024
MAX_READ_SIZE = 256 * 1024
DIRECTIONS = ("up", "down")


def read_size_for(rate_bytes_s: float) -> int:
    return int(min(MAX_READ_SIZE, max(READ_SIZE, rate_bytes_s * 0.005)))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TokenBucket:
    """A shared token bucket for one direction, as a virtual-time (GCRA) schedule.

    ``take(n)`` reserves the next ``n / rate`` seconds of the link and sleeps until the
    reservation starts, less the burst allowance. Reservations are handed out in call order,
    so waiting connections are served first come first served, chunk by chunk.
    """

    def __init__(self, rate_bytes_s: float, burst_bytes: int):
        if not rate_bytes_s > 0 or not math.isfinite(rate_bytes_s):
            raise ValueError("bandwidth must be a positive finite number of bytes/s")
        self.rate = float(rate_bytes_s)
        self.burst_s = max(0, burst_bytes) / self.rate
        self._tat = 0.0  # theoretical arrival time: when the link is free again

    async def take(self, n: int) -> None:
        now = trio.current_time()
        self._tat = max(self._tat, now) + n / self.rate
        start = self._tat - n / self.rate - self.burst_s
        if start > now:
            await trio.sleep_until(start)


@dataclass
class RelayStats:
    """Counters of one relay; read them inside its trio run or through ``Relay.stats()``."""

    sample_interval_s: float = 0.1
    max_samples: int = 36_000
    started_at: float | None = None
    accepted: int = 0
    rejected: int = 0
    failed: int = 0
    active: int = 0
    bytes: dict[str, int] = field(default_factory=lambda: {d: 0 for d in DIRECTIONS})
    # plain HTTP through the relay (an S3 endpoint): "down" bytes and requests by the kind of the
    # request they answer (`request_kind`), to tell what crossed
    down_by_request: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    samples: dict[str, collections.deque] = field(default_factory=dict)
    _last: dict[str, int] = field(default_factory=lambda: {d: 0 for d in DIRECTIONS})

    def __post_init__(self) -> None:
        self.samples = {d: collections.deque(maxlen=self.max_samples) for d in DIRECTIONS}

    def sample(self, now: float) -> None:
        t = now - (self.started_at or now)
        for d in DIRECTIONS:
            self.samples[d].append((round(t, 6), self.bytes[d] - self._last[d]))
            self._last[d] = self.bytes[d]

    def snapshot(self) -> dict[str, Any]:
        """Plain values: totals, and per direction a list of (t since start, bytes delivered in
        the sample interval ending at t)."""
        return {
            "accepted": self.accepted, "rejected": self.rejected, "failed": self.failed,
            "active": self.active, "sample_interval_s": self.sample_interval_s,
            "bytes": dict(self.bytes),
            "down_by_request": dict(self.down_by_request), "requests": dict(self.requests),
            "samples": {d: list(self.samples[d]) for d in DIRECTIONS},
        }


_METHODS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ")


def request_kind(chunk: bytes) -> str | None:
    """The kind of the HTTP request a chunk sent up starts (None: not a request's start): its
    method, LIST for a bucket listing (LIST-AFTER with start-after), and ":journal" for a hintfs
    journal's objects."""
    if not chunk.startswith(_METHODS):
        return None
    line = chunk.split(b"\r\n", 1)[0]
    method = line.split(b" ", 1)[0].decode()
    if method == "GET" and (b"list-type=" in line or b"delimiter=" in line or b"prefix=" in line):
        method = "LIST-AFTER" if b"start-after=" in line else "LIST"
    if b"hintfs-journal" in line:
        return method + ":journal"
    if method.startswith("LIST"):
        return method
    # an object's request: by the first two folders of its key (after the bucket)
    parts = line.split(b" ")[1].split(b"?", 1)[0].split(b"/")[2:4] if b" " in line else []
    return method + ":" + b"/".join(parts).decode(errors="replace")[:60]


async def _pump(src: trio.SocketStream, dst: trio.SocketStream, direction: str,
                bucket: TokenBucket, delay_s: float, max_inflight: int, stats: RelayStats,
                conn: dict | None = None) -> None:
    """One direction of one connection: read -> bucket -> stamp -> queue -> release at stamp+delay.
    `conn`: the connection's state both directions share (the kind of its last request)."""
    queue: collections.deque[tuple[float, bytes]] = collections.deque()
    read_size = read_size_for(bucket.rate)
    inflight = 0
    changed = trio.Event()    # the writer is told when a chunk (or EOF) was queued
    drained = trio.Event()    # the reader is told when bytes left the queue

    async def reader() -> None:
        nonlocal inflight, changed
        while True:
            while inflight >= max_inflight:
                await drained.wait()
            try:
                data = await src.receive_some(read_size)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if data:
                await bucket.take(len(data))
            queue.append((trio.current_time(), data))
            inflight += len(data)
            changed.set()
            if not data:
                return

    async def writer() -> None:
        nonlocal inflight, changed, drained
        while True:
            while not queue:
                changed = trio.Event()
                await changed.wait()
            stamp, data = queue[0]
            await trio.sleep_until(stamp + delay_s)
            queue.popleft()
            if not data:
                try:
                    await dst.send_eof()
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
                return
            await dst.send_all(data)
            inflight -= len(data)
            stats.bytes[direction] += len(data)
            if conn is not None:
                if direction == "up":
                    kind = request_kind(data)
                    if kind is not None:
                        conn["kind"] = kind
                        stats.requests[kind] = stats.requests.get(kind, 0) + 1
                else:
                    kind = conn.get("kind", "other")
                    stats.down_by_request[kind] = stats.down_by_request.get(kind, 0) + len(data)
            old, drained = drained, trio.Event()
            old.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        nursery.start_soon(writer)


async def _handle(client: trio.SocketStream, target_host: str, target_port: int, delay_s: float,
                  buckets: dict[str, TokenBucket], max_inflight: int, connect_timeout_s: float,
                  stats: RelayStats) -> None:
    stats.active += 1
    try:
        async with client:
            try:
                with trio.fail_after(connect_timeout_s):
                    server = await trio.open_tcp_stream(target_host, target_port)
            except (OSError, trio.TooSlowError) as e:
                stats.failed += 1
                log.warning("wan relay: cannot reach %s:%d: %s", target_host, target_port, e)
                return
            async with server:
                conn: dict = {}
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_pump, client, server, "up", buckets["up"], delay_s,
                                           max_inflight, stats, conn)
                        nursery.start_soon(_pump, server, client, "down", buckets["down"],
                                           delay_s, max_inflight, stats, conn)
                except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass  # one side went away: close both
    finally:
        stats.active -= 1


def _validate(listen_host: str, target_host: str, delay_s: float, bandwidth_bytes_s: float) -> None:
    if not _is_loopback(listen_host) or not _is_loopback(target_host):
        raise ValueError("the WAN relay listens on and forwards to loopback addresses only")
    if not (delay_s >= 0 and math.isfinite(delay_s)):
        raise ValueError("delay_s must be a finite number >= 0")
    if not (bandwidth_bytes_s > 0 and math.isfinite(bandwidth_bytes_s)):
        raise ValueError("bandwidth must be a positive finite number of bytes/s")


async def run_relay(listen_port: int, target_host: str, target_port: int, delay_s: float,
                    bandwidth_bytes_s: float, *, listen_host: str = "127.0.0.1",
                    stats: RelayStats | None = None, max_connections: int = 1024,
                    max_inflight_bytes: int | None = None, burst_bytes: int | None = None,
                    connect_timeout_s: float = 10.0, buckets: dict[str, TokenBucket] | None = None,
                    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled. ``task_status.started(port)`` reports the bound port (0 picks one).

    ``max_inflight_bytes`` per connection and direction defaults to twice the bandwidth-delay
    product (at least 1 MiB, at most 64 MiB); ``burst_bytes`` defaults to 5 ms of bandwidth (at
    least one read of 64 KiB). ``buckets``: another relay's buckets (same trio run), so that two
    relays are one link: pass ``{"up": its["down"], "down": its["up"]}`` for a relay whose
    clients sit on the other side.
    """
    _validate(listen_host, target_host, delay_s, bandwidth_bytes_s)
    if max_connections < 1:
        raise ValueError("max_connections must be >= 1")
    if max_inflight_bytes is None:
        max_inflight_bytes = int(min(64 << 20, max(1 << 20, 2 * bandwidth_bytes_s * delay_s)))
    if burst_bytes is None:
        burst_bytes = int(max(read_size_for(bandwidth_bytes_s), bandwidth_bytes_s * 0.005))
    if buckets is None:
        buckets = {d: TokenBucket(bandwidth_bytes_s, burst_bytes) for d in DIRECTIONS}
    stats = stats if stats is not None else RelayStats()
    listeners = await trio.open_tcp_listeners(listen_port, host=listen_host)
    port = listeners[0].socket.getsockname()[1]
    stats.started_at = trio.current_time()

    async def sampler() -> None:
        while True:
            await trio.sleep(stats.sample_interval_s)
            stats.sample(trio.current_time())

    async def handler(stream: trio.SocketStream) -> None:
        if stats.active >= max_connections:
            stats.rejected += 1
            await stream.aclose()
            return
        stats.accepted += 1
        await _handle(stream, target_host, target_port, delay_s, buckets, max_inflight_bytes,
                      connect_timeout_s, stats)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sampler)
        await nursery.start(trio.serve_listeners, handler, listeners)
        log.info("wan relay %s:%d -> %s:%d, %.1f ms each way, %.1f Mbit/s per direction",
                 listen_host, port, target_host, target_port, delay_s * 1e3,
                 bandwidth_bytes_s * 8 / 1e6)
        task_status.started(port)


def _parse_target(target: str | tuple[str, int]) -> tuple[str, int]:
    if isinstance(target, tuple):
        return target[0], int(target[1])
    host, _, port = target.rpartition(":")
    return host, int(port)


class Relay:
    """``run_relay`` in a background thread with its own trio loop.

    ``start()`` returns the bound port, ``stats()`` returns ``RelayStats.snapshot()``,
    ``stop()`` cancels the relay (open connections are closed) and joins the thread.
    Also a context manager.

    ``reverse_target``: a second listener (``reverse_port``, ``reverse_stats()``) towards a
    target on the *client* side of the link, e.g. an eval-DC agent that training hosts send to
    while eval hosts read the store through the first listener. Both share the link's two
    token buckets, crossed: the second's "up" is the first's "down" (the same direction of the
    link), so the link's bandwidth holds for both together.
    """

    def __init__(self, target: str | tuple[str, int], delay_s: float, bandwidth_bytes_s: float, *,
                 listen_host: str = "127.0.0.1", listen_port: int = 0,
                 sample_interval_s: float = 0.1, reverse_target: str | tuple[str, int] | None = None,
                 nice: int = 0, cpus: list[int] | None = None, **kwargs: Any):
        self.target = _parse_target(target)
        _validate(listen_host, self.target[0], delay_s, bandwidth_bytes_s)
        self.delay_s = delay_s
        self.bandwidth_bytes_s = bandwidth_bytes_s
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.kwargs = kwargs
        self._stats = RelayStats(sample_interval_s=sample_interval_s)
        self.reverse_target = _parse_target(reverse_target) if reverse_target is not None else None
        self._rstats = RelayStats(sample_interval_s=sample_interval_s)
        self.reverse_port: int | None = None
        self.nice = nice   # the relay thread's CPU priority (a link is not on the hosts' CPUs)
        self.cpus = cpus   # the relay thread's CPUs (and its worker threads'), None: the process's
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancel: trio.CancelScope | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.port: int | None = None

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:
            self._cancel = scope
            async with trio.open_nursery() as nursery:
                burst = self.kwargs.pop("burst_bytes", None)
                if burst is None:
                    burst = int(max(read_size_for(self.bandwidth_bytes_s), self.bandwidth_bytes_s * 0.005))
                buckets = {d: TokenBucket(self.bandwidth_bytes_s, burst) for d in DIRECTIONS}

                async def listen(port: int, target: tuple[str, int], stats: RelayStats, bk: dict) -> int:
                    return await nursery.start(functools.partial(
                        run_relay, port, target[0], target[1], self.delay_s, self.bandwidth_bytes_s,
                        listen_host=self.listen_host, stats=stats, buckets=bk, **self.kwargs))
                self.port = await listen(self.listen_port, self.target, self._stats, buckets)
                if self.reverse_target is not None:
                    self.reverse_port = await listen(0, self.reverse_target, self._rstats,
                                                     {"up": buckets["down"], "down": buckets["up"]})
                await self._more_listeners(listen, buckets)
                self._ready.set()

    async def _more_listeners(self, listen, buckets: dict) -> None:
        """A subclass's further listeners on the same link: `await listen(port, target, stats,
        buckets)` gives each one's port (bench/scale_xdc.py's direct-remote reference)."""

    def _snapshot(self, stats: RelayStats) -> dict[str, Any]:
        """`stats.snapshot()`, taken in the relay's thread while it runs."""
        if self._token is not None and self._thread is not None and self._thread.is_alive():
            try:
                return trio.from_thread.run_sync(stats.snapshot, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        return stats.snapshot()

    def _run(self) -> None:
        if self.nice:
            os.setpriority(os.PRIO_PROCESS, 0, self.nice)   # this thread only (Linux)
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)              # this thread only (Linux)
        try:
            trio.run(self._main)
        except BaseException as e:  # reported to start()
            self._error = e
        finally:
            self._ready.set()

    def start(self, timeout_s: float = 10.0) -> int:
        if self._thread is not None:
            raise RuntimeError("relay already started")
        self._thread = threading.Thread(target=self._run, name="wan-relay", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError("wan relay did not start")
        if self._error is not None:
            err = self._error
            while isinstance(err, BaseExceptionGroup) and len(err.exceptions) == 1:
                err = err.exceptions[0]
            raise err
        assert self.port is not None
        return self.port

    def stats(self) -> dict[str, Any]:
        return self._snapshot(self._stats)

    def reverse_stats(self) -> dict[str, Any]:
        """The second listener's ``RelayStats.snapshot()`` (its "up" crosses the link like the
        first's "down")."""
        return self._snapshot(self._rstats)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is None:
            return
        if self._thread.is_alive() and self._token is not None and self._cancel is not None:
            try:
                trio.from_thread.run_sync(self._cancel.cancel, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError("wan relay did not stop")

    def __enter__(self) -> Relay:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _hostport(s: str) -> tuple[str, int]:
    host, sep, port = s.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {s!r}")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="User-space WAN emulator: TCP relay with per-direction "
                                            "delay and a token bucket (loopback only).")
    p.add_argument("--listen", type=_hostport, default=("127.0.0.1", 9000), help="HOST:PORT")
    p.add_argument("--target", type=_hostport, required=True, help="HOST:PORT")
    p.add_argument("--delay-ms", type=float, default=50.0, help="one-way delay per direction")
    p.add_argument("--bandwidth-mbit", type=float, default=400.0, help="per direction, Mbit/s")
    p.add_argument("--duration-s", type=float, default=None, help="stop after this long")
    p.add_argument("--stats-json", default=None, help="write stats here on exit")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stats = RelayStats()

    async def run() -> None:
        with trio.move_on_after(a.duration_s if a.duration_s is not None else math.inf):
            await run_relay(a.listen[1], a.target[0], a.target[1], a.delay_ms / 1e3,
                            a.bandwidth_mbit * 1e6 / 8, listen_host=a.listen[0], stats=stats)

    try:
        trio.run(run)
    except KeyboardInterrupt:
        pass
    except (ValueError, OSError) as e:
        print(f"wan: {e}", file=sys.stderr)
        return 2
    snap = stats.snapshot()
    print(f"wan: {snap['accepted']} connections, up {snap['bytes']['up']} B, "
          f"down {snap['bytes']['down']} B")
    if a.stats_json:
        with open(a.stats_json, "w") as f:
            json.dump(snap, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

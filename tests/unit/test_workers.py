"""fusefs.workers.run_sync, the store calls' hop to a worker thread: what trio.to_thread.run_sync
promises them (a value, an exception, the limiter's bound, no call abandoned on cancel)."""
from __future__ import annotations

import threading

import pytest
import trio

from fusefs import workers


def test_a_call_gives_its_value_or_raises_its_exception_in_another_thread():
    async def main():
        lim = trio.CapacityLimiter(2)
        here = threading.get_ident()
        assert await workers.run_sync(lambda a, b: (a + b, threading.get_ident() != here), 1, 2, limiter=lim) == (3, True)

        def boom():
            raise FileNotFoundError(2, "gone", "x")
        with pytest.raises(FileNotFoundError) as exc:
            await workers.run_sync(boom, limiter=lim)
        assert exc.value.filename == "x" and lim.borrowed_tokens == 0
    trio.run(main)


def test_at_most_the_limiters_tokens_run_at_once():
    running, most = [0], [0]
    lock = threading.Lock()
    release = threading.Event()

    def call():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(10)
        with lock:
            running[0] -= 1

    async def main():
        lim = trio.CapacityLimiter(3)
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(lambda: workers.run_sync(call, limiter=lim))
            while lim.borrowed_tokens < 3 or running[0] < 3:
                await trio.sleep(0.001)
            assert lim.statistics().tasks_waiting == 5
            release.set()
        assert lim.borrowed_tokens == 0
    trio.run(main)
    assert most[0] == 3


def test_a_cancelled_request_waits_for_its_call_and_is_cancelled_after():
    started, finish = threading.Event(), threading.Event()
    done = []

    def call():
        started.set()
        finish.wait(10)
        done.append(True)
        return 7

    lim, got, scope = _cancelled_once_started(call, started, then=finish.set)
    assert done == [True] and got == [7] and scope.cancelled_caught and lim.borrowed_tokens == 0


def _cancelled_once_started(call, started: threading.Event, then=lambda: None, **kw):
    """`workers.run_sync(call, **kw)` in a scope cancelled once `started` is set (then `then()`):
    (its limiter, [its value], the scope)."""
    lim = trio.CapacityLimiter(1)
    got: list = []
    scope = trio.CancelScope()

    async def main():
        with scope:
            async def cancel_when_started():
                await trio.to_thread.run_sync(started.wait, 10)
                scope.cancel()
                then()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_when_started)
                got.append(await workers.run_sync(call, limiter=lim, **kw))
                await trio.lowlevel.checkpoint()
                got.append("not cancelled")
    trio.run(main)
    return lim, got, scope


def test_on_cancel_tells_a_call_of_many_steps_to_stop_early():
    """`on_cancel` runs when the request is cancelled while its call runs (an unmount during a
    fetch ahead of 16 objects: `Filesystem._fetch_ahead` stops after the one in progress)."""
    started, stop = threading.Event(), threading.Event()
    steps = []

    def call():
        started.set()
        for i in range(1000):
            if stop.is_set():
                return "stopped"
            steps.append(i)
            stop.wait(0.01)
        return "ran to the end"

    lim, got, scope = _cancelled_once_started(call, started, on_cancel=stop.set)
    assert got == ["stopped"] and scope.cancelled_caught and stop.is_set() and len(steps) < 1000
    assert lim.borrowed_tokens == 0

"""A store call in a worker thread, with less of the interpreter's time than trio.to_thread.

`trio.to_thread.run_sync` names the worker thread after the call twice a call (two
`pthread_setname_np` through ctypes), copies the context variables, and sets up what
`trio.from_thread` needs in the thread. Store calls use none of that, and a mount reading thousands
of small S3 objects is bound by the interpreter's lock (issue 39, bench/notes/s3_cold.md): this hop
costs ~60 us of CPU against trio's ~95 (8 tasks, 20,000 calls of a no-op, this VM). What it keeps:
trio's thread cache (`trio.lowlevel.start_thread_soon`), the limiter, and trio.to_thread's default
cancellation (`abandon_on_cancel=False`: a cancelled request waits for its call to finish and is
cancelled at its next checkpoint; a thread is never left behind holding a store connection).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")


def _no_abort(_raise_cancel) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


async def run_sync(fn: Callable[..., T], *args, limiter: trio.CapacityLimiter,
                   on_cancel: Callable[[], None] | None = None) -> T:
    """`fn(*args)` in one of trio's cached worker threads, at most `limiter`'s tokens at once; its
    value, or its exception raised here. `on_cancel`: called (in the loop's thread) when the
    request is cancelled while `fn` runs, so that a call of many steps can stop early."""
    marker = object()
    await limiter.acquire_on_behalf_of(marker)
    try:
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()

        def deliver(result) -> None:
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            except trio.RunFinishedError:   # (the loop is gone: no one waits)
                pass

        trio.lowlevel.start_thread_soon(functools.partial(fn, *args), deliver)
        abort = _no_abort
        if on_cancel is not None:
            def abort(_raise_cancel) -> trio.lowlevel.Abort:
                on_cancel()
                return trio.lowlevel.Abort.FAILED
        value: T = await trio.lowlevel.wait_task_rescheduled(abort)
        return value
    finally:
        limiter.release_on_behalf_of(marker)


__all__ = ["run_sync"]

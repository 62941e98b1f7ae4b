"""Read-ahead for one open file of a remote store (S3, HDFS) without the host cache.

Sequential reads (each starting where the last ended, or within the chunks already asked for)
open a window of ranged reads ahead of the reader: `chunk` bytes each, read in the shared
threads of `ReadPool` (their requests reuse the store client's pooled connections), the window
doubling each time the reader enters a new chunk, up to `max_bytes`. A read elsewhere (random
access) drops the window and is read as asked, alone. Every chunk held counts against a
`Budget` shared by all open files (`[store] read_buffer_bytes`): when it is spent, reads go to
the store as asked, without read-ahead, so memory stays bounded whatever is open.

Bytes fetched ahead and never read are the cost of a wrong guess; the window starts at two chunks
and only grows while the reader keeps coming.
"""
from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from collections.abc import Callable

MiB = 1 << 20


class Budget:
    """Bytes that may be held at once, over all open files (thread-safe)."""

    def __init__(self, total: int):
        self.total = total
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.total:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


class ReadPool:
    """Daemon worker threads (a read in flight never holds up the daemon's exit), started at the
    first submit; `close` cancels what has not started. The read-ahead's ranged reads and the
    host cache's fetches use it."""

    def __init__(self, n: int, name: str = "hintfs-readahead"):
        self._n = n
        self._name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable, *args) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._closed:
                fut.cancel()
                fut.set_running_or_notify_cancel()
                return fut
            if not self._threads:
                for i in range(self._n):
                    t = threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True)
                    t.start()
                    self._threads.append(t)
            self._q.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as err:
                fut.set_exception(err)

    def close(self, timeout: float) -> bool:
        """True when every thread has stopped."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
                item[0].set_running_or_notify_cancel()   # (cancel alone does not wake a cf.wait)
        for _ in threads:
            self._q.put(None)
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)


class ReadAhead:
    """The read-ahead state of one open file of `size` bytes read by `read_at(offset, size)`."""

    __slots__ = ("_read_at", "_size", "_max", "_chunk", "_budget", "_pool", "_lock", "_chunks", "_last_end",
                 "_window", "_last_chunk", "_closed", "fetched", "counters")

    def __init__(self, read_at: Callable[[int, int], bytes], size: int, max_bytes: int, budget: Budget,
                 pool: ReadPool, chunk: int = 8 * MiB, counters: dict | None = None):
        self._read_at = read_at
        self._size = size
        self._chunk = max(64 << 10, min(chunk, max_bytes // 2 or chunk))
        self._max = max(max_bytes, 2 * self._chunk)
        self._budget = budget
        self._pool = pool
        self._lock = threading.Lock()
        self._chunks: dict[int, _Owned] = {}   # chunk index -> its read (bytes) and budget held
        self._last_end = -1                       # no read yet
        self._window = 0                          # bytes ahead of the reader; 0: not sequential
        self._last_chunk = -1
        self._closed = False
        self.fetched = 0                          # bytes asked of the store ahead of the reader
        self.counters = counters if counters is not None else {}

    # -- the reader's side ------------------------------------------------------------------------
    def read(self, offset: int, size: int) -> bytes:
        futs = self._plan(offset, size)
        if futs is None:
            return self._read_at(offset, size)
        parts = []
        for idx, fut in futs:
            try:
                data = fut.result()
            except BaseException:
                self._forget(idx)
                return self._read_at(offset, size)   # (a failed read ahead: ask again, as asked)
            start = idx * self._chunk
            lo = max(offset, start) - start
            hi = min(offset + size, start + len(data)) - start
            parts.append(data[lo:hi])
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_nowait(self, offset: int, size: int) -> bytes | None:
        """The bytes, if every chunk they lie in has arrived (never waits): else None."""
        end = min(offset + size, self._size)
        if end <= offset:
            return None
        c = self._chunk
        with self._lock:
            chunks = [(i, self._chunks.get(i)) for i in range(offset // c, (end - 1) // c + 1)]
            owned = [(i, o) for i, o in chunks if o is not None]
            if len(owned) != len(chunks) or any(not o.fut.done() or o.fut.cancelled() or o.fut.exception() is not None
                                                for _i, o in owned):
                return None
            parts = []
            for i, o in owned:
                data = o.fut.result()   # (done: no wait)
                start = i * c
                parts.append(data[max(offset, start) - start:min(end, start + len(data)) - start])
        self._plan(offset, size)         # the pattern, and the window's next chunks
        self.counters["readahead_nowait"] = self.counters.get("readahead_nowait", 0) + 1
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _plan(self, offset: int, size: int) -> list[tuple[int, cf.Future]] | None:
        """Update the pattern, ask for the chunks of the window; the reads of the chunks that
        hold [offset, offset + size), or None (read it as asked)."""
        end = min(offset + size, self._size)
        if end <= offset:
            return None
        c = self._chunk
        first, last = offset // c, (end - 1) // c
        with self._lock:
            if self._closed:
                return None
            near = self._last_end >= 0 and (abs(offset - self._last_end) <= c or first in self._chunks)
            self._last_end = end
            if not near:   # the first read, or one elsewhere: as asked, and no window
                self._drop(lambda i: True)
                self._window = 0
                self._last_chunk = first
                return None
            if self._window == 0:
                self._window = 2 * c
            elif first != self._last_chunk:
                self._window = min(self._max, self._window * 2)
            self._last_chunk = first
            self._drop(lambda i: i < first)   # behind the reader: this pattern never reads it again
            want_last = min((offset + self._window - 1) // c, (self._size - 1) // c)
            for i in range(first, max(want_last, last) + 1):
                if i in self._chunks:
                    continue
                n = min(c, self._size - i * c)
                if not self._budget.take(n):   # every open file's chunks together: bounded
                    self.counters["readahead_no_budget"] = self.counters.get("readahead_no_budget", 0) + 1
                    break
                self._chunks[i] = _Owned(self._pool.submit(self._read_at, i * c, n), n)
                self.fetched += n
            if any(i not in self._chunks for i in range(first, last + 1)):
                return None
            return [(i, self._chunks[i].fut) for i in range(first, last + 1)]

    def _forget(self, idx: int) -> None:
        with self._lock:
            owned = self._chunks.pop(idx, None)
            if owned is not None:
                self._budget.give(owned.held)

    def _drop(self, which: Callable[[int], bool]) -> None:   # under self._lock
        for i in [i for i in self._chunks if which(i)]:
            owned = self._chunks.pop(i)
            owned.fut.cancel()
            self._budget.give(owned.held)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop(lambda i: True)


class _Owned:
    """A chunk's read and the budget bytes it holds."""
    __slots__ = ("fut", "held")

    def __init__(self, fut: cf.Future, held: int):
        self.fut = fut
        self.held = held

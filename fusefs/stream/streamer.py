"""Write-time streaming, the training mount's side (docs/cross_dc.md, "Write-time streaming"):
send a file's bytes to the eval tier while the job writes it, reading behind the writer.

Driven by `step` calls (`fusefs.stream.threads.ThreadSink` runs them in worker threads for a
mount with `[stream]`; the unit tests call them directly), against a `Transport`: the tier's calls
(Flight calls to the eval agent, `fusefs.stream.flight.FlightTransport`; `hintfs.agent.streams.StreamTier`
in the unit tests).

- While the file is written, a step sends the whole chunks below the staging file's current size
  that were not sent (`policy.stream.ranges_to_send`), read with `pread` from its own dup of the
  staging fd: the writer never waits for the streamer. While the file grows, the chunks at its
  growing end that no eval read named leave only in full calls (`call_bytes`); a shorter run
  there goes once the file stops growing for a poll, or at the publish.
- After publish (the store committed the file as (size, mtime_ns)), a step computes the CRC of
  every chunk of the final file, re-sends the chunks that changed since they were sent (in-place
  rewrites), and publishes with the last of them (and the stream's open, when the tier has not
  heard of it yet) in the same call: a small file costs one round trip. A tier that answers
  "fill" gets the chunks it names.
- Chunks go in calls of consecutive chunks (at most `call_bytes` each), `parallel` calls at a
  time (a long link needs several in flight), each after the optional link gate grants it
  (`hintfs.agent.linkgate.LinkGate`: the mount's share of the link, by class).
  While the file is written they leave without a barrier: a step hands the new whole chunks to
  the send pool and returns, so the link stays full between steps. Only the publish waits for
  the chunks in flight (`idle` says when none are; the caller changes a stream's generation or
  closes it only then, and `close` of a stream with chunks in flight waits for them to land).
- Eval reads first (`first_by_reads`): the tier's answer to a stream's open names the chunks eval
  jobs read of the previous checkpoint's file of the same name (`hintfs.agent.readmemory`). The open
  rides on the stream's first calls (no round trip of its own), so the streamer starts from the
  chunks named for the last file of that name it sent (`policy.stream.checkpoint_family`) and
  takes the tier's answer when it comes. Named chunks leave as soon as they are written, as
  `urgent` calls (the transport's connection of their own: they share the link at once instead
  of queueing behind the megabytes already in flight on the bulk connection); while any are on
  their way, at most `others_in_flight` calls of other chunks are (of all this streamer's
  files); otherwise the others go as before, keeping the link full. A named partial tail goes
  once the file stops growing, and named chunks still to send go first at the publish. A merge
  that starts at the commit then finds its bytes at the tier.
- A failed call (link down, tier restarted) leaves the stream as it is; the next step re-opens it
  (`open` answers what the tier holds) and goes on from there. Nothing is lost but time.
- `restart` (the file was truncated or staged anew) starts a new generation: the tier forgets the
  older one's chunks. `drop` (unlinked or abandoned before publish) aborts it at the tier.
"""
from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import socket
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Protocol
from collections.abc import Callable, Sequence

from policy.link import transfer_weight
from policy.stream import checkpoint_family, chunk_count, chunk_crc, chunk_span, ranges_to_send, send_calls

log = logging.getLogger("hintfs.streamer")

QUIET_STEPS = 2      # steps without growth before a named partial tail is sent ahead of the close
NAMED_FILES = 4096   # file names whose named chunks a streamer remembers

_ids = itertools.count()
_HOST = "".join(c if c.isalnum() else "-" for c in socket.gethostname())[:40] or "host"


@dataclass(frozen=True)
class PutAnswer:
    """The tier's answer to one put."""
    named: Sequence[int] | None = None   # the stream's open rode on it: the chunks to send first
    ready: bool = False                     # the stream is the published file's replica now


@dataclass(frozen=True)
class PublishAnswer:
    """The tier's answer to a publish."""
    state: str                              # "ready": the replica; else "fill": `fetch` is missing
    fetch: tuple[int, ...] = ()             # chunks the tier lacks (or holds with another CRC)
    named: Sequence[int] | None = None   # the stream's open rode on it: the chunks to send first


class Transport(Protocol):
    def open(self, sid: str, gen: int, path: str, chunk: int,
             job: str | None = None) -> tuple[dict[int, int], Sequence[int]]:
        """(the chunks the tier holds: index -> CRC, the chunks to send first)"""
    def put(self, sid: str, gen: int, chunks: Sequence[tuple[int, bytes | memoryview, int]],
            opening: tuple[str, int, str | None] | None = None, seen: int | None = None,
            urgent: bool = False) -> PutAnswer:
        """Chunks (offset, data, crc) in one call; `opening` = (path, chunk, job): open the stream
        first if the tier lacks it (`named`: the chunks to send first, None when not opened);
        `seen`: the file's size now (the tier's estimate of what is still to come); `urgent`:
        eval reads want these first (not behind the bulk). `ready`: the stream was published and
        these were its last missing chunks (or it was complete already): the tier made it the
        replica."""
    def publish(self, sid: str, gen: int, path: str, size: int, mtime_ns: int, crcs: list[int],
                record: str | None = None, chunks: Sequence[tuple[int, bytes, int]] = (),
                opening: tuple[str, int, str | None] | None = None) -> PublishAnswer:
        """Write `chunks` (offset, data, crc), then publish; `opening` = (path, chunk, job): open
        the stream first (it is new to the tier; `named` as for a put). One call."""
    def abort(self, sid: str) -> None: ...


@dataclass
class FileStream:
    sid: str
    path: str
    fd: int                      # the streamer's own dup of the staging fd
    chunk: int
    job: str | None = None
    gen: int = 0
    opened: bool = False         # the tier knows this generation (an `open` answered)
    sent: dict[int, int] = field(default_factory=dict)   # chunk -> CRC the tier holds
    version: tuple[int, int] | None = None             # (size, mtime_ns) once published
    record: str | None = None                          # the journal record of that publish
    final: list[int] | None = None                     # the final file's chunk CRCs
    state: str = "writing"       # writing | published | done | dropped
    errors: int = 0
    bytes_sent: int = 0
    inflight: dict[int, Future] = field(default_factory=dict)   # chunks handed to the send pool
    first: frozenset[int] = frozenset()   # chunks eval reads will want (the tier's open answers)
    last_size: int = -1          # the staging file's size at the last step, and how many steps
    still: int = 0               # in a row it has not changed (a named tail goes when it is still)
    closing: bool = False        # close the fd when the last chunk in flight lands
    announced: bool = False      # the tier knows the published version (it waits for the rest)
    tier_ready: bool = False     # a put's answer: the tier made this generation the replica
    waiting: bool = False        # (published) the last step left only chunks to land: the next is
                                 # worth taking when one lands (`Streamer.on_landed`), not before
    lock: threading.Lock = field(default_factory=threading.Lock)


def background_thread(nice: int) -> None:
    """Lower this thread's CPU priority to `nice` (Linux: per thread), never raise it: on a busy
    host the job's own writes and uploads run first and the stream waits, not the other way round."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(nice, os.getpriority(os.PRIO_PROCESS, 0)))
    except OSError:
        pass


class Streamer:
    def __init__(self, transport: Transport, chunk_bytes: int = 4 << 20, max_chunks_per_step: int = 256,
                 parallel: int = 1, link=None, call_bytes: int | None = None, first_by_reads: bool = False,
                 others_in_flight: int = 1, nice: int = 5, others_while_writing: bool = True):
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self.transport = transport
        self.chunk = chunk_bytes
        self.call_bytes = call_bytes or chunk_bytes
        self.max_chunks = max_chunks_per_step
        self.link = link            # LinkGate-like: open / acquire / close, or None
        self.first_by_reads = first_by_reads
        self._local = threading.local()   # per-thread read buffers (`_buffer`)
        self.others_in_flight = others_in_flight
        # False: while a file with named chunks is written only those go; the others wait for its
        # publish (the writer's CPU is not spent on bytes the next merge will not read)
        self.others_while_writing = others_while_writing
        self._busy_lock = threading.Lock()
        # checkpoint_family -> chunks the tier named at the last open of a file of that name
        self._named: OrderedDict[tuple[str, str], frozenset[int]] = OrderedDict()
        self._busy = {True: 0, False: 0}  # calls in flight: of named chunks (True), of others
        self.landings = 0           # calls landed so far (under _busy_lock)
        self.on_landed: Callable[[], None] | None = None   # after each call lands (the pump's wake)
        self.parallel = parallel
        self.pool = (ThreadPoolExecutor(parallel, thread_name_prefix="hintfs-stream-send",
                                        initializer=functools.partial(background_thread, nice))
                     if parallel > 1 else None)

    # -- the mount's hooks (each a cheap call: the work happens in `step`) ----------------------
    def start(self, path: str, fd: int, job: str | None = None) -> FileStream:
        fs = FileStream(f"{_HOST}-{os.getpid()}-{next(_ids)}", path, os.dup(fd), self.chunk, job)
        if self.first_by_reads:
            with self._busy_lock:
                fs.first = self._named.get(checkpoint_family(path), frozenset())
        return fs

    def _tier_named(self, fs: FileStream, gen: int, first: Sequence[int] | None) -> None:
        """The tier's answer to this stream's open: the chunks eval reads want first."""
        if first is None or not self.first_by_reads:
            return
        named = frozenset(first)
        with fs.lock:
            if fs.gen == gen:
                fs.first = named
        family = checkpoint_family(fs.path)
        with self._busy_lock:
            self._named[family] = named
            self._named.move_to_end(family)
            while len(self._named) > NAMED_FILES:
                self._named.popitem(last=False)

    def restart(self, fs: FileStream, fd: int | None = None) -> None:
        """The file was truncated or staged anew: a new generation (the tier forgets the old)."""
        if fd is not None:
            if fs.fd >= 0:                      # (a finished stream has closed its fd)
                os.close(fs.fd)
            fs.fd = os.dup(fd)
        fs.gen += 1
        fs.opened, fs.sent, fs.version, fs.final, fs.state = False, {}, None, None, "writing"
        fs.announced, fs.last_size, fs.still = False, -1, 0     # (`first` stays: the same file)
        fs.tier_ready = False

    def published(self, fs: FileStream, size: int, mtime_ns: int, record: str | None = None) -> None:
        """The store committed the file with these attributes (no writer can change it now)."""
        fs.version = (size, mtime_ns)
        fs.record = record
        fs.state = "published"

    def drop(self, fs: FileStream) -> None:
        """Unlinked or abandoned before publish: the tier must drop what it holds."""
        fs.state = "dropped"

    def idle(self, fs: FileStream) -> bool:
        """No chunk of this stream is in flight (its state may be changed)."""
        with fs.lock:
            return not fs.inflight

    def close(self, fs: FileStream) -> None:
        with fs.lock:
            if fs.inflight:
                fs.closing = True               # the last chunk to land closes it
                return
            fd, fs.fd = fs.fd, -1
        if fd >= 0:
            os.close(fd)

    # -- work -----------------------------------------------------------------------------------
    def step(self, fs: FileStream) -> bool:
        """One round of work; True when the stream is finished (done or dropped at the tier).
        A failed tier call is counted and left for the next step."""
        fs.waiting = False
        try:
            if fs.state == "dropped":
                self.transport.abort(fs.sid)
                self.close(fs)
                return True
            if fs.state == "done":
                return True
            if fs.state == "writing":
                size = os.fstat(fs.fd).st_size
                with fs.lock:
                    busy = dict.fromkeys(fs.inflight, -1)
                    known = {**fs.sent, **busy}
                only = fs.first if fs.first and not self.others_while_writing else None
                todo = ranges_to_send(size, fs.chunk, known, limit=self.max_chunks, only=only)
                fs.still, fs.last_size = (fs.still + 1, size) if size == fs.last_size else (0, size)
                tail = size // fs.chunk
                if (size % fs.chunk and tail in fs.first and tail not in known and fs.still >= QUIET_STEPS):
                    # A named partial tail of a file that stopped growing (DCP writes a file, then
                    # fsyncs and closes: the upload at close takes longer than the link needs for
                    # it). Should the file grow after all, its final CRC differs and it goes again.
                    todo.append(tail)
                if todo and not fs.opened and (fs.sent or fs.errors):
                    if busy:
                        return False            # let the chunks in flight land first
                    self._open(fs)             # after a failure: learn first what the tier kept
                # (a new stream opens with its chunks: no extra call)
                # While the file grows, chunks nobody named at its growing end wait for a call's
                # worth (`call_bytes`): a call costs the writer's host CPU of its own (its setup, a
                # thread's wake, the tier's answer), and a poll's new bytes are often a single
                # chunk. They go once the file stops growing for a poll, and at the publish.
                growing_end = size // fs.chunk - 1 if fs.still == 0 else None
                if self.pool is None:
                    self._send(fs, self._calls(fs, todo, growing_end=growing_end), size)
                else:
                    self._hand_to_pool(fs, todo, size, growing_end)
                return False
            assert fs.version is not None
            size = fs.version[0]
            if fs.final is None:
                fs.final = self._final_crcs(fs, size)
            if fs.tier_ready:
                return self._done(fs)
            if not fs.opened and fs.errors:
                self._reopen_published(fs)
                if fs.state == "done":
                    return True
            if not fs.announced and (fs.opened or not fs.errors):
                with fs.lock:
                    behind = len(fs.inflight) + len(ranges_to_send(size, fs.chunk, self._known(fs), fs.final))
                if behind > 1:
                    # Behind the writer at its publish. Chunks never sent leave now (named first,
                    # the others as the send pool's rule for them allows: `_send_rest`) and the
                    # publish goes beside them, without waiting for the chunks in flight: the tier
                    # knows the version at once (its copier and demand reads wait for this
                    # stream), and the put that brings the last missing chunk makes the replica
                    # (its answer: `ready`). A publish sent after them would cost a round trip more.
                    # A stream none of whose puts has landed yet (the writer outran the link) opens
                    # with its publish: else the publish would wait for all of them (seen: 0.4 s
                    # after the close, while the merge's reads of the file waited for it).
                    self._send_rest(fs, size)
                    with fs.lock:
                        acked = set(fs.sent)    # what the tier held before it answers
                    answer = self._publish(fs, opening=not fs.opened)
                    fs.announced = fs.opened = True
                    if answer.state != "fill":
                        return self._done(fs)
                    with fs.lock:
                        # Only a chunk acknowledged before the question is really missing (its
                        # bytes were not the published file's). One in flight then may have
                        # landed since: the answer predates it, and sending it again would cross
                        # the link twice.
                        for i in answer.fetch:
                            if i in acked and i not in fs.inflight:
                                fs.sent.pop(i, None)
            if fs.announced and fs.opened and self.pool is not None:
                # The rest goes as a written file's chunks do, step by step (the step never
                # waits): the next file's named chunks must not queue behind all of this one's.
                if fs.tier_ready:
                    return self._done(fs)
                with fs.lock:
                    pending = bool(fs.inflight)
                if self._send_rest(fs, size) or pending:
                    fs.waiting = True           # chunks in flight, or held back until some land
                    return False
                if fs.tier_ready:
                    return self._done(fs)
                # every chunk acknowledged, and no put answered ready: ask with the publish below
            if fs.first and fs.opened:
                # Named chunks still to send (the file's tail, never sent while it is written, or
                # chunks written last) go now, not behind the others in flight and the rest.
                with fs.lock:
                    named = [i for i in ranges_to_send(size, fs.chunk, fs.sent, fs.final)
                             if i in fs.first and i not in fs.inflight]
                self._send(fs, self._calls(fs, named), size)
            self._drain(fs)
            # A stream the tier has never heard of (nothing sent, no failure) opens inside the
            # publish call; one that failed before learns first what the tier kept.
            opening = False
            if not fs.opened:
                if fs.sent or fs.errors:
                    self._open(fs)
                else:
                    opening = True
            todo = ranges_to_send(size, fs.chunk, fs.sent, fs.final)
            last = todo[-1:]
            self._send(fs, self._calls(fs, todo[:-1]), size)
            inline = self._read_chunks(fs, last, size)
            answer = self._publish(fs, inline, opening)
            fs.opened = True
            for off, data, crc in inline:
                fs.sent[off // fs.chunk] = crc
                fs.bytes_sent += len(data)
            if answer.state == "fill":
                for i in answer.fetch:                 # the tier does not have these: send them again
                    fs.sent.pop(i, None)
                return False
            fs.state = "done"
            self.close(fs)
            return True
        except OSError as err:
            fs.errors += 1
            fs.opened = False                   # re-open next time: learn what the tier holds
            log.debug("stream %s of %s: %s (will retry)", fs.sid, fs.path, err)
            return False

    def _done(self, fs: FileStream) -> bool:
        """The tier has the published file: finished (once the calls still in flight landed, so
        that the counters are whole; the tier answers them at once)."""
        fs.state = "done"
        self._drain(fs)
        self.close(fs)
        return True

    @staticmethod
    def _known(fs: FileStream) -> dict[int, int]:
        """(under fs.lock, published) What the tier holds or will: the chunks acknowledged, and
        those in flight taken at their final CRC (checked when they land)."""
        assert fs.final is not None
        return {**fs.sent, **{i: fs.final[i] for i in fs.inflight if i < len(fs.final)}}

    def _send_rest(self, fs: FileStream, size: int) -> bool:
        """(published) Chunks never sent: sent now without a send pool, else handed to it by
        `_hand_to_pool`. Whether any were left to send (some may be held back)."""
        with fs.lock:
            todo = ranges_to_send(size, fs.chunk, self._known(fs), fs.final)
        if todo and self.pool is None:
            self._send(fs, self._calls(fs, todo), size)
        elif todo:
            self._hand_to_pool(fs, todo, size)
        return bool(todo)

    def _hand_to_pool(self, fs: FileStream, todo: list[int], size: int, growing_end: int | None = None) -> None:
        """`todo` to the send pool, named chunks first; while named chunks of any file are on
        their way, other chunks only up to `others_in_flight` calls in flight (the rest waits for
        a later step), so that named chunks never queue behind a file's bulk. `growing_end`: the
        file's last whole chunk while it grows (a short run of others ending there waits:
        `policy.stream.send_calls`)."""
        with self._busy_lock:
            yielding = self._busy[True] > 0 or not fs.first.isdisjoint(todo)
            others = max(0, self.others_in_flight - self._busy[False]) if yielding else None
        self._send_behind(fs, self._calls(fs, todo, others, growing_end), size)

    def _publish(self, fs: FileStream, chunks: Sequence[tuple[int, bytes, int]] = (),
                 opening: bool = False) -> PublishAnswer:
        """Publish `fs` at its version, with `chunks`; `opening`: the stream opens in the same
        call (it is new to the tier), and the chunks the tier names in its answer are learned as
        an open's are (they serve this file's next checkpoints too)."""
        assert fs.version is not None and fs.final is not None
        answer = self.transport.publish(fs.sid, fs.gen, fs.path, fs.version[0], fs.version[1], fs.final,
                                        fs.record, chunks, (fs.path, fs.chunk, fs.job) if opening else None)
        if opening:
            self._tier_named(fs, fs.gen, answer.named)
        return answer

    def _reopen_published(self, fs: FileStream) -> None:
        """After a failure, a published stream asks with its publish what the tier holds of that
        version: a put may have completed it (its answer lost), or it names what is missing.
        A tier that lost the stream (restarted without it) refuses: the stream opens again."""
        assert fs.version is not None and fs.final is not None
        try:
            answer = self._publish(fs)
        except OSError as err:
            if err.errno != errno.ESTALE:
                raise
            self._open(fs)
            return
        fs.opened = fs.announced = True
        if answer.state != "fill":
            self._done(fs)
            return
        missing = set(answer.fetch)
        with fs.lock:
            fs.sent = {i: crc for i, crc in enumerate(fs.final) if i not in missing}

    def _open(self, fs: FileStream) -> None:
        held, first = self.transport.open(fs.sid, fs.gen, fs.path, fs.chunk, fs.job)
        fs.sent, fs.opened = dict(held), True
        self._tier_named(fs, fs.gen, first)

    def _calls(self, fs: FileStream, chunks: list[int], others: int | None = None,
               growing_end: int | None = None) -> list[list[int]]:
        """`chunks` as calls, this stream's named ones first (`policy.stream.send_calls`)."""
        return send_calls(chunks, fs.first, fs.chunk, self.call_bytes, others, growing_end)

    def _read_chunks(self, fs: FileStream, chunks: list[int], size: int) -> list[tuple[int, bytes, int]]:
        out = []
        for i in chunks:
            off, n = chunk_span(i, size, fs.chunk)
            data = os.pread(fs.fd, n, off)
            if len(data) != n:
                raise OSError(5, f"{fs.path}: staging file shorter than its published size")
            out.append((off, data, chunk_crc(data)))
        return out

    def _send_one(self, fs: FileStream, call: list[int], size: int, tid,
                  gen: int | None = None, urgent: bool = False) -> list[tuple[int, int, int]]:
        """One call: consecutive chunks, read with one `pread`; (index, CRC, length) of each sent."""
        off = chunk_span(call[0], size, fs.chunk)[0]
        spans = [chunk_span(i, size, fs.chunk)[1] for i in call]
        if tid is not None:
            self.link.acquire(tid)
        if gen is not None and (gen != fs.gen or fs.fd < 0):
            return []                           # a newer generation, or given up
        view = self._buffer(sum(spans))
        if os.preadv(fs.fd, [view], off) != len(view):
            return []                           # truncated under us: the final CRCs will tell
        rows, sent, pos = [], [], 0
        for i, n in zip(call, spans):
            piece = view[pos:pos + n]
            crc = chunk_crc(piece)
            rows.append((off + pos, piece, crc))
            sent.append((i, crc, n))
            pos += n
        opening = None if fs.opened else (fs.path, fs.chunk, fs.job)
        sent_gen = gen if gen is not None else fs.gen
        answer = self.transport.put(fs.sid, sent_gen, rows, opening, seen=size, urgent=urgent)
        if opening is not None:
            self._tier_named(fs, sent_gen, answer.named)
        if answer.ready:
            with fs.lock:
                if fs.gen == sent_gen:
                    fs.tier_ready = True
        return sent

    def _link_transfer(self, fs: FileStream, calls: list[list[int]], size: int):
        """These calls as one transfer on the link gate (class eval), or None without a gate."""
        if self.link is None:
            return None
        return self.link.open(fs.path, "eval", transfer_weight(size),
                              [sum(chunk_span(i, size, fs.chunk)[1] for i in c) for c in calls], fs.job)

    @staticmethod
    def _acknowledged(fs: FileStream, i: int, crc: int, n: int) -> None:
        """The tier holds chunk `i` with this CRC (under fs.lock where chunks land concurrently)."""
        fs.sent[i] = crc
        fs.bytes_sent += n
        fs.opened = True

    def _send(self, fs: FileStream, calls: list[list[int]], size: int) -> None:
        if not calls:
            return
        tid = self._link_transfer(fs, calls, size)
        error: BaseException | None = None
        try:
            if self.pool is None or len(calls) == 1:
                results = []
                for call in calls:
                    try:
                        results.append(self._send_one(fs, call, size, tid, None, call[0] in fs.first))
                    except OSError as err:
                        error = err
                        break
            else:
                futures = [self.pool.submit(self._send_one, fs, call, size, tid, None, call[0] in fs.first)
                           for call in calls]
                wait(futures)
                results = [f.result() for f in futures if f.exception() is None]
                error = next((f.exception() for f in futures if f.exception() is not None), None)
            for sent in results:                # what the tier acknowledged counts, even on a failure
                for r in sent:
                    self._acknowledged(fs, *r)
            if error is not None:
                raise error
        finally:
            if tid is not None:
                self.link.close(tid)

    def _send_behind(self, fs: FileStream, calls: list[list[int]], size: int) -> None:
        """Hand `calls` to the send pool and return: each records itself when it lands."""
        if not calls:
            return
        assert self.pool is not None            # (only with a send pool)
        tid = self._link_transfer(fs, calls, size)
        left = [len(calls)]
        gen = fs.gen
        for call in calls:
            urgent = call[0] in fs.first
            with self._busy_lock:
                self._busy[urgent] += 1
            with fs.lock:
                fut = self.pool.submit(self._send_one, fs, call, size, tid, gen, urgent)
                for i in call:
                    fs.inflight[i] = fut
            fut.add_done_callback(functools.partial(self._landed, fs, call, gen, tid, left, urgent))

    def _landed(self, fs: FileStream, call: list[int], gen: int, tid, left: list, urgent: bool, fut: Future) -> None:
        err = fut.exception()
        with self._busy_lock:
            self._busy[urgent] -= 1
        with fs.lock:
            for i in call:
                fs.inflight.pop(i, None)
            left[0] -= 1
            last = left[0] == 0
            if fs.gen == gen:
                if err is None:
                    for r in fut.result():
                        self._acknowledged(fs, *r)
                else:
                    fs.errors += 1
                    fs.opened = False           # re-open next time: learn what the tier holds
                    log.debug("stream %s of %s: chunks %d-%d: %s (will retry)", fs.sid, fs.path, call[0], call[-1],
                              err)
            close_now = fs.closing and not fs.inflight
            if close_now:
                fd, fs.fd = fs.fd, -1
        if last and tid is not None:
            self.link.close(tid)
        if close_now and fd >= 0:
            os.close(fd)
        with self._busy_lock:
            self.landings += 1
        if self.on_landed is not None:
            self.on_landed()

    def _drain(self, fs: FileStream) -> None:
        with fs.lock:
            futures = list(fs.inflight.values())
        if futures:
            wait(futures)

    def warm(self, timeout_s: float = 1.0) -> None:
        """Start every thread of the send pool and give each its read buffer now, at the mount's
        start, not while the first checkpoint is written: the pool starts a thread only when
        calls first overlap, and a fresh buffer of `call_bytes` is megabytes of page faults (2-7
        ms for 4 MiB on the bench's VM, more under load), on the writer's CPU."""
        if self.pool is None:
            self._buffer(self.call_bytes)
            return
        meet = threading.Barrier(self.parallel, timeout=timeout_s)

        def hold_a_thread() -> None:
            self._buffer(self.call_bytes)
            try:
                meet.wait()               # each task keeps its thread until all have one
            except threading.BrokenBarrierError:
                pass                      # (a slow start: the rest start at the first calls)
        for _ in range(self.parallel):
            self.pool.submit(hold_a_thread)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def _final_crcs(self, fs: FileStream, size: int) -> list[int]:
        out = []
        for i in range(chunk_count(size, fs.chunk)):
            off, n = chunk_span(i, size, fs.chunk)
            view = self._buffer(n)
            got = os.preadv(fs.fd, [view], off)
            out.append(chunk_crc(view[:got]))
        return out

    def _buffer(self, n: int) -> memoryview:
        """This thread's read buffer, `n` bytes of it: a fresh `pread` result of megabytes is a
        new mapping whose pages the kernel faults in and zeroes every time (seen in `perf`)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < n:      # (the send pool's are made by `warm`)
            buf = self._local.buf = bytearray(max(n, self.call_bytes))
        return memoryview(buf)[:n]


__all__ = ["Streamer", "FileStream", "Transport", "PutAnswer", "PublishAnswer"]

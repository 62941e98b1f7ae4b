"""The filesystem's `StreamHooks` (fusefs/interfaces.py) for write-time streaming: what is streamed,
and where each streamed inode stands, decided here once; the sends are a sink's.

The filesystem calls the hooks from the trio loop; each only records what it learned and hands
the sink one command (the sink queues it, never waits on the link):

- `started(key, path, fd)`: a staging file was created or replaced for inode `key` (create, an
  open with O_TRUNC, a fresh copy after a publish): a new stream, or a new generation of it
  (`seq`, unique per start: a sink reports the `seq` it finished, so that a stream started again
  meanwhile is never forgotten).
- `published(key, path, st, record, final)`: the store committed the file. `final` when no other
  write handle is left (the close of the last writer): the sink publishes that version.
  Otherwise (fsync, a rename of an open file) the version is only remembered here: more writes
  may come.
- `released(key)`: the last writer is gone. A remembered version with no write since (an fsync,
  then a close with nothing new, as DCP does) is published now; a stream never published is
  dropped.
- `dropped(key)`: unlinked while open, or abandoned at unmount: the tier drops what it holds.
- `renamed(key, path, st, record)`: a published file got a new name (DCP renames `.metadata.tmp`
  to `.metadata`, the commit marker). A stream still being written follows the inode and
  publishes under the new name; otherwise a file of at most one chunk is read back from the store
  and streamed under its new name (one round trip), a larger one is left to the follower's copy.
  `will_stream_renamed` answers beforehand which of the two happens (the journal record says so).

A `Sink` does the sends: `fusefs.stream.threads.ThreadSink` in this process, or
`fusefs.stream.process.ProcessSink`, which forwards the commands to the sender child
(`fusefs.stream.sender`), where a `ThreadSink` runs them.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, Protocol
from collections.abc import Callable

from mountconfig.schema import StreamConfig
from hintfs.stores.base import Stat

log = logging.getLogger("hintfs.stream")

ReadStore = Callable[[str], tuple[bytes, Stat]]   # (path) -> (its bytes, its stat): a renamed small file


class Version(NamedTuple):
    """A published version of a streamed file, as the tier is told of it."""
    size: int
    mtime_ns: int
    record: str | None     # the journal record of that publish


class Counters(Protocol):
    """`fusefs.stats.Stats.add` (in the sender child: forwarded to the mount's)."""
    def add(self, counter: str, n: int = 1) -> None: ...


Finished = Callable[[int, int], None]    # (key, seq): the sink is done with the stream `start`ed so


class Sink(Protocol):
    """Where the sends run. Every command comes from one thread in order (`add_published` from
    the restream thread); none waits on the link."""
    @property
    def alive(self) -> bool:
        """False once streaming is off for this mount (the sender child kept dying)."""
    def start(self, key: int, seq: int, path: str, fd: int) -> None:
        """A new stream of `fd` (a staging file; the sink keeps its own dup), or a new generation."""
    def moved(self, key: int, path: str) -> None:
        """The file being written is now at `path` (its publish will name it)."""
    def publish(self, key: int, path: str, version: Version) -> None:
        """Published for good at `path` as `version`: only sending is left."""
    def drop(self, key: int) -> None:
        """Never to be published: the tier drops what it holds."""
    def add_published(self, path: str, fd: int, version: Version) -> None:
        """A published file's bytes at `fd` (a renamed file's copy; the sink keeps its own dup)."""
    def close(self, timeout_s: float) -> None:
        """At unmount: published streams get `timeout_s` to reach the tiers."""


def restreams(sc: StreamConfig, size: int) -> bool:
    """A published file renamed into a streamed prefix is sent again from the store: small ones."""
    return size <= sc.chunk_bytes


def renamed_copy(read_store: ReadStore, path: str, st: Stat) -> int | None:
    """A renamed file's bytes at version `st`, read back from the store, in a memory file (its
    stream's source; the caller closes it); None when the store no longer has that version."""
    try:
        data, now = read_store(path)
    except OSError as err:
        log.info("not streaming renamed %s: %s", path, err)
        return None
    if now.identity() != st.identity() or len(data) != st.size:
        return None                        # changed again meanwhile: its own publish will tell
    fd = os.memfd_create("hintfs-renamed", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass
class _Stream:
    """Where one streamed inode stands."""
    seq: int                              # its last start (`Sink.start`)
    path: str
    pending: Version | None = None     # an fsync's publish: more writes may come
    final: bool = False                   # published for good, or dropped: no more writes will come


class StreamFront:
    """`StreamHooks` over a `Sink`: the one place that decides what is streamed, when a stream is
    published or dropped, and what a rename does."""

    def __init__(self, sc: StreamConfig, make_sink: Callable[[Finished], Sink],
                 read_store: ReadStore | None = None):
        self.sc = sc
        self.prefixes = [p.rstrip("/") for p in sc.prefixes]
        self.read_store = read_store
        self.lock = threading.Lock()      # (a sink's lock may be held while taking it, never the reverse)
        self.live: dict[int, _Stream] = {}   # inode -> stream, until the sink is done with it
        self._seqs = itertools.count(1)
        self.restreamer = ThreadPoolExecutor(1, thread_name_prefix="hintfs-restream")
        self.sink = make_sink(self._finished)

    def _finished(self, key: int, seq: int) -> None:
        """(a sink's thread) Done with the stream of `key` started as `seq`."""
        with self.lock:
            s = self.live.get(key)
            if s is not None and s.seq == seq:      # (else started again since: a new stream of it)
                del self.live[key]

    # -- hooks (trio loop: record, hand the sink a command, return) -------------------------------
    def wants(self, path: str) -> bool:
        return self.sink.alive and any(path == p or path.startswith(p + "/") for p in self.prefixes)

    def started(self, key: int, path: str, fd: int) -> None:
        if not self.wants(path):
            return
        with self.lock:
            seq = next(self._seqs)
            self.live[key] = _Stream(seq, path)      # (truncated or staged anew: a new generation)
        self.sink.start(key, seq, path, fd)

    def published(self, key: int, path: str, st: Stat, record: str | None, final: bool) -> None:
        version = Version(st.size, st.mtime_ns, record)
        with self.lock:
            s = self.live.get(key)
            if s is None:
                return
            s.path = path
            if final:
                s.final, s.pending = True, None
            else:
                s.pending = version
        if final:
            self.sink.publish(key, path, version)
        else:
            self.sink.moved(key, path)

    def released(self, key: int) -> None:
        with self.lock:
            s = self.live.get(key)
            if s is None or s.final:
                return
            s.final, version, s.pending = True, s.pending, None
            path = s.path
        if version is not None:
            self.sink.publish(key, path, version)
        else:
            self.sink.drop(key)

    def dropped(self, key: int) -> None:
        with self.lock:
            s = self.live.get(key)
            if s is None:
                return
            s.final = True
        self.sink.drop(key)

    def _following(self, key: int | None) -> _Stream | None:
        """(under `lock`) The stream of the inode renamed when it is still written: it follows
        the inode (its publish names the new path)."""
        s = self.live.get(key) if key is not None else None
        return s if s is not None and not s.final else None

    def _restreams(self, size: int) -> bool:
        return self.read_store is not None and restreams(self.sc, size)

    def will_stream_renamed(self, key: int | None, path: str, size: int) -> bool:
        """A file renamed to `path` will reach the tiers by stream (see `renamed`)."""
        if not self.wants(path):
            return False
        with self.lock:
            if self._following(key) is not None:
                return True
        return self._restreams(size)

    def renamed(self, key: int | None, path: str, st: Stat, record: str | None) -> None:
        if not self.wants(path):
            return
        with self.lock:
            s = self._following(key)
            if s is not None:
                s.path = path
        if s is not None and key is not None:
            self.sink.moved(key, path)
        elif self._restreams(st.size):
            self.restreamer.submit(self._restream, path, st, record)

    def _restream(self, path: str, st: Stat, record: str | None) -> None:
        """(the restream thread) Stream a small published file from the store under its new name."""
        assert self.read_store is not None
        fd = renamed_copy(self.read_store, path, st)
        if fd is None:
            return
        try:
            self.sink.add_published(path, fd, Version(st.size, st.mtime_ns, record))
        finally:
            os.close(fd)                     # the sink keeps its own dup

    def close(self, timeout_s: float = 10.0) -> None:
        """At unmount, after the trio loop: published files get `timeout_s` to reach the tiers."""
        self.restreamer.shutdown(wait=False)
        self.sink.close(timeout_s)


__all__ = ["StreamFront", "Sink", "Version", "Counters", "Finished", "ReadStore", "restreams", "renamed_copy"]

"""The agent's copies: a file copied here from the store or from a trusted peer agent (tree
fan-out), ranged reads many in flight, checked before and after, resumed after a cut, and made a
replica in the catalog (docs/cross_dc.md, "Copies"; docs/restart_storm.md).

A copy that a write-time stream will make needless waits for that stream first
(`wait_for_stream`): its publish makes the replica without a second copy across the link.
"""
from __future__ import annotations

import errno
import logging
import os
import stat as stat_mod
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable

from hintfs.agent.catalog import Catalog, Replica
from hintfs.agent.client import AgentClient
from hintfs.agent.demand import ReadHints
from hintfs.agent.linkgate import LinkGate
from hintfs.agent.persist import CutCopy, Progress, descriptions
from hintfs.common.refusals import RefusalLog
from hintfs.agent.rpc import ReplicateReply, rpc_error
from hintfs.agent.streams import StreamTier
from hintfs.agent.tier import STREAM_QUIET_S, Arrivals, CopyInFlight
from hintfs.common.clock import SYSTEM_CLOCK, Clock
from hintfs.common.errors import HintfsError
from hintfs.common.journal import later_by_same_writer, streamed_record
from policy.link import transfer_weight
from hintfs.stores.base import Stat, Store

log = logging.getLogger("hintfs.agent")
CHUNK = 8 << 20                # a copy's ranged reads (from a peer, or the store without a link gate)
PEER_TIMEOUT_S = 30.0          # a peer's read may take at least this long ...
PEER_MIN_RATE = 16 << 10       # ... or as long as the copy's bytes in flight take at this rate (bytes/s)
STREAM_PUBLISH_WAIT_S = 5.0    # a replicate waits this long for an unpublished stream's publish,
STREAM_ALIVE_WAIT_S = 30.0     # ... up to this long while the stream is alive (a call within STREAM_QUIET_S)
Version = tuple[int, int]


def peer_timeout_s(size: int, chunk: int, parallel: int) -> float:
    """The deadline of one ranged read from a peer agent: PEER_TIMEOUT_S, or the time the copy's
    reads in flight (up to `parallel` chunks) take at PEER_MIN_RATE, whichever is longer. A data
    node with a slow NIC or a busy token bucket shares it between a tree fan-out's copy and its
    readers: at 0.25 MiB/s per agent, a 3.9 MB copy ran past a fixed 30 s in bench/scale_storm.py
    and the replica was missing (the mount hinted again); at 0.125 MiB/s, with a source serving
    several fan-outs at once, a 1.2 MB copy ran past 30 s too (hence 16 KiB/s, not 64)."""
    in_flight = min(size, max(1, parallel) * chunk)
    return max(PEER_TIMEOUT_S, in_flight / PEER_MIN_RATE)


class Copier:
    """`replicate` is the one way a file is copied here. `peers`: the agents a copy may name as
    its source (`[agents] locations`), sent `token`, their TLS certificates checked against
    `tls_root` (`[agents] tls_root_file`; None: the system's roots); `link`: the gate copies from
    the store wait at, each `link_chunk_bytes`; `stream_idle_s`: the longest wait for a stream."""

    def __init__(self, store: Store, catalog: Catalog, arrivals: Arrivals, streams: StreamTier, hints: ReadHints, *,
                 peers: list[str], token: str | None, link: LinkGate | None, link_chunk_bytes: int,
                 stream_idle_s: float, refusals: RefusalLog, clock: Clock = SYSTEM_CLOCK,
                 tls_root: bytes | None = None) -> None:
        self.store = store
        self.catalog = catalog
        self.arrivals = arrivals
        self.streams = streams
        self.hints = hints
        self.peers = peers
        self.token = token
        self.tls_root = tls_root
        self.link = link
        self.link_chunk_bytes = link_chunk_bytes
        self.stream_idle_s = stream_idle_s
        self.refusals = refusals
        self.clock = clock
        self.cut: dict[str, CutCopy] = {}   # interrupted copies: version, ranges done (under the lock)
        self.copies = 0                # copies made (from the store or a peer), for status
        self.resumed_ranges = 0
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def replicate(self, path: str, ttl_s: float, source: str | None, parallel: int = 16,
                  priority: str = "background", job: str | None = None, importance: float = 1.0,
                  expect: Version | None = None, record: str | None = None,
                  trusted: bool = True) -> ReplicateReply:
        """Copy `path` here (from the store, or from the agent at `source`) and keep it `ttl_s`.

        The copy is `parallel` ranged reads of 8 MiB in flight, enough to fill the bandwidth-delay
        product of a long link; one copy per path at a time (a second caller waits for the first).
        The source's size and mtime are checked before and after: a file that changed during the
        copy is not kept (EAGAIN). `expect` = (size, mtime_ns) of the version to copy (from a
        journal record) saves the first check: one round trip less per file on a long link.
        A replica of another version than `expect` is replaced. `record`: the journal record
        that announced this version. Every close writes a record of its own, so a replica copied
        for another record is replaced even if size and mtime match: that is a rewrite within
        the mtime's precision (one second on S3), which size + mtime alone cannot see.

        `trusted` False (a caller over the network): `expect` and `record` are that caller's
        word, not the store's. The record is ignored, and `expect` is checked against the
        store's own stat before anything is copied (ESTALE when it differs), never taken as the
        version the replica holds.
        """
        if source:
            source = self._peer(source)   # before anything is evicted or reserved for the copy
        if not trusted:
            record = None
            if expect is not None:
                st = self.store.stat(path)
                if st.identity() != tuple(expect):
                    raise HintfsError(errno.ESTALE, f"{path}: the store has version {st.identity()}, "
                                                    f"not {tuple(expect)}")
        # A training mount is streaming this file here: its publish makes the replica, without a
        # second copy across the link (docs/cross_dc.md, "The commit marker").
        self.wait_for_stream(path, expect, streamed_record(record))
        while True:
            with self.catalog.lock:
                rep = self.catalog.replicas.get(path)
                # the same write, or a later one of the same writer (fsync, then close: two records
                # of one version; the later replica is what a copy would fetch now)
                same_write = (record is None or rep is None or rep.record in (None, record)
                              or later_by_same_writer(rep.record, record))
                if rep is not None and same_write and (expect is None or rep.version == tuple(expect)):
                    if record is not None and rep.record is None:
                        rep.record = record   # copied before its record was seen: the same write
                    self.catalog.renew(rep, ttl_s)
                    return ReplicateReply(path=path, size=rep.size, already=True)
                if rep is not None and expect is not None and rep.source_mtime_ns > int(expect[1]):
                    # A newer version is here already (its stream or copy came first): an older
                    # journal record never replaces it.
                    return ReplicateReply(path=path, size=rep.size, already=True, newer=True)
                busy = self.arrivals.copying.get(path)
                if busy is None:
                    self.arrivals.copying[path] = threading.Event()
                    break
            busy.wait()
        try:
            if rep is not None:
                self.catalog.drop(path)    # an older version: the new one replaces it
            return self._copy_in(path, ttl_s, source, parallel, priority, job, importance, expect, record)
        finally:
            self.arrivals.release(path)

    def _copy_in(self, path: str, ttl_s: float, source: str | None, parallel: int,
                 priority: str = "background", job: str | None = None, importance: float = 1.0,
                 expect: Version | None = None, record: str | None = None) -> ReplicateReply:
        if expect is not None and not source:
            st = Stat(stat_mod.S_IFREG | 0o644, int(expect[0]), int(expect[1]), int(expect[1]))
        else:
            st = self.store.stat(path)
        with self.catalog.lock:
            self.arrivals.copying_version[path] = (st.size, st.mtime_ns)
        self.hints.announce(path, (st.size, st.mtime_ns), open_reader=False)
        self.catalog.make_room(path, st.size)
        tmp = self.catalog.local_name(path) + ".part"
        read: Callable[[int, int], bytes]
        src: AgentClient | None = None
        chunk = self.link_chunk_bytes if self.link is not None and not source else CHUNK
        if source:
            src = AgentClient(source, token=self.token, tls_root=self.tls_root,
                              timeout_s=peer_timeout_s(st.size, chunk, parallel))
            peer = src
            read = lambda off, n: peer.read(path, off, n, replica_only=True)  # noqa: E731
        else:
            open_data = getattr(self.store, "open_data", None)   # a reader without its own stat
            reader = open_data(path) if open_data is not None else self.store.open_reader(path)[0]
            read = reader.read
        ranges = [(off, min(chunk, st.size - off)) for off in range(0, st.size, chunk)]
        # One ranged GET returns one version whole: asking for a byte more than expected shows a
        # grown file, and a same-size rewrite journals a record of its own (copied again then).
        single = expect is not None and not source and len(ranges) <= 1
        if single:
            ranges = [(0, st.size + 1)]
        # A copy of this very version that was cut (the link dropped) resumes at the ranges it
        # had not finished; the `.part` file is never served either way.
        cut = self.cut.pop(path, None)
        done: dict[int, int] = {}
        if (cut is not None and cut.version == st.identity() and cut.chunk == chunk
                and not single and os.path.exists(tmp)):
            done = cut.done
            fd = os.open(tmp, os.O_RDWR | os.O_CLOEXEC)
            log.info("resuming the copy of %s: %d of %d ranges already here", path, len(done), len(ranges))
        else:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        resumed = len(done)
        with self.catalog.lock:   # demand reads may read its finished ranges (`TierView.held_bytes`)
            self.arrivals.copy_reads[path] = CopyInFlight(st.identity(), fd, done, st.size + 1 if single else chunk)
        ranges = [r for r in ranges if r[0] not in done]
        # A persistent agent also keeps the progress on disk (`.part.progress`, after an
        # fdatasync of the ranges it lists), so a copy cut by a crash resumes after a restart.
        progress = (Progress(tmp, path, st.identity(), chunk, fd, self.clock)
                    if self.catalog.persistent and not single else None)
        tid = None
        link = self.link
        if link is not None and not source and ranges:
            # Copies from the store cross the shared link: each chunk waits for its turn.
            tid = link.open(path, priority, transfer_weight(st.size, importance), [n for _o, n in ranges], job)
        try:
            def copy(rng: tuple[int, int]) -> int:
                if tid is not None and link is not None:
                    link.acquire(tid)
                data = read(*rng)
                os.pwrite(fd, data, rng[0])
                with self.catalog.lock:
                    done[rng[0]] = len(data)
                    snapshot = dict(done) if progress is not None and progress.due() else None
                if snapshot is not None and progress is not None:
                    progress.save(snapshot)
                self.arrivals.notify()   # a demand read may be waiting for this range
                return len(data)

            try:
                if len(ranges) > 1 and parallel > 1:
                    with ThreadPoolExecutor(min(parallel, len(ranges))) as pool:
                        list(pool.map(copy, ranges))
                else:
                    list(map(copy, ranges))
            except BaseException:
                if not single:
                    with self.catalog.lock:
                        self.cut[path] = CutCopy(st.identity(), chunk, done)
                        snapshot = dict(done)
                    if progress is not None:
                        progress.save(snapshot, force=True)
                raise
            copied = sum(done.values())
        finally:
            with self.catalog.lock:
                if self.arrivals.copy_reads.get(path) is not None and self.arrivals.copy_reads[path].fd == fd:
                    del self.arrivals.copy_reads[path]
                os.close(fd)
            if tid is not None and link is not None:
                link.close(tid)
            if src is not None:
                src.close()
            else:
                reader.close()
        if progress is not None:
            progress.remove()
        after = st if single else self.store.stat(path)
        if copied != st.size or after.identity() != st.identity():
            os.unlink(tmp)
            raise rpc_error(errno.EAGAIN, f"{path} changed or was short during the copy")
        rep = self.catalog.replica_from(tmp, path, st.size, st.mtime_ns, ttl_s, record)
        kept = self.catalog.add_unless_removed(rep)
        with self.catalog.lock:
            self.resumed_ranges += resumed
            self.copies += 1
        if not kept:
            log.info("copy of %s not kept: the store removed it since", path)
            return ReplicateReply(path=path, size=st.size, already=False, removed=True)
        log.info("replica of %s ready (%d bytes, ttl %.0fs, from %s)", path, st.size, ttl_s, source or "store")
        return ReplicateReply(path=path, size=st.size, already=False)

    def _peer(self, source: str) -> str:
        """A copy's `source` must be one of the agents this agent's config trusts, `[agents]
        locations`: bytes at a tier come only from sources the tier trusts (a copy from a source
        is not checked byte by byte against the store: only its size and mtime are). So never an
        address a caller names freely (before, with no `[agents] locations`, any grpc:// address:
        another user's Flight server answered the copy's reads with other bytes, and eval mounts
        served them), never a unix socket (a mount's private agent), and this agent's token goes
        only where its operator configured. With none configured, no copy names a source."""
        if not source.startswith(("grpc://", "grpc+tcp://", "grpc+tls://")):
            why, code = "only grpc:// or grpc+tls:// agents", errno.EINVAL
        elif not self.peers:
            why, code = "this agent trusts no other agent ([agents] locations is empty)", errno.EACCES
        elif source not in self.peers:
            why, code = "it is not one of [agents] locations", errno.EACCES
        else:
            return source
        since = self.refusals.note("source")
        if since is not None:
            log.warning("replicate from source %.200r refused: %s%s", source, why, RefusalLog.more(since))
        raise HintfsError(code, f"source {source!r}: {why}")

    def wait_for_stream(self, path: str, expect: Version | None, announced: bool = False) -> None:
        """Wait while a stream may bring this version of `path` instead of a copy:

        - a published stream still filling, of version `expect`, a newer one (it supersedes the
          record: a file published at fsync and again at close), or any when None;
        - an unpublished one for `STREAM_PUBLISH_WAIT_S` (its publish may be in flight), longer
          while it is alive (a call within `STREAM_QUIET_S`), at most `STREAM_ALIVE_WAIT_S`
          (it may be a newer write);
        - none yet, when `expect` is known and other files of its folder are being streamed: a
          stream that runs a file behind the writer opens the next file's stream only after the
          journal record of that file is out, and a small file (the commit marker) opens its
          stream in the call that publishes it. Waited for while the folder's streams are alive;
        - a finished stream whose part is on its way into the catalog (`being_handed_over`, at
          most `HANDOVER_S`): it left the streams' table before it is the replica, and a fetch
          that looked then found neither and copied the file a second time;
        - none yet, when the journal record says its writer streams the file (`announced`), for
          `STREAM_PUBLISH_WAIT_S`: the record can overtake the stream's first call (the first
          file of a folder, on a loaded host).

        All bounded by `stream_idle_s`. While it waits with `expect`, the tier answers `copying`
        at that version (the journal says the store has it), so eval reads are served on demand."""
        start = self.clock.monotonic()
        prepared = False
        announce = expect is not None   # the caller knows the store's version (journal record)
        if expect is None:   # (an eval's fetch on read) the version a follower's copy waits for
            with self.catalog.lock:
                expect = self.arrivals.awaiting.get(path)
        if announce and expect is not None:
            with self.catalog.lock:
                self.arrivals.awaiting[path] = (int(expect[0]), int(expect[1]))
        try:
            while not self._stop.is_set():
                waited = self.clock.monotonic() - start
                if waited > self.stream_idle_s:
                    return
                st = self.streams.state_of(path)
                if st is None and self.streams.being_handed_over(path) is not None:
                    pass   # finished, its part not yet the replica: a copy now would be a second one
                elif st is None:
                    if expect is None or self.catalog.has(path, *expect):
                        return
                    if (self.streams.folder_quiet_s(path) > STREAM_QUIET_S
                            and not (announced and waited < STREAM_PUBLISH_WAIT_S)):
                        return
                elif st[0] == "streaming":
                    if waited > STREAM_ALIVE_WAIT_S or (waited > STREAM_PUBLISH_WAIT_S
                                                        and self.streams.quiet_s(path) > STREAM_QUIET_S):
                        return
                elif expect is not None and st[1] is not None and st[1][1] < int(expect[1]):
                    return   # an older version is filling: copy the one journaled
                if expect is not None and not prepared:
                    self.hints.announce(path, (int(expect[0]), int(expect[1])))   # eval reads may come meanwhile
                    prepared = True
                with self.arrivals.changed:
                    self.arrivals.changed.wait(0.02)
        finally:
            if announce and expect is not None:
                with self.catalog.lock:
                    if self.arrivals.awaiting.get(path) == (int(expect[0]), int(expect[1])):
                        del self.arrivals.awaiting[path]

    def adopt(self, folder: str) -> int:
        """Copies cut by the stop (or crash) of the agent that owned `folder`: their `.part` file
        and its progress move here, and the next copy of the same version resumes from them."""
        n = 0
        for name, data, doc in descriptions(folder, ".part.progress"):
            part = data + ".part"
            try:
                path, cut = Progress.read(doc)
                if path in self.catalog.replicas or path in self.cut or os.path.getsize(part) > cut.version[0]:
                    continue
                os.rename(part, self.catalog.local_name(path) + ".part")
                self.cut[path] = cut
                n += 1
                log.info("adopted a cut copy of %s: %d ranges already here", path, len(cut.done))
            except (OSError, ValueError, KeyError, AttributeError) as err:
                log.warning("not adopting the cut copy %s from %s: %s", name, folder, err)
        return n


__all__ = ["Copier", "Replica"]

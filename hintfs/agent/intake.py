"""The eval tier's write-time stream actions (docs/cross_dc.md, "Write-time streaming"): a
training mount opens, fills (`do_put`), publishes or aborts the stream of each file it writes;
the stream tier (hintfs/agent/streams.py) holds it apart; once its version is confirmed by the store's
word (hintfs/agent/versions.py) and every chunk is verified, it becomes the replica in the catalog as a
finished copy would.
"""
from __future__ import annotations

import errno
import logging
import os
from typing import cast
from collections.abc import Iterable

from hintfs.agent import rpc
from hintfs.agent.catalog import Catalog
from hintfs.agent.demand import ReadHints
from hintfs.agent.readmemory import ReadMemory
from hintfs.common.refusals import RefusalLog
from hintfs.agent.rpc import (PublishState, StreamAbortReply, StreamOpenReply, StreamOpenRequest, StreamPublishReply,
                       StreamPublishRequest, StreamPutReply, StreamPutRequest, rpc_error)
from hintfs.agent.streams import ANYONE, StreamError, StreamFinished, StreamRefused, StreamTier
from hintfs.agent.tier import Arrivals
from hintfs.agent.versions import VersionCheck
from hintfs.common.clock import SYSTEM_CLOCK, Clock
from policy.stream import Sender, chunks_touching
from hintfs.stores.base import Store

log = logging.getLogger("hintfs.agent")
MAX_FIRST = 1 << 16   # chunks a stream's open names to send first (a bounded answer)
Version = tuple[int, int]


class StreamIntake:
    """`prefixes`: where streams are taken (`[agent] stream_prefixes`, else `[follow] prefixes`);
    `journal_dir`: the journal whose records confirm versions (None: a stat of the store does);
    `record_wait_s`, `verify_poll_s`: `VersionCheck`'s."""

    def __init__(self, store: Store, streams: StreamTier, catalog: Catalog, arrivals: Arrivals, hints: ReadHints,
                 memory: ReadMemory, *, prefixes: list[str], journal_dir: str | None, record_wait_s: float,
                 verify_poll_s: float, refusals: RefusalLog, clock: Clock = SYSTEM_CLOCK) -> None:
        self.streams = streams
        self.catalog = catalog
        self.arrivals = arrivals
        self.hints = hints
        self.memory = memory
        self.prefixes = prefixes
        self.refusals = refusals
        self.published = 0              # streams made replicas
        self.first_chunks = 0           # chunks named to send first at stream opens (ReadMemory)
        self.packed_chunks = 0          # chunks that came compressed, and the bytes that saved
        self.bytes_saved = 0
        # A stream's version is served only once the store's word confirms it (VersionCheck):
        # the journal the follower reads, or a batched stat.
        self.versions = VersionCheck(store, clock.monotonic, self._version_confirmed, self._version_refused,
                                     streams.unconfirmed, journal_dir, record_wait_s, verify_poll_s,
                                     wall_ns=clock.time_ns, start=bool(prefixes))

    def close(self) -> None:
        self.versions.close()

    def _check_path(self, path: str) -> None:
        """A stream makes the replica eval mounts read: only strictly below the prefixes this
        tier takes streams for (`[agent] stream_prefixes`, else `[follow] prefixes`). A stream at a
        prefix itself would make the routed folder a file at the tier (ENOTDIR for its files)."""
        if not any(path.startswith(p.rstrip("/") + "/") for p in self.prefixes):
            at = any(path == p.rstrip("/") for p in self.prefixes)
            since = self.refusals.note("stream path")
            if since is not None:
                log.warning("stream of %.300s refused: %s%s", path,
                            "it is a stream prefix itself" if at else "not under [agent] stream_prefixes",
                            RefusalLog.more(since))
            raise rpc_error(errno.EACCES, f"{path}: this tier takes no streams there (only below "
                                          "[agent] stream_prefixes, else [follow] prefixes)")

    def open(self, req: StreamOpenRequest, sender: Sender = ANYONE) -> StreamOpenReply:
        self._check_path(req.path)
        try:
            held = self.streams.open(req.stream, req.gen, req.path, req.chunk, req.job, sender)
        except StreamRefused as err:
            raise rpc_error(err.errno, str(err)) from None
        except StreamError as err:
            raise rpc_error(errno.ESTALE, str(err)) from None
        # The chunks eval jobs read of this file's previous checkpoint: the sender sends them first.
        first = chunks_touching(self.memory.predict(req.path), req.chunk, MAX_FIRST)
        if first:
            log.debug("stream %s of %s: %d chunks of %d bytes first, by eval reads of the last checkpoint",
                      req.stream, req.path, len(first), req.chunk)
            with self.catalog.lock:
                self.first_chunks += len(first)
        return StreamOpenReply(held=sorted(held.items()), first=first)

    def put(self, req: StreamPutRequest, reader: Iterable, sender: Sender = ANYONE) -> StreamPutReply:
        """One `do_put`: open the stream if asked, write its chunks, publish if asked. A put that
        completes a stream published (and confirmed) already makes it the replica, and answers
        "ready"."""
        opened: StreamOpenReply | None = None
        if req.open is not None:
            if (req.open.stream, req.open.gen) != (req.stream, req.gen):
                raise rpc_error(errno.EINVAL, "open names another stream or generation")
            opened = self.open(req.open, sender)

        def reply(state: PublishState | None, fetch: list[int] | None = None,
                  pending: bool | None = None) -> StreamPutReply:
            """The open's answer (when it opened), then the chunks' and the publish's."""
            return StreamPutReply(held=opened.held if opened is not None else None,
                                  first=opened.first if opened is not None else None,
                                  state=state, fetch=fetch, pending=pending)
        complete = False
        try:
            if req.seen is not None:   # before the chunks land: known as soon as the call starts
                self.streams.saw(req.stream, req.gen, req.seen, sender)
            for batch in reader:
                data = batch.data
                offsets = data.column("offset").to_pylist()
                crcs = data.column("crc").to_pylist()
                chunks = data.column("data")
                raw_sizes = data.column("raw_size").to_pylist() if req.compress else [None] * len(offsets)
                for i, (off, crc, raw_size) in enumerate(zip(offsets, crcs, raw_sizes)):
                    # A view of Arrow's buffer, not a copy: `as_py()` copied each chunk (4 MiB)
                    # holding the GIL, the agent's largest CPU cost while receiving streams.
                    view: memoryview | bytes = memoryview(chunks[i].as_buffer())
                    wire = len(view)
                    if raw_size is not None:   # inflated to at most the stream's chunk, exactly
                        limit = self.streams.chunk_bytes(req.stream, req.gen, sender)
                        try:
                            view = rpc.unpack_range(view, raw_size, limit)
                        except OSError as err:
                            raise StreamError(f"stream {req.stream}: chunk at {off}: {err.strerror}") from None
                    complete |= self.streams.put(req.stream, req.gen, int(off), view, int(crc), sender)
                    if raw_size is not None:
                        with self.catalog.lock:
                            self.packed_chunks += 1
                            self.bytes_saved += raw_size - wire
                self.arrivals.notify()   # demand reads may be waiting for these chunks
        except StreamFinished:
            for _ in reader:          # the rest of the call's chunks: the tier holds them
                pass
            return reply("ready")
        except StreamRefused as err:
            raise rpc_error(err.errno, str(err)) from None
        except StreamError as err:
            raise rpc_error(errno.ESTALE, str(err)) from None
        except (KeyError, TypeError, ValueError) as err:
            raise rpc_error(errno.EINVAL, f"stream chunks: {err}") from None
        state: PublishState | None = "ready" if complete and self._finish_stream(req.stream, req.gen) else None
        if req.publish is None:
            return reply(state)
        if (req.publish.stream, req.publish.gen) != (req.stream, req.gen):
            raise rpc_error(errno.EINVAL, "publish names another stream or generation")
        published = self.publish(req.publish, sender)
        return reply(published.state, published.fetch, published.pending)

    def _finish_stream(self, sid: str, gen: int) -> bool:
        """A published stream completed by its last chunks: made the replica of its version."""
        done = self.streams.finish_if_complete(sid, gen)
        if done is None:
            return False
        path, (size, mtime_ns), (record, ttl_s), part = done
        try:
            self._adopt_stream(path, part, size, mtime_ns, record, ttl_s)
        finally:
            self.streams.handed_over(path)
            self.arrivals.notify()
        return True

    def publish(self, req: StreamPublishRequest, sender: Sender = ANYONE) -> StreamPublishReply:
        """The training mount published the streamed file as (size, mtime_ns): a stream holding
        exactly those bytes (CRC of every chunk) becomes the replica of that version once the
        store's word confirms the version (a journal record, else a batched stat: `VersionCheck`;
        the sender's word is not enough: docs/cross_dc.md, "Versions the store has"). Otherwise
        the sender is told which chunks to send again (the put that brings the last of them makes
        the replica). A complete stream waiting for its confirmation answers "ready" with
        `"pending": true`: the sender has nothing more to send."""
        self._check_path(req.path)
        version = (req.size, req.mtime_ns)
        known, record = self.versions.record_of(req.path, version)
        rep = self.catalog.get(req.path)
        replica_version = rep.version if rep is not None else None
        try:
            # The replica remembers the journal's record of its version, never the sender's.
            v, part = self.streams.publish(req.stream, req.gen, req.path, req.size, req.mtime_ns,
                                           req.crcs, replica_version, meta=(record, req.ttl_s), sender=sender,
                                           confirmed=known)
        except StreamRefused as err:
            raise rpc_error(err.errno, str(err)) from None
        except StreamError as err:
            raise rpc_error(errno.ESTALE, str(err)) from None
        except ValueError as err:
            raise rpc_error(errno.EINVAL, str(err)) from None
        self.versions.published()   # (an unconfirmed one is confirmed or refused by its thread)
        if known and v.state == "fill":   # eval reads may come before the last chunks: open the store file now
            self.hints.announce(req.path, version)
        try:
            if part is not None:
                self._adopt_stream(req.path, part, req.size, req.mtime_ns, record, req.ttl_s)
        finally:
            if part is not None:
                self.streams.handed_over(req.path)
            self.arrivals.notify()
        return StreamPublishReply(state=cast(PublishState, v.state), fetch=list(v.fetch),
                                  pending=True if not known and v.state != "stale" else None)

    def _version_confirmed(self, path: str, version: Version, record: str | None) -> None:
        """(VersionCheck) The store has `version` of `path`: its streams are confirmed; each one
        complete becomes the replica now, one still filling may be read on demand."""
        done = self.streams.confirm(path, version, lambda meta: (record, meta[1] if meta else 86400.0))
        for p, (size, mtime_ns), (rec, ttl_s), part in done:
            try:
                self._adopt_stream(p, part, size, mtime_ns, rec, ttl_s)
            except Exception as err:   # the follower copies the file
                log.warning("stream of %s not made a replica: %s", p, err)
            finally:
                self.streams.handed_over(p)
        if not done and self.streams.state_of(path) == ("filling", tuple(version)):
            self.hints.announce(path, (version[0], version[1]))
        self.arrivals.notify()

    def _version_refused(self, path: str, version: Version, why: str) -> None:
        """(VersionCheck) The store does not have `version` of `path`: its streams go."""
        if self.streams.refuse(path, version, why):
            self.arrivals.notify()

    def _adopt_stream(self, path: str, part: str, size: int, mtime_ns: int, record: str | None,
                      ttl_s: float) -> None:
        """A verified stream becomes the replica of (size, mtime_ns), as a finished copy would."""
        with self.arrivals.claim(path):
            try:
                self.catalog.make_room(path, size)
            except BaseException:
                os.unlink(part)
                raise
            self.catalog.drop(path)
            rep = self.catalog.replica_from(part, path, size, mtime_ns, ttl_s, record)
            kept = self.catalog.add_unless_removed(rep)
            with self.catalog.lock:
                self.published += 1
            if not kept:
                log.info("stream of %s not kept: the store removed it since", path)
            else:
                log.info("replica of %s ready from its write-time stream (%d bytes)", path, size)

    def abort(self, sid: str, sender: Sender = ANYONE) -> StreamAbortReply:
        try:
            gone = self.streams.abort(sid, sender)
        except StreamRefused as err:
            raise rpc_error(err.errno, str(err)) from None
        self.arrivals.notify()
        return StreamAbortReply(dropped=gone)

    def expire(self) -> None:
        """(the reclaim loop) Streams idle past `stream_idle_s` go; the progress of the others is saved."""
        if self.streams.expire():
            self.arrivals.notify()
        self.streams.save_due()

    def status(self) -> dict:
        limits = self.streams.limits
        return {"open": len(self.streams.streams), "published": self.published,
                "bytes_held": self.streams.bytes_held(), "bytes_counted": self.catalog.replicas.reserved_bytes,
                "first_chunks": self.first_chunks,
                "packed_chunks": self.packed_chunks, "bytes_saved": self.bytes_saved,
                "files_read_remembered": len(self.memory),
                "unconfirmed": len(self.streams.unconfirmed()),
                "by_sender": {k: {"open": u.open, "bytes": u.bytes, "refused": u.refused}
                              for k, u in self.streams.usage().items()},
                "limits": {"open": limits.max_streams, "per_peer": limits.per_peer,
                           "per_token": limits.per_token, "peer_bytes": limits.peer_bytes},
                "versions": self.versions.status()}


__all__ = ["StreamIntake", "MAX_FIRST"]

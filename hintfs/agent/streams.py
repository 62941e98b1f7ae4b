"""The eval tier's side of write-time streaming (docs/cross_dc.md, "Write-time streaming"):
the streams a training mount sends while it writes, held apart from replicas until published.

`hintfs.agent.intake.StreamIntake` calls it for the `stream_open` and `stream_publish` actions, for
`do_put` (chunks, with an optional open before and publish after: one round trip for a small
file) and for `stream_abort`; it moves a verified part into the replica catalog. A stream's
record, its errors and what each sender may hold: hintfs/agent/streamparts.py; what the streams tell
readers (state, verified bytes, backlog): hintfs/agent/streamreads.py.

- Each stream is `<id>.part` (bytes at their offsets) and, when `persistent`, a
  `<id>.part.progress` JSON (generation, path, job, the chunks held with their CRCs), written
  after an `fdatasync` of the part, at most every `progress_every_s` and at publish: a restarted
  agent adopts both and the sender re-sends only what is not listed.
- A stream's bytes are never readable through the tier before `publish` says "ready": the tier
  serves replicas only, and a stream becomes one only by `publish` handing its finished part to
  the caller (who renames it into the replica catalog).
- A new generation (the writer truncated, or the file was rewritten) forgets the older one's
  chunks. Streams with no call for `idle_s` are dropped (`expire`): that is how the stream of a
  training mount that died before publishing goes away.

Bounds (issue 34; docs/cross_dc.md, "What one sender may hold"): each stream belongs to the
`Sender` (token, peer host) that opened it, and only that sender may call it. A new stream is
refused (EAGAIN) past `StreamLimits` (in total, per peer, per token: each stream holds a
descriptor); a chunk that would take a peer's streams past `peer_bytes`, or the tier past its
budget (`StreamBudget`: the agent's catalog counts stream bytes beside replicas and evicts as a
copy does) is refused (ENOSPC); a publish must name exactly one CRC per chunk (EINVAL). Each
refusal is one errno and one log line per sender and bound every `REFUSAL_LOG_S`.

Versions (`confirmed`): a publish names a version (size, mtime_ns) the sender says the store
has. The tier serves it only once the store's own word confirms it (a journal record of that
version, or a stat: `VersionCheck`). Until then the stream is "streaming" to eval mounts
(`state_of`), its bytes are never read (`read_verified`, `verified_view`), and a complete one
is not made the replica (`finish_if_complete`); `confirm` makes it so, `refuse` drops it.

Thread-safe: one lock for the catalog and, per stream, `lock` for its chunk map and fd (demand
reads hold it for a check and a `pread`) and `io_lock` for its fd's writes and syncs. An
`fdatasync` (a progress save every `progress_every_s`, the publish) holds only `io_lock`, so a
demand read never waits for the disk behind a sync of the stream it reads. A put checks a chunk
against the published CRCs and writes it under `io_lock`, and a publish judges the stream under
it: a publish never judges a chunk map that a put is about to change (the sender publishes
without waiting for its puts in flight).
Lock order: `io_lock`, then `lock`, then the catalog's; the fd is closed only under both.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import threading
from array import array
from typing import Any
from collections.abc import Callable, Sequence

from cachetools import FIFOCache

from hintfs.agent import persist
from hintfs.agent.rpc import as_version
from hintfs.agent.streamreads import StreamReads, folder_of
from hintfs.agent.streamparts import (ANYONE, REFUSAL_LOG_S, SenderBounds, Stream, StreamBudget, StreamError,
                               StreamFinished, StreamRefused)
from policy.stream import RangeMap, Sender, StreamLimits, Verdict, chunk_crc, crc_count_refusal, stream_refusal, verdict

log = logging.getLogger("hintfs.streams")

_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


FINISHED_KEPT = 4096   # finished streams remembered, so that a late call is answered "ready"


class StreamTier(StreamReads):
    def __init__(self, folder: str, clock: Callable[[], float], persistent: bool = False,
                 idle_s: float = 120.0, progress_every_s: float = 0.5,
                 limits: StreamLimits | None = None, budget: StreamBudget | None = None):
        self.folder = folder
        self.clock = clock
        self.persistent = persistent
        self.idle_s = idle_s
        self.progress_every_s = progress_every_s
        self.limits = limits or StreamLimits()
        self.bounds = SenderBounds(self.limits, budget, clock)
        self.streams: dict[str, Stream] = {}
        self.finished: FIFOCache[str, int] = FIFOCache(FINISHED_KEPT)   # sid -> generation made a replica
        # path -> (version, when) of a finished part the caller is making the replica: between
        # the stream leaving the catalog and the replica entering the caller's, that version is
        # still arriving (demand reads wait for it instead of sending the reader to the store)
        self.handing_over: dict[str, tuple[tuple[int, int], float]] = {}
        self.folder_calls: dict[str, float] = {}   # folder -> last stream call for a file in it
        self.lock = threading.Lock()
        os.makedirs(folder, mode=0o700, exist_ok=True)

    # -- files ----------------------------------------------------------------------------------
    def _part(self, sid: str) -> str:
        return os.path.join(self.folder, f"stream-{sid}.part")

    def _save(self, s: Stream, force: bool = False) -> None:
        """The progress file, when due (or `force`): the chunk map as it is now, written after an
        `fdatasync` of the part (the map's chunks were written before they were added to it).
        Called without `s.lock` held (lock order)."""
        if not self.persistent:
            return
        with s.io_lock:
            with s.lock:
                now = self.clock()
                if s.fd < 0 or s.finishing or (not force and now - s.saved_at < self.progress_every_s):
                    return
                s.saved_at = now
                s.unsaved = False
                doc = persist.stamped({"stream": s.sid, "gen": s.gen, "path": s.path, "job": s.job,
                                       "sender": [s.sender.token, s.sender.peer], **s.ranges.to_doc()})
                fd = s.fd
            os.fdatasync(fd)            # demand reads (s.lock) go on meanwhile
            tmp = self._part(s.sid) + ".progress.tmp"
            with open(tmp, "w") as f:
                json.dump(doc, f)
            os.rename(tmp, self._part(s.sid) + ".progress")

    def _close_fd(self, s: Stream) -> None:
        """Close the stream's fd: after any write or sync in flight (io_lock) and any demand
        read (lock)."""
        with s.io_lock:
            with s.lock:
                fd, s.fd = s.fd, -1
            if fd >= 0:
                os.close(fd)

    def _remove(self, s: Stream) -> None:
        self._close_fd(s)
        self.bounds.release_all(s)
        for name in (self._part(s.sid) + ".progress", self._part(s.sid)):
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass

    # -- calls ----------------------------------------------------------------------------------
    def open(self, sid: str, gen: int, path: str, chunk: int, job: str | None = None,
             sender: Sender = ANYONE) -> dict[int, int]:
        """Start or resume stream `sid` at generation `gen`; the chunks already held (index -> CRC),
        so the sender re-sends only the others. An older generation's chunks are forgotten. A new
        stream past the sender's or the tier's bounds is refused (StreamRefused, EAGAIN)."""
        if not _ID.match(sid):
            raise StreamError(f"bad stream id {sid!r}")
        if chunk <= 0:
            raise StreamError("chunk must be positive")
        while True:
            with self.lock:
                if self.finished.get(sid, -1) >= gen:
                    raise StreamFinished(f"stream {sid} generation {gen} is a replica already")
                s = self.streams.get(sid)
                if s is not None:
                    self._check_sender(s, sender)
                if s is not None and (s.gen > gen):
                    raise StreamError(f"stream {sid}: generation {gen} is older than {s.gen}")
                if s is not None and (s.gen < gen or s.ranges.chunk != chunk):
                    del self.streams[sid]      # removed below, outside the lock (its budget)
                else:
                    if s is None:
                        why = stream_refusal(self.limits, (x.sender for x in self.streams.values()), sender)
                        if why is not None:
                            raise self.bounds.refuse(sender, "streams", errno.EAGAIN,
                                               f"stream {sid} of {path} refused: {why}")
                        fd = os.open(self._part(sid), os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                        s = Stream(sid, gen, path, job, RangeMap(chunk), fd, self.clock(), sender=sender)
                        self.streams[sid] = s
                    s.path, s.job, s.last_call = path, job, self.clock()
                    self._touch(path)
                    return {i: crc for i, (_n, crc) in s.ranges.held.items()}
            self._remove(s)            # an older generation: then the new one (its part anew)

    # -- bounds ----------------------------------------------------------------------------------
    @staticmethod
    def _check_sender(s: Stream, sender: Sender) -> None:
        """Only the sender that opened a stream may call it (a stream adopted from a stopped
        agent's folder without a sender, `ANYONE`, is anyone's)."""
        if sender is not ANYONE and s.sender is not ANYONE and s.sender != sender:
            raise StreamRefused(errno.EACCES, f"stream {s.sid} was opened by another sender")

    def _get(self, sid: str, gen: int, sender: Sender = ANYONE) -> Stream:
        with self.lock:
            s = self.streams.get(sid)
            if s is None and self.finished.get(sid) == gen:
                raise StreamFinished(f"stream {sid} generation {gen} is a replica already")
            if s is None:
                raise StreamError(f"no stream {sid} (never opened, aborted or expired)")
            self._check_sender(s, sender)
            if s.gen != gen:
                raise StreamError(f"stream {sid} is at generation {s.gen}, not {gen}")
            s.last_call = self.clock()
            self._touch(s.path)
            return s

    def _touch(self, path: str) -> None:
        """(under `lock`) A call for a stream of `path`: its folder's streams are alive."""
        self.folder_calls[folder_of(path)] = self.clock()
        if len(self.folder_calls) > 4096:
            cutoff = self.clock() - self.idle_s
            self.folder_calls = {k: t for k, t in self.folder_calls.items() if t > cutoff}

    def chunk_bytes(self, sid: str, gen: int, sender: Sender = ANYONE) -> int:
        """The stream's chunk size: the most bytes one of its chunks holds (a compressed chunk is
        inflated to no more than this, `StreamIntake.put`)."""
        return self._get(sid, gen, sender).ranges.chunk

    def put(self, sid: str, gen: int, offset: int, data: bytes | memoryview, crc: int,
            sender: Sender = ANYONE) -> bool:
        """One aligned chunk; refused (nothing written) when its CRC is not the bytes', or when
        its bytes do not fit the sender's bound or the tier's budget (StreamRefused, ENOSPC).
        True when the stream is published, confirmed, and now holds every chunk of it
        (`finish_if_complete`)."""
        s = self._get(sid, gen, sender)
        if chunk_crc(data) != crc & 0xFFFFFFFF:
            raise StreamError(f"stream {sid}: chunk at {offset} arrived damaged (CRC)")
        if offset % s.ranges.chunk or not 0 < len(data) <= s.ranges.chunk:
            raise StreamError(f"stream {sid}: {offset}+{len(data)} is not one aligned chunk")
        i = offset // s.ranges.chunk
        with s.lock:
            extra = len(data) - s.extents.get(i, 0)
        if extra > 0:                   # counted before the bytes land (the budget may evict)
            self.bounds.reserve(s, extra)
        took = [0]
        try:
            return self._write(s, i, offset, data, crc, took)
        finally:
            if extra > 0:
                self.bounds.release(s, extra - took[0])   # a chunk not written, or landed alongside

    def _write(self, s: Stream, i: int, offset: int, data: bytes | memoryview, crc: int, took: list[int]) -> bool:
        """Chunk `i` written (`put`); `took[0]`: the bytes its extent added to what the stream
        counts in the budget."""
        sid = s.sid
        # Checked and written under io_lock, which a publish holds while it judges the stream:
        # a chunk either lands before the verdict (and is judged) or is checked against the
        # final CRCs after it (and refused if it is not the published file's).
        with s.io_lock:
            with s.lock:
                if s.finishing:         # complete already: this chunk is one the tier holds
                    raise StreamFinished(f"stream {sid} generation {s.gen} is a replica already")
                final = s.final
            if final is not None and (i >= len(final) or final[i] & 0xFFFFFFFF != crc & 0xFFFFFFFF):
                # Published already: a chunk that is not the published file's (sent before a
                # rewrite, landing late) is not kept, so that no verified chunk is overwritten
                # while demand reads may read it. The sender re-sends from the final CRC list.
                log.debug("stream %s: late chunk %d is not the published file's; dropped", sid, i)
                return False
            if final is not None and s.ranges.held.get(i) == (len(data), crc & 0xFFFFFFFF):
                return False            # verified already: never written again (`verified_view`)
            if s.fd < 0:
                raise StreamError(f"stream {sid} was dropped")
            os.pwrite(s.fd, data, offset)
            with s.lock:
                grew = len(data) - s.extents.get(i, 0)
                if grew > 0:
                    s.extents[i] = len(data)
                    s.reserved += grew
                    took[0] = grew
                s.ranges.add(offset, len(data), crc)
                s.unsaved = True
                complete = (s.final is not None and s.version is not None and s.confirmed
                            and self._complete(s))
        if not complete:
            self._save(s)
        return complete

    @staticmethod
    def _complete(s: Stream) -> bool:
        """(under s.lock) Every chunk of the published file is held with its final CRC."""
        assert s.version is not None and s.final is not None
        return verdict(s.ranges, s.version[0], s.final, s.version).state == "ready"

    def finish_if_complete(self, sid: str, gen: int) -> tuple[str, tuple[int, int], Any, str] | None:
        """A published stream whose last missing chunks came after its publish (the sender sends
        them behind the publish instead of publishing again): (path, version, meta given at
        publish, the finished part file, which the caller renames into its catalog and owns), or
        None when it is not complete, or another call finishes it."""
        with self.lock:
            s = self.streams.get(sid)
        if s is None or s.gen != gen:
            return None
        with s.io_lock:                 # no put is writing (a put checks `finishing` under it)
            with s.lock:
                if (s.finishing or s.final is None or s.version is None or not s.confirmed
                        or not self._complete(s)):
                    return None
                s.finishing = True
                path, version, meta = s.path, s.version, s.meta
        return path, version, meta, self._finish(s)

    def _finish(self, s: Stream) -> str:
        """The complete stream `s` (marked `finishing`) as a finished part file: cut to its size,
        synced, forgotten (a late call for it is answered "ready")."""
        assert s.version is not None
        done = f"{self._part(s.sid)}.{s.gen}.done"
        with s.io_lock:                 # not under s.lock: demand reads go on during the sync
            if s.fd < 0:
                raise StreamError(f"stream {s.sid} was dropped while it was published")
            os.ftruncate(s.fd, s.version[0])
            os.fdatasync(s.fd)
            # Off the stream's name at once: a new generation of the stream creates its part
            # there (O_TRUNC), and must never truncate this one before the caller renamed it.
            os.rename(self._part(s.sid), done)
        with self.lock:
            self.streams.pop(s.sid, None)
            self.handing_over[s.path] = (s.version, self.clock())
            self.finished[s.sid] = s.gen
        self._close_fd(s)
        self.bounds.release_all(s)            # the caller counts the replica it makes of the part
        try:
            os.unlink(self._part(s.sid) + ".progress")
        except FileNotFoundError:
            pass
        return done

    def publish(self, sid: str, gen: int, path: str, size: int, mtime_ns: int, crcs: Sequence[int],
                replica_version: tuple[int, int] | None = None,
                meta: Any = None, sender: Sender = ANYONE,
                confirmed: bool = True) -> tuple[Verdict, str | None]:
        """The sender published `path` as (size, mtime_ns) with these final chunk CRCs (exactly
        one per chunk, else StreamRefused EINVAL). Returns the verdict and, when "ready", the
        finished part file (the caller renames it into its catalog and owns it). On "fill" the
        stream stays, its bad chunks forgotten, to be filled by `put` (from the sender: the put
        that completes it makes it ready, `finish_if_complete`) or by the caller's copy
        (`part_of`); `meta` is kept for the caller until then. On "stale" it is gone. A stream
        finished already answers "ready" with no part (the replica is the caller's already).

        `confirmed` False: the store's word for this version is still to come (`confirm`). The
        verdict is the same, but a complete stream is not finished (no part) before it comes."""
        try:
            s = self._get(sid, gen, sender)
        except StreamFinished:
            return Verdict("ready", (), ()), None
        why = crc_count_refusal(size, s.ranges.chunk, len(crcs))
        if why is not None:
            with self.lock:
                raise self.bounds.refuse(s.sender, "crcs", errno.EINVAL, f"publish of stream {sid} refused: {why}")
        final = array("I", crcs)        # 4 bytes a chunk while the stream fills (not a list of ints)
        with s.io_lock, s.lock:         # no put between its check and its write (see `put`)
            if s.finishing:             # a put completed it meanwhile
                return Verdict("ready", (), ()), None
            v = verdict(s.ranges, size, final, (size, mtime_ns), replica_version)
            if v.state != "stale":
                s.path = path
                for i in v.fetch:
                    s.ranges.held.pop(i, None)
                if s.version != (size, mtime_ns):
                    s.confirmed = confirmed
                    s.published_at = self.clock()
                else:
                    s.confirmed = s.confirmed or confirmed
                s.version = (size, mtime_ns)
                s.final = final
                s.meta = meta
                s.finishing = v.state == "ready" and s.confirmed
        if v.state == "stale":
            self.abort(sid)
            return v, None
        if v.state == "fill" or not s.finishing:
            self._save(s, force=True)
            return v, None
        return v, self._finish(s)

    # -- versions: served only once the store's word confirms them -----------------------------
    def confirm(self, path: str, version: tuple[int, int],
                meta: Callable[[Any], Any] = lambda m: m) -> list[tuple[str, tuple[int, int], Any, str]]:
        """The store has `version` of `path` (a journal record, a stat): its published streams are
        confirmed; those complete are finished, as (path, version, meta given at publish as
        `meta` maps it, the finished part) for the caller to make replicas of."""
        with self.lock:
            streams = [s for s in self.streams.values() if s.path == path and s.version == tuple(version)
                       and not s.confirmed]
        done = []
        for s in streams:
            with s.io_lock:
                with s.lock:
                    if s.confirmed or s.finishing or s.version != tuple(version):
                        continue
                    s.confirmed = True
                    s.meta = meta(s.meta)
                    if s.final is None or not self._complete(s):
                        continue
                    s.finishing = True
            done.append((s.path, as_version(version), s.meta, self._finish(s)))
        return done

    def refuse(self, path: str, version: tuple[int, int], why: str) -> list[str]:
        """The store does not have `version` of `path`: its published streams not confirmed are
        dropped (one log line each). Their ids."""
        with self.lock:
            gone = [s for s in self.streams.values() if s.path == path and s.version == tuple(version)
                    and not s.confirmed and not s.finishing]
            for s in gone:
                self.streams.pop(s.sid, None)
        for s in gone:
            self._remove(s)
            log.warning("stream %s of %s refused: %s; dropped (sender %s)", s.sid, path, why, s.sender.key())
        return [s.sid for s in gone]

    def abort(self, sid: str, sender: Sender = ANYONE) -> bool:
        with self.lock:
            s = self.streams.get(sid)
            if s is not None:
                self._check_sender(s, sender)
                del self.streams[sid]
        if s is None:
            return False
        self._remove(s)
        return True

    def save_due(self) -> None:
        """Progress files of streams whose last chunks arrived after their last save (a burst of
        chunks is listed within `progress_every_s` plus the caller's period, not at the next put)."""
        if not self.persistent:
            return
        with self.lock:
            streams = [s for s in self.streams.values() if s.unsaved]
        for s in streams:
            try:
                self._save(s)
            except OSError as err:
                log.warning("cannot save the progress of stream %s: %s", s.sid, err)

    def expire(self) -> list[str]:
        """Drop streams with no call for `idle_s`; their ids."""
        now = self.clock()
        with self.lock:
            gone = [sid for sid, s in self.streams.items() if now - s.last_call > self.idle_s]
        for sid in gone:
            self.abort(sid)
            log.info("stream %s dropped: no call for %.0f s (its sender died or gave up)", sid, self.idle_s)
        return gone

    def handed_over(self, path: str) -> None:
        """The caller's replica of `path` is in place (or its adoption failed)."""
        with self.lock:
            self.handing_over.pop(path, None)

    def saw(self, sid: str, gen: int, size: int, sender: Sender = ANYONE) -> None:
        """The sender's file was `size` bytes when it sent its last chunks."""
        s = self._get(sid, gen, sender)
        with s.lock:
            s.seen = max(size, s.seen or 0)

    def adopt(self, folder: str) -> int:
        """Take over the streams of a stopped agent's folder (part + progress); others are left
        for the caller to remove with the folder. Returns how many."""
        n = 0
        for name in sorted(os.listdir(folder)):
            if not (name.startswith("stream-") and name.endswith(".part.progress")):
                continue
            try:
                with open(os.path.join(folder, name)) as f:
                    doc = json.load(f)
                why = persist.data_refusal(doc)
                if why:                 # (docs/versions.md) left with the folder, said
                    log.warning("stream %s in %s not adopted: %s", name, folder, why)
                    continue
                sid = str(doc["stream"])
                if not _ID.match(sid) or sid in self.streams:
                    continue
                ranges = RangeMap.from_doc(doc)
                who = doc.get("sender")
                sender = Sender(str(who[0]), str(who[1])) if isinstance(who, list) and len(who) == 2 else ANYONE
                src = os.path.join(folder, name[: -len(".progress")])
                os.rename(src, self._part(sid))
                fd = os.open(self._part(sid), os.O_RDWR | os.O_CLOEXEC)
                s = Stream(sid, int(doc["gen"]), str(doc["path"]), doc.get("job"), ranges, fd, self.clock(),
                           sender=sender)
                held = {i: n for i, (n, _crc) in ranges.held.items()}
                try:
                    self.bounds.reserve(s, sum(held.values()))   # its bytes count in the budget again
                except StreamRefused:
                    self._remove(s)
                    raise
                s.extents, s.reserved = held, sum(held.values())
                with self.lock:
                    self.streams[sid] = s
                self._save(s, force=True)
                n += 1
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.warning("not adopting stream %s from %s: %s", name, folder, err)
        return n

    def close(self) -> None:
        with self.lock:
            streams, self.streams = list(self.streams.values()), {}
        for s in streams:
            if self.persistent:
                self._save(s, force=True)
                self._close_fd(s)
            else:
                self._remove(s)


__all__ = ["StreamTier", "StreamError", "StreamRefused", "StreamFinished", "StreamBudget", "ANYONE", "REFUSAL_LOG_S",
           "Stream"]

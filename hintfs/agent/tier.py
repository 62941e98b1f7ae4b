"""What the tier holds and what is on its way to it: the view eval mounts ask for (`tier_stat`)
and demand reads read through (hintfs/agent/demand.py).

`Arrivals` is what is on its way into the catalog, under the catalog's lock: the copies in
flight (their version, and the ranges written so far: `CopyInFlight`), the versions a journal
record announced whose copy waits for a write-time stream (`awaiting`), and the claim that lets
one copy (or one stream's adoption) make the replica of a path at a time. `changed` is notified
whenever bytes land (chunks, copied ranges, a finished stream): callers waiting for the tier wake.

`TierView` answers from the catalog, the arrivals and the stream tier: `stat` (ready, copying,
streaming, dir, absent), `held_bytes` (bytes of exactly one version, wherever they are here),
`arriving`, `announced_version`, `stream_behind_s`.
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from collections.abc import Iterator

from hintfs.agent.catalog import Catalog
from hintfs.agent.rpc import TierStatReply
from hintfs.agent.streams import StreamTier
from hintfs.common.clock import SYSTEM_CLOCK, Clock
from policy.stream import chunks_under

Version = tuple[int, int]
STREAM_QUIET_S = 5.0   # a stream (or a folder's streams) with a call within this long is alive


@dataclass
class CopyInFlight:
    """A copy being made: its `.part` fd and the ranges written (offset -> length, filled under
    the catalog's lock after each range's pwrite), for demand reads of this version."""
    version: Version
    fd: int
    done: dict[int, int]
    chunk: int

    def covers(self, offset: int, length: int, size: int) -> bool:
        return all(self.done.get(i * self.chunk) == min(self.chunk, size - i * self.chunk)
                   for i in chunks_under(offset, length, size, self.chunk))


class Arrivals:
    def __init__(self, catalog: Catalog) -> None:
        self.lock = catalog.lock                       # the agent's state lock (the catalog's)
        self.copying: dict[str, threading.Event] = {}  # path -> set when its copy or adoption ends
        self.copying_version: dict[str, Version] = {}  # (size, mtime_ns) of copies in flight
        # path -> (size, mtime_ns) journaled, whose copy waits for a stream (`Copier.wait_for_stream`)
        self.awaiting: dict[str, Version] = {}
        # copies in flight whose finished ranges demand reads may serve
        self.copy_reads: dict[str, CopyInFlight] = {}
        self.changed = threading.Condition()

    def notify(self) -> None:
        """Bytes landed (or a copy, a stream ended): wake who waits for the tier."""
        with self.changed:
            self.changed.notify_all()

    def release(self, path: str) -> None:
        """End the claim on `path` (`Copier.replicate` or `claim`): the next caller goes on."""
        with self.lock:
            self.copying.pop(path).set()
            self.copying_version.pop(path, None)

    @contextlib.contextmanager
    def claim(self, path: str) -> Iterator[None]:
        """Make the replica of `path` alone: wait while a copy or another adoption of it runs."""
        while True:
            with self.lock:
                busy = self.copying.get(path)
                if busy is None:
                    self.copying[path] = threading.Event()
                    break
            busy.wait()
        try:
            yield
        finally:
            self.release(path)


class TierView:
    def __init__(self, catalog: Catalog, arrivals: Arrivals, streams: StreamTier, link_bytes_s: int = 0,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.catalog = catalog
        self.arrivals = arrivals
        self.streams = streams
        self.link_bytes_s = link_bytes_s
        self.clock = clock

    def stat(self, path: str, wait_s: float = 0.0, appear_s: float = 0.0) -> TierStatReply:
        """What this agent holds at `path`: a ready replica (its version), a copy in flight or a
        published stream still filling (the version), an unpublished stream ("streaming": its
        bytes are never served; with `wait_s` the answer waits that long for its publish), a
        folder of replicas, or nothing. Eval mounts answer lookups of routed paths with it instead
        of a round trip to the remote store.

        "absent" says `"expected": true` while other files of the folder are being streamed in (a
        call within `STREAM_QUIET_S`): the file may be on its way (a commit marker published a
        few milliseconds ago). With `appear_s` the answer then waits that long for it to appear."""
        start = self.clock.monotonic()
        while True:
            doc = self.state(path)
            waited = self.clock.monotonic() - start
            if doc.state == "streaming" and waited < wait_s:
                pass
            elif doc.state == "absent" and self.streams.folder_quiet_s(path) < STREAM_QUIET_S:
                doc = TierStatReply(state="absent", expected=True)
                if waited >= appear_s:
                    return doc
            else:
                return doc
            limit = wait_s if doc.state == "streaming" else appear_s
            with self.arrivals.changed:
                self.arrivals.changed.wait(min(0.02, max(start + limit - self.clock.monotonic(), 0.001)))

    def state(self, path: str) -> TierStatReply:
        stream = self.streams.state_of(path)
        a = self.arrivals
        with a.lock:
            # A version a removal record says the store no longer has is not on its way here,
            # whatever a stream or a copy of it still does (it is not cataloged either)
            gone = self.catalog.version_removed
            if stream is not None and stream[1] is not None and gone(path, stream[1]):
                stream = None
            rep = self.catalog.replicas.get(path)
            if stream is not None and stream[1] is not None and (rep is None or rep.version != stream[1]):
                return TierStatReply(state="copying", size=stream[1][0], mtime_ns=stream[1][1])
            awaiting = a.awaiting.get(path)
            if awaiting is not None and (rep is None or rep.version != awaiting) and not gone(path, awaiting):
                # journaled (the store has this version), its stream not published here yet
                return TierStatReply(state="copying", size=awaiting[0], mtime_ns=awaiting[1])
            if stream is not None and rep is None and path not in a.copying_version:
                return TierStatReply(state="streaming")
            if rep is not None:
                return TierStatReply(state="ready", size=rep.size, mtime_ns=rep.source_mtime_ns)
            ver = a.copying_version.get(path)
            if ver is not None and not gone(path, ver):
                return TierStatReply(state="copying", size=ver[0], mtime_ns=ver[1])
            folder = path.rstrip("/")
            prefix = folder + "/"
            # (the catalog's folder index: a pass over every replica, under the lock, for each stat
            # of a folder or of a name not here cost 2.5-6.1 ms at 67,622 replicas, and grew with
            # every checkpoint an eval tier held; copies in flight are few)
            if (folder and self.catalog.replicas.has_below(folder)) or any(p.startswith(prefix) for p in a.copying):
                return TierStatReply(state="dir")
        if self.streams.below(path.rstrip("/") + "/"):
            return TierStatReply(state="dir")
        return TierStatReply(state="absent")

    # -- demand reads (hintfs/agent/demand.py): the bytes of a version still arriving -----------------
    def held_bytes(self, path: str, version: Version, offset: int, length: int) -> bytes | None:
        """[offset, offset + length) of exactly `version` of `path`, if this agent holds it: its
        replica, a published stream's verified chunks, or a copy's finished ranges; else None."""
        n = max(0, min(length, version[0] - offset))
        with self.arrivals.lock:
            data = self.catalog.pread(path, version, offset, n)
            if data is not None:
                return data
            if self.catalog.version_removed(path, version):
                return None      # removed from the store since: not read from what still arrives
            copy = self.arrivals.copy_reads.get(path)
            if copy is not None and copy.version == version and copy.covers(offset, length, version[0]):
                return os.pread(copy.fd, n, offset)   # under the lock: the copy closes its fd under it
        return self.streams.read_verified(path, version, offset, length)

    def stream_behind_s(self, path: str, version: Version) -> float | None:
        """Seconds of link (`[agent] link_bytes_s`) the streams' backlog still needs, when
        `version` of `path` comes by a stream; None when it does not, or when the backlog is not
        known (a stream whose size neither its publish, the journal nor its sender told)."""
        if self.streams.being_handed_over(path) == version:
            return 0.0                       # complete: in the catalog within milliseconds
        state = self.streams.state_of(path)
        with self.arrivals.lock:
            awaited = dict(self.arrivals.awaiting)   # journaled versions whose stream is not published here yet
        if state != ("filling", version) and not (state == ("streaming", None) and awaited.get(path) == version):
            return None
        backlog = self.streams.backlog_bytes({p: v[0] for p, v in awaited.items()})
        return None if backlog is None else backlog / self.link_bytes_s

    def announced_version(self, path: str) -> Version | None:
        """The version of `path` on its way here that demand reads may ask for: a published
        stream's, or the one a journal record announced; None if none is known."""
        state = self.streams.state_of(path)
        if state is not None and state[0] == "filling" and state[1] is not None:
            return state[1]
        with self.arrivals.lock:
            return self.arrivals.awaiting.get(path) or self.arrivals.copying_version.get(path)

    def arriving(self, path: str, version: Version) -> bool:
        """A published stream or a copy of exactly `version` of `path` is on its way here (a
        finished stream's part on its way into the catalog too), and a removal record does not say
        the store no longer has it."""
        with self.arrivals.lock:
            if self.catalog.version_removed(path, version):
                return False
            if self.arrivals.copying_version.get(path) == version or self.arrivals.awaiting.get(path) == version:
                return True
        return self.streams.state_of(path) == ("filling", version) or self.streams.being_handed_over(path) == version


__all__ = ["Arrivals", "CopyInFlight", "TierView", "STREAM_QUIET_S"]

"""What the streams a tier holds tell their readers (`StreamReads`, the read side of
`hintfs.agent.streams.StreamTier`): whether a stream is headed for a path and in which state, its
verified bytes of a published version (demand reads, the fd socket), the backlog still to come,
how long a file's or a folder's streams have been quiet, and what each sender holds. Nothing
here changes a stream; every look takes the tier's lock, then a stream's own."""
from __future__ import annotations

import os
import threading
from collections.abc import Callable

from hintfs.agent.streamparts import SenderBounds, SenderUsage, Stream

HANDOVER_S = 10.0      # a finished part counts as arriving this long at most (`being_handed_over`)


def folder_of(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


class StreamReads:
    """The looks of `StreamTier` (which sets these attributes)."""

    lock: threading.Lock
    streams: dict[str, Stream]
    clock: Callable[[], float]
    bounds: SenderBounds
    folder_calls: dict[str, float]          # folder -> last stream call for a file in it
    handing_over: dict[str, tuple[tuple[int, int], float]]

    def usage(self) -> dict[str, SenderUsage]:
        """Per sender (key): streams held, their bytes counted, refusals so far."""
        with self.lock:
            out: dict[str, SenderUsage] = {}
            for st in self.streams.values():
                u = out.setdefault(st.sender.key(), SenderUsage())
                u.open += 1
                u.bytes += st.reserved
        for key, n in self.bounds.refusals().items():
            out.setdefault(key, SenderUsage()).refused = n
        return out

    def quiet_s(self, path: str) -> float:
        """Seconds since the last call of the newest stream headed for `path` (inf: none)."""
        with self.lock:
            calls = [s.last_call for s in self.streams.values() if s.path == path]
        return self.clock() - max(calls) if calls else float("inf")

    def folder_quiet_s(self, path: str) -> float:
        """Seconds since the last stream call for any file in `path`'s folder (inf: never)."""
        with self.lock:
            last = self.folder_calls.get(folder_of(path))
        return self.clock() - last if last is not None else float("inf")

    def unconfirmed(self) -> list[tuple[str, tuple[int, int], float]]:
        """(path, version, published at) of the published streams whose version the store's word
        has not confirmed yet."""
        with self.lock:
            return [(s.path, s.version, s.published_at) for s in self.streams.values()
                    if s.version is not None and not s.confirmed and not s.finishing]

    def streaming(self, path: str) -> bool:
        """An unpublished stream is headed for `path` (eval reads of it wait or go to the store,
        never to these bytes)."""
        with self.lock:
            return any(s.path == path for s in self.streams.values())

    def being_handed_over(self, path: str) -> tuple[int, int] | None:
        """The version of `path` whose finished part the caller is making its replica (for at
        most HANDOVER_S, should a caller never say it is done), or None."""
        with self.lock:
            entry = self.handing_over.get(path)
            if entry is None or self.clock() - entry[1] > HANDOVER_S:
                return None
            return entry[0]

    def state_of(self, path: str) -> tuple[str, tuple[int, int] | None] | None:
        """The newest stream headed for `path`: ("streaming", None) before its publish, and after
        it until the store's word confirms its version; ("filling", (size, mtime_ns)) when
        published and confirmed with chunks still to come; None: no stream."""
        with self.lock:
            best = None
            for s in self.streams.values():
                if s.path == path and (best is None or s.last_call >= best.last_call):
                    best = s
            if best is None:
                return None
            if best.version is None or not best.confirmed:
                return ("streaming", None)
            return ("filling", best.version)

    def read_verified(self, path: str, version: tuple[int, int], offset: int, length: int) -> bytes | None:
        """[offset, offset + length) of `path` as published at `version` = (size, mtime_ns), from
        a stream still filling, when every chunk under the range arrived with the publish's CRC;
        None otherwise (not published, another version, or a chunk still missing)."""
        with self.lock:
            streams = [s for s in self.streams.values() if s.path == path and s.version == tuple(version)
                       and s.confirmed]
        for s in streams:
            with s.lock:
                if s.fd >= 0 and s.final is not None and s.ranges.verified(offset, length, version[0], s.final):
                    return os.pread(s.fd, max(0, min(length, version[0] - offset)), offset)
        return None

    def verified_view(self, path: str, version: tuple[int, int]) -> tuple[int, list[tuple[int, int]]]:
        """A new read-only fd of the part of a published stream of `path` at `version` still
        filling, with the runs (offset, length) of it verified so far; (-1, []) when there is
        none. For a mount on this host (`hintfs.agent.fdserver`), which reads those runs itself: a
        verified chunk of a published stream is never written again (`put`), and the part's
        inode becomes the replica or is unlinked, never reused, so the runs stay that version's
        bytes for as long as the fd is open."""
        with self.lock:
            streams = [s for s in self.streams.values() if s.path == path and s.version == tuple(version)
                       and s.confirmed]
        for s in streams:
            with s.lock:
                if s.fd < 0 or s.final is None or s.finishing:
                    continue
                runs = s.ranges.verified_runs(version[0], s.final)
                if runs:
                    return os.open(f"/proc/self/fd/{s.fd}", os.O_RDONLY | os.O_CLOEXEC), runs
        return -1, []

    def backlog_bytes(self, expected: dict[str, int] | None = None) -> int | None:
        """Bytes still to arrive (size less what is held) for every stream: what the link must
        carry before the last of them is complete. A stream's size is its publish's, else the
        journal's (`expected`: path -> size), else what its sender last saw; None when a stream
        has none of them (its backlog could be anything)."""
        expected = expected or {}
        with self.lock:
            streams = list(self.streams.values())
        total = 0
        for s in streams:
            size = s.version[0] if s.version is not None else expected.get(s.path, s.seen)
            if size is None:
                return None
            total += max(0, size - s.ranges.bytes_held())
        return total

    def bytes_held(self) -> int:
        with self.lock:
            streams = list(self.streams.values())
        return sum(s.ranges.bytes_held() for s in streams)

    def bytes_counted(self) -> int:
        """What the streams count in the budget (every chunk written, verified or not)."""
        with self.lock:
            return sum(s.reserved for s in self.streams.values())

    def below(self, prefix: str) -> bool:
        """A stream is headed for a path below folder `prefix`."""
        with self.lock:
            return any(s.path.startswith(prefix) for s in self.streams.values())



__all__ = ["StreamReads", "folder_of", "HANDOVER_S"]

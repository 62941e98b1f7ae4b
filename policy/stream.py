"""Write-time streaming to the eval tier (docs/cross_dc.md, "Write-time streaming"): the pure
decisions of both ends, no I/O and no clock.

- `ranges_to_send`: what a sender sends next, reading behind a writer: whole chunks below the
  staging file's current size, and at publish the tail and every chunk whose bytes changed since
  they were sent (in-place rewrites, which the daemon does not see with FUSE passthrough).
- `RangeMap`: what a tier holds of one stream, chunk by chunk with each chunk's CRC, and its
  JSON form for the progress file of a persistent agent.
- `verdict`: at publish, whether the tier's bytes *are* the published file (every chunk present
  with the sender's final CRC), and if not, which chunks must come from elsewhere. The tier never
  serves a stream that was not published, nor one whose verdict is not `ready`.
- `chunk_crc`: the checksum both sides compute (CRC-32C of the chunk's bytes, `crc32c`).
- `checkpoint_family`, `chunks_touching`, `send_calls`: eval reads first. The tier remembers
  which ranges of a checkpoint's files eval jobs read and, when the next checkpoint's file of the
  same name starts streaming, names the chunks holding them (DCP lays out each step's files
  alike); the sender sends those as soon as they are written and holds the others back while
  the file is written.

- `Sender`, `StreamLimits`, `stream_refusal`, `crc_count_refusal`: what one sender may hold at a
  tier (issue 34): streams per peer host, per token and in total (each holds a descriptor), the
  bytes of a peer's streams not yet replicas, and a publish's CRC list exactly one per chunk.

Chunks are aligned: chunk i covers [i * chunk, min((i + 1) * chunk, size)). Only the last chunk
of a file may be short, and a short chunk is sent only at publish (the writer may still extend it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Iterable, Sequence

import crc32c


def chunk_crc(data: bytes | memoryview) -> int:
    """CRC-32C (Castagnoli) of a chunk, in hardware where the CPU has it (SSE4.2: ~2x zlib's
    CRC-32 here); the sender computes it twice per byte and the tier once, beside the writer."""
    return crc32c.crc32c(data) & 0xFFFFFFFF


def chunk_count(size: int, chunk: int) -> int:
    return (size + chunk - 1) // chunk if size > 0 else 0


def chunk_span(index: int, size: int, chunk: int) -> tuple[int, int]:
    """(offset, length) of chunk `index` of a file of `size` bytes."""
    off = index * chunk
    return off, max(0, min(chunk, size - off))


def chunks_under(offset: int, length: int, size: int, chunk: int) -> range:
    """Indices of the chunks that hold [offset, offset + length) of a file of `size` bytes
    (the range is cut at the end of the file; nothing past it)."""
    end = min(offset + length, size)
    if end <= offset:
        return range(0)
    return range(offset // chunk, (end - 1) // chunk + 1)


def ranges_to_send(size: int, chunk: int, sent: dict[int, int], final_crcs: list[int] | None = None,
                   limit: int | None = None, only: frozenset[int] | None = None) -> list[int]:
    """Chunk indices to send next, in order.

    While writing (`final_crcs` None): the whole chunks below `size` not in `sent` (index -> CRC
    sent), of `only` when given. At publish (`final_crcs`: the CRC of every chunk of the final
    file): first the chunks whose final CRC differs from what was sent (rewritten in place), then
    those never sent, the tail included. `limit` caps how many are returned."""
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    if final_crcs is None:
        whole = size // chunk
        among = range(whole) if only is None else sorted(i for i in only if i < whole)
        out = [i for i in among if i not in sent]
    else:
        if len(final_crcs) != chunk_count(size, chunk):
            raise ValueError(f"{len(final_crcs)} final CRCs for {chunk_count(size, chunk)} chunks")
        changed = [i for i, c in enumerate(final_crcs) if i in sent and sent[i] != c]
        unsent = [i for i in range(len(final_crcs)) if i not in sent]
        out = changed + unsent
    return out if limit is None else out[:limit]


@dataclass
class RangeMap:
    """The chunks of one stream a tier holds: index -> (length, CRC of the bytes received)."""
    chunk: int
    held: dict[int, tuple[int, int]] = field(default_factory=dict)

    def add(self, offset: int, length: int, crc: int) -> None:
        """Record a received chunk (the caller checked `crc` against the bytes). Chunks are
        aligned; a chunk received again replaces the earlier one (a re-send after a rewrite)."""
        if offset % self.chunk or length <= 0 or length > self.chunk:
            raise ValueError(f"range {offset}+{length} is not one aligned chunk of {self.chunk}")
        self.held[offset // self.chunk] = (length, crc & 0xFFFFFFFF)

    def drop_from(self, size: int) -> None:
        """Forget chunks at or past `size` and a partial chunk that `size` cuts (a truncate)."""
        for i in list(self.held):
            off, length = i * self.chunk, self.held[i][0]
            if off + length > size:
                del self.held[i]

    def bytes_held(self) -> int:
        return sum(length for length, _crc in self.held.values())

    def verified_runs(self, size: int, final_crcs: Sequence[int]) -> list[tuple[int, int]]:
        """(offset, length) runs of the published file of `size` bytes whose every chunk is held
        whole with its final CRC, in order (consecutive verified chunks joined)."""
        runs: list[list[int]] = []
        for i in sorted(self.held):
            off, n = chunk_span(i, size, self.chunk)
            got = self.held[i]
            if n <= 0 or i >= len(final_crcs) or got != (n, final_crcs[i] & 0xFFFFFFFF):
                continue
            if runs and runs[-1][0] + runs[-1][1] == off:
                runs[-1][1] += n
            else:
                runs.append([off, n])
        return [(o, n) for o, n in runs]

    def verified(self, offset: int, length: int, size: int, final_crcs: Sequence[int]) -> bool:
        """Every chunk under [offset, offset + length) of the published file of `size` bytes is
        held whole with its final CRC: those bytes are the published file's (demand reads)."""
        for i in chunks_under(offset, length, size, self.chunk):
            got = self.held.get(i)
            if (got is None or i >= len(final_crcs) or got[0] != chunk_span(i, size, self.chunk)[1]
                    or got[1] != final_crcs[i] & 0xFFFFFFFF):
                return False
        return True

    def missing(self, size: int) -> list[int]:
        return [i for i in range(chunk_count(size, self.chunk))
                if self.held.get(i, (None,))[0] != chunk_span(i, size, self.chunk)[1]]

    def to_doc(self) -> dict:
        return {"chunk": self.chunk, "held": {str(i): [n, c] for i, (n, c) in sorted(self.held.items())}}

    @classmethod
    def from_doc(cls, doc: dict) -> RangeMap:
        chunk = int(doc["chunk"])
        if chunk <= 0:
            raise ValueError("chunk must be positive")
        m = cls(chunk)
        for k, (n, c) in doc["held"].items():
            m.add(int(k) * chunk, int(n), int(c))
        return m


@dataclass(frozen=True)
class Verdict:
    state: str                 # "ready" | "fill" | "stale"
    fetch: tuple[int, ...]     # chunk indices to take from elsewhere (state "fill")
    keep: tuple[int, ...]      # chunk indices whose bytes are the published file's


def verdict(held: RangeMap, size: int, final_crcs: Sequence[int],
            version: tuple[int, int], replica_version: tuple[int, int] | None = None) -> Verdict:
    """What a tier does with a stream at its publish as `version` = (size, mtime_ns).

    - "stale": the tier already holds a replica of a newer version (mtime later): the stream's
      bytes are dropped, the replica stays.
    - "ready": every chunk is held with the final CRC: the stream *is* the published file.
    - "fill": the chunks in `fetch` (missing, short, or with another CRC) must come from the
      store at `version` (or the sender); the ones in `keep` are verified and stay."""
    if version[0] != size:
        raise ValueError("the version's size is the file's size")
    n = chunk_count(size, held.chunk)
    if len(final_crcs) != n:
        raise ValueError(f"{len(final_crcs)} final CRCs for {n} chunks")
    if replica_version is not None and replica_version[1] > version[1]:
        return Verdict("stale", (), ())
    keep, fetch = [], []
    for i in range(n):
        got = held.held.get(i)
        want_len = chunk_span(i, size, held.chunk)[1]
        if got is not None and got[0] == want_len and got[1] == (final_crcs[i] & 0xFFFFFFFF):
            keep.append(i)
        else:
            fetch.append(i)
    return Verdict("fill" if fetch else "ready", tuple(fetch), tuple(keep))


def checkpoint_family(path: str) -> tuple[str, str]:
    """What a file's name keeps from one checkpoint of a job to the next: (the job's folder, the
    file's name), the path without its step folder (`ckpt/run/step_100/__0_0.distcp` ->
    (`ckpt/run`, `__0_0.distcp`))."""
    parts = path.split("/")
    return "/".join(parts[:-2]), parts[-1]


def merged_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) ranges sorted, with those that overlap or touch joined (empty and negative
    ones dropped)."""
    out: list[list[int]] = []
    for off, length in sorted((int(o), int(n)) for o, n in ranges if n > 0 and o >= 0):
        if out and off <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], off + length - out[-1][0])
        else:
            out.append([off, length])
    return [(o, n) for o, n in out]


def chunks_touching(ranges: Iterable[tuple[int, int]], chunk: int, limit: int = 1 << 20) -> list[int]:
    """The chunk indices (sorted, at most `limit`) that hold any byte of these (offset, length)
    ranges."""
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    out: set[int] = set()
    for off, length in ranges:
        if length <= 0 or off < 0:
            continue
        out.update(range(off // chunk, (off + length - 1) // chunk + 1))
        if len(out) >= limit:
            break
    return sorted(out)[:limit]


def send_calls(todo: list[int], first: Iterable[int], chunk: int, call_bytes: int,
               others: int | None = None, growing_end: int | None = None) -> list[list[int]]:
    """The chunks of `todo` to send now, as calls: runs of consecutive chunks of at most
    `call_bytes` (at least one chunk). The chunks in `first` (eval reads come for them) go first;
    then the others in at most `others` calls (None: all of them). `growing_end` (the file is
    still growing: the index of its last whole chunk): a run of others that ends there and is
    shorter than a call waits for the file to grow (each call has a cost of its own on the
    writer's host: fewer, fuller calls cost less); a short run that cannot grow goes."""
    per_call = max(1, call_bytes // chunk)
    firsts = set(first)

    def runs(indices: list[int]) -> list[list[int]]:
        calls: list[list[int]] = []
        for i in indices:
            if calls and calls[-1][-1] == i - 1 and len(calls[-1]) < per_call:
                calls[-1].append(i)
            else:
                calls.append([i])
        return calls

    rest = runs([i for i in todo if i not in firsts])
    if growing_end is not None and rest and rest[-1][-1] == growing_end and len(rest[-1]) < per_call:
        rest.pop()
    return runs([i for i in todo if i in firsts]) + (rest if others is None else rest[:max(0, others)])


def crcs_of(chunks: Iterable[bytes]) -> list[int]:
    """The final CRC list of a file given its chunks in order (tests, and small files)."""
    return [chunk_crc(c) for c in chunks]


@dataclass(frozen=True)
class Sender:
    """Who sent a stream call: the token it presented ("-" without one: an agent with no token,
    or a mount's own agent on its private socket) and the connection's peer host (the address
    without its port: one host opens several connections)."""
    token: str
    peer: str

    def key(self) -> str:
        return f"{self.token}@{self.peer}"


@dataclass(frozen=True)
class StreamLimits:
    """What a tier holds of the streams of training mounts (`[agent] stream_*`). Each stream
    keeps a descriptor and disk space until it is a replica or dropped."""
    max_streams: int = 4096            # streams held at once, all senders
    per_peer: int = 512                # of one peer host
    per_token: int = 4096              # of one token (one token often serves a whole fleet)
    peer_bytes: int | None = None   # bytes of one peer's streams not yet replicas (None: no bound)

    def capped(self, open_files: int) -> StreamLimits:
        """These limits within an open-file limit: streams take at most a quarter of it, and one
        peer or one token at most a quarter of what streams may take (others keep working)."""
        total = max(4, min(self.max_streams, open_files // 4))
        share = max(1, total // 4)
        return StreamLimits(total, min(self.per_peer, share), min(self.per_token, total), self.peer_bytes)


def stream_refusal(limits: StreamLimits, held: Iterable[Sender], sender: Sender) -> str | None:
    """Why one more stream of `sender` is refused, given the senders of the streams held (one
    per stream), or None when it fits. The bounds in order: total, per peer, per token."""
    total = by_peer = by_token = 0
    for s in held:
        total += 1
        by_peer += s.peer == sender.peer
        by_token += s.token == sender.token
    if total >= limits.max_streams:
        return f"the tier holds {total} streams (at most {limits.max_streams})"
    if by_peer >= limits.per_peer:
        return f"peer {sender.peer} holds {by_peer} streams (at most {limits.per_peer})"
    if by_token >= limits.per_token:
        return f"its token holds {by_token} streams (at most {limits.per_token})"
    return None


def crc_count_refusal(size: int, chunk: int, ncrcs: int) -> str | None:
    """A publish names exactly one CRC per chunk of the file; why not, or None."""
    want = chunk_count(size, chunk)
    if ncrcs != want:
        return f"{ncrcs} CRCs for {want} chunks of {chunk} bytes in a file of {size} bytes"
    return None


__all__ = ["chunk_crc", "chunk_count", "chunk_span", "chunks_under", "ranges_to_send", "RangeMap", "Verdict", "verdict",
           "crcs_of", "checkpoint_family", "merged_ranges", "chunks_touching", "send_calls", "Sender",
           "StreamLimits", "stream_refusal", "crc_count_refusal"]

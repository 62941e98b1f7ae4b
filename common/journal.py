"""The closed-file journal: the training-side mount records every file it publishes, one small
object per file under `journal.dir`, so eval-side agents learn of new checkpoint files at once
instead of listing the remote store. Object names sort by time; an object store needs no append.

The record (path, size, mtime) is also encoded in the object's name when the name stays within
255 bytes (`<time_ns>-<host>-<pid>-<seq>~<size>~<mtime_ns>~<base64url(path)>.rec`): a follower
then learns everything from one listing, without a GET per record (each is a round trip on a
long link). Longer paths get a `<time_ns>-<host>-<pid>-<seq>.json` name and the record as content.

A record may say that the writing mount is also streaming the file to eval tiers (a `-s` after
the stem's sequence number: `<time_ns>-<host>-<pid>-<seq>-s~...`): a follower that sees the record
before the stream has opened waits for the stream instead of copying the file a second time
(`streamed_record`). Readers that do not know the flag ignore it (the stem is opaque to them).

A record may also say that the file is gone from the store (a `-r`: `removed_record`), written
when a mount unlinks a file or renames it away (DCP's `.metadata.tmp`): followers drop what their
tier holds of that path, or of anything under it for a folder, from before the record's time
(`agent.server.AgentServer.removed_from_store`). Its size and mtime are 0: the mount does not
stat a file to remove it.

Records go into one folder per 10 s of their time (`<journal>/by-time/<slice>/<name>`, the slice
being the time in units of 10 s: `record_key`), so that a follower's poll lists the folder of
the current slice, known by name: the cost of a poll stays that of the files published in the
last seconds, not of every record the retention keeps (a flat folder of a day's records was
listed whole on every poll, and the S3 server's work for it grew with every checkpoint). Records
of older mounts, directly in `<journal>/`, are still read.

The journal is pruned by age (`journal.retention_s`): every writing mount deletes records whose
name's time is older, whoever wrote them (deleting twice is harmless), and the slice folders
that are wholly older. Followers forget the names they no longer see, so their memory is bounded
by the retention too.
"""
from __future__ import annotations

import base64
import itertools
import json
import os
import socket
import time
from collections import OrderedDict
from typing import Optional

from common.paths import relpath

_seq = itertools.count()
_HOST = socket.gethostname().replace("/", "_").replace("-", "_").replace("~", "_")
NAME_MAX = 255


def record_name(path: Optional[str] = None, size: int = 0, mtime_ns: int = 0, streamed: bool = False,
                removed: bool = False) -> str:
    flag = "-r" if removed else "-s" if streamed else ""
    stem = f"{time.time_ns():020d}-{_HOST}-{os.getpid()}-{next(_seq)}" + flag
    if path is not None:
        enc = base64.urlsafe_b64encode(path.encode()).decode().rstrip("=")
        name = f"{stem}~{size}~{mtime_ns}~{enc}.rec"
        if len(name.encode()) <= NAME_MAX:
            return name
    return stem + ".json"


def streamed_record(name: Optional[str]) -> bool:
    """The record `name` says its writer streams the file to the eval tiers as well. (A forged
    flag costs a follower a bounded wait before it copies: nothing is served on its word.)"""
    parts = _stem_parts(name)
    return parts is not None and len(parts) == 5 and parts[4] == "s"


def removed_record(name: Optional[str]) -> bool:
    """The record `name` says its path was removed from the store (unlinked or renamed away). (A
    forged one costs eval reads of that path a trip to the store: nothing is served on its word.)"""
    parts = _stem_parts(name)
    return parts is not None and len(parts) == 5 and parts[4] == "r"


class Removals:
    """The newest removal record's time per path (a file or a folder), for the last `kept` paths
    removed. Not thread-safe: its owner's lock guards it."""

    def __init__(self, kept: int = 65536):
        self.kept = kept
        self._at: "OrderedDict[str, int]" = OrderedDict()

    def note(self, path: str, removed_ns: int) -> None:
        self._at[path] = max(removed_ns, self._at.get(path, -1))
        self._at.move_to_end(path)
        while len(self._at) > self.kept:
            self._at.popitem(last=False)

    def note_round(self, removals: list[tuple[str, int]]) -> "Removals":
        """Note a round's (path, time) removals; a `Removals` of only those, to find what they
        remove in one pass over what the caller holds."""
        batch = Removals(kept=len(removals) or 1)
        for path, removed_ns in removals:
            self.note(path, removed_ns)
            batch.note(path, removed_ns)
        return batch

    def newest(self, path: str) -> Optional[int]:
        """The time of the newest removal of `path` or of a folder above it; None if none."""
        parts = path.split("/")
        times = [self._at.get("/".join(parts[:i])) for i in range(len(parts), 0, -1)]
        return max((t for t in times if t is not None), default=None)


def _stem_parts(name: Optional[str]) -> Optional[list[str]]:
    """A record name's stem, split: [time_ns, host, pid, seq] and "s" when streamed or "r" when
    removed; None for names that are not records."""
    if not name or record_time_ns(name) is None:
        return None
    return name.split("~", 1)[0].removesuffix(".json").split("-")


def _writer_seq(name: Optional[str]) -> Optional[tuple[str, str, int]]:
    """(host, pid, sequence number) of a record's name; None for names that are not records."""
    parts = _stem_parts(name)
    if parts is None or len(parts) not in (4, 5) or not parts[2].isdigit() or not parts[3].isdigit():
        return None
    return parts[1], parts[2], int(parts[3])


def later_by_same_writer(newer: Optional[str], older: Optional[str]) -> bool:
    """Record `newer` was written after `older` by the same mount process (same host and pid, a
    higher sequence number). A replica made for `newer` then holds what a copy for `older` would
    fetch now: the store file of that path as its writer left it after both, so an older record
    of the same version needs no copy (a file published at fsync and again at its close)."""
    a, b = _writer_seq(newer), _writer_seq(older)
    if a is None or b is None or a[:2] != b[:2] or a[2] <= b[2]:
        return False
    # the time too: a pid reused by a later mount on the host starts its numbers again
    ta, tb = record_time_ns(newer or ""), record_time_ns(older or "")
    return ta is not None and tb is not None and ta > tb


def record_time_ns(name: str) -> Optional[int]:
    """The write time a record's name starts with; None for names that are not records."""
    stamp = name[:20]
    return int(stamp) if len(name) > 20 and stamp.isdigit() and name[20] == "-" else None


TIMED = "by-time"           # the folder of the time slices, in the journal folder
BUCKET_NS = 10 * 10**9      # one slice folder per 10 s of record time
_BUCKET_DIGITS = 11


def bucket_of(time_ns: int) -> str:
    """The slice folder (under TIMED) of the records written at `time_ns`."""
    return f"{time_ns // BUCKET_NS:0{_BUCKET_DIGITS}d}"


def bucket_start_ns(bucket: str) -> Optional[int]:
    """When the slice `bucket` begins; None for names that are not slice folders."""
    return int(bucket) * BUCKET_NS if len(bucket) == _BUCKET_DIGITS and bucket.isdigit() else None


def record_key(name: str) -> str:
    """Where the record `name` goes under the journal folder: `by-time/<slice>/<name>`."""
    t = record_time_ns(name)
    if t is None:
        raise ValueError(f"{name!r} is not a record name")
    return f"{TIMED}/{bucket_of(t)}/{name}"


def slice_dir(journal_dir: str, bucket: str) -> str:
    """The store folder of the slice `bucket` of the journal in `journal_dir`."""
    return f"{journal_dir}/{TIMED}/{bucket}"


def list_folder(store, rel: str) -> list:
    """(name, stat) of the entries of the store folder `rel`; none when it does not exist (a slice
    nobody wrote in, a journal not started yet). Blocking (a store call)."""
    try:
        return list(store.iter_dir(rel))
    except FileNotFoundError:
        return []


def prune(store, journal_dir: str, older_than_ns: int) -> int:
    """Delete the records written before `older_than_ns`; returns how many went. Slice folders
    wholly before it are emptied and removed; records of older mounts directly in the journal
    folder are pruned the same way. Blocking (store calls): run it in a worker thread."""
    gone = 0
    for name, st in list_folder(store, journal_dir):
        if not st.is_dir:
            gone += _prune_names(store, journal_dir, [name], older_than_ns)
    for name, st in list_folder(store, f"{journal_dir}/{TIMED}"):
        start = bucket_start_ns(name)
        if start is None or not st.is_dir or start >= older_than_ns:
            continue
        folder = slice_dir(journal_dir, name)
        gone += _prune_names(store, folder, [n for n, _st in list_folder(store, folder)], older_than_ns)
        if start + BUCKET_NS <= older_than_ns:
            try:
                store.rmdir(folder)       # (a record written there since stays)
            except OSError:
                pass
    return gone


def _prune_names(store, folder: str, names: list[str], older_than_ns: int) -> int:
    gone = 0
    for name in names:
        t = record_time_ns(name)
        if t is None or t >= older_than_ns:
            continue
        try:
            store.unlink(f"{folder}/{name}")
            gone += 1
        except FileNotFoundError:
            pass   # another writer pruned it first
    return gone


def prune_interval_s(retention_s: float) -> float:
    return min(600.0, max(0.05, retention_s / 10))


def encode_record(path: str, size: int, mtime_ns: int) -> bytes:
    return json.dumps({"path": path, "size": size, "mtime_ns": mtime_ns}).encode()


def decode_record(data: bytes) -> dict:
    doc = json.loads(data)
    return {"path": _record_path(doc["path"]), "size": int(doc["size"]), "mtime_ns": int(doc["mtime_ns"])}


def _record_path(path: object) -> str:
    """A record names a store path: the one path rule applies (a record is a file anyone with
    write access to the store's journal folder could have written). ValueError if refused."""
    try:
        return relpath(path, what="journal record path")
    except OSError as err:
        raise ValueError(err.strerror) from None


def decode_name(name: str) -> Optional[dict]:
    """The record carried by a `.rec` name; None for `.json` names (read the content) or junk."""
    if not name.endswith(".rec"):
        return None
    try:
        _stem, size, mtime_ns, enc = name[:-4].split("~", 3)
        path = _record_path(base64.urlsafe_b64decode(enc + "=" * (-len(enc) % 4)).decode())
        return {"path": path, "size": int(size), "mtime_ns": int(mtime_ns)}
    except (ValueError, UnicodeDecodeError):
        return None

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
(`hintfs.agent.catalog.Catalog.removed_from_store`). Its size and mtime are 0: the mount does not
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

A record is input from whoever could write the journal folder (issue 34, finding 9): it is read
with bounds (`MAX_RECORD_BYTES`, one flat JSON object of exactly path, size and mtime_ns, numbers
in 0..2^63-1: `decode_record`, `decode_name`), and a record dated more than `MAX_SKEW_NS` past
the store's clock (the record's own mtime as the store lists it), or listed in a time folder
that is not its time's, is refused (`refusal`) and pruned. On stores with owners and modes
(file://), the journal's folders are the writing mount's and private (`prepare_journal`: 0700,
records 0600; group read where the operator gave the journal folder a group), and a reader
trusts a journal only in folders owned by root, itself or the store root's owner that no other
user may write (`journal_problem`).
"""
from __future__ import annotations

import base64
import errno
import itertools
import json
import logging
import os
import re
import socket
import stat as stat_mod
import threading
import time

from cachetools import FIFOCache

from hintfs.common.jsontext import nests_within
from hintfs.common.formatversion import placed
from hintfs.common.paths import relpath

log = logging.getLogger("hintfs.journal")

_seq = itertools.count()
_HOST = socket.gethostname().replace("/", "_").replace("-", "_").replace("~", "_")
NAME_MAX = 255
MAX_RECORD_BYTES = 32 * 1024   # a record's content: a path of at most 4095 bytes, JSON-escaped
MAX_SKEW_S = 600.0             # how far past the store's clock a record may be dated (writers' clocks)
MAX_SKEW_NS = int(MAX_SKEW_S * 1e9)
_NUMBER_MAX = 2**63 - 1        # sizes and times in a record


# The journal's format version (docs/versions.md). Version 1 is the format as it was before
# versions: its names end in `.rec` / `.json` and its content has no `v` key (readers from before
# versions refuse any other key). A later version N names its records `<...>.vN.rec` /
# `<...>.vN.json` and writes `"v": N` in their content: a reader from before versions refuses
# those (logged), and a reader of this code that does not read N refuses them with one line
# naming both versions (`version_refusal`). Nothing prunes a record for its version.
JOURNAL_VERSION = 1          # the version this code writes
JOURNAL_READS = (1, 1)       # the versions it reads
_VERSIONED = re.compile(r"\.v([0-9]{1,5})\.(?:rec|json)$")


def record_version(name: str) -> int:
    """The journal version a record's name says it was written in (1: no `.vN` before its suffix)."""
    m = _VERSIONED.search(name)
    return int(m.group(1)) if m else 1


def version_refusal(version: int) -> str | None:
    """Why a record of journal version `version` is not read here; None when it is."""
    where = placed(version, JOURNAL_READS)
    if where is None:
        return None
    lo, hi = JOURNAL_READS
    side = ("upgrade the agents that follow this journal (readers before the training mounts that write it)"
            if where == "newer" else "upgrade the training mounts that write this journal")
    return f"written in journal version {version}; this agent reads journal versions {lo}..{hi}: {side}"


def _suffix(ext: str) -> str:
    return ext if JOURNAL_VERSION == 1 else f".v{JOURNAL_VERSION}{ext}"


def record_name(path: str | None = None, size: int = 0, mtime_ns: int = 0, streamed: bool = False,
                removed: bool = False) -> str:
    flag = "-r" if removed else "-s" if streamed else ""
    stem = f"{time.time_ns():020d}-{_HOST}-{os.getpid()}-{next(_seq)}" + flag
    if path is not None:
        enc = base64.urlsafe_b64encode(path.encode()).decode().rstrip("=")
        name = f"{stem}~{size}~{mtime_ns}~{enc}{_suffix('.rec')}"
        if len(name.encode()) <= NAME_MAX:
            return name
    return stem + _suffix(".json")


def streamed_record(name: str | None) -> bool:
    """The record `name` says its writer streams the file to the eval tiers as well. (A forged
    flag costs a follower a bounded wait before it copies: nothing is served on its word.)"""
    parts = _stem_parts(name)
    return parts is not None and len(parts) == 5 and parts[4] == "s"


def removed_record(name: str | None) -> bool:
    """The record `name` says its path was removed from the store (unlinked or renamed away). (A
    forged one costs eval reads of that path a trip to the store: nothing is served on its word.)"""
    parts = _stem_parts(name)
    return parts is not None and len(parts) == 5 and parts[4] == "r"


class Removals:
    """The newest removal record's time per path (a file or a folder), for the last `kept` paths
    removed. Not thread-safe: its owner's lock guards it."""

    def __init__(self, kept: int = 65536):
        self.kept = kept
        # FIFOCache: a path noted again moves to the end; a lookup does not (LRUCache's would).
        self._at: FIFOCache[str, int] = FIFOCache(maxsize=kept)

    def note(self, path: str, removed_ns: int) -> None:
        self._at[path] = max(removed_ns, self._at.get(path, -1))

    def note_round(self, removals: list[tuple[str, int]]) -> Removals:
        """Note a round's (path, time) removals; a `Removals` of only those, to find what they
        remove in one pass over what the caller holds."""
        batch = Removals(kept=len(removals) or 1)
        for path, removed_ns in removals:
            self.note(path, removed_ns)
            batch.note(path, removed_ns)
        return batch

    def newest(self, path: str) -> int | None:
        """The time of the newest removal of `path` or of a folder above it; None if none."""
        parts = path.split("/")
        times = [self._at.get("/".join(parts[:i])) for i in range(len(parts), 0, -1)]
        return max((t for t in times if t is not None), default=None)


def _stem_parts(name: str | None) -> list[str] | None:
    """A record name's stem, split: [time_ns, host, pid, seq] and "s" when streamed or "r" when
    removed; None for names that are not records."""
    if not name or record_time_ns(name) is None:
        return None
    return _VERSIONED.sub("", name.split("~", 1)[0]).removesuffix(".json").split("-")


def _writer_seq(name: str | None) -> tuple[str, str, int] | None:
    """(host, pid, sequence number) of a record's name; None for names that are not records."""
    parts = _stem_parts(name)
    if parts is None or len(parts) not in (4, 5) or not parts[2].isdigit() or not parts[3].isdigit():
        return None
    return parts[1], parts[2], int(parts[3])


def later_by_same_writer(newer: str | None, older: str | None) -> bool:
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


def record_time_ns(name: str) -> int | None:
    """The write time a record's name starts with; None for names that are not records."""
    stamp = name[:20]
    return int(stamp) if len(name) > 20 and stamp.isdigit() and name[20] == "-" else None


TIMED = "by-time"           # the folder of the time slices, in the journal folder
BUCKET_NS = 10 * 10**9      # one slice folder per 10 s of record time
_BUCKET_DIGITS = 11


def bucket_of(time_ns: int) -> str:
    """The slice folder (under TIMED) of the records written at `time_ns`."""
    return f"{time_ns // BUCKET_NS:0{_BUCKET_DIGITS}d}"


def bucket_start_ns(bucket: str) -> int | None:
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


# What the journal's readers (an eval tier's follower and its stream version checks) may take of
# the link to the store by listing, about: after a listing, the next waits until that one's bytes
# (its names, ENTRY_BYTES of each entry besides and REQUEST_BYTES for the request) fit in this
# rate. A slice holds every record of its 10 s: listed whole every 10 ms while a checkpoint of
# small files was written, the listings were half the bytes on a 400 Mbit/s link and most of the
# S3 server's CPU (bench/scale_xdc.py: 28,429 listings in 13 minutes). Bounded so, they stay a few
# hundred KB/s at any slice size; listed from the last name seen (`SliceListings`), most listings
# carry only the records written since the one before and the budget is seldom reached.
LIST_BYTES_S = 256 << 10
ENTRY_BYTES = 300      # an entry of an S3 listing besides its name (key, size, ETag, date, class)
REQUEST_BYTES = 1000   # a listing's request and its response's headers and envelope


def listing_gap_s(names) -> float:
    """The least wait after a listing of `names` before the next (LIST_BYTES_S)."""
    return (sum(len(n) + ENTRY_BYTES for n in names) + REQUEST_BYTES) / LIST_BYTES_S


class ListingBudget:
    """LIST_BYTES_S for all the journal listings of one agent: its follower's rounds and its
    stream version checks list the same slice, so after a listing by either, the next by either
    waits until that one's bytes fit (each had a budget of its own: twice the bytes, and the
    follower's records reach the version check anyway). Times: the caller's monotonic clock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = float("-inf")

    def wait_s(self, now: float) -> float:
        """How long until the next listing may start."""
        with self._lock:
            return max(0.0, self._next - now)

    def spent(self, names, now: float) -> None:
        """A listing that carried `names` ended at `now`."""
        gap = listing_gap_s(names)
        with self._lock:
            self._next = max(self._next, now + gap)


def list_folder(store, rel: str) -> list:
    """(name, stat) of the entries of the store folder `rel`; none when it does not exist (a slice
    nobody wrote in, a journal not started yet). Blocking (a store call)."""
    try:
        return list(store.iter_dir(rel))
    except FileNotFoundError:
        return []


# How a slice is listed again (`SliceListings`): from its newest record's name (a tail: only what
# was written since), and at least every LAGGED_EVERY_S from a lag before that record's time (a
# record named earlier than one already seen, whose PUT took longer or whose writer's clock is
# behind, is seen then): LAG_NS, or more where records are seen later than that after their
# names' time (the store's date of a record, less its name's, over the kept slices, and a
# second more; a writer whose clock runs behind is followed so), up to the whole slice. Later
# records still are the follower's sweeps' (whole listings of the last SWEEP_BACK_NS of slices).
LAG_NS = 2 * 10**9
LAGGED_EVERY_S = 1.0
KEPT_SLICES = 8        # slices whose names are kept (the newest: a poll lists at most three)


class _Slice:
    __slots__ = ("lock", "known", "tail", "lagged_at", "late_ns")

    def __init__(self) -> None:
        self.lock = threading.Lock()         # one listing of a slice at a time
        self.known: dict | None = None       # name -> Stat, as of the last listing; None: never listed
        self.tail: str | None = None         # the newest record name of the slice's own time in `known`
        self.lagged_at = float("-inf")       # when it was last listed from before its tail
        self.late_ns = 0                     # the most a record's store date was past its name's time


class SliceListings:
    """The journal's recent time slices as its readers (the follower, the stream version check)
    know them: `listing(slice)` answers every name the slice holds, as a whole listing would, but
    asks the store only for the names after the newest record known there (`Store.iter_dir_after`:
    ListObjectsV2's start-after on S3), so a listing crosses the link with the records written
    since the last one, not the whole slice again (listed whole, only LIST_BYTES_S bounded them;
    so, 2.5% of the bytes written in bench/scale_xdc.py). Names at or before the start
    are the last listing's; a record removed since (pruned: the retention's, hours old) stays
    known until the slice is listed whole. Stores that cannot list from a name are listed whole
    each time, as before. Every listing is charged to `budget` by what it carried. Thread-safe."""

    def __init__(self, store, journal_dir: str, budget: ListingBudget) -> None:
        self.store = store
        self.dir = journal_dir
        self.budget = budget
        self._lock = threading.Lock()
        self._slices: dict[str, _Slice] = {}
        self.counts = {"whole": 0, "tail": 0, "lagged": 0, "names_listed": 0}

    def listing(self, bucket: str, now: float, whole: bool = False) -> dict:
        """name -> Stat of every entry of the slice `bucket` (a slice nobody wrote in: none);
        `whole`: ask the store for all of it. Blocking (a store call); `now`: monotonic."""
        with self._lock:
            sl = self._slices.get(bucket)
            kept = sl is not None
            if sl is None:
                sl = _Slice()
        with sl.lock:
            start, kind = self._start(bucket, sl, now, whole)
            rel = slice_dir(self.dir, bucket)
            try:
                if start is None:
                    listed = dict(self.store.iter_dir(rel))
                else:
                    listed = dict(self.store.iter_dir_after(rel, start))
            except FileNotFoundError:
                listed = {}
            if start is None or sl.known is None:
                known = listed
            else:
                known = {n: st for n, st in sl.known.items() if n <= start}
                known.update(listed)
            if kind != "tail":
                sl.lagged_at = now
            sl.known = known
            # The newest record of the slice's own time: the last one if the listing kept it (it
            # started at or after it), or one listed now; a pass over the names kept only where
            # a listing from before the newest found none of the slice's after its start.
            lo = bucket_start_ns(bucket)
            tail = sl.tail if start is not None and sl.tail is not None and sl.tail <= start else None
            for name, st in listed.items():
                t = record_time_ns(name)
                if t is not None:
                    sl.late_ns = max(sl.late_ns, min(BUCKET_NS, int(getattr(st, "mtime_ns", 0) or 0) - t))
                    if lo is not None and lo <= t < lo + BUCKET_NS and (tail is None or name > tail):
                        tail = name
            sl.tail = tail if tail is not None or start is None else self._tail(bucket, known)
            self.counts[kind] += 1
            self.counts["names_listed"] += len(listed)
        self.budget.spent(listed, now)
        if not kept:
            self._keep(bucket, sl)
        return dict(known)

    def _start(self, bucket: str, sl: _Slice, now: float, whole: bool) -> tuple[str | None, str]:
        """(the name this listing starts after, None for the slice whole; which kind it is)."""
        if whole or sl.known is None or not getattr(self.store, "lists_after", False):
            return None, "whole"
        tail = sl.tail
        if tail is None:
            return None, "whole"
        if now - sl.lagged_at < LAGGED_EVERY_S:
            return tail, "tail"
        t = record_time_ns(tail)
        assert t is not None
        return f"{max(0, t - self.lag_ns()):020d}", "lagged"

    def lag_ns(self) -> int:
        """How far before a slice's newest record its lagged listings start (see LAG_NS)."""
        with self._lock:
            late = max((sl.late_ns for sl in self._slices.values()), default=0)
        return min(BUCKET_NS, max(LAG_NS, late + 10**9 if late > 0 else 0))

    @staticmethod
    def _tail(bucket: str, known: dict) -> str | None:
        """The newest record name of the slice's own time (names of other times, refused by the
        readers, must not move the start: one dated far ahead would hide every later record)."""
        lo = bucket_start_ns(bucket)
        if lo is None:
            return None
        names = [n for n in known if (t := record_time_ns(n)) is not None and lo <= t < lo + BUCKET_NS]
        return max(names, default=None)

    def _keep(self, bucket: str, sl: _Slice) -> None:
        """Remember the slice's names if it is among the KEPT_SLICES newest listed (a sweep's old
        slices are listed whole and not kept)."""
        with self._lock:
            if bucket in self._slices:
                return
            if len(self._slices) >= KEPT_SLICES:
                oldest = min(self._slices)
                if bucket < oldest:
                    return
                del self._slices[oldest]
            self._slices[bucket] = sl


def prune(store, journal_dir: str, older_than_ns: int, now_ns: int | None = None) -> int:
    """Delete the records written before `older_than_ns`, and those refused for their date or
    place (`refusal`: dated past the store's clock, or in another time's folder); returns how
    many went. Slice folders wholly before the cutoff are emptied and removed, and so are those
    dated more than MAX_SKEW_S past `now_ns` (this host's clock; each record in them is judged
    by the store's); records of older mounts directly in the journal folder are pruned the same
    way. Blocking (store calls): run it in a worker thread."""
    now = time.time_ns() if now_ns is None else now_ns
    gone = _prune_names(store, journal_dir, [(n, st) for n, st in list_folder(store, journal_dir) if not st.is_dir],
                        older_than_ns, None, now)
    for name, st in list_folder(store, f"{journal_dir}/{TIMED}"):
        start = bucket_start_ns(name)
        if start is None or not st.is_dir:
            continue
        future = start > now + MAX_SKEW_NS
        if start >= older_than_ns and not future:
            continue
        folder = slice_dir(journal_dir, name)
        gone += _prune_names(store, folder, list_folder(store, folder), older_than_ns, name, now)
        if future or start + BUCKET_NS <= older_than_ns:
            try:
                store.rmdir(folder)       # (a record written there since stays)
            except OSError:
                pass
    return gone


def _prune_names(store, folder: str, entries: list, older_than_ns: int, slice_name: str | None,
                 now_ns: int) -> int:
    gone = 0
    for name, st in entries:
        t = record_time_ns(name)
        if t is None or (t >= older_than_ns and refusal(name, st, slice_name, now_ns, versions=False) is None):
            continue
        try:
            store.unlink(f"{folder}/{name}")
            gone += 1
        except OSError:
            pass   # another writer pruned it first (or a folder named like a record: left alone)
    return gone


def prune_interval_s(retention_s: float) -> float:
    return min(600.0, max(0.05, retention_s / 10))


def encode_record(path: str, size: int, mtime_ns: int) -> bytes:
    doc: dict = {"path": path, "size": size, "mtime_ns": mtime_ns}
    if JOURNAL_VERSION != 1:
        doc["v"] = JOURNAL_VERSION
    return json.dumps(doc).encode()


_RECORD_KEYS = frozenset(("path", "size", "mtime_ns"))
_VERSIONED_KEYS = _RECORD_KEYS | {"v"}


def decode_record(data: bytes) -> dict:
    """The record in a record's content: one flat JSON object of exactly `path` (the one path
    rule), `size` and `mtime_ns` (integers in 0..2^63-1), at most MAX_RECORD_BYTES. ValueError
    saying why not (never RecursionError: nesting is refused before json.loads recurses)."""
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"{len(data)} bytes, more than {MAX_RECORD_BYTES}")
    text = data.decode("utf-8")      # (UnicodeDecodeError is a ValueError)
    if not nests_within(text, 1, arrays=False):   # one flat object
        raise ValueError("nested JSON: a record is one flat object")
    try:
        doc = json.loads(text)
    except RecursionError:           # (cannot happen after nests_within; never out of a round)
        raise ValueError("nested JSON") from None
    if isinstance(doc, dict) and set(doc) == _VERSIONED_KEYS:
        version = doc.pop("v")
        why = version_refusal(version) if type(version) is int else "its version v is not a number"
        if why:
            raise ValueError(why)
    if not isinstance(doc, dict) or set(doc) != _RECORD_KEYS:
        raise ValueError("not an object of exactly path, size and mtime_ns")
    return {"path": _record_path(doc["path"]), "size": _number(doc["size"], "size"),
            "mtime_ns": _number(doc["mtime_ns"], "mtime_ns")}


def _number(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= _NUMBER_MAX:
        raise ValueError(f"{what} must be an integer in 0..2^63-1")
    return value


def _digits(text: str, what: str) -> int:
    """A number of a `.rec` name: ASCII digits only (int() also takes '+1', ' 1', '1_0', '١')."""
    if not (text.isascii() and text.isdigit()) or len(text) > 19:
        raise ValueError(f"{what} is not a number")
    return _number(int(text), what)


def _record_path(path: object) -> str:
    """A record names a store path: the one path rule applies (a record is a file anyone with
    write access to the store's journal folder could have written). ValueError if refused."""
    try:
        return relpath(path, what="journal record path")
    except OSError as err:
        raise ValueError(err.strerror) from None


def decode_name(name: str) -> dict | None:
    """The record carried by a `.rec` name; None for `.json` names (read the content) or junk."""
    if not name.endswith(".rec") or len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        return None
    if version_refusal(record_version(name)):
        return None      # (`refusal` says why; its content is not read either)
    try:
        _stem, size, mtime_ns, enc = _VERSIONED.sub("", name).removesuffix(".rec").split("~", 3)
        path = _record_path(base64.urlsafe_b64decode(enc + "=" * (-len(enc) % 4)).decode())
        return {"path": path, "size": _digits(size, "size"), "mtime_ns": _digits(mtime_ns, "mtime_ns")}
    except (ValueError, UnicodeDecodeError):
        return None


def refusal(name: str, st, slice_name: str | None, now_ns: int | None = None,
            versions: bool = True) -> str | None:
    """Why the record `name`, listed with the store's stat `st` in the time folder `slice_name`
    (None: directly in the journal folder, as older mounts wrote), is not to be acted on; None
    if it may be. A record dated more than MAX_SKEW_S past the store's clock (its own mtime as the
    store lists it: the S3 or HDFS server's, the file system's; the caller's clock where the
    store gives none) would outrank every real record and removal of its path until that date;
    one in a time folder not of its time was not written by a mount (`record_key`). One of a
    journal version this code does not read is refused too (`version_refusal`), unless
    `versions` is False: pruning keeps it for the readers that do."""
    t = record_time_ns(name)
    if t is None:
        return "not a record name"
    if versions:
        why = version_refusal(record_version(name))
        if why:
            return why
    if not st.is_file:
        return "not a regular file"
    if st.size > MAX_RECORD_BYTES:
        return f"{st.size} bytes, more than {MAX_RECORD_BYTES}"
    if slice_name is not None and bucket_of(t) != slice_name:
        return f"its date is not in the time folder {slice_name} it is listed in"
    clock = st.mtime_ns or (time.time_ns() if now_ns is None else now_ns)
    if t > clock + MAX_SKEW_NS:
        return (f"dated {(t - clock) / 1e9:.0f} s past the store's clock (more than {MAX_SKEW_S:g} s: "
                "not acted on, pruned by the training mounts)")
    return None


# -- who may write and read the journal on the store ----------------------------------------------
def has_modes(store) -> bool:
    """The store reports real owners and modes and can set them: file:// stores (whose metadata
    the kernel answers inline). Object stores (S3, HDFS through pyarrow) report fixed ones (root,
    0755): their own access control on the journal's prefix is what guards it."""
    return bool(getattr(store, "inline_metadata", False))


def trusted_owners(store) -> set[int]:
    """Owners of journal folders a reader or writer trusts: root, this process's user, and the
    owner of the store root (who may change anything in the store anyway). Blocking."""
    return {0, os.geteuid(), store.stat("").uid}


def _folder_problem(rel: str, st, trusted: set[int], sticky_ok: bool) -> str | None:
    if not st.is_dir:
        return f"{rel} is not a folder"
    if st.uid not in trusted:
        return f"{rel} is owned by uid {st.uid}, not by root, this process's user or the store root's owner"
    if st.mode & 0o022 and not (sticky_ok and st.mode & stat_mod.S_ISVTX):
        return f"{rel} is writable by other users (mode {stat_mod.S_IMODE(st.mode):o})"
    return None


def _ancestors_problem(store, journal_dir: str, trusted: set[int]) -> str | None:
    """The folders above the journal folder (not the store root): a sticky one is fine (others
    may add names to it, not replace ours). FileNotFoundError if one is missing."""
    parts = journal_dir.split("/")
    for i in range(1, len(parts)):
        rel = "/".join(parts[:i])
        why = _folder_problem(rel, store.stat(rel), trusted, sticky_ok=True)
        if why:
            return why
    return None


def journal_problem(store, journal_dir: str, listed: dict | None = None) -> str | None:
    """(a follower) Why the journal in `journal_dir` must not be followed, or None: each of its
    folders (and those above it) owned by a trusted user (`trusted_owners`) and writable by no
    other (so nobody else can have written a record in it). `listed`: the journal folder's own
    listing (name -> stat), for the stat of its time folder. Nothing to check, and no store call,
    on stores without modes (`has_modes`). FileNotFoundError when there is no journal. Blocking."""
    if not has_modes(store):
        return None
    trusted = trusted_owners(store)
    why = _ancestors_problem(store, journal_dir, trusted)
    if why:
        return why
    why = _folder_problem(journal_dir, store.stat(journal_dir), trusted, sticky_ok=False)
    if why is None and listed is not None and TIMED in listed:
        why = _folder_problem(f"{journal_dir}/{TIMED}", listed[TIMED], trusted, sticky_ok=False)
    return why


class JournalRefused(OSError):
    """The journal folder cannot be made private to this mount (`prepare_journal`)."""


def prepare_journal(store, journal_dir: str) -> tuple[int, int]:
    """(a writer, once before its first record) Make the journal folder and its time folder
    private: created 0700 where missing, narrowed where ours and wider (an older mount's 0755).
    The group read bits (r-x) of a journal folder others have no access to are kept: an operator
    who gives it a group (`chgrp G; chmod 2750`) lets that group's agents read the records on the
    store (an older mount's 0755 is narrowed to 0700). Returns
    (mode of the folders, mode of the records) to write. JournalRefused (one line saying why)
    when a folder is another user's or writable by others and not ours to fix: no record is
    written there (it would name files to its owner, and that owner could forge records). On
    stores without modes nothing is checked: (0o700, 0o600). Blocking."""
    if not has_modes(store):
        return 0o700, 0o600
    trusted = trusted_owners(store)
    parts = journal_dir.split("/")
    for i in range(1, len(parts)):          # the folders above, as put_small makes them
        try:
            store.mkdir("/".join(parts[:i]), 0o755)
        except FileExistsError:
            pass
    why = _ancestors_problem(store, journal_dir, trusted)
    if why:
        raise JournalRefused(errno.EACCES, why)
    group, gid = 0, -1
    for rel in (journal_dir, f"{journal_dir}/{TIMED}"):
        try:
            store.mkdir(rel, 0o700 | group)
        except FileExistsError:
            pass
        st = store.stat(rel)
        if not st.is_dir or st.uid not in trusted:
            raise JournalRefused(errno.EACCES, _folder_problem(rel, st, trusted, sticky_ok=False) or rel)
        if rel == journal_dir:    # an operator's group: group r-x and nothing for others (not 0755)
            group, gid = (st.mode & 0o050, st.gid) if not st.mode & 0o027 else (0, -1)
        want = 0o700 | group
        if group:                 # time folders and records below take the group (setgid)
            want |= stat_mod.S_ISGID
            if st.gid != gid:
                try:
                    store.chown(rel, -1, gid)
                except OSError as err:
                    log.warning("journal: %s keeps gid %d (not %d): %s", rel, st.gid, gid, err.strerror)
        if stat_mod.S_IMODE(st.mode) != want:
            try:
                store.chmod(rel, want)
            except OSError as err:
                if st.mode & 0o027 & ~group:
                    raise JournalRefused(errno.EACCES, f"{rel} is mode {stat_mod.S_IMODE(st.mode):o} "
                                         f"and cannot be made {want:o}: {err.strerror}") from None
    return 0o700 | group, 0o600 | (group & 0o040)

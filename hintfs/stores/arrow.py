"""A store over any `pyarrow.fs` filesystem: S3 (with endpoint override), HDFS in production.

Every call may cross the network, so the operations layer runs all of them in worker threads.
Writes are staged in a local spool file and uploaded on close: S3 makes the object visible only
when the upload completes (atomic for readers); other filesystems get a temporary name and an
atomic rename.
"""
from __future__ import annotations

import contextlib
import errno
import itertools
import os
import stat as stat_mod
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlparse

import pyarrow.fs as pafs
from cachetools import LRUCache

from hintfs.common.errors import HintfsError
from hintfs.common.owndir import make_own_dir
from hintfs.stores.base import STAGING_PREFIX, Stat, Staging, StatxDirFactory, copy_fd
from hintfs.stores.readahead import Budget, ReadAhead, ReadPool
from hintfs.stores.s3get import S3Getter
from datetime import UTC

_seq = itertools.count()
_UPLOAD_CHUNK = 8 << 20
_FILE_MODE = stat_mod.S_IFREG | 0o644
_DIR_MODE = stat_mod.S_IFDIR | 0o755
_READ_THREADS = 16          # ranged reads ahead in flight, over all open files of a store
_READ_CHUNK = 8 << 20       # bytes per ranged read ahead (less where read_ahead_bytes is small)
_LISTED_MAX = 100_000       # entries of listings kept for stat (about 300 bytes each)
# A folder whose listed names keep being asked for after the listing's answers expired (a reader
# going through a big folder for longer than the attribute timeout) is listed again instead of a
# HEAD per name, after RELIST_AFTER_MISSES such stats: where the store lists from a name (S3 with
# explicit keys, `S3Getter.list_after`), one LIST page of RELIST_WINDOW_KEYS names from the name
# asked for (a window: what a reader going through the folder in order asks for next), whatever
# the folder's size; else the folder whole, if its last listing had at most RELIST_MAX_ENTRIES
# entries. A stat of a name the listing running now may answer waits for it (RELIST_WAIT_S at most).
# A listing made so that answered fewer than RELIST_AFTER_MISSES stats (a reader going through the
# folder in random order: a page of 1,000 names for a few answers) doubles the misses the next
# one waits for, up to RELIST_MAX_MISSES; one that answered that many brings them back.
RELIST_AFTER_MISSES = 8
RELIST_MAX_MISSES = 1024
RELIST_MAX_ENTRIES = 10_000
RELIST_WINDOW_KEYS = 1000
RELIST_WAIT_S = 30.0
_CHANGED_MAX = 10_000      # names changed while a listing runs, remembered one by one (then: all)


class ArrowReader:
    """One open file of a pyarrow filesystem: its reads are positional (`read_at`). `whole`: the
    object fetched whole at open (small objects: one GET), every read served from memory.
    `ahead`: read-ahead for sequential reads (hintfs.stores.readahead); `plain()` turns it off."""
    __slots__ = ("_file", "_lock", "whole", "_etag", "_ahead", "_held", "_budget", "counters", "ranged")

    def __init__(self, f, whole: bytes | None = None, etag: str | None = None, ahead: ReadAhead | None = None,
                 budget: Budget | None = None, counters: dict[str, int] | None = None):
        self._file = f
        self.counters = counters if counters is not None else {}   # (the store's: `store_gets`)
        self._lock = threading.Lock()
        self.whole = whole
        self._etag = etag
        self._ahead = ahead
        self._budget = budget
        self._held = len(whole) if whole is not None and budget is not None else 0
        # (key, S3Getter) where this object's ranges can be read straight into a buffer
        # (`read_into`: the host cache's fetch); None elsewhere.
        self.ranged: tuple[str, S3Getter] | None = None

    def read_into(self, offset: int, buf: memoryview) -> bool:
        """Fill `buf` with the object's bytes at `offset`, of this open's version, by one ranged
        GET whose body lands in `buf` itself (`S3Getter.get_range_into`); False where this reader
        cannot (no signing keys, not S3, no ETag) or the store answered anything else (another
        version, an error): read the range with `read` instead. Counted as a GET either way."""
        ranged = self.ranged
        if ranged is None or self.whole is not None:
            return False
        etag = self.etag
        if not etag:
            return False
        c = self.counters
        c["store_gets"] = c.get("store_gets", 0) + 1
        key, getter = ranged
        if getter.get_range_into(key, offset, buf, etag):
            c["store_gets_into"] = c.get("store_gets_into", 0) + 1
            return True
        c["store_gets_into_refused"] = c.get("store_gets_into_refused", 0) + 1
        return False

    def read(self, offset: int, size: int) -> bytes:
        whole = self.whole
        if whole is not None:
            return whole[offset:offset + size]
        ahead = self._ahead
        if ahead is not None:
            return ahead.read(offset, size)
        return self._read_at(offset, size)

    def _read_at(self, offset: int, size: int) -> bytes:
        # read_at is positional and thread-safe in Arrow; no seek state is shared. One GET.
        c = self.counters
        c["store_gets"] = c.get("store_gets", 0) + 1
        data: bytes = self._file.read_at(size, offset)
        return data

    def read_nowait(self, offset: int, size: int) -> bytes | None:
        whole = self.whole
        if whole is not None:
            return whole[offset:offset + size]
        ahead = self._ahead
        return ahead.read_nowait(offset, size) if ahead is not None else None

    def plain(self) -> None:
        """No read-ahead: reads ask the store for what they ask (the host cache's fetch reads
        whole blocks itself)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.close()

    @property
    def etag(self) -> str:
        """The object's ETag from the open's own HEAD (no request); "" where the filesystem has
        none (HDFS, a closed reader)."""
        if self._etag is not None:
            return self._etag
        f = self._file
        try:
            raw = f.metadata().get("ETag") if f is not None else None
        except Exception:   # pyarrow raises for filesystems without metadata
            raw = None
        return (raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw) or ""

    def close(self) -> None:
        with self._lock:
            self.plain()
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._held and self._budget is not None:
                self._budget.give(self._held)
                self._held = 0
            self.whole = None


def _last_modified_ns(meta) -> int | None:
    """Last-Modified of an S3 object's HEAD (`2026-11-29T17:02:24Z`, seconds) in ns, or None."""
    raw = meta.get("Last-Modified") if meta is not None else None
    if not raw:
        return None
    from datetime import datetime
    try:
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        dt = datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return None
    return int(dt.timestamp()) * 1_000_000_000


def _stat_of(info: pafs.FileInfo, s3: bool = False) -> Stat:
    """The attributes of a pyarrow entry; on S3 (`s3`) a file's time in whole seconds (`_s3_file`)."""
    mtime = info.mtime_ns or 0
    if info.type == pafs.FileType.Directory:
        return Stat(_DIR_MODE, 0, mtime, mtime, 2)
    if info.type == pafs.FileType.File:
        return _s3_file(info.size or 0, mtime) if s3 else Stat(_FILE_MODE, info.size or 0, mtime, mtime, 1)
    raise FileNotFoundError(errno.ENOENT, "not found", info.path)


def _s3_file(size: int, mtime_ns: int) -> Stat:
    """An S3 object's attributes, its time in whole seconds: a listing gives milliseconds, a HEAD
    or a GET (Last-Modified, an HTTP date) whole seconds, and a file whose time changed from one
    answer to the next would look changed (the kernel drops its cached pages; tools that compare
    times read it again)."""
    mtime = mtime_ns - mtime_ns % 1_000_000_000
    return Stat(_FILE_MODE, size, mtime, mtime, 1)


# A folder's attributes (the root's, and what pyarrow's stat gives an S3 folder: no mtime).
_DIR_STAT = Stat(_DIR_MODE, 0, 0, 0, 2)

CHECKSUM_ENV = "AWS_REQUEST_CHECKSUM_CALCULATION"
_checksum_lock = threading.Lock()


def request_checksum_of(store_cfg) -> str | None:
    """The request checksum policy an S3 store runs with: `[store] request_checksum` when given,
    else "when_required" for a store with `endpoint_override` (S3-compatible servers: MinIO-based
    gateways, many on-site servers refuse the SDK's default, which sends multipart parts with a
    CRC trailer in aws-chunked encoding: `MissingContentLength`), else None (the AWS SDK's own
    default, or whatever the environment already says)."""
    explicit: str | None = getattr(store_cfg, "request_checksum", None)
    if explicit:
        return explicit
    if store_cfg.endpoint_override and not os.environ.get(CHECKSUM_ENV):
        return "when_required"
    return None


def s3_filesystem(policy: str | None, **kwargs) -> pafs.S3FileSystem:
    """An S3FileSystem whose AWS client reads `policy` as AWS_REQUEST_CHECKSUM_CALCULATION.

    The AWS SDK has no pyarrow option for it: it reads the environment variable when a client's
    configuration is built, i.e. in the S3FileSystem constructor. The variable is set for the
    construction and put back afterwards (under a lock, so two stores built at once in one
    process cannot mix their settings); the daemons build their store once, at start."""
    if policy is None:
        return pafs.S3FileSystem(**kwargs)
    with _checksum_lock:
        before = os.environ.get(CHECKSUM_ENV)
        os.environ[CHECKSUM_ENV] = policy
        try:
            return pafs.S3FileSystem(**kwargs)
        finally:
            if before is None:
                os.environ.pop(CHECKSUM_ENV, None)
            else:
                os.environ[CHECKSUM_ENV] = before


def filesystem_from_config(store_cfg) -> tuple[pafs.FileSystem, str]:
    """Build the pyarrow filesystem and the root path inside it from the [store] section."""
    uri = store_cfg.uri
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        kwargs = dict(
            scheme=store_cfg.scheme,
            connect_timeout=store_cfg.connect_timeout_s,
            request_timeout=store_cfg.request_timeout_s,
        )
        if store_cfg.endpoint_override:
            kwargs["endpoint_override"] = store_cfg.endpoint_override
        if store_cfg.region:
            kwargs["region"] = store_cfg.region
        if store_cfg.access_key:
            kwargs["access_key"] = store_cfg.access_key
            kwargs["secret_key"] = store_cfg.secret_key or ""
        fs = s3_filesystem(request_checksum_of(store_cfg), **kwargs)
        root = (parsed.netloc + parsed.path).rstrip("/")
        return fs, root
    fs, root = pafs.FileSystem.from_uri(uri)
    return fs, root.rstrip("/")


class ArrowStore:
    inline_metadata = False
    passthrough_capable = False   # objects are not local files
    inode_numbers = False

    def __init__(self, fs: pafs.FileSystem, root: str, spool_dir: str, description: str, *,
                 whole_object_bytes: int = 1 << 20, read_ahead_bytes: int = 64 << 20,
                 read_buffer_bytes: int = 1 << 30, listing_ttl: Callable[[str], float] | None = None,
                 clock: Callable[[], float] = time.monotonic, getter: S3Getter | None = None):
        self.fs = fs
        self.root = root
        self.spool_dir = spool_dir
        self.description = description
        self._is_s3 = isinstance(fs, pafs.S3FileSystem)
        # Reads ([store] whole_object_bytes, read_ahead_bytes, read_buffer_bytes): every byte held
        # for open files (whole small objects, chunks read ahead) counts against one budget.
        self.whole_bytes = whole_object_bytes
        self.read_ahead_bytes = read_ahead_bytes
        self.read_budget = Budget(read_buffer_bytes)
        self._read_pool = ReadPool(_READ_THREADS)
        self.read_counters: dict[str, int] = {}
        # What a listing said of each entry, for `listing_ttl(path)` seconds (the mount's attribute
        # timeout of that path: as long as the kernel keeps attributes it got with a listing): a stat of a
        # listed name is answered from it, no HEAD per file. Bounded; every change through this
        # store forgets what it touches.
        self._listing_ttl = listing_ttl
        self._clock = clock
        self._listed: LRUCache | None = LRUCache(maxsize=_LISTED_MAX) if listing_ttl is not None else None
        self._listed_lock = threading.Lock()
        # folder -> [stats of its expired names since its last listing, entries of that listing,
        # the stats its last listing made again answered (a list shared by the entries it gave:
        # see `_listed`), the misses the next one waits for] (`_relist_due`); the folders being
        # listed again now -> the name their listing starts after ("" for a whole folder), and
        # the condition their end is told by.
        self._relist: LRUCache = LRUCache(maxsize=1024)
        self._relisting: dict[str, str] = {}
        self._relisted = threading.Condition(self._listed_lock)
        # Listings in flight, and what changed through this store while one was (`_forget_listed`):
        # a listing asked for before a change may answer from before it, so it keeps no answer of
        # what changed after it began (`_listing`, `_note_listed`).
        self._changes = 0
        self._listings_running = 0
        self._changed: dict[str, int] = {}
        self._changed_all = -1   # (a tree changed, or too many names to remember: every name)
        # Small objects opened in one GET (hintfs.stores.s3get): the sizes listings and stats said
        # (any age: only which request the open makes depends on it), bounded like `_listed`.
        self._getter = getter if self._is_s3 and whole_object_bytes > 0 else None
        self._sizes: LRUCache | None = LRUCache(maxsize=_LISTED_MAX) if self._getter is not None else None
        # Listings of the names after a given one (S3 with explicit keys: `iter_dir_after`).
        self._lister = getter if self._is_s3 else None
        # A folder -> an object a listing showed in it (S3): its stat is two HEADs, not two and a LIST.
        self._children: LRUCache | None = LRUCache(maxsize=_LISTED_MAX // 10) if self._is_s3 else None
        os.close(self._spool())      # at mount time: one line if the spool is not the daemon's own

    def _spool(self) -> int:
        """An fd of the spool folder, the daemon's own (hintfs.common.owndir: made 0700; another user's
        folder or a symlink refused, HintfsError). Opened and checked again for each staging
        file: a folder swapped in after the mount is refused, never written into."""
        return make_own_dir(self.spool_dir, f"cache.spool_dir {self.spool_dir}", "stage writes there")

    def _p(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def refuse_device(self, st_dev: int, statx_dir: StatxDirFactory | None = None) -> None:
        """Objects live on no device: nothing of the mount can appear in the store."""

    def check(self) -> None:
        info = self.fs.get_file_info(self.root)
        if info.type == pafs.FileType.NotFound:
            raise HintfsError(errno.ENOENT, f"its root {self.root} does not exist (create it, or fix [store] uri)")
        if info.type != pafs.FileType.Directory:
            raise HintfsError(errno.ENOTDIR, f"its root {self.root} is not a folder (give the store's root "
                              "in [store] uri)")
        os.close(self._spool())

    def stat(self, rel: str) -> Stat:
        if rel == "" and self._is_s3:
            # A bucket (or prefix) has no attributes of its own (no mtime): the root checked at
            # mount time is a directory. No request: the kernel asks for the root's attributes
            # whenever they expire, and each request is a round trip on a long link.
            return _DIR_STAT
        listed = self._listed
        if listed is not None:
            with self._listed_lock:
                kept = listed.get(rel)
            if kept is not None and self._clock() < kept[1]:
                self._count("stat_from_listing")
                if kept[2] is not None:
                    kept[2][0] += 1   # (a listing made again: counted, `_relist_due`; no lock: a tally)
                st: Stat = kept[0]
                return st
            if kept is not None and rel and self._is_s3:
                again = self._relisted_stat(rel)
                if again is not None:
                    return again
        if self._children is not None:
            known = self._dir_by_child(rel)
            if known is not None:
                return known
        self._count("store_heads")
        info = self.fs.get_file_info(self._p(rel))
        st = _stat_of(info, self._is_s3)
        if st.is_file:
            self._size_seen(rel, st.size)
        return st

    def _relisted_stat(self, rel: str) -> Stat | None:
        """A stat of `rel`, a name a listing gave whose answer expired, answered by listing its
        folder again (RELIST_AFTER_MISSES): by this caller when due (`_relist_due`), or by the
        listing another thread is making now, waited for, if that listing may hold `rel`. None:
        not answered so (the caller asks the store for `rel` alone)."""
        folder, _, name = rel.rpartition("/")
        listed = self._listed
        assert listed is not None
        window = self._lister is not None
        with self._relisted:
            after = self._relisting.get(folder)
            if after is not None:
                if name <= after:
                    return None   # (a window that starts after this name: a HEAD is quicker)
                self._relisted.wait_for(lambda: folder not in self._relisting, timeout=RELIST_WAIT_S)
            elif (tally := self._relist_due(folder, window)) is not None:
                after = name[:-1] if window else ""   # (a prefix sorts before the name itself)
                self._relisting[folder] = after
                try:
                    self._relisted.release()   # (the listing is made with the lock let go)
                    try:
                        self._list_again(folder, after if window else None, tally)
                    except (OSError, ValueError):   # (ValueError: a name S3 cannot carry)
                        pass   # (the HEAD after this says what is wrong, if anything)
                finally:
                    self._relisted.acquire()
                    del self._relisting[folder]
                    self._relisted.notify_all()
            else:
                return None
            kept = listed.get(rel)
        if kept is not None and self._clock() < kept[1]:
            self._count("stat_from_relisting")
            if kept[2] is not None:
                kept[2][0] += 1
            st: Stat = kept[0]
            return st
        return None

    def _relist_due(self, folder: str, window: bool) -> list[int] | None:   # under self._listed_lock
        """One more stat of a name `folder`'s listing gave, after that answer expired: on the
        last of the misses its next listing waits for (RELIST_AFTER_MISSES, doubled after each
        listing again that answered fewer stats than that, up to RELIST_MAX_MISSES), if the
        folder can be listed again (a window of it always, the whole folder if its last listing
        was small enough), the tally of stats the listing this caller makes now will answer;
        else None."""
        seen = self._relist.get(folder)
        if seen is None:
            if not window:
                return None
            seen = self._relist[folder] = [0, 0, None, RELIST_AFTER_MISSES]
        if seen[1] > RELIST_MAX_ENTRIES and not window:
            return None
        seen[0] += 1
        last, need = seen[2], seen[3]
        if last is not None:   # (what the last listing made again answered so far)
            need = RELIST_AFTER_MISSES if last[0] >= RELIST_AFTER_MISSES else min(2 * need, RELIST_MAX_MISSES)
        if seen[0] < need:
            return None
        tally = [0]
        seen[0], seen[2], seen[3] = 0, tally, need
        return tally

    def _list_again(self, folder: str, after: str | None, tally: list[int] | None = None) -> None:
        """List `folder` again for the stats to come: whole (`after` None), or one LIST page of
        RELIST_WINDOW_KEYS names sorting after `after` (`S3Getter.list_after`); each entry is
        answered for its attribute timeout, as `iter_dir`'s are, and counted in `tally` when it is."""
        if after is None:
            self._list_whole(folder, tally)
            return
        assert self._lister is not None
        now = self._clock()   # (when the listing was asked for: its entries are that old)
        with self._listing() as began:
            entries = self._lister.list_after(self._folder_key(folder), after, max_keys=RELIST_WINDOW_KEYS)
            if entries is None:
                return
            self._count("store_list_windows")
            for name, size, ns, is_dir in entries:
                if not name.startswith(STAGING_PREFIX):
                    self._note_listed(folder, name, _DIR_STAT if is_dir else _s3_file(size, ns), now, began, tally)

    def _folder_key(self, rel: str) -> str:
        """The key prefix of folder `rel`'s entries ("" for the bucket's top)."""
        key = self._key(rel) if rel or "/" in self.root else ""
        return f"{key}/" if key else ""

    @contextlib.contextmanager
    def _listing(self) -> Iterator[int]:
        """A listing asked for now, until it is read: gives the count of changes it comes after
        (`_note_listed`'s `began`); changes meanwhile are remembered (`_forget_listed`)."""
        with self._listed_lock:
            self._listings_running += 1
            began = self._changes
        try:
            yield began
        finally:
            with self._listed_lock:
                self._listings_running -= 1
                if not self._listings_running:
                    self._changed.clear()

    def _note_listed(self, folder: str, name: str, st: Stat, now: float, began: int,
                     tally: list[int] | None = None) -> None:
        """A listing made at `now`, after `began` changes, said `st` of `folder`'s entry `name`:
        stats of it are answered so for its attribute timeout (counted in `tally`, for a listing
        made again), unless it changed through this store since (the listing may be from before
        that); its next open is one GET if small."""
        child = f"{folder}/{name}" if folder else name
        if self._listed is not None and self._listing_ttl is not None:
            ttl = self._listing_ttl(child)
            if ttl > 0:
                with self._listed_lock:
                    if self._changed_all < began and self._changed.get(child, -1) < began:
                        self._listed[child] = (st, now + ttl, tally)
        if st.is_file and self._sizes is not None:
            self._size_seen(child, st.size)

    def _dir_by_child(self, rel: str) -> Stat | None:
        """A folder a listing showed with an object in it, asked in two HEADs: `rel` is no object
        (404) and that object is still there, so the prefix exists: a folder, as pyarrow's stat
        would find with two HEADs and a LIST (the LIST costs a server like JuiceFS's gateway a
        listing of the whole folder: ~9 ms of its CPU per stat of a folder of 400, against 0.8
        for a HEAD). The answer is kept as a listing's is, for the folder's attribute timeout
        (the kernel asks again for a folder every reader's lookups walk through). None: ask as
        before."""
        assert self._children is not None
        with self._listed_lock:
            child = self._children.get(rel)
        if child is None:
            return None
        now = self._clock()
        with self._listing() as began:
            self._count("store_heads")
            try:
                self.fs.open_input_file(self._p(rel)).close()   # (a HEAD; an object by that name: ask as before)
                return None
            except FileNotFoundError:
                pass
            self._count("store_heads")
            try:
                self.fs.open_input_file(self._p(child)).close()
            except FileNotFoundError:
                with self._listed_lock:
                    self._children.pop(rel, None)
                return None
            self._count("stat_dir_by_child")
            parent, _, name = rel.rpartition("/")
            self._note_listed(parent, name, _DIR_STAT, now, began)
        return _DIR_STAT

    def _size_seen(self, rel: str, size: int) -> None:
        """A listing or a stat said `rel` is a file of `size` bytes: its next open is one GET if small."""
        sizes = self._sizes
        if sizes is not None:
            with self._listed_lock:
                if 0 < size <= self.whole_bytes:
                    sizes[rel] = size
                else:
                    sizes.pop(rel, None)

    def iter_dir(self, rel: str) -> Iterator[tuple[str, Stat]]:
        yield from self._list_whole(rel)

    def _list_whole(self, rel: str, tally: list[int] | None = None) -> list[tuple[str, Stat]]:
        """Folder `rel`'s entries, listed whole; each is answered by stats for its attribute
        timeout (`_note_listed`, `tally`)."""
        path = self._p(rel)
        now = self._clock()   # (when the listing was asked for: its entries are that old)
        self._count("store_lists")
        with self._listing() as began:
            infos = self.fs.get_file_info(pafs.FileSelector(path, allow_not_found=False, recursive=False))
            entries: list[tuple[str, Stat]] = []
            for info in infos:
                name = info.base_name
                if not name or name.startswith(STAGING_PREFIX):
                    continue
                try:
                    st = _stat_of(info, self._is_s3)
                except FileNotFoundError:
                    continue
                self._note_listed(rel, name, st, now, began, tally)
                entries.append((name, st))
        if self._listed is not None:
            with self._listed_lock:
                seen = self._relist.get(rel)
                if seen is None:
                    self._relist[rel] = [0, len(infos), None, RELIST_AFTER_MISSES]
                else:
                    seen[0], seen[1] = 0, len(infos)
        if rel and self._children is not None:   # (the root needs none: it is never asked for)
            child = next((name for name, st in entries if st.is_file), None)
            if child is not None:
                with self._listed_lock:
                    self._children[rel] = f"{rel}/{child}"
        return entries

    @property
    def lists_after(self) -> bool:
        """`iter_dir_after` lists only the names asked for (one ListObjectsV2 with `start-after`);
        else it lists the folder whole and filters."""
        return self._lister is not None

    def iter_dir_after(self, rel: str, after: str) -> Iterator[tuple[str, Stat]]:
        """The entries of folder `rel` named after `after` (bytewise UTF-8 order, S3's), sorted,
        with no listing-cache side effects (the journal's readers use it). Where the store cannot
        list from a name, or the server's answer cannot be used (`S3Getter.list_after`), the whole
        folder through pyarrow, filtered."""
        listed = None
        if self._lister is not None:
            listed = self._lister.list_after(self._folder_key(rel), after)
        if listed is None:
            self._count("store_lists")
            infos = self.fs.get_file_info(pafs.FileSelector(self._p(rel), allow_not_found=False, recursive=False))
            entries = [(info.base_name, _stat_of(info, self._is_s3)) for info in infos
                       if info.type in (pafs.FileType.File, pafs.FileType.Directory)]
        else:
            self._count("store_lists_after")
            entries = [(name, _DIR_STAT if is_dir else _s3_file(size, ns)) for name, size, ns, is_dir in listed]
        for name, st in sorted(entries, key=lambda e: e[0]):
            # (S3 lists a folder `after/` after `after`: names are compared here too)
            if name > after and not name.startswith(STAGING_PREFIX):
                yield name, st

    def _forget_listed(self, *rels: str, tree: bool = False) -> None:
        """A change through this store: what listings said of `rels` (with `tree`, of everything
        below them too) is not answered any more."""
        with self._listed_lock:
            self._changes += 1
            if self._listings_running:
                if tree or len(self._changed) >= _CHANGED_MAX:
                    self._changed_all = self._changes
                else:
                    self._changed.update((rel, self._changes) for rel in rels)
            for kept in (self._listed, self._sizes):
                if kept is None:
                    continue
                for rel in rels:
                    kept.pop(rel, None)
                    if tree:
                        prefix = rel.rstrip("/") + "/" if rel else ""
                        for k in [k for k in list(kept.keys()) if k.startswith(prefix)]:
                            kept.pop(k, None)

    def open_reader(self, rel: str, lazy: bool = False) -> tuple[ArrowReader, Stat]:
        if self._is_s3:
            small = self._open_small(rel) if self._sizes is not None and not lazy else None
            if small is not None:
                return small
            # One request instead of two: opening sends a HEAD whose Last-Modified is the mtime
            # a stat would give (each request is a round trip on a long link).
            self._count("store_heads")
            try:
                f = self.fs.open_input_file(self._p(rel))
            except FileNotFoundError:
                f = None   # missing, or a "directory" (a prefix): the stat below says which
            if f is not None:
                mtime = _last_modified_ns(f.metadata())
                if mtime is not None:
                    size = f.size()
                    reader = self._reader(f, size, lazy)
                    if self._lister is not None and reader.whole is None:
                        reader.ranged = (self._key(rel), self._lister)
                    return reader, Stat(_FILE_MODE, size, mtime, mtime, 1, etag=reader.etag)
                f.close()
        info = self.fs.get_file_info(self._p(rel))
        st = _stat_of(info, self._is_s3)
        if st.is_dir:
            raise IsADirectoryError(errno.EISDIR, "is a directory", rel)
        f = self.fs.open_input_file(self._p(rel))
        return self._reader(f, f.size(), lazy), st

    def _open_small(self, rel: str) -> tuple[ArrowReader, Stat] | None:
        """An object a listing or stat said is small (up to `whole_bytes`): one GET gives its
        bytes and its version (hintfs.stores.s3get), instead of pyarrow's HEAD and GET. None
        where that GET cannot answer (missing, larger now, the read budget spent): open as usual."""
        assert self._sizes is not None and self._getter is not None
        with self._listed_lock:
            hint = self._sizes.get(rel)
        if hint is None or not self.read_budget.take(hint):
            return None
        self._count("store_gets")
        try:
            got = self._getter.get_whole(self._key(rel), self.whole_bytes)
        except BaseException:
            self.read_budget.give(hint)
            raise
        held = hint
        if got is not None and got.size != hint:
            if got.size < hint:
                self.read_budget.give(hint - got.size)
                held = got.size
            elif self.read_budget.take(got.size - hint):
                held = got.size
            else:
                got = None
        if got is None:
            self.read_budget.give(held)
            self._size_seen(rel, 0)   # (asked as usual from now on, until a listing or stat says small again)
            self._count("get_open_misses")
            return None
        self._count("whole_object_opens")
        self._count("get_opens")
        reader = ArrowReader(None, whole=got.data, etag=got.etag, budget=self.read_budget, counters=self.read_counters)
        return reader, Stat(_FILE_MODE, got.size, got.mtime_ns, got.mtime_ns, 1, etag=got.etag)

    def _key(self, rel: str) -> str:
        """The object key of `rel` within the bucket (the root's first part)."""
        return self._p(rel).split("/", 1)[1]

    def _reader(self, f, size: int, lazy: bool = False) -> ArrowReader:
        """The reader of an open file: a small object (up to `whole_bytes`) read whole now, in one
        request, if the read budget allows; else one whose sequential reads read ahead. `lazy`:
        neither (`Store.open_reader`)."""
        if lazy:
            return ArrowReader(f, counters=self.read_counters)
        if 0 < size <= self.whole_bytes and self.read_budget.take(size):
            try:
                self._count("store_gets")
                data = f.read_at(size, 0)
            except BaseException:
                self.read_budget.give(size)
                f.close()
                raise
            if len(data) == size:   # (else the object changed since the open's HEAD: read as asked)
                etag = ArrowReader(f).etag
                f.close()
                self._count("whole_object_opens")
                return ArrowReader(None, whole=data, etag=etag, budget=self.read_budget)
            self.read_budget.give(size)
        reader = ArrowReader(f, counters=self.read_counters)
        if self.read_ahead_bytes > 0 and size > 0:
            reader._ahead = ReadAhead(reader._read_at, size, self.read_ahead_bytes, self.read_budget,
                                      self._read_pool, _READ_CHUNK, self.read_counters)
        return reader

    def _count(self, key: str) -> None:
        self.read_counters[key] = self.read_counters.get(key, 0) + 1

    def attach_stats(self, stats) -> None:
        """Keep the read counters (`whole_object_opens`, `stat_from_listing`, `readahead_*`) in the
        mount's `Stats` from now on (the host cache forwards its own call here)."""
        target = stats.counters
        if target is not self.read_counters:
            for key, value in self.read_counters.items():
                target[key] = target.get(key, 0) + value
            self.read_counters = target

    def current(self, rel: str) -> Stat:
        """An S3 object's version from its HEAD (as `open_reader`'s, with the ETag); elsewhere `stat`."""
        self._count("store_heads")
        if not self._is_s3:   # (asked of the store: never a listing's answer, `stat` may give one)
            return _stat_of(self.fs.get_file_info(self._p(rel)))
        try:
            f = self.fs.open_input_file(self._p(rel))   # (its HEAD only: no byte is read)
        except FileNotFoundError:
            f = None
        if f is not None:
            try:
                mtime = _last_modified_ns(f.metadata())
                if mtime is not None:
                    return Stat(_FILE_MODE, f.size(), mtime, mtime, 1, etag=ArrowReader(f).etag)
            finally:
                f.close()
        reader, st = self.open_reader(rel)
        reader.close()
        return st

    def open_data(self, rel: str) -> ArrowReader:
        """A reader without a Stat: one request less than `open_reader` on an object store (for
        copies whose version the caller knows already)."""
        return ArrowReader(self.fs.open_input_file(self._p(rel)), counters=self.read_counters)   # (no read-ahead: copies read big blocks)

    def readlink(self, rel: str) -> str:
        raise HintfsError(errno.EINVAL, "this store has no symlinks")

    def symlink(self, rel: str, target: str) -> None:
        raise HintfsError(errno.EPERM, "this store has no symlinks")

    def mknod(self, rel: str, mode: int, rdev: int) -> None:
        raise HintfsError(errno.EPERM, "this store has no FIFOs, sockets or device nodes")

    def link(self, src: str, dst: str) -> None:
        raise HintfsError(errno.EPERM, "this store has no hard links")

    def statfs(self):
        return None

    def mkdir(self, rel: str, mode: int) -> None:
        self._forget_listed(rel)
        if self.fs.get_file_info(self._p(rel)).type != pafs.FileType.NotFound:
            raise FileExistsError(errno.EEXIST, "exists", rel)
        self.fs.create_dir(self._p(rel), recursive=False)

    def rmdir(self, rel: str) -> None:
        self._forget_listed(rel, tree=True)
        path = self._p(rel)
        info = self.fs.get_file_info(path)
        if info.type != pafs.FileType.Directory:
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", rel)
        if self.fs.get_file_info(pafs.FileSelector(path, recursive=False)):
            raise OSError(errno.ENOTEMPTY, "directory not empty", rel)
        self.fs.delete_dir(path)

    def unlink(self, rel: str) -> None:
        self._forget_listed(rel)
        info = self.fs.get_file_info(self._p(rel))
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(errno.ENOENT, "not found", rel)
        if info.type == pafs.FileType.Directory:
            raise IsADirectoryError(errno.EISDIR, "is a directory", rel)
        self.fs.delete_file(self._p(rel))
        self._forget_listed(rel)

    def rename(self, src: str, dst: str, noreplace: bool) -> None:
        self._forget_listed(src, dst, tree=True)
        dst_info = self.fs.get_file_info(self._p(dst))
        if noreplace and dst_info.type != pafs.FileType.NotFound:
            raise FileExistsError(errno.EEXIST, "target exists", dst)
        src_info = self.fs.get_file_info(self._p(src))
        if src_info.type == pafs.FileType.Directory and self._is_s3:
            self._rename_tree(src, dst)
        else:
            self.fs.move(self._p(src), self._p(dst))
        self._forget_listed(src, dst, tree=True)

    def _rename_tree(self, src: str, dst: str) -> None:
        """S3 has no directory rename: copy each object, then delete the originals (not atomic)."""
        if self.fs.get_file_info(self._p(dst)).type == pafs.FileType.Directory:
            if self.fs.get_file_info(pafs.FileSelector(self._p(dst), recursive=False)):
                raise OSError(errno.ENOTEMPTY, "target directory not empty", dst)
        self.fs.create_dir(self._p(dst), recursive=True)
        infos = self.fs.get_file_info(pafs.FileSelector(self._p(src), recursive=True))
        prefix = self._p(src) + "/"
        for info in sorted(infos, key=lambda i: i.path):
            tail = info.path[len(prefix):]
            if info.type == pafs.FileType.Directory:
                self.fs.create_dir(self._p(f"{dst}/{tail}"), recursive=True)
            else:
                self.fs.copy_file(info.path, self._p(f"{dst}/{tail}"))
        # One DeleteObject per object, deepest first, each folder when it is empty: pyarrow's
        # delete_dir of a folder with objects sends DeleteObjects, which MinIO-based servers (JuiceFS's
        # gateway among them) refuse from current AWS SDKs (`MissingContentMD5`: the SDK sends a CRC32
        # checksum, no Content-MD5, whatever request_checksum says).
        for info in sorted(infos, key=lambda i: i.path.count("/"), reverse=True):
            if info.type == pafs.FileType.Directory:
                self.fs.delete_dir(info.path)
            else:
                self.fs.delete_file(info.path)
        self.fs.delete_dir(self._p(src))

    def chmod(self, rel: str, mode: int) -> None:
        raise HintfsError(errno.EPERM, "this store has no permissions to change")

    def chown(self, rel: str, uid: int, gid: int) -> None:
        raise HintfsError(errno.EPERM, "this store has no owners to change")

    def utimens(self, rel: str, atime_ns: int, mtime_ns: int) -> None:
        # Object stores set mtime at upload; accept and ignore (as s3fs-fuse does) so `cp -p`,
        # `touch` and `tar` keep working.
        self.stat(rel)

    def new_staging(self, rel: str, copy_existing: bool, source: Staging | None = None) -> Staging:
        name = f"{STAGING_PREFIX}{os.getpid()}.{next(_seq)}"
        path = os.path.join(self.spool_dir, name)
        spool = self._spool()
        try:      # (in the folder just checked, by its fd: not in one swapped in meanwhile)
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=spool)
            try:
                os.unlink(name, dir_fd=spool)  # the spool file needs no name: nothing can leak if we die
                # An open writer's attributes are its staging file's: the mode every object shows
                # (nameless in a 0700 folder, nobody else can open it anyway)
                os.fchmod(fd, _FILE_MODE & 0o777)
            except BaseException:
                os.close(fd)
                raise
        finally:
            os.close(spool)
        try:
            if copy_existing and source is not None:
                copy_fd(source.fd, fd, os.fstat(source.fd).st_size)
            elif copy_existing:
                info = self.fs.get_file_info(self._p(rel))
                if info.type == pafs.FileType.File:
                    with self.fs.open_input_stream(self._p(rel)) as src:
                        offset = 0
                        while True:
                            chunk = src.read(_UPLOAD_CHUNK)
                            if not chunk:
                                break
                            os.pwrite(fd, chunk, offset)
                            offset += len(chunk)
        except BaseException:
            os.close(fd)
            raise
        from hintfs.stores.local import read_mode
        staging = Staging(fd, path, rel)
        staging.inline_io = read_mode(os.fstat(fd).st_dev) == "memory"
        return staging

    def commit(self, staging: Staging, rel: str, keep: bool = False) -> Stat:
        self._forget_listed(rel)
        # (an upload never changes the staging file: `keep` needs nothing more)
        target = self._p(rel)
        dest = target if self._is_s3 else f"{os.path.dirname(target)}/{STAGING_PREFIX}{os.getpid()}.{next(_seq)}"
        size = os.fstat(staging.fd).st_size
        with self.fs.open_output_stream(dest) as out:
            offset = 0
            while offset < size:
                chunk = os.pread(staging.fd, min(_UPLOAD_CHUNK, size - offset), offset)
                if not chunk:
                    break
                out.write(chunk)
                offset += len(chunk)
        if dest != target:
            self.fs.move(dest, target)
        self._forget_listed(rel)   # (a listing that ran during the upload may have put it back)
        staging.dirty = False
        return self.current(rel)    # (on S3 the HEAD with the new object's ETag: `Stat.version`)

    def put_small(self, rel: str, data: bytes) -> None:
        """Write a small file whole (journal records); one PUT on S3."""
        self._forget_listed(rel)
        parent = os.path.dirname(self._p(rel))
        if not self._is_s3:
            self.fs.create_dir(parent, recursive=True)
        with self.fs.open_output_stream(self._p(rel)) as out:
            out.write(data)
        self._forget_listed(rel)

    def discard(self, staging: Staging) -> None:
        staging.close()

    def unname(self, staging: Staging) -> None:
        """(spool files have no name)"""

    def follow(self, staging: Staging, rel: str) -> None:
        """(spool files are not beside their target)"""

    def nameless_copy(self, staging: Staging) -> Staging:
        """(a spool file is never the published object: nothing to copy from)"""
        raise HintfsError(errno.EINVAL, "spool files are never live")

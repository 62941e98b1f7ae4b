"""A host cache for remote stores: whole files on a local disk, served at kernel speed.

`HostCachedStore` wraps a remote store (S3, HDFS). Every call goes to that store, except reads:

- `open_reader` asks the store for the file (one request on S3: the open's HEAD gives size,
  Last-Modified and ETag: its *version*). If the cache holds a complete copy of exactly that
  version, the open is answered with a local reader that has an `fd` (so the mount can hand the
  file to the kernel: FUSE passthrough) and the store reader is closed. Otherwise the store's
  reader is returned, and its first read asks for a whole-file fetch of that version in the
  background; once the fetch completes, later reads of the same open switch to the local copy.
- A fetch is ranged parallel reads (`fetch_block_bytes` each, `fetch_threads` in flight over all
  files) into a temporary file, its size checked, the store's version checked again at the end
  (a file replaced meanwhile is dropped), then one rename makes it complete. A fetch that fails or
  is overtaken by a change through the mount is never served. At most one fetch per path runs at
  once; a failed path+version is not tried again for `RETRY_AFTER_S`.
- Writes through the mount (commit, put_small), unlink, rename, rmdir, and attribute changes drop
  the cached copies of the paths they touch and cancel their fetches. A change made by anyone else
  is caught at the next open by the version check (close-to-open).
- The index is a `cachetools.LRUCache` sized in bytes (`budget_bytes`); making room evicts the least
  recently opened files. An evicted file that is still open keeps its bytes (the open fd holds
  them) until it is closed.

The cache directory is created 0700 and must be owned by the daemon's user. Each store gets a
subdirectory named by a hash of the store's URI, locked (flock) by one daemon at a time. Files are
named by a hash of their store path: no path in the cache is ever built from a remote name. Each
file carries its path and version in an extended attribute, so a restarted daemon finds its cache
again (every entry is still verified against the store at its next open).

Counters (`hostcache_*`) are kept in `self.counters`; `attach_stats(stats)` makes them part of the
mount's stats. `close()` stops the fetches and must be called at unmount. docs/hostcache.md.
"""
from __future__ import annotations

import concurrent.futures as cf
import errno
import fcntl
import hashlib
import itertools
import json
import logging
import mmap
import os
import stat as stat_mod
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast
from collections.abc import Callable, Iterator

from cachetools import LRUCache, TTLCache

from hintfs.common.errors import HintfsError
from hintfs.common.formatversion import placed
from hintfs.common.owndir import make_own_dir, open_own_dir
from hintfs.stores.base import Reader, Stat, Staging, StatxDirFactory, Store
from hintfs.stores.local import LocalReader, read_mode
from hintfs.stores.readahead import ReadPool

log = logging.getLogger("hintfs.hostcache")

RETRY_AFTER_S = 30.0          # a fetch of a path+version that failed is not tried again before this
XATTR = "user.hintfs.hostcache"   # {"path": rel, "version": [size, mtime_ns, etag], "v": 1} of a complete file
# The xattr's format version (docs/versions.md; none: 1, as written before versions). A file whose
# xattr is of a version this code does not read is dropped at start like any unknown file: the
# cache fetches it again from the store.
XATTR_VERSION = 1
XATTR_READS = (1, 1)
_NAME_LEN = 64                # sha256 hex
_TMP_SUFFIX = ".tmp"
_LOCK_NAME = ".lock"
# Files fetched at once: a worker mostly waits for its blocks (the `fetch_threads` read threads are
# shared by all files, and each file keeps at most `fetch_threads` blocks in flight, so the files
# of several readers are fetched side by side, not one after another).
_FILE_WORKERS = 16
_seq = itertools.count()
_R = TypeVar("_R")
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 8)

COUNTERS = ("hostcache_hits", "hostcache_misses", "hostcache_stale", "hostcache_switched",
            "hostcache_fetches", "hostcache_fetched_bytes", "hostcache_fetch_failed",
            "hostcache_fetch_dropped", "hostcache_fetch_skipped", "hostcache_evictions",
            "hostcache_evicted_bytes", "hostcache_invalidations", "hostcache_bytes", "hostcache_files",
            "hostcache_restored")

Version = tuple[int, int, str]   # (size, mtime_ns, etag or "")


def version_of(reader: Any, st: Stat) -> Version:
    """The store's version of an open file: size, mtime and, where the store has one, the ETag
    (S3's Last-Modified has whole seconds: a rewrite of the same size within a second differs only
    in its ETag). The ETag comes from the open's own HEAD, no extra request."""
    etag = st.etag or getattr(reader, "etag", "")   # hintfs.stores.arrow.ArrowReader.etag; local readers have none
    return (st.size, st.mtime_ns, str(etag or ""))


def cache_name(rel: str) -> str:
    """The cache file of a store path: a hash, so no remote name ever becomes a local path."""
    return hashlib.sha256(rel.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass
class _Entry:
    name: str
    version: Version
    size: int


@dataclass
class _Job:
    version: Version | None     # None: a prefetch (the version is whatever the store has)
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    # While the fetch runs (under the cache's lock): its file and the blocks already in it, so
    # reads of those ranges are local before the whole file is (`read_partial`).
    fd: int = -1
    size: int = 0
    blocks: set = field(default_factory=set)
    # Which blocks were handed to the read threads, and where the next ones come from: the fetch
    # reads forward from `cursor`, which a reader ahead of it moves to where it reads (then wraps
    # around to the blocks it skipped), so the fetch is the open's read-ahead.
    submitted: set = field(default_factory=set)
    cursor: int = 0
    nblocks: int = 0
    started: bool = False       # a worker has it
    # The fetch's file mapped (shared, read-write) where its blocks are read straight into it
    # (`_fetch_block`); reads of fetched blocks are answered from it. Never closed by hand: a
    # reply still holding a view keeps it mapped until the view goes.
    mm: mmap.mmap | None = None

    def next_block(self) -> int | None:
        """The next block to fetch: the first not yet submitted at or after `cursor`, wrapping."""
        n = self.nblocks
        for i in range(n):
            b = (self.cursor + i) % n
            if b not in self.submitted:
                self.cursor = b
                return b
        return None


class _Index(LRUCache):
    """The in-memory index: store path -> complete cached file, sized in bytes, least recently
    used evicted first (its file unlinked by `on_evict`)."""

    def __init__(self, budget: int, on_evict: Callable[[str, _Entry], None]):
        super().__init__(maxsize=budget, getsizeof=lambda e: e.size)
        self._on_evict = on_evict

    def popitem(self):
        key, entry = super().popitem()
        self._on_evict(key, entry)
        return key, entry


class _Stale(Exception):
    """The fetch no longer matches the store (or was cancelled): dropped, not an error."""


class CachedReader:
    """A store reader whose first read asks for the whole file to be fetched; once the fetch of
    this version is complete, reads go to the local copy (page-cache hits then served inline)."""

    __slots__ = ("_cache", "_rel", "_version", "_reader", "_asked", "_local", "_seen", "_switch")

    def __init__(self, cache: HostCachedStore, rel: str, version: Version, reader: Reader):
        self._cache = cache
        self._rel = rel
        self._version = version
        self._reader = reader
        self._asked = False
        self._local: LocalReader | None = None
        self._seen = -1
        self._switch = threading.Lock()   # reads of one open may run in several threads at once

    def read(self, offset: int, size: int) -> bytes:
        local = self._local
        if local is None and (not self._asked or self._cache.completed != self._seen):
            with self._switch:
                local = self._local
                if local is None:
                    if not self._asked:
                        self._asked = True
                        self._cache.want(self._rel, self._version)
                    done = self._cache.completed
                    if done != self._seen:     # a fetch finished since the last look: ours?
                        self._seen = done
                        local = self._local = self._cache.open_local(self._rel, self._version)
                        if local is not None:
                            self._cache.count("hostcache_switched")
        if local is not None:
            return local.read(offset, size)
        if self._asked:
            data = self._cache.read_fetched(self._rel, self._version, offset, size)
            if data is not None:
                return data
            local = self._cache.open_local(self._rel, self._version) if self._cache.completed != self._seen else None
            if local is not None:   # the fetch completed while this read waited
                with self._switch:
                    if self._local is None:
                        self._local = local
                        self._cache.count("hostcache_switched")
                    else:
                        local.close()
                return self._local.read(offset, size)
        return self._reader.read(offset, size)

    def read_nowait(self, offset: int, size: int) -> bytes | None:
        local = self._local
        if local is not None:
            return cast("bytes | None", local.read_nowait(offset, size))
        if self._asked:   # blocks already fetched, in the page cache: served on the event loop
            return self._cache.read_fetched_nowait(self._rel, self._version, offset, size)
        return None

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
        self._reader.close()


class HostCachedStore:
    """A `Store` over a remote store, with whole files cached on this host (see the module doc)."""

    def __init__(self, store: Store, cache_cfg, *, store_id: str | None = None):
        self._store = store
        self.inline_metadata = store.inline_metadata
        self.description = store.description
        # Complete cached files are local files (and so are the staging files of a remote store's
        # writes: a plain read-write fd in the spool), so FUSE passthrough may serve both.
        self.passthrough_capable = True
        self.inode_numbers = store.inode_numbers
        self.budget = cache_cfg.budget_bytes
        self.min_bytes = cache_cfg.min_file_bytes
        self.max_bytes = min(cache_cfg.max_file_bytes or cache_cfg.budget_bytes, cache_cfg.budget_bytes)
        self.block = cache_cfg.fetch_block_bytes
        self.map_fetches = cache_cfg.fetch_mapped   # (blocks read into a mapping of the file: _fetch_block)
        self.buffer_fetches = cache_cfg.fetch_buffered   # (else into a fetch thread's own buffer, then pwrite)
        self._buffers = threading.local()               # each fetch thread's buffer (`_buffer`)
        self.counters: dict[str, int] = defaultdict(int)
        for key in COUNTERS:
            self.counters[key] = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)   # a block fetched, a fetch started or ended
        self._window = cache_cfg.fetch_threads          # blocks in flight per file
        self._index = _Index(self.budget, self._evicted)
        self._fetching: dict[str, _Job] = {}
        self._failed: TTLCache = TTLCache(maxsize=10_000, ttl=RETRY_AFTER_S)
        self._reserved = 0
        self.completed = 0          # fetches completed (readers look for their file when it moves)
        self._closed = False
        self._files = ReadPool(_FILE_WORKERS, "hostcache-file")
        self._running = 0           # fetches that have a worker (the others wait for one)
        self._blocks = ReadPool(cache_cfg.fetch_threads, "hostcache-read")
        self.root, self.dir_fd, self._lock_fd = _open_cache_dir(cache_cfg.dir, store_id or store.description)
        self._dev = os.fstat(self.dir_fd).st_dev
        self._read_mode = read_mode(self._dev)
        try:
            self._restore()
        except BaseException:
            self._release_dir()
            raise

    # -- counters --------------------------------------------------------------------------------
    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n

    def attach_stats(self, stats) -> None:
        """Keep the counters in the mount's `Stats` (its `counters` dict) from now on, so they show
        in `.hintfs/stats`, `hintfs status` and the metrics. Idempotent."""
        target = stats.counters
        inner = getattr(self._store, "attach_stats", None)
        if inner is not None:
            inner(stats)
        with self._lock:
            if target is self.counters:
                return
            for key, value in self.counters.items():
                target[key] = target.get(key, 0) + value
            self.counters = target

    def _gauges(self) -> None:   # under self._lock
        self.counters["hostcache_bytes"] = int(self._index.currsize)
        self.counters["hostcache_files"] = len(self._index)

    # -- the cache directory ---------------------------------------------------------------------
    def _restore(self) -> None:
        """Index the complete files a previous daemon left (oldest first, so the LRU order is
        roughly kept); remove temporary files and anything unknown."""
        found = []
        for name in os.listdir(self.dir_fd):
            if name == _LOCK_NAME:
                continue
            entry = None
            rel = None
            if len(name) == _NAME_LEN and all(c in "0123456789abcdef" for c in name):
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=self.dir_fd)
                except OSError:
                    fd = -1
                if fd >= 0:
                    try:
                        st = os.fstat(fd)
                        meta = json.loads(os.getxattr(fd, XATTR))
                        rel, version = meta["path"], tuple(meta["version"])
                        v = meta.get("v", 1)
                        if (stat_mod.S_ISREG(st.st_mode) and isinstance(rel, str) and cache_name(rel) == name
                                and placed(v, XATTR_READS) is None
                                and len(version) == 3 and version[0] == st.st_size):
                            entry = (st.st_ctime_ns, rel, _Entry(name, (int(version[0]), int(version[1]),
                                                                        str(version[2])), st.st_size))
                    except (OSError, ValueError, KeyError, TypeError):
                        entry = None
                    finally:
                        os.close(fd)
            if entry is not None and entry[2].size <= self.max_bytes:
                found.append(entry)
            else:
                _unlink_quiet(self.dir_fd, name)
        for _ctime, rel, e in sorted(found, key=lambda t: t[0]):
            with self._lock:
                self._index[rel] = e        # over the budget (a smaller one now): the oldest go
                self.counters["hostcache_restored"] += 1
                self._gauges()
        if found:
            log.info("host cache %s: %d files (%d bytes) kept from before", self.root, len(self._index),
                     self._index.currsize)

    def _evicted(self, rel: str, entry: _Entry) -> None:   # under self._lock
        _unlink_quiet(self.dir_fd, entry.name)
        self.counters["hostcache_evictions"] += 1
        self.counters["hostcache_evicted_bytes"] += entry.size

    def _drop(self, rel: str) -> None:   # under self._lock
        entry = self._index.pop(rel, None)
        if entry is not None:
            _unlink_quiet(self.dir_fd, entry.name)

    def open_local(self, rel: str, version: Version) -> LocalReader | None:
        """A reader of the complete cached copy of exactly `version`, or None."""
        with self._lock:
            if self._closed:
                return None
            entry = self._index.get(rel)      # (a get makes it the most recently used)
            if entry is None:
                return None
            if entry.version != version:
                self.counters["hostcache_stale"] += 1
                self._drop(rel)
                self._gauges()
                return None
            try:
                fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dir_fd)
            except OSError as err:
                log.warning("host cache: the copy of %s cannot be opened (%s): dropped", rel, err.strerror)
                self._index.pop(rel, None)
                self._gauges()
                return None
        st = os.fstat(fd)
        if st.st_size != entry.size:
            os.close(fd)
            log.warning("host cache: the copy of %s has %d bytes, not %d: dropped", rel, st.st_size, entry.size)
            self.invalidate(rel)
            return None
        return LocalReader(fd, st.st_dev)

    # -- fetching --------------------------------------------------------------------------------
    def want(self, rel: str, version: Version | None) -> bool:
        """Fetch `rel` (at `version`; None: whatever the store has) in the background unless it is
        cached, being fetched, out of bounds or failed lately. Never blocks on the store."""
        with self._lock:
            if self._closed:
                return False
            if version is not None:
                entry = self._index.get(rel)
                if entry is not None and entry.version == version:
                    return False
                if not self.min_bytes <= version[0] <= self.max_bytes or version[0] == 0:
                    self.counters["hostcache_fetch_skipped"] += 1
                    return False
                if (rel, version) in self._failed:
                    return False
            running = self._fetching.get(rel)
            if running is not None:
                if version is None or running.version in (None, version):
                    return False
                running.cancelled = True   # an older version: it would be dropped at its end anyway
            job = self._fetching[rel] = _Job(version)
        self._files.submit(self._fetch, rel, job)
        return True

    def prefetch(self, rel: str) -> bool:
        """Fetch a file ahead of its first read (a hint said it will be read): non-blocking."""
        return self.want(rel, None)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no fetch is in flight (tests and benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                jobs = list(self._fetching.values())
            if not jobs:
                return True
            for job in jobs:
                if not job.done.wait(max(0.0, deadline - time.monotonic())):
                    return False

    def _fetch(self, rel: str, job: _Job) -> None:
        reader = None
        fd = -1
        tmp = ""
        reserved = 0
        version = job.version
        with self._cond:
            self._running += 1
            job.started = True
        try:
            reader, st = self._store.open_reader(rel)
            plain = getattr(reader, "plain", None)
            if plain is not None:
                plain()           # (no read-ahead: the fetch reads whole blocks itself)
            now = version_of(reader, st)
            if version is None:   # a prefetch: this version, unless it is cached already
                version = now
                with self._lock:
                    entry = self._index.get(rel)
                    if entry is not None and entry.version == version:
                        return
                if not self.min_bytes <= st.size <= self.max_bytes or st.size == 0:
                    self.count("hostcache_fetch_skipped")
                    return
            if now != version:
                raise _Stale("the store has another version than the one opened")
            size = st.size
            with self._lock:
                if not self._make_room(size):
                    self.counters["hostcache_fetch_skipped"] += 1
                    log.debug("host cache: no room for %s (%d bytes) while other fetches run", rel, size)
                    return
                self._reserved += size
                reserved = size
            name = cache_name(rel)
            tmp = f"{name}.{os.getpid()}.{next(_seq)}{_TMP_SUFFIX}"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=self.dir_fd)
            mm = None
            try:
                os.posix_fallocate(fd, 0, size)   # ENOSPC now, not halfway through
                allocated = True
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                allocated = False
            if allocated and self.map_fetches and getattr(reader, "ranged", None) is not None:
                # Every page is allocated: stores through the mapping cannot fail (no SIGBUS).
                try:
                    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                except (OSError, ValueError) as err:   # (a filesystem without shared mappings)
                    log.debug("host cache: %s not mapped (%s): written with pwrite", rel, err)
            with self._cond:
                job.fd, job.size, job.version, job.mm = fd, size, version, mm
                job.nblocks = -(-size // self.block)
                self._cond.notify_all()
            self._fetch_blocks(job, reader, fd)
            if os.fstat(fd).st_size != size:
                raise OSError(errno.EIO, f"fetched file has {os.fstat(fd).st_size} bytes, not {size}")
            # The store's version again: a file replaced during the fetch may have mixed its bytes.
            current = getattr(self._store, "current", None)
            if current is not None:   # (a HEAD on S3: the version, no byte read)
                after = version_of(None, current(rel))
            else:
                check, st2 = self._store.open_reader(rel)
                try:
                    after = version_of(check, st2)
                finally:
                    check.close()
            if after != version:
                raise _Stale("the file changed in the store during the fetch")
            try:   # what a restarted daemon indexes the file by (no xattrs here: it starts empty)
                os.setxattr(fd, XATTR, json.dumps({"path": rel, "version": list(version),
                                                   "v": XATTR_VERSION}).encode())
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EPERM):
                    raise
            os.utime(fd, ns=(st.mtime_ns, st.mtime_ns))   # what an fstat of an unlinked open file shows
            with self._lock:
                if self._closed or job.cancelled:
                    raise _Stale("changed through the mount during the fetch")
                os.rename(tmp, name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
                tmp = ""
                self._index.pop(rel, None)   # the same name: the rename replaced its file
                self._reserved -= reserved
                reserved = 0
                self._make_room(size)
                self._index[rel] = _Entry(name, version, size)
                self.counters["hostcache_fetches"] += 1
                self.counters["hostcache_fetched_bytes"] += size
                self.completed += 1
                self._gauges()
            log.debug("host cache: %s fetched (%d bytes)", rel, size)
        except _Stale as why:
            self.count("hostcache_fetch_dropped")
            log.debug("host cache: fetch of %s dropped: %s", rel, why)
        except Exception as err:
            with self._lock:
                self.counters["hostcache_fetch_failed"] += 1
                if version is not None:
                    self._failed[(rel, version)] = True
            if not self._closed:
                log.warning("host cache: fetch of %s failed (read from the store meanwhile): %s", rel, err)
        finally:
            with self._lock:
                job.fd = -1                    # no new partial read takes it (they dup it)
                job.mm = None                  # (unmapped once no reply holds a view of it)
            if fd >= 0:
                os.close(fd)
            if tmp:
                _unlink_quiet(self.dir_fd, tmp)
            if reader is not None:
                try:
                    reader.close()
                except Exception:
                    pass
            with self._cond:
                self._reserved -= reserved
                self._running -= 1
                if self._fetching.get(rel) is job:
                    del self._fetching[rel]
                job.done.set()
                self._cond.notify_all()

    def _fetch_block(self, job: _Job, reader: Reader, fd: int, off: int, n: int) -> None:
        if self._closed or job.cancelled:
            raise _Stale("stopped")
        start = off
        mm = job.mm
        if mm is not None:
            # Into the mapping of the file: the GET's body goes from the socket to the file's
            # pages (one copy), where a read through pyarrow and a pwrite copy it three times.
            # (Not MADV_POPULATE_WRITE first: on a 16-core host that made the fetch slower
            # than letting the copy fault the pages in, bench/notes/s3_cold.md.)
            with memoryview(mm) as whole, whole[off:off + n] as view:
                if not reader.read_into(off, view):   # type: ignore[attr-defined]
                    got = reader.read(off, n)
                    if len(got) != n:
                        raise OSError(errno.EIO, f"short read from the store: {len(got)} of {n} bytes at {off}")
                    view[:] = got
        else:
            buf = self._buffer(n) if self.buffer_fetches and getattr(reader, "ranged", None) is not None else None
            if buf is not None and reader.read_into(off, buf[:n]):   # type: ignore[attr-defined]
                # The GET's body into this thread's buffer (its pages long in place), then one
                # pwrite: no page faults on the cache file's pages, which a 16-core host paid for
                # in the mapping (bench/notes/s3_cold.md), and no pyarrow.
                data = buf[:n]
            else:
                data = memoryview(reader.read(off, n))
            if len(data) != n:
                raise OSError(errno.EIO, f"short read from the store: {len(data)} of {n} bytes at {off}")
            while data:
                w = os.pwrite(fd, data, off)
                data, off = data[w:], off + w
        with self._cond:
            job.blocks.add(start // self.block)
            self._cond.notify_all()

    def _buffer(self, n: int) -> memoryview:
        """This fetch thread's buffer of at least `n` bytes (one a thread: `fetch_threads` x
        `fetch_block_bytes` in all, allocated and touched once)."""
        buf = getattr(self._buffers, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._buffers.buf = memoryview(bytearray(max(n, self.block)))
        return buf

    def _fetch_blocks(self, job: _Job, reader: Reader, fd: int) -> None:
        """Every block of `job` into `fd`, at most `self._window` of them in flight (in the shared
        read threads), in the order `job.next_block` gives; raises the first failure (after every
        block in flight has stopped: none may write into fd once it is closed), _Stale if stopped."""
        inflight: set[cf.Future] = set()
        failed: BaseException | None = None
        while True:
            with self._cond:
                while failed is None and len(inflight) < self._window:
                    b = job.next_block()
                    if b is None:
                        break
                    job.submitted.add(b)
                    off = b * self.block
                    inflight.add(self._blocks.submit(self._fetch_block, job, reader, fd, off,
                                                     min(self.block, job.size - off)))
            if not inflight:
                break
            done, inflight = cf.wait(inflight, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                if fut.cancelled():
                    failed = failed or _Stale("stopped")
                elif fut.exception() is not None:
                    failed = failed or fut.exception()
            if failed is not None:
                for fut in inflight:
                    fut.cancel()
                cf.wait(inflight)
                inflight = set()
        if failed is not None:
            raise failed

    def read_fetched(self, rel: str, version: Version, offset: int, size: int) -> bytes | None:
        """Bytes of `rel` at `version` from its fetch (the open's read-ahead): when every block
        they lie in is fetched, or being fetched, or follows in line (the first of them not yet asked
        for is within `fetch_threads` blocks of the fetch's cursor), wait for those blocks and read them from the fetch's file; a range
        further away moves the fetch's cursor there and is answered None (read it from the store:
        the fetch reaches it soon after). None as well when no fetch of this version runs or it
        ends first (then the cache may hold it complete: `open_local`)."""
        with self._cond:
            while True:
                job = self._fetching.get(rel)
                if job is None or job.cancelled or job.version not in (None, version) or job.done.is_set():
                    return None
                if job.fd < 0:
                    if not job.started and self._running >= _FILE_WORKERS:   # queued behind other files
                        return None
                    self._cond.wait()        # starting: its HEAD (the size) comes first
                    continue
                end = min(offset + size, job.size)
                if end <= offset:
                    return None
                first, last = offset // self.block, (end - 1) // self.block
                missing = [b for b in range(first, last + 1) if b not in job.blocks]
                if not missing:
                    self.counters["hostcache_partial_reads"] += 1
                    mm = job.mm
                    fd = os.dup(job.fd) if mm is None else -1
                    break
                ahead = [b for b in missing if b not in job.submitted]
                if ahead and not 0 <= ahead[0] - job.cursor <= self._window:
                    job.cursor = ahead[0]    # the reader is elsewhere: the fetch follows it
                    self.counters["hostcache_fetch_jumps"] += 1
                    return None
                self.counters["hostcache_read_waits"] += 1
                self._cond.wait()
        if mm is not None:   # (copied out of the mapping with no lock held)
            return mm[offset:end]
        try:
            return os.pread(fd, end - offset, offset)
        finally:
            os.close(fd)

    def read_fetched_nowait(self, rel: str, version: Version, offset: int, size: int) -> bytes | None:
        """`read_fetched` when every block is in the fetch's file already and its pages are in
        the page cache (RWF_NOWAIT): never waits; else None."""
        with self._lock:
            job = self._fetching.get(rel)
            if job is None or job.fd < 0 or job.version != version or job.cancelled:
                return None
            end = min(offset + size, job.size)
            if end <= offset or any(b not in job.blocks
                                    for b in range(offset // self.block, (end - 1) // self.block + 1)):
                return None
            mm = job.mm
            if mm is not None and self._read_mode == "memory":
                # A view of the mapping: the reply copies from the file's pages. (On a disk a
                # page written back and then reclaimed would be read from it by a fault, on the
                # event loop: there the bytes come by RWF_NOWAIT as before.)
                self.counters["hostcache_partial_reads"] += 1
                with memoryview(mm) as whole:
                    return cast(bytes, whole[offset:end])
            fd = os.dup(job.fd)
        mode = self._read_mode      # (local.read_mode: a memory filesystem is read inline, always)
        try:
            buf = bytearray(end - offset)
            try:
                if mode == "memory":
                    n = os.preadv(fd, [buf], offset)
                elif mode == "nowait":
                    n = os.preadv(fd, [buf], offset, _RWF_NOWAIT)
                else:
                    return None
            except (BlockingIOError, OSError):
                return None
        finally:
            os.close(fd)
        if n != len(buf):
            return None
        self.count("hostcache_partial_reads")
        return cast(bytes, buf)   # (a bytearray, as LocalReader.read_nowait's: the mount replies with it)

    def read_partial(self, rel: str, version: Version, offset: int, size: int) -> bytes | None:
        """Bytes of `rel` at `version` from a fetch still running, when every block they lie in
        is already in its file (read from the same version as the store reader would); None
        otherwise. A file replaced in the store meanwhile is the store reader's case too."""
        with self._lock:
            job = self._fetching.get(rel)
            if job is None or job.fd < 0 or job.version != version or job.cancelled:
                return None
            end = min(offset + size, job.size)
            if end <= offset:
                return None
            if any(b not in job.blocks for b in range(offset // self.block, (end - 1) // self.block + 1)):
                return None
            self.counters["hostcache_partial_reads"] += 1
            mm = job.mm
            fd = os.dup(job.fd) if mm is None else -1
        if mm is not None:   # (copied out of the mapping with no lock held)
            return mm[offset:end]
        try:
            return os.pread(fd, end - offset, offset)
        finally:
            os.close(fd)

    def _make_room(self, size: int) -> bool:   # under self._lock
        """Evict least recently used files until `size` more bytes fit beside the complete files
        and the fetches in flight; False if the fetches in flight alone leave no room."""
        if self._reserved + size > self.budget:
            return False
        while self._index.currsize + self._reserved + size > self.budget and len(self._index):
            self._index.popitem()
        self._gauges()
        return True

    # -- invalidation ----------------------------------------------------------------------------
    def invalidate(self, rel: str, tree: bool = False) -> None:
        """Forget `rel` (and with `tree`, everything below it): its cached copy is removed and a
        fetch of it in flight is never made complete."""
        prefix = rel.rstrip("/") + "/" if rel else ""

        def hit(k: str) -> bool:
            return k == rel or (tree and k.startswith(prefix))

        with self._lock:
            if tree:
                touched = [k for k in self._index if hit(k)]
            else:
                touched = [rel] if rel in self._index else []
            for k in touched:
                self._drop(k)
            for k, job in self._fetching.items():
                if hit(k):
                    job.cancelled = True
            self._cond.notify_all()   # (readers waiting for its blocks read from the store)
            if touched:
                self.counters["hostcache_invalidations"] += len(touched)
                self._gauges()

    # -- the Store interface: reads ---------------------------------------------------------------
    def open_reader(self, rel: str, lazy: bool = False) -> tuple[Reader, Stat]:
        if lazy:    # (no bytes at the open: nothing to keep either; reads go to the store)
            return self._store.open_reader(rel, lazy=True)
        reader, st = self._store.open_reader(rel)
        try:
            version = version_of(reader, st)
            local = self.open_local(rel, version)
        except BaseException:
            reader.close()
            raise
        if local is not None:
            reader.close()
            self.count("hostcache_hits")
            return local, st
        self.count("hostcache_misses")
        whole = getattr(reader, "whole", None)
        if whole is not None:
            # A small object the store read whole at open (one GET): kept here now, from these
            # very bytes (hintfs.stores.arrow.ArrowStore._reader), and the open served from the
            # copy just written, so that the kernel can read it itself (passthrough: no READ
            # request reaches the daemon); from the bytes in memory if it was not kept.
            kept = self._keep_whole(rel, version, whole)
            if kept is not None:
                reader.close()
                return kept, st
            return reader, st
        plain = getattr(reader, "plain", None)
        if plain is not None:
            plain()   # the cache's fetch is this open's read-ahead (`read_fetched`)
        return CachedReader(self, rel, version, reader), st

    def _keep_whole(self, rel: str, version: Version, data: bytes) -> LocalReader | None:
        """Enter `data`, the whole of `rel` at `version` (read in one request), as a complete copy,
        within the bounds and the budget as a fetch would; never over a fetch of `rel` running.
        A reader of the copy if it was entered, else None."""
        size = len(data)
        if size != version[0] or not self.min_bytes <= size <= self.max_bytes or size == 0:
            return None
        with self._lock:
            if self._closed or rel in self._fetching or (rel, version) in self._failed:
                return None
            entry = self._index.get(rel)
            if entry is not None and entry.version == version:
                return None
            if not self._make_room(size):
                self.counters["hostcache_fetch_skipped"] += 1
                return None
            self._reserved += size
            job = self._fetching[rel] = _Job(version)   # (a change through the mount cancels it)
            job.started = True
        name = cache_name(rel)
        tmp = f"{name}.{os.getpid()}.{next(_seq)}{_TMP_SUFFIX}"
        fd = -1
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=self.dir_fd)
            view = memoryview(data)
            off = 0
            while off < size:
                off += os.pwrite(fd, view[off:], off)
            try:
                os.setxattr(fd, XATTR, json.dumps({"path": rel, "version": list(version),
                                                   "v": XATTR_VERSION}).encode())
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EPERM):
                    raise
            os.utime(fd, ns=(version[1], version[1]))
            with self._lock:
                if self._closed or job.cancelled:
                    raise _Stale("changed through the mount")
                os.rename(tmp, name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
                tmp = ""
                try:   # (under the lock: the name is this version's until the lock is let go)
                    copy = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dir_fd)
                except OSError:
                    copy = -1   # (kept all the same; this open reads the bytes in memory)
                self._index.pop(rel, None)
                self._reserved -= size
                size = 0
                self._make_room(len(data))
                self._index[rel] = _Entry(name, version, len(data))
                self.counters["hostcache_fetches"] += 1
                self.counters["hostcache_fetched_bytes"] += len(data)
                self.counters["hostcache_whole"] += 1
                self.completed += 1
                self._gauges()
        except _Stale:
            self.count("hostcache_fetch_dropped")
            return None
        except OSError as err:
            self.count("hostcache_fetch_failed")
            log.warning("host cache: %s not kept: %s", rel, err)
            return None
        finally:
            if fd >= 0:
                os.close(fd)
            if tmp:
                _unlink_quiet(self.dir_fd, tmp)
            with self._cond:
                self._reserved -= size
                if self._fetching.get(rel) is job:
                    del self._fetching[rel]
                job.done.set()
                self._cond.notify_all()
        return LocalReader(copy, self._dev) if copy >= 0 else None

    def stat(self, rel: str) -> Stat:
        return self._store.stat(rel)

    def current(self, rel: str) -> Stat:
        return self._store.current(rel)

    def iter_dir(self, rel: str) -> Iterator[tuple[str, Stat]]:
        return self._store.iter_dir(rel)

    @property
    def lists_after(self) -> bool:
        return self._store.lists_after

    def iter_dir_after(self, rel: str, after: str) -> Iterator[tuple[str, Stat]]:
        return self._store.iter_dir_after(rel, after)

    def readlink(self, rel: str) -> str:
        return self._store.readlink(rel)

    def statfs(self) -> os.statvfs_result | None:
        return self._store.statfs()

    def check(self) -> None:
        self._store.check()

    def refuse_device(self, st_dev: int, statx_dir: StatxDirFactory | None = None) -> None:
        self._store.refuse_device(st_dev, statx_dir)

    # -- the Store interface: changes (each forgets what it touches, before and after) -----------
    def _changing(self, rels: tuple[str, ...], tree: bool, fn: Callable[..., _R], *args: Any) -> _R:
        for rel in rels:
            self.invalidate(rel, tree)
        try:
            return fn(*args)
        finally:
            for rel in rels:
                self.invalidate(rel, tree)

    def symlink(self, rel: str, target: str) -> None:
        self._changing((rel,), False, self._store.symlink, rel, target)

    def mknod(self, rel: str, mode: int, rdev: int) -> None:
        self._changing((rel,), False, self._store.mknod, rel, mode, rdev)

    def link(self, src: str, dst: str) -> None:
        self._changing((dst,), False, self._store.link, src, dst)

    def mkdir(self, rel: str, mode: int) -> None:
        self._store.mkdir(rel, mode)

    def rmdir(self, rel: str) -> None:
        self._changing((rel,), True, self._store.rmdir, rel)

    def unlink(self, rel: str) -> None:
        self._changing((rel,), False, self._store.unlink, rel)

    def rename(self, src: str, dst: str, noreplace: bool) -> None:
        self._changing((src, dst), True, self._store.rename, src, dst, noreplace)

    def chmod(self, rel: str, mode: int) -> None:
        self._changing((rel,), False, self._store.chmod, rel, mode)

    def chown(self, rel: str, uid: int, gid: int) -> None:
        self._changing((rel,), False, self._store.chown, rel, uid, gid)

    def utimens(self, rel: str, atime_ns: int, mtime_ns: int) -> None:
        self._changing((rel,), False, self._store.utimens, rel, atime_ns, mtime_ns)

    def new_staging(self, rel: str, copy_existing: bool, source: Staging | None = None) -> Staging:
        return self._store.new_staging(rel, copy_existing, source)

    def commit(self, staging: Staging, rel: str, keep: bool = False) -> Stat:
        if keep:
            return self._changing((rel,), False, self._store.commit, staging, rel, keep)
        return self._changing((rel,), False, self._store.commit, staging, rel)

    def discard(self, staging: Staging) -> None:
        self._store.discard(staging)

    def unname(self, staging: Staging) -> None:
        self._store.unname(staging)

    def follow(self, staging: Staging, rel: str) -> None:
        self._store.follow(staging, rel)

    def nameless_copy(self, staging: Staging) -> Staging:
        return self._store.nameless_copy(staging)

    def put_small(self, rel: str, data: bytes) -> None:
        self._changing((rel,), False, self._store.put_small, rel, data)

    def __getattr__(self, name: str):
        # Extras of the wrapped store (ArrowStore.open_data, spool_dir, ...), unchanged.
        if name.startswith("__") or name == "_store":
            raise AttributeError(name)
        return getattr(self._store, name)

    # -- shutdown --------------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Stop fetching (at unmount): fetches in flight are dropped, their temporary files removed;
        complete files stay for the next daemon. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for job in self._fetching.values():
                job.cancelled = True
            self._cond.notify_all()
        joined = self._blocks.close(timeout)
        joined = self._files.close(timeout) and joined
        if joined:
            self._release_dir()
        else:   # a thread still runs (a store read that does not return): it may still use the fds
            log.warning("host cache: fetch threads did not stop within %gs", timeout)

    def _release_dir(self) -> None:
        for fd in (self._lock_fd, self.dir_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._lock_fd = self.dir_fd = -1


def _unlink_quiet(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as err:
        log.warning("host cache: cannot remove %s: %s", name, err.strerror)


def _open_cache_dir(path: str, store_id: str) -> tuple[str, int, int]:
    """(the store's cache subdirectory, an fd of it, the fd holding its lock). The directory and
    the subdirectory are the daemon's own (hintfs.common.owndir, the rule `cache.spool_dir` follows too):
    made 0700; a directory of another user, or a symlink, is refused (HintfsError, one line)."""
    top = make_own_dir(path, f"cache.dir {path}", _PURPOSE)
    try:
        sub = hashlib.sha256(store_id.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        try:
            os.mkdir(sub, 0o700, dir_fd=top)
        except FileExistsError:
            pass
        where = os.path.join(path, sub)
        fd = open_own_dir(sub, top, f"cache.dir {where}", _PURPOSE)
    finally:
        os.close(top)
    try:
        lock_fd = os.open(_LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise HintfsError(errno.EBUSY, f"cache.dir {where} is in use by another hintfs daemon of the same "
                              "store: give each mount its own cache.dir") from None
    except BaseException:
        os.close(fd)
        raise
    return where, fd, lock_fd


_PURPOSE = "keep cached files there"


__all__ = ["HostCachedStore", "CachedReader", "version_of", "cache_name"]

"""The page allocator (hintfs/governor/csrc/pagealloc.c) from Python: build it, put it behind torch, drive it.

`install(device)` makes it torch's CUDA allocator for the whole process (every thread, autograd's
included). It must run before anything touches CUDA memory. From then on the training client can
give back exactly the bytes the governor asks for: `release(keep_bytes)` unmaps empty 32 MiB pages
and returns them to the driver in about a millisecond per GB, with no `empty_cache`. Or it can
hand them to another process: `lend(keep_bytes)` returns one file descriptor per page.

`PageAllocator.host(...)` runs the same code on host memory (memfd pages). The CPU tests use it:
the bookkeeping, the release path and the fd handoff are the ones the GPU runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parent / "csrc" / "pagealloc.c"
PAGE_BYTES = 32 << 20
STAT_FIELDS = ("allocated", "peak_allocated", "mapped", "peak_mapped", "page_bytes", "allocs", "frees",
               "maps", "unmaps", "map_ns", "unmap_ns", "pages_lent", "ooms", "free_ranges", "va_bytes",
               "empty_pages", "unmap_calls", "idle_released", "handle_release_ns")

_installed: PageAllocator | None = None


class PageAllocError(RuntimeError):
    pass


def _build_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("HINTFS_BUILD_DIR"):
        dirs.append(Path(os.environ["HINTFS_BUILD_DIR"]))
    dirs.append(SRC.parent.parent.parent / "build")       # a source checkout
    dirs.append(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hintfs")
    return dirs


def library_path() -> Path:
    """The compiled library, built on first use (one C file, no CUDA headers: libcuda is
    dlopen'd at run time). Named by the source's hash, so an edit rebuilds it."""
    digest = hashlib.sha256(SRC.read_bytes()).hexdigest()[:12]
    name = f"pagealloc-{digest}.so"
    for d in _build_dirs():
        if (d / name).exists():
            return d / name
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise PageAllocError("no C compiler (cc) to build hintfs/governor/csrc/pagealloc.c")
    errors = []
    for d in _build_dirs():
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=d, suffix=".so.tmp")
            os.close(fd)
        except OSError as err:
            errors.append(f"{d}: {err.strerror}")
            continue
        r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, str(SRC), "-ldl", "-lpthread"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            os.unlink(tmp)
            raise PageAllocError(f"building pagealloc failed: {r.stderr.strip()[:2000]}")
        os.rename(tmp, d / name)   # atomic: concurrent builders agree on one file
        return d / name
    raise PageAllocError("no writable build folder: " + "; ".join(errors))


class PageAllocator:
    """One loaded instance of the allocator (its state is per loaded copy of the library)."""

    def __init__(self, lib_path: Path, backend: int, device: int, page_bytes: int, va_bytes: int,
                 export_fds: bool = False) -> None:
        self.path = Path(lib_path)
        self.lib = ctypes.CDLL(str(self.path))
        L = self.lib
        L.pa_init.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64]
        L.pa_last_error.restype = ctypes.c_char_p
        L.pa_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        L.pa_malloc.restype = ctypes.c_void_p
        L.pa_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        L.pa_release.argtypes = [ctypes.c_uint64]
        L.pa_release.restype = ctypes.c_uint64
        L.pa_lend.argtypes = [ctypes.c_uint64, ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        L.pa_lend_deferred.argtypes = [ctypes.c_uint64, ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        L.pa_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        L.pa_mark.restype = ctypes.c_uint64
        L.pa_set_mark_stream.argtypes = [ctypes.c_void_p]
        L.pa_release_idle.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
        L.pa_release_idle.restype = ctypes.c_uint64
        L.pa_set_unmap_threads.argtypes = [ctypes.c_int]
        L.pa_mapped.restype = ctypes.c_uint64
        L.pa_peak_allocated.restype = ctypes.c_uint64
        if L.pa_init(backend, device, page_bytes, va_bytes) != 0:
            raise PageAllocError(f"pagealloc init: {L.pa_last_error().decode()}")
        if export_fds:
            _raise_fd_limit()
            L.pa_export_at_create(1)
        self.device = device
        self.page_bytes = page_bytes

    @classmethod
    def host(cls, page_bytes: int = 2 << 20, va_bytes: int = 1 << 30, export_fds: bool = False) -> PageAllocator:
        """Host-memory backend, for tests: a private copy of the library, so each instance has
        its own state."""
        src = library_path()
        fd, tmp = tempfile.mkstemp(suffix=".so", prefix="pagealloc-")
        os.close(fd)
        shutil.copyfile(src, tmp)
        try:
            return cls(Path(tmp), 1, 0, page_bytes, va_bytes, export_fds)
        finally:
            os.unlink(tmp)   # the mapping stays; the name is not needed any more

    # --- the torch ABI, callable from Python for tests -----------------------------------
    def malloc(self, size: int, stream: int = 0) -> int:
        return self.lib.pa_malloc(size, self.device, stream) or 0

    def free(self, ptr: int, size: int, stream: int = 0) -> None:
        self.lib.pa_free(ptr, size, self.device, stream)

    # --- control -----------------------------------------------------------------------------
    def release(self, keep_bytes: int = 0) -> int:
        """Unmap empty pages until at most `keep_bytes` stay mapped; the bytes released. Syncs the
        device first (a freed block's kernels may still be queued)."""
        return int(self.lib.pa_release(max(0, int(keep_bytes))))

    def mark(self) -> int:
        """Close an epoch of frees; record an event on the mark stream right after. Once that
        event has completed, `release_idle(keep, mark)` may release pages freed before it."""
        return int(self.lib.pa_mark())

    def set_mark_stream(self, stream: int) -> None:
        """The stream mark events are recorded on (frees on any other stream are never idle)."""
        self.lib.pa_set_mark_stream(stream or None)

    def release_idle(self, keep_bytes: int, done_mark: int) -> int:
        """Release, without a device sync, the empty pages whose last free came before the
        completed mark `done_mark`, until at most `keep_bytes` stay mapped. They leave the books
        at once and worker threads unmap them meanwhile; `release` waits for those unmaps, so
        call it before acknowledging. The bytes taken out."""
        return int(self.lib.pa_release_idle(max(0, int(keep_bytes)), max(0, int(done_mark))))

    def set_unmap_threads(self, n: int) -> None:
        """Threads that unmap pages (with more than one, a release unmaps in parallel)."""
        self.lib.pa_set_unmap_threads(int(n))

    def lend(self, keep_bytes: int, max_pages: int, defer_unmap: bool = False) -> list[int]:
        """Release like `release`, but hand each page out as an fd (the caller owns the fds).
        `defer_unmap`: the pages leave this allocator at once, but stay mapped here until
        `finish_lend()` (call it after the ack: unmapping is off the handover's path)."""
        buf = (ctypes.c_int * max(1, max_pages))()
        fn = self.lib.pa_lend_deferred if defer_unmap else self.lib.pa_lend
        n = fn(max(0, int(keep_bytes)), buf, max_pages)
        return list(buf[:n])

    def finish_lend(self) -> int:
        """Unmap the pages a deferred lend left mapped; how many."""
        return int(self.lib.pa_finish_lend())

    def stats(self) -> dict:
        out = (ctypes.c_uint64 * len(STAT_FIELDS))()
        self.lib.pa_stats(out)
        return dict(zip(STAT_FIELDS, (int(v) for v in out)))

    def mapped(self) -> int:
        """Bytes of mapped pages (what this process holds on the device); no lock, cheap."""
        return int(self.lib.pa_mapped())

    def peak_allocated(self) -> int:
        return int(self.lib.pa_peak_allocated())

    def reset_peak(self) -> None:
        self.lib.pa_reset_peak()


def _raise_fd_limit() -> None:
    """One fd per mapped page (4,400 for 141 GB of 32 MiB pages) exceeds the usual soft limit
    of 1,024: raise it to the hard limit."""
    from hintfs.common.fdlimit import raise_open_file_limit
    raise_open_file_limit()   # (kept as it was if it cannot be raised: lending falls back to
    #                            exporting at lend time)
    # the fd table for a device's worth of pages, now (growing it later, while torch's threads
    # run, waits for an RCU grace period inside a page's creation)
    from hintfs.common.fdlimit import reserve_fd_table
    reserve_fd_table(8192)


def install(device: int = 0, page_bytes: int = PAGE_BYTES, va_bytes: int = 0,
            export_fds: bool = False) -> PageAllocator:
    """Make the page allocator torch's CUDA allocator in this process (call before any CUDA
    allocation; torch refuses to swap an allocator in use). `export_fds`: export each page as
    an fd when it is created, so that lending pages (the governor's handoff) costs no export
    on the shrink's path."""
    global _installed
    if _installed is not None:
        return _installed
    import torch

    if torch.cuda.is_initialized():
        raise PageAllocError("pagealloc.install() must run before CUDA is initialised in this "
                             "process (torch cannot swap an allocator in use)")
    path = library_path()
    alloc = PageAllocator(path, 0, device, page_bytes, va_bytes, export_fds)   # torch's dlopen handle
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(str(path), "pa_malloc", "pa_free")
    torch.cuda.memory.change_current_allocator(pluggable)
    _installed = alloc
    return alloc


def installed() -> PageAllocator | None:
    return _installed


__all__ = ["PageAllocator", "PageAllocError", "install", "installed", "library_path", "PAGE_BYTES"]

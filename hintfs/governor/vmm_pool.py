"""CUDA VMM page pool: physical pages that move between processes without cudaFree/cudaMalloc.

Pages (32 MiB by default) are created once with `cuMemCreate` as exportable POSIX file
descriptors; the fds travel once over a Unix socket (SCM_RIGHTS) and the peer imports them.
Afterwards a handoff is only: the old owner unmaps (cuMemUnmap, after its GPU work on the page
drained), the new owner maps the page into a reserved virtual range (cuMemMap+cuMemSetAccess)
and ZEROES it before use. Zeroing is mandatory whenever the owner changes: the page still holds
the previous owner's data (activations, weights of another tenant).

Needs `cuda-python` (module `cuda.bindings.driver`, or the older `cuda.cuda`); torch is used only
to wrap mapped ranges as tensors (`as_tensor`) and to share torch's primary context.
"""

from __future__ import annotations

import array
import socket
from dataclasses import dataclass
from typing import Any


def _cuda_driver() -> Any:
    """cuda-python's driver module, or None when cuda-python is not installed."""
    try:  # cuda-python >= 12.6
        from cuda.bindings import driver
        return driver
    except ImportError:  # pragma: no cover - older layout, or not installed
        pass
    try:
        from cuda import cuda
        return cuda
    except ImportError:
        return None


cu: Any = _cuda_driver()

FD = None if cu is None else cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


class VmmError(RuntimeError):
    pass


def available() -> bool:
    return cu is not None


def _check(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name = cu.cuGetErrorName(err)[1] if cu is not None else err
        raise VmmError(f"CUDA driver error {name}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def _prop(device: int):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = FD
    return prop


def _access(device: int):
    a = cu.CUmemAccessDesc()
    a.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    a.location.id = device
    a.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return a


def ensure_context(device: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread."""
    if cu is None:
        raise VmmError("cuda-python is not installed (pip install cuda-python)")
    _check(cu.cuInit(0))
    dev = _check(cu.cuDeviceGet(device))
    ctx = _check(cu.cuDevicePrimaryCtxRetain(dev))
    _check(cu.cuCtxSetCurrent(ctx))


def granularity(device: int) -> int:
    return int(_check(cu.cuMemGetAllocationGranularity(
        _prop(device), cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))


@dataclass
class Mapping:
    va: int
    nbytes: int
    pages: list[int]


class PagePool:
    """One process's view of the shared pages: handles by page id, and its mappings."""

    def __init__(self, device: int, page_bytes: int, handles: list) -> None:
        self.device = device
        self.page_bytes = page_bytes
        self.handles = handles
        self.mappings: dict[int, Mapping] = {}
        self._access = _access(device)

    # --- creation and sharing ---------------------------------------------------------
    @classmethod
    def create(cls, device: int, n_pages: int, page_bytes: int = 32 << 20) -> PagePool:
        ensure_context(device)
        g = granularity(device)
        if page_bytes % g:
            raise VmmError(f"page_bytes {page_bytes} is not a multiple of granularity {g}")
        prop = _prop(device)
        handles = [_check(cu.cuMemCreate(page_bytes, prop, 0)) for _ in range(n_pages)]
        return cls(device, page_bytes, handles)

    def export_fds(self) -> list[int]:
        """One fd per page (done once; the peer keeps its imported handles)."""
        return [int(_check(cu.cuMemExportToShareableHandle(h, FD, 0))) for h in self.handles]

    @classmethod
    def import_fds(cls, device: int, fds: list[int], page_bytes: int) -> PagePool:
        ensure_context(device)
        handles = [_check(cu.cuMemImportFromShareableHandle(fd, FD)) for fd in fds]
        return cls(device, page_bytes, handles)

    # --- mapping --------------------------------------------------------------------------
    def map(self, pages: list[int]) -> Mapping:
        """Map `pages` contiguously into a fresh virtual range; returns the mapping."""
        n = len(pages) * self.page_bytes
        va = _check(cu.cuMemAddressReserve(n, self.page_bytes, 0, 0))
        va = int(va)
        for i, p in enumerate(pages):
            _check(cu.cuMemMap(va + i * self.page_bytes, self.page_bytes, 0, self.handles[p], 0))
        _check(cu.cuMemSetAccess(va, n, [self._access], 1))
        m = Mapping(va, n, list(pages))
        self.mappings[va] = m
        return m

    def zero(self, m: Mapping, stream: int = 0) -> None:
        """Zero a mapping (call after the owner changed, before anyone reads it)."""
        _check(cu.cuMemsetD32Async(m.va, 0, m.nbytes // 4, stream))

    def unmap(self, m: Mapping) -> None:
        """Unmap (the caller has drained GPU work using it) and free the virtual range."""
        _check(cu.cuMemUnmap(m.va, m.nbytes))
        _check(cu.cuMemAddressFree(m.va, m.nbytes))
        self.mappings.pop(m.va, None)

    def release(self) -> None:
        for m in list(self.mappings.values()):
            self.unmap(m)
        for h in self.handles:
            _check(cu.cuMemRelease(h))
        self.handles = []


def as_tensor(m: Mapping, dtype=None, device: int = 0):
    """A torch tensor aliasing the mapping (uint8 unless `dtype`)."""
    import torch

    class _Cai:
        __cuda_array_interface__ = {"shape": (m.nbytes,), "typestr": "|u1",
                                    "data": (m.va, False), "version": 3, "strides": None}

    t = torch.as_tensor(_Cai(), device=f"cuda:{device}")
    return t if dtype is None else t.view(dtype)


# --- fds over a Unix socket -------------------------------------------------------------------

def send_fds(sock: socket.socket, fds: list[int], chunk: int = 200) -> None:
    """Send fds (SCM_RIGHTS, in chunks under the kernel's per-message limit)."""
    sock.sendall(len(fds).to_bytes(4, "little"))
    for i in range(0, len(fds), chunk):
        part = fds[i:i + chunk]
        socket.send_fds(sock, [len(part).to_bytes(4, "little")], part)


def recv_fds(sock: socket.socket) -> list[int]:
    n = int.from_bytes(_recv_exact(sock, 4), "little")
    out: list[int] = []
    while len(out) < n:
        msg, fds, _, _ = socket.recv_fds(sock, 4, 256)
        out.extend(fds)
    return out


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        b = sock.recv(n - len(buf))
        if not b:
            raise VmmError("peer closed")
        buf += b
    return buf


__all__ = ["PagePool", "Mapping", "as_tensor", "send_fds", "recv_fds", "available", "VmmError",
           "ensure_context", "granularity", "array"]

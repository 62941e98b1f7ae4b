"""The memory of the governed cards, for `[[governor.gpus]]` entries without `total_bytes`.

Read once at start through NVML (`libnvidia-ml.so.1`, the library the NVIDIA driver installs, over
ctypes: no Python package, no CUDA context, no torch in the daemon). NVML numbers the cards in PCI
order; CUDA numbers them the same way on a host of one kind of card, or with
`CUDA_DEVICE_ORDER=PCI_BUS_ID`. A `CUDA_VISIBLE_DEVICES` of the daemon's own (indexes or `GPU-`
UUIDs) is followed, as CUDA would. A card in MIG mode, or a host without the driver, is one line
that says to set `total_bytes`.

`read_cards(indexes)` is the probe; `with_card_memory(config, probe)` fills the missing totals
(tests pass a probe of their own)."""
from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass

from mountconfig.governor import GovernorConfig

NVML_LIBRARY = "libnvidia-ml.so.1"
NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_DEVICE_MIG_ENABLE = 1
NAME_LEN = 96                     # NVML_DEVICE_NAME_V2_BUFFER_SIZE


class CardMemoryError(RuntimeError):
    """The card's memory cannot be read; `str()` is one line."""


@dataclass(frozen=True)
class Card:
    index: int             # as in the config
    name: str              # e.g. "NVIDIA H100 80GB HBM3"
    total_bytes: int       # the card's memory, as NVML reports it


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


Probe = Callable[[list[int]], dict[int, Card]]


def read_cards(indexes: list[int], library: str | None = None) -> dict[int, Card]:
    """The cards of these (CUDA) indexes, from NVML (`library`: NVML_LIBRARY); CardMemoryError
    if any cannot be read."""
    library = library or NVML_LIBRARY
    try:
        nvml = ctypes.CDLL(library)
    except OSError:
        raise CardMemoryError(f"no NVIDIA driver here ({library} not found)") from None

    def check(ret: int, what: str) -> None:
        if ret != NVML_SUCCESS:
            fn = nvml.nvmlErrorString
            fn.restype = ctypes.c_char_p
            why = (fn(ret) or b"error %d" % ret).decode(errors="replace")
            raise CardMemoryError(f"{what}: NVML says {why}")

    check(nvml.nvmlInit_v2(), "NVML init")
    try:
        visible = _visible_devices()
        cards = {}
        for index in indexes:
            handle = ctypes.c_void_p()
            if visible is None:
                check(nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)),
                      f"GPU {index}")
            elif index >= len(visible):
                raise CardMemoryError(f"GPU {index}: CUDA_VISIBLE_DEVICES shows {len(visible)} GPU(s)")
            elif visible[index].isdigit():
                check(nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(int(visible[index])),
                                                         ctypes.byref(handle)), f"GPU {index}")
            elif visible[index].startswith("GPU-"):
                check(nvml.nvmlDeviceGetHandleByUUID(visible[index].encode(), ctypes.byref(handle)),
                      f"GPU {index} ({visible[index]})")
            else:
                raise CardMemoryError(f"GPU {index}: CUDA_VISIBLE_DEVICES entry {visible[index]!r} "
                                      "is not an index or a GPU- UUID")
            current, pending = ctypes.c_uint(), ctypes.c_uint()
            ret = nvml.nvmlDeviceGetMigMode(handle, ctypes.byref(current), ctypes.byref(pending))
            if ret == NVML_SUCCESS and current.value == NVML_DEVICE_MIG_ENABLE:
                raise CardMemoryError(f"GPU {index} is in MIG mode (its instances have less memory "
                                      "than the card)")
            mem = _Memory()
            check(nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)), f"GPU {index} memory")
            name = ctypes.create_string_buffer(NAME_LEN)
            if nvml.nvmlDeviceGetName(handle, name, ctypes.c_uint(NAME_LEN)) != NVML_SUCCESS:
                name.value = b"?"
            cards[index] = Card(index, name.value.decode(errors="replace"), int(mem.total))
        return cards
    finally:
        nvml.nvmlShutdown()


def _visible_devices() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES of this process as a list (None: unset, every card in NVML's order)."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    out = []
    for item in raw.split(","):
        item = item.strip()
        if not item or item.startswith("-"):     # CUDA stops at the first invalid entry
            break
        out.append(item)
    return out


def with_card_memory(cfg: GovernorConfig, probe: Probe = read_cards) -> tuple[GovernorConfig, dict[int, Card]]:
    """`cfg` with every missing `total_bytes` read from its card, and the cards read. Raises
    CardMemoryError (one line naming the GPU and saying what to set) when a card cannot be read
    or its memory is not above `reserve_bytes`."""
    missing = [g.index for g in cfg.gpus if g.total_bytes is None]
    if not missing:
        return cfg, {}
    try:
        cards = probe(missing)
    except CardMemoryError as e:
        gpus = ", ".join(str(i) for i in missing)
        raise CardMemoryError(f"cannot read the card's memory ({e}): set total_bytes of GPU {gpus} in "
                              "[[governor.gpus]] (the bytes the ledger may hand out)") from None
    gpus_out = []
    for g in cfg.gpus:
        if g.total_bytes is None:
            total = cards[g.index].total_bytes
            if g.reserve_bytes >= total:
                raise CardMemoryError(f"GPU {g.index}: reserve_bytes {g.reserve_bytes} is not below the "
                                      f"card's {total} bytes; lower reserve_bytes or set total_bytes")
            g = g.model_copy(update={"total_bytes": total})
        gpus_out.append(g)
    return cfg.model_copy(update={"gpus": gpus_out}), cards

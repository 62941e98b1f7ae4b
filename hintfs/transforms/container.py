"""The `.tensor` file: a safetensors file, 64-byte aligned, in tensor or raw mode.

Layout (standard safetensors, readable by ``safetensors.safe_open`` and ``load_file``)::

    u64 little-endian N | N bytes of JSON header, space-padded | data section

* ``8 + N`` is a multiple of 64, so the data section starts 64-byte aligned
  (safetensors itself only pads to 8).
* Tensors are laid out in name order. safetensors forbids gaps between tensors, so when a
  tensor's byte length is not a multiple of 64 and another tensor follows, a 1-D uint8
  tensor named ``__pad<i>__`` fills the gap; every real tensor then starts at a
  64-byte-aligned file offset. ``decode``/``load_sample`` drop the padding tensors. (The
  usual files hold one tensor and need none.)
* ``__metadata__`` (all values strings, as safetensors requires)::

      hintfs: "1"            format version
      mode:   "tensor"|"raw"
      kind:   "image"|"video"
      params: canonical JSON of the validated parameters (every field, sorted keys)
      params_hash, aug_seed, source (relpath), source_size, source_mtime_ns

In raw mode the file holds the original media bytes as one uint8 tensor ``raw``;
``load_sample`` then runs the transform locally with the metadata's parameters and seed
(limits included) and returns exactly what tensor mode would have held, or raises
``SampleEIO`` (an ``OSError`` with ``errno.EIO`` that is also a ``TransformError``) when the
media are corrupt or over a limit.
"""
from __future__ import annotations

import errno
import json
import os
import struct
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .errors import SampleEIO, TransformError
from .params import Params, params_hash, params_json, parse_params

ALIGN = 64
FORMAT_VERSION = "1"
MAX_HEADER = 100 * 1024 * 1024  # what safetensors accepts

_DTYPES: dict[np.dtype, str] = {  # numpy dtype → safetensors dtype
    np.dtype("uint8"): "U8", np.dtype("int8"): "I8", np.dtype("uint16"): "U16",
    np.dtype("int16"): "I16", np.dtype("uint32"): "U32", np.dtype("int32"): "I32",
    np.dtype("uint64"): "U64", np.dtype("int64"): "I64", np.dtype("float16"): "F16",
    np.dtype("float32"): "F32", np.dtype("float64"): "F64", np.dtype("bool"): "BOOL",
}
_NP = {v: k for k, v in _DTYPES.items()}


class SampleMeta(BaseModel):
    """What a `.tensor` file says about itself (the ``__metadata__`` block, typed)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["tensor", "raw"] = "tensor"
    kind: Literal["image", "video"]
    params: dict[str, Any] = Field(description="the validated transform parameters")
    aug_seed: int = Field(ge=0)
    source: str = Field(description="relpath of the media file")
    source_size: int = Field(ge=0)
    source_mtime_ns: int = 0
    params_hash: str = ""

    def transform_params(self) -> Params:
        return parse_params(self.kind, self.params)


def make_meta(kind: str, params: Any, aug_seed: int, source: str, source_size: int,
              source_mtime_ns: int = 0) -> SampleMeta:
    """Build a validated ``SampleMeta`` (``params`` may be a model, dict or JSON)."""
    p = parse_params(kind, params)
    return SampleMeta(kind=kind, params=p.model_dump(mode="json"), aug_seed=int(aug_seed),
                      source=source, source_size=int(source_size),
                      source_mtime_ns=int(source_mtime_ns), params_hash=params_hash(p))


def _as_meta(meta: SampleMeta | dict) -> SampleMeta:
    if isinstance(meta, SampleMeta):
        return meta
    d = dict(meta)
    d.pop("mode", None)
    d.pop("params_hash", None)
    return make_meta(**d)


def _meta_strings(meta: SampleMeta, mode: str) -> dict[str, str]:
    p = meta.transform_params()
    return {
        "hintfs": FORMAT_VERSION, "mode": mode, "kind": meta.kind,
        "params": params_json(p), "params_hash": params_hash(p),
        "aug_seed": str(meta.aug_seed), "source": meta.source,
        "source_size": str(meta.source_size), "source_mtime_ns": str(meta.source_mtime_ns),
    }


def _encode(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    names = sorted(arrays)
    for name in names:
        if name.startswith("__"):
            raise ValueError(f"tensor names starting with '__' are reserved: {name!r}")
    header: dict[str, Any] = {"__metadata__": metadata}
    blobs: list[bytes] = []
    offset = 0
    npad = 0
    for i, name in enumerate(names):
        a = np.asarray(arrays[name])
        dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        if dt not in _DTYPES:
            raise ValueError(f"dtype {a.dtype} of {name!r} has no safetensors equivalent")
        blob = np.ascontiguousarray(a, dtype=dt).tobytes()
        header[name] = {"dtype": _DTYPES[dt], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
        gap = -offset % ALIGN
        if gap and i + 1 < len(names):
            pad = f"__pad{npad}__"
            npad += 1
            header[pad] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            blobs.append(bytes(gap))
            offset += gap
    hjson = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    n = len(hjson) + (-(8 + len(hjson)) % ALIGN)
    return b"".join([struct.pack("<Q", n), hjson, b" " * (n - len(hjson)), *blobs])


def encode_tensor(arrays: dict[str, np.ndarray], meta: SampleMeta | dict) -> bytes:
    """A tensor-mode `.tensor` file holding ``arrays`` (the output of ``apply``)."""
    return _encode(arrays, _meta_strings(_as_meta(meta), "tensor"))


def encode_raw(raw_bytes: bytes, meta: SampleMeta | dict) -> bytes:
    """A raw-mode `.tensor` file: the media bytes as uint8 tensor ``raw`` plus the params."""
    raw = np.frombuffer(bytes(raw_bytes) if not isinstance(raw_bytes, bytes) else raw_bytes,
                        dtype=np.uint8)
    return _encode({"raw": raw}, _meta_strings(_as_meta(meta), "raw"))


def data_offset(data: bytes | bytearray | memoryview) -> int:
    """File offset of the data section (8 + header length)."""
    if len(data) < 8:
        raise TransformError("not a .tensor file: shorter than 8 bytes")
    (length,) = struct.unpack_from("<Q", data, 0)
    return 8 + int(length)


def read_header(data: bytes | bytearray | memoryview) -> tuple[dict, int]:
    """(parsed header JSON, file offset of the data section)."""
    start = data_offset(data)
    if start - 8 > MAX_HEADER or start > len(data):
        raise TransformError("not a .tensor file: bad header length")
    try:
        header = json.loads(bytes(memoryview(data)[8:start]))
    except (UnicodeDecodeError, ValueError) as e:
        raise TransformError(f"not a .tensor file: header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise TransformError("not a .tensor file: header is not an object")
    return header, start


def decode(data: bytes | bytearray | memoryview) -> tuple[SampleMeta, dict[str, np.ndarray]]:
    """Parse a `.tensor` file: (metadata, arrays without padding tensors).

    The arrays are views on ``data`` (read-only for ``bytes``, writable for a
    ``bytearray``)."""
    header, start = read_header(data)
    md = header.pop("__metadata__", None) or {}
    if md.get("hintfs") != FORMAT_VERSION:
        if isinstance(md.get("hintfs"), str) and md["hintfs"].isdigit():
            raise TransformError(f"a hintfs .tensor of format version {md['hintfs']}, this reader reads version "
                                 f"{FORMAT_VERSION}: upgrade hintfs in the job's image")
        raise TransformError(f"not a hintfs .tensor file (hintfs={md.get('hintfs')!r})")
    try:
        meta = SampleMeta(
            mode=md["mode"], kind=md["kind"], params=json.loads(md["params"]),
            aug_seed=int(md["aug_seed"]), source=md["source"],
            source_size=int(md["source_size"]), source_mtime_ns=int(md["source_mtime_ns"]),
            params_hash=md.get("params_hash", ""))
    except (KeyError, ValueError) as e:
        raise TransformError(f"bad .tensor metadata: {e}") from e
    buf = memoryview(data)
    arrays: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name.startswith("__pad"):
            continue
        try:
            dt = _NP[info["dtype"]]
            lo, hi = info["data_offsets"]
            shape = tuple(int(x) for x in info["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TransformError(f"bad .tensor header entry {name!r}: {exc}") from exc
        if not (0 <= lo <= hi and start + hi <= len(data)):
            raise TransformError(f"tensor {name!r} lies outside the file (truncated?)")
        if (hi - lo) != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
            raise TransformError(f"tensor {name!r}: size does not match shape and dtype")
        arrays[name] = np.frombuffer(buf[start + lo:start + hi], dtype=dt).reshape(shape)
    return meta, arrays


def load_sample(path_or_bytes: str | os.PathLike | bytes | bytearray | memoryview
                ) -> dict[str, np.ndarray]:
    """The transformed arrays of a `.tensor` file, whichever mode it is in.

    Tensor mode: the stored arrays (writable, owned by the caller). Raw mode: runs
    ``transforms.apply`` locally with the stored kind, params and seed: the result is bit
    for bit what the storage side would have stored, and media it cannot transform (corrupt,
    truncated, over a limit) raise ``SampleEIO`` (errno EIO), never give a tensor."""
    if isinstance(path_or_bytes, (str, os.PathLike)):
        with open(path_or_bytes, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = bytearray(size)
            got = f.readinto(data)
            if got != size:
                del data[got:]
    elif isinstance(path_or_bytes, bytearray):
        data = path_or_bytes
    else:
        data = bytearray(path_or_bytes)
    meta, arrays = decode(data)
    return materialize(meta, arrays)


def materialize(meta: SampleMeta, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The transformed arrays of a decoded `.tensor`: ``arrays`` themselves in tensor mode; in
    raw mode the transform run here on the stored bytes (``SampleEIO`` if it cannot be)."""
    if meta.mode == "tensor":
        return arrays
    if "raw" not in arrays:
        raise TransformError("raw-mode .tensor file without a 'raw' tensor")
    from . import apply
    try:
        return apply(meta.kind, arrays["raw"].tobytes(), meta.params, meta.aug_seed)
    except TransformError as err:
        # The storage side fell back to raw bytes (busy CPU, deadline) before it knew the
        # source was bad: the reader gets the same EIO the tensor-mode open would have given.
        raise SampleEIO(errno.EIO, f"transform of {meta.source} failed: {err}") from err


def tensor_offsets(data: bytes | bytearray | memoryview) -> dict[str, tuple[int, int]]:
    """File offsets [start, end) of every tensor, padding included (for alignment checks)."""
    header, start = read_header(data)
    header.pop("__metadata__", None)
    return {k: (start + v["data_offsets"][0], start + v["data_offsets"][1])
            for k, v in header.items()}

"""Deterministic media transforms for hintfs `.tensor` files.

``apply(kind, raw, params, aug_seed)`` turns the bytes of an image or a video into a dict of
numpy arrays; the same bytes, parameters and seed always give bit-identical arrays, so a
storage node and a client (load-aware fallback) agree. ``hintfs.transforms.container`` holds the
`.tensor` file format. Pure library: no I/O besides the bytes given, no threads of its own
(one decode thread per call), safe to run in a process pool.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import ValidationError

from hintfs.common.errors import validation_message

from .errors import SampleEIO, TransformError, TransformTimeout, WorkerDied
from .params import (ImageParams, Params, TransformRule, VideoParams, default_seed,
                     match_rule, params_hash, params_json, parse_params)

__all__ = [
    "apply", "check_decodes", "TransformError", "SampleEIO", "TransformTimeout", "WorkerDied",
    "ImageParams", "VideoParams", "TransformRule", "Params",
    "params_hash", "params_json", "parse_params", "default_seed", "match_rule",
]


def apply(kind: str, raw: bytes, params: Any, aug_seed: int) -> dict[str, np.ndarray]:
    """Transform ``raw`` (the whole media file) by ``kind`` ("image" or "video").

    ``params`` is an ``ImageParams``/``VideoParams``, a dict or a JSON string.
    Returns ``{"pixels": ...}`` for images and ``{"frames": ...}`` for videos.
    Raises ``TransformError`` for corrupt or truncated media, impossible parameters and media
    over the parameters' resource bounds (``max_pixels``, ``max_frames``, ``max_decoded_bytes``,
    ``max_source_bytes``, ``time_limit_s``: see ``hintfs.transforms.limits``).
    """
    try:
        p = parse_params(kind, params)
    except TransformError:
        raise
    except ValueError as e:  # pydantic.ValidationError is a ValueError
        reason = validation_message(e, root="(parameters)") if isinstance(e, ValidationError) else str(e)
        raise TransformError(f"bad {kind} transform parameters: {reason}") from e
    if isinstance(raw, memoryview):
        raw = raw.tobytes()
    elif not isinstance(raw, bytes):
        raw = bytes(raw)
    from .limits import Deadline, check_source_size
    deadline = Deadline(p.time_limit_s)
    check_source_size(len(raw), p)
    try:
        if isinstance(p, ImageParams):  # parse_params gives ImageParams exactly for "image"
            from .image import transform_image
            return transform_image(raw, p, aug_seed, deadline)
        from .video import transform_video
        return transform_video(raw, p, aug_seed, deadline=deadline)
    except MemoryError:
        # an allocation over the worker's address-space cap, or a machine out of memory
        raise TransformError(f"out of memory while transforming (in the agent: over the worker's "
                             f"address-space cap, which follows max_decoded_bytes={p.max_decoded_bytes})"
                             ) from None


def check_decodes(kind: str, raw: bytes, params: Any) -> None:
    """Whether ``apply`` could decode ``raw``, checked before the agent hands the bytes out raw
    (load-aware fallback: a `.tensor` must never hold bytes the transform would refuse).

    An image is decoded once, as ``apply`` decodes it (same decoder options, same bounds), with
    no resize, crop or encode: damage only a decoder finds (a flipped byte in the compressed
    data that FFmpeg's CRC or bitstream checks catch) raises ``TransformError`` here as it would
    in ``apply``. A video gets the checks that need no decoder (``hintfs.transforms.limits.precheck``:
    size, truncation, the container's structure): decoding it is what a fallback saves, so
    damage inside its frames is found by the transform of the raw bytes (the client's
    ``load_sample``: ``SampleEIO``)."""
    try:
        p = parse_params(kind, params)
    except TransformError:
        raise
    except ValueError as e:
        raise TransformError(f"bad {kind} transform parameters: {e}") from e
    if isinstance(raw, memoryview):
        raw = raw.tobytes()
    from .limits import precheck
    precheck(kind, raw, p)
    if kind == "image":
        from .image import decode_image
        try:
            decode_image(raw, p)
        except MemoryError:
            raise TransformError(f"out of memory while decoding (max_decoded_bytes={p.max_decoded_bytes})") from None

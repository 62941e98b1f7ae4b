"""Deterministic media transforms for hintfs `.tensor` files.

``apply(kind, raw, params, aug_seed)`` turns the bytes of an image or a video into a dict of
numpy arrays; the same bytes, parameters and seed always give bit-identical arrays, so a
storage node and a client (load-aware fallback) agree. ``transforms.container`` holds the
`.tensor` file format. Pure library: no I/O besides the bytes given, no threads of its own
(one decode thread per call), safe to run in a process pool.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .errors import TransformError
from .params import (ImageParams, Params, TransformRule, VideoParams, default_seed,
                     match_rule, params_hash, params_json, parse_params)

__all__ = [
    "apply", "TransformError", "ImageParams", "VideoParams", "TransformRule", "Params",
    "params_hash", "params_json", "parse_params", "default_seed", "match_rule",
]


def apply(kind: str, raw: bytes, params: Any, aug_seed: int) -> dict[str, np.ndarray]:
    """Transform ``raw`` (the whole media file) by ``kind`` ("image" or "video").

    ``params`` is an ``ImageParams``/``VideoParams``, a dict or a JSON string.
    Returns ``{"pixels": ...}`` for images and ``{"frames": ...}`` for videos.
    Raises ``TransformError`` for corrupt or truncated media and impossible parameters.
    """
    try:
        p = parse_params(kind, params)
    except TransformError:
        raise
    except ValueError as e:  # pydantic.ValidationError is a ValueError
        raise TransformError(f"bad {kind} transform parameters: {e}") from e
    if isinstance(raw, memoryview):
        raw = raw.tobytes()
    elif not isinstance(raw, bytes):
        raw = bytes(raw)
    if kind == "image":
        from .image import transform_image
        return transform_image(raw, p, aug_seed)
    from .video import transform_video
    return transform_video(raw, p, aug_seed)

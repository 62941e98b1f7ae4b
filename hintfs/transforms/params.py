"""Transform parameters: typed, validated, hashable.

A parameter set is what a mount-config transform rule says (``glob`` → ``kind`` and
``params``) and what a raw-mode ``.tensor`` file carries in its metadata, so that the
client can run the very same transform locally. ``params_hash`` is stable across
processes and versions of Python: it hashes the canonical JSON of the validated model.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Safe defaults of the resource bounds (see the fields' descriptions and docs/transforms.md).
MAX_PIXELS = 1 << 26                 # 67,108,864 px = 8192 x 8192 (a 96 MP 12000 x 8000 photo is over)
MAX_DECODED_BYTES = 512 << 20        # 512 MiB per sample
MAX_SOURCE_BYTES = 1 << 30           # 1 GiB media file
MAX_FRAMES = 100_000                 # ~55 min at 30 fps
TIME_LIMIT_S = 30.0                  # a sample normally takes 5-150 ms

PosInt = Annotated[int, Field(ge=1, le=16384)]
Interp = Literal["bilinear", "bicubic", "area", "nearest"]


class _Pixels(BaseModel):
    """What images and video frames share: resize, crop, dtype, normalization, layout."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    size: PosInt | None = Field(
        None, description="resize so that the shorter side is `size` px (aspect kept); "
                          "None keeps the decoded size")
    crop: tuple[PosInt, PosInt] | None = Field(
        None, description="crop to (height, width) after the resize; if the resized picture "
                          "is smaller, it is scaled up just enough to cover the crop")
    crop_mode: Literal["random", "center"] = Field(
        "random", description="random: offset drawn from numpy Generator(aug_seed); "
                              "center: ignores the seed")
    interpolation: Interp = Field("bilinear", description="swscale interpolation of the resize")
    normalize: bool = Field(False, description="float32 (x/255 - mean)/std")
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    dtype: Literal["uint8", "float32"] | None = Field(
        None, description="uint8 (raw RGB) or float32 (x/255, or normalized); "
                          "default: float32 when normalize else uint8")
    layout: Literal["HWC", "CHW"] | None = Field(
        None, description="channel position; default: CHW for float32, HWC for uint8")
    # Resource bounds: checked from the file's header before anything is decoded (see
    # hintfs/transforms/limits.py). They travel with the other parameters (and so into a raw-mode
    # `.tensor` file's metadata), so a client transforming a raw container locally refuses what
    # the agent refuses. Like every field they are part of ``params_hash``.
    max_pixels: int = Field(
        MAX_PIXELS, ge=1, le=1 << 32,
        description="largest source picture (width x height of the image or of a video frame) "
                    "that is decoded; read from the header before decoding, and given to the "
                    "decoder as its max_pixels; a larger one is an error (EIO)")
    max_decoded_bytes: int = Field(
        MAX_DECODED_BYTES, ge=1 << 20, le=1 << 40,
        description="most bytes one sample may hold while it is made: one decoded source "
                    "picture, the converted frames and the output array, estimated from the "
                    "header before decoding; a transform worker's address space is capped at "
                    "3x this plus its baseline")
    max_source_bytes: int = Field(
        MAX_SOURCE_BYTES, ge=1, le=1 << 44,
        description="largest media file that is read to make a sample (the whole file is held "
                    "in memory while it is transformed)")
    time_limit_s: float = Field(
        TIME_LIMIT_S, gt=0, le=3600,
        description="wall time one sample may take; checked between decoding steps, and the "
                    "agent kills a worker that runs past it (plus a 1 s grace) and starts a new one")

    @field_validator("std")
    @classmethod
    def _std_positive(cls, v):
        if any(s <= 0 for s in v):
            raise ValueError("std values must be > 0")
        return v

    @model_validator(mode="after")
    def _dtype_consistent(self):
        if self.normalize and self.dtype == "uint8":
            raise ValueError("normalize=true needs dtype float32 (or leave dtype unset)")
        return self

    @property
    def out_dtype(self) -> str:
        return self.dtype or ("float32" if self.normalize else "uint8")

    @property
    def out_layout(self) -> str:
        return self.layout or ("CHW" if self.out_dtype == "float32" else "HWC")


class ImageParams(_Pixels):
    """Image transform: decode (JPEG/PNG/WebP) → RGB at target size → crop → dtype/normalize.

    Output: ``{"pixels": HxWx3 uint8}`` or ``{"pixels": 3xHxW float32}`` (see layout)."""


class VideoParams(_Pixels):
    """Video transform: sample K frames, each like an image.

    Output: ``{"frames": KxHxWx3}`` or ``{"frames": Kx3xHxW}`` (see layout)."""

    frames: PosInt = Field(8, description="K, frames kept per sample")
    mode: Literal["uniform", "fps"] = Field(
        "uniform", description="uniform: the centres of K equal segments of the video; "
                               "fps: K frames spaced 1/fps seconds apart")
    fps: float | None = Field(None, gt=0, le=1000, description="sampling rate for mode=fps")
    clip_start: Literal["random", "start", "center"] = Field(
        "random", description="mode=fps: where the K/fps-long clip starts "
                              "(random: drawn from Generator(aug_seed))")
    max_frames: int = Field(
        MAX_FRAMES, ge=1, le=1 << 31,
        description="most frames a video may have (the header's count, then the packets counted "
                    "while indexing, before any decoding); a longer one is an error (EIO)")

    @model_validator(mode="after")
    def _fps_needed(self):
        if self.mode == "fps" and self.fps is None:
            raise ValueError("mode='fps' needs fps")
        if self.mode == "uniform" and self.fps is not None:
            raise ValueError("fps is only used with mode='fps'")
        return self


Params = Union[ImageParams, VideoParams]  # noqa: UP007  (docs/config.md names a Union's members)
Kind = Literal["image", "video"]
PARAMS_BY_KIND: dict[str, type[ImageParams] | type[VideoParams]] = {
    "image": ImageParams, "video": VideoParams}


def parse_params(kind: str, params: Any) -> Params:
    """Validate ``params`` (a model, a dict or a JSON string) for ``kind``."""
    try:
        cls = PARAMS_BY_KIND[kind]
    except KeyError:
        raise ValueError(f"unknown transform kind {kind!r} (expected image or video)") from None
    if isinstance(params, cls):
        return params
    if isinstance(params, _Pixels):
        raise ValueError(f"{type(params).__name__} given for kind {kind!r}")
    if isinstance(params, (str, bytes)):
        return cls.model_validate_json(params)
    return cls.model_validate(params or {})


class TransformRule(BaseModel):
    """One rule of the mount config: files whose relpath matches ``glob`` get ``kind``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    glob: str = Field(min_length=1, description="fnmatch pattern on the relpath (no leading /)")
    kind: Kind
    params: Params

    @model_validator(mode="before")
    @classmethod
    def _params_by_kind(cls, data):
        if isinstance(data, dict) and "kind" in data:
            kind = data.get("kind")
            if kind in PARAMS_BY_KIND:
                data = dict(data)
                data["params"] = parse_params(kind, data.get("params"))
        return data

    def matches(self, relpath: str) -> bool:
        return fnmatch.fnmatchcase(relpath.lstrip("/"), self.glob)


def match_rule(rules: list[TransformRule], relpath: str) -> TransformRule | None:
    """The first rule whose glob matches ``relpath``, or None."""
    for rule in rules:
        if rule.matches(relpath):
            return rule
    return None


def params_json(params: Params) -> str:
    """Canonical JSON: every field (defaults included), sorted keys, no spaces."""
    return json.dumps(params.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def params_hash(params: Params) -> str:
    """A stable 16-hex-digit hash of the kind and all parameter values (defaults included)."""
    kind = "image" if isinstance(params, ImageParams) else "video"
    h = hashlib.sha256(f"hintfs-transform-v1\0{kind}\0{params_json(params)}".encode())
    return h.hexdigest()[:16]


def default_seed(relpath: str) -> int:
    """The augmentation seed used when no plan gives one: a hash of the relpath.

    Non-negative and < 2**63, so it fits the plan's int64 ``aug_seed`` column."""
    digest = hashlib.blake2b(relpath.lstrip("/").encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)

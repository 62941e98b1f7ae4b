"""Image transform: JPEG/PNG/WebP bytes → RGB at the target size → crop → dtype/normalize.

Decoding is PyAV (FFmpeg) from an in-memory buffer, one decode thread, FFmpeg's bit-exact
flags on both the decoder and the scaler, and the resize happens inside the colour
conversion (one swscale pass from the decoder's YUV/RGB to rgb24 at the target size).
The helpers below (target size, crop offset, finishing) are shared with the video
transform, so a video frame goes through exactly the same steps as an image.
"""
from __future__ import annotations

import io
import logging
from typing import cast

import av
import numpy as np
from av.video.codeccontext import VideoCodecContext
from av.video.reformatter import Interpolation

from .errors import TransformError
from .geometry import target_size
from .limits import Deadline, check_image_bytes, check_picture
from .params import ImageParams, _Pixels

log = logging.getLogger(__name__)

_INTERP = {
    "bilinear": Interpolation.BILINEAR,
    "bicubic": Interpolation.BICUBIC,
    "area": Interpolation.AREA,
    "nearest": Interpolation.POINT,
}
# ACCURATE_RND and BITEXACT make swscale give the same bytes whatever SIMD the CPU has,
# so a storage node and a client with different CPUs agree bit for bit.
_EXACT = Interpolation.ACCURATE_RND | Interpolation.BITEXACT

# The decoder options used for every decode (images and video): bit-exact output, and
# bitstream errors raise instead of being concealed (a damaged sample is an error).
DECODER_OPTIONS = {"flags": "+bitexact", "err_detect": "+crccheck+bitstream+buffer+explode"}


def sws_flags(params: _Pixels) -> int:
    return int(_INTERP[params.interpolation] | _EXACT)


def crop_offset(height: int, width: int, params: _Pixels, aug_seed: int) -> tuple[int, int]:
    """(y, x) of the crop's top-left corner. Random mode: ``np.random.default_rng(aug_seed)``
    draws y in [0, height-ch] and then x in [0, width-cw]; center mode: the centre
    (rounded down). Without a crop: (0, 0)."""
    if params.crop is None:
        return 0, 0
    ch, cw = params.crop
    if ch > height or cw > width:
        raise TransformError(f"crop {ch}x{cw} larger than the resized picture {height}x{width}")
    if params.crop_mode == "center":
        return (height - ch) // 2, (width - cw) // 2
    rng = np.random.default_rng(_seed(aug_seed))
    y = int(rng.integers(0, height - ch + 1))
    x = int(rng.integers(0, width - cw + 1))
    return y, x


def _seed(aug_seed: int) -> int:
    aug_seed = int(aug_seed)
    if aug_seed < 0:
        raise TransformError(f"aug_seed must be >= 0, got {aug_seed}")
    return aug_seed


def to_rgb(frame: av.VideoFrame, width: int, height: int, params: _Pixels) -> np.ndarray:
    """One swscale pass: decoded frame → rgb24 at (width, height), in the calling thread. Returns
    HxWx3 uint8. (PyAV 18 asks swscale for a pool of threads by default, one per CPU, made at each
    call: the transforms promise no threads of their own, and a DataLoader worker forked from a
    process with such a pool hung here in CI, in a futex wait.)"""
    out = frame.reformat(width=width, height=height, format="rgb24",
                         interpolation=sws_flags(params), threads=1)
    arr = out.to_ndarray()
    if arr.shape != (height, width, 3):  # to_ndarray drops line padding; be sure
        raise TransformError(f"unexpected converted frame shape {arr.shape}")
    return arr


def finish(rgb: np.ndarray, params: _Pixels) -> np.ndarray:
    """Cropped ...xHxWx3 uint8 → the requested dtype, normalization and layout.

    float32 values are computed as ``(x * (1/255) - mean) * (1/std)`` in float32, which is
    what the docs promise and what both sides of a fallback compute."""
    if params.out_dtype == "uint8":
        out = rgb
    else:
        x = rgb.astype(np.float32) * np.float32(1.0 / 255.0)
        if params.normalize:
            mean = np.asarray(params.mean, dtype=np.float32)
            inv_std = (np.float32(1.0) / np.asarray(params.std, dtype=np.float32))
            x = (x - mean) * inv_std
        out = x
    if params.out_layout == "CHW":
        out = np.moveaxis(out, -1, -3)
    return np.ascontiguousarray(out)


def bytes_per_px(frame_or_format) -> int:
    """Upper estimate of a decoded picture's bytes per pixel: 8 with >8-bit samples, else 4."""
    try:
        fmt = getattr(frame_or_format, "format", frame_or_format)
        return 8 if max(c.bits for c in fmt.components) > 8 else 4
    except Exception:
        return 8


def ffmpeg_max_pixels(params: _Pixels) -> str:
    """The picture-size bound given to FFmpeg, which checks it before it allocates a picture.
    FFmpeg counts the *coded* size (width and height rounded up to its block alignment), so it
    gets room for that (2x + 4 Mpx); the exact ``max_pixels`` is checked here on the header
    and on the decoded picture."""
    return str(min(2 * params.max_pixels + (4 << 20), (1 << 31) - 1))   # an int option in FFmpeg


def decoder_options(params: _Pixels) -> dict[str, str]:
    """DECODER_OPTIONS plus FFmpeg's own picture-size bound (``ffmpeg_max_pixels``)."""
    return {**DECODER_OPTIONS, "max_pixels": ffmpeg_max_pixels(params)}


# The decoder of each format whose header ``image_header`` reads: such a file is one packet to
# its decoder, as FFmpeg's image demuxers (jpeg_pipe, png_pipe, webp_pipe) hand it over.
_DECODER_OF = {"jpeg": "mjpeg", "png": "png", "webp": "webp"}


def decode_image(raw: bytes, params: _Pixels | None = None) -> av.VideoFrame:
    """Decode the first picture of an image file held in memory, within ``params``' limits.

    The header (JPEG/PNG/WebP) is checked against ``max_pixels``/``max_decoded_bytes`` before
    FFmpeg sees the bytes. Such a file then goes straight to its decoder as one packet: opening
    it through a demuxer would first decode it once more to probe it, which cost 2.4x the
    decode itself (a 2048x1536 JPEG: 20.5 ms to open, 8.3 to decode; bench/notes/
    multimodal_loading.md). Other formats are opened and probed, FFmpeg getting ``max_pixels``
    for the probe and for the decoder, since their header is not read here. Either way the
    decoder runs with the same options (``decoder_options``) and one thread."""
    params = params if params is not None else ImageParams()
    head = check_image_bytes(raw, params)
    try:
        if head is not None:
            frame = _decode_packet(_DECODER_OF[head[0]], raw, params)
        else:
            frame = _decode_probed(raw, params)
        if frame is not None:
            check_picture(frame.width, frame.height, bytes_per_px(frame), params)
            return frame
    except TransformError:
        raise
    except MemoryError:
        raise                       # reported by transforms.apply
    except (av.FFmpegError, ValueError, OSError, EOFError) as e:
        hint = ""
        if head is None and isinstance(e, av.error.ArgumentError):
            hint = f" (the picture may be over max_pixels={params.max_pixels})"
        raise TransformError(f"cannot decode image: {e}{hint}") from e
    raise TransformError("no picture decoded (corrupt or truncated image)")


def _decode_packet(codec: str, raw: bytes, params: _Pixels) -> av.VideoFrame | None:
    cc = cast(VideoCodecContext, av.CodecContext.create(codec, "r"))
    cc.options = decoder_options(params)
    cc.thread_count = 1
    for frame in cc.decode(av.Packet(raw)):
        return frame
    for frame in cc.decode(None):           # a decoder that holds its picture until drained
        return frame
    return None


def _decode_probed(raw: bytes, params: _Pixels) -> av.VideoFrame | None:
    opts = {"max_pixels": ffmpeg_max_pixels(params)}
    with av.open(io.BytesIO(raw), mode="r", options=opts) as container:
        if not container.streams.video:
            raise TransformError("no picture in the file")
        stream = container.streams.video[0]
        cc = stream.codec_context
        if cc is None:
            raise TransformError("no decoder for this image format")
        cc.options = decoder_options(params)
        cc.thread_count = 1
        for frame in container.decode(stream):
            return frame
    return None


def transform_image(raw: bytes, params: ImageParams, aug_seed: int,
                    deadline: Deadline | None = None) -> dict[str, np.ndarray]:
    frame = decode_image(raw, params)
    if deadline is not None:
        deadline.check("image decode")
    w, h = target_size(frame.width, frame.height, params)
    y, x = crop_offset(h, w, params, aug_seed)
    rgb = to_rgb(frame, w, h, params)
    if params.crop is not None:
        ch, cw = params.crop
        rgb = rgb[y:y + ch, x:x + cw]
    return {"pixels": finish(rgb, params)}

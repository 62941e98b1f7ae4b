"""Media the tests make for themselves (nothing is downloaded): images and videos in memory with
PyAV, JPEG files on disk. A codec this PyAV build lacks skips the test that asked for it."""
from __future__ import annotations

import io

import av
import numpy as np
import pytest

from hintfs.demo import write_jpeg


def has_encoder(name: str) -> bool:
    try:
        av.codec.Codec(name, "w")
        return True
    except Exception:
        return False


def has_decoder(name: str) -> bool:
    try:
        av.codec.Codec(name, "r")
        return True
    except Exception:
        return False


def pattern(i: int, w: int, h: int, seed: int = 0) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w]
    a = np.stack([(xx * 4 + i * 7 + seed) % 256, (yy * 5 + i * 3) % 256,
                  ((xx + yy) * 3 + i * 11) % 256], -1)
    return a.astype(np.uint8)


def make_image(fmt: str, w: int, h: int, seed: int = 0) -> bytes:
    codec, pix, muxer = {"jpeg": ("mjpeg", "yuvj420p", "image2pipe"),
                         "png": ("png", "rgb24", "image2pipe"),
                         "webp": ("libwebp", "yuv420p", "webp")}[fmt]
    if not has_encoder(codec):
        pytest.skip(f"PyAV has no {codec} encoder")
    buf = io.BytesIO()
    with av.open(buf, "w", format=muxer) as c:
        s = c.add_stream(codec)
        s.width, s.height, s.pix_fmt = w, h, pix
        rng = np.random.default_rng(seed)
        a = (pattern(seed, w, h, seed) // 2 + rng.integers(0, 128, (h, w, 3))).astype(np.uint8)
        for p in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
            c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


VIDEO_CASES = {
    # name: (encoder, muxer, decoder)
    "h264-mp4": ("libx264", "mp4", "h264"),
    "h264-mkv": ("libx264", "matroska", "h264"),
    "h265-mp4": ("libx265", "mp4", "hevc"),
    "vp9-webm": ("libvpx-vp9", "webm", "vp9"),
    "av1-mkv": ("libsvtav1", "matroska", "av1"),
}


def make_video(encoder: str, muxer: str, n: int = 40, w: int = 64, h: int = 48, rate: int = 20,
               gop: int = 8) -> bytes:
    if not has_encoder(encoder):
        pytest.skip(f"PyAV has no {encoder} encoder")
    buf = io.BytesIO()
    with av.open(buf, "w", format=muxer) as c:
        s = c.add_stream(encoder, rate=rate)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        s.codec_context.gop_size = gop
        s.codec_context.thread_count = 1
        s.options = {
            "libx264": {"x264-params": f"mbtree=0:keyint={gop}:min-keyint={gop}:scenecut=0:"
                                       "bframes=2:threads=1", "preset": "veryfast"},
            "libx265": {"x265-params": f"keyint={gop}:min-keyint={gop}:scenecut=0:"
                                       "log-level=error:frame-threads=1:pools=none",
                        "preset": "ultrafast"},
            "libvpx-vp9": {"deadline": "realtime", "cpu-used": "8", "threads": "1",
                           "row-mt": "0", "lag-in-frames": "0"},
            "libsvtav1": {"preset": "12", "svtav1-params": f"keyint={gop}:lp=1"},
        }.get(encoder, {})
        for i in range(n):
            for p in s.encode(av.VideoFrame.from_ndarray(pattern(i, w, h), format="rgb24")):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


def jpeg_file(path, seed=0, w=160, h=120):
    write_jpeg(path, np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))

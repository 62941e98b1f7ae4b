"""Resource bounds of a transform: refuse a bomb from its header, before decoding anything.

The bounds are fields of the transform parameters (``max_pixels``, ``max_decoded_bytes``,
``max_source_bytes``, ``time_limit_s``; ``max_frames`` for video). Each check raises
``TransformError`` naming the bound and the value that broke it, so the caller (the agent, or
``load_sample`` on a client) turns it into EIO with a one-line reason.

``image_header`` reads width, height and bit depth of a JPEG, PNG or WebP file in pure Python
(a few hundred bytes looked at; no decoder runs): a 746 KB PNG announcing 16000x16000 is refused
in microseconds. Other formats, or headers this does not understand, are still bounded: FFmpeg
gets a picture-size bound of its own (``image.ffmpeg_max_pixels``: it refuses a larger picture
before it allocates it, also while probing), and the decoded picture is checked before it is
converted. In the agent's workers the address space is capped as well (hintfs/agent/samples.py).
"""
from __future__ import annotations

import struct
import time

from .errors import TransformError, TransformTimeout
from .geometry import target_size

# JPEG start-of-frame markers (C4 DHT, C8 JPG and CC DAC are not frames).
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_MAX_JPEG_SEGMENTS = 65536


def image_header(raw: bytes) -> tuple[str, int, int, int] | None:
    """(format, width, height, bytes per decoded pixel) from the header, or None when the
    format is not JPEG/PNG/WebP or its header does not say (then the decoder's own
    ``max_pixels`` bound applies). Bytes per pixel is an upper estimate of the decoded picture:
    4 for 8-bit samples, 8 for 16-bit PNG."""
    try:
        if raw[:8] == b"\x89PNG\r\n\x1a\n":
            if raw[12:16] != b"IHDR":
                return None
            w, h, depth = struct.unpack_from(">IIB", raw, 16)
            return "png", w, h, 8 if depth > 8 else 4
        if raw[:2] == b"\xff\xd8":
            return _jpeg_header(raw)
        if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
            chunk = raw[12:16]
            if chunk == b"VP8 " and raw[23:26] == b"\x9d\x01\x2a":
                w, h = struct.unpack_from("<HH", raw, 26)
                return "webp", w & 0x3FFF, h & 0x3FFF, 4
            if chunk == b"VP8L" and raw[20] == 0x2F:
                b0, b1, b2, b3 = raw[21:25]
                w = 1 + (b0 | (b1 & 0x3F) << 8)
                h = 1 + (b1 >> 6 | b2 << 2 | (b3 & 0x0F) << 10)
                return "webp", w, h, 4
            if chunk == b"VP8X":
                w = 1 + int.from_bytes(raw[24:27], "little")
                h = 1 + int.from_bytes(raw[27:30], "little")
                return "webp", w, h, 4
    except (struct.error, IndexError, ValueError):
        return None
    return None


def _jpeg_header(raw: bytes) -> tuple[str, int, int, int] | None:
    i, n = 2, len(raw)
    for _ in range(_MAX_JPEG_SEGMENTS):
        while i < n and raw[i] != 0xFF:
            i += 1                      # garbage between segments: skip as decoders do
        while i < n and raw[i] == 0xFF:
            i += 1                      # fill bytes
        if i + 2 >= n:
            return None
        marker = raw[i]
        i += 1
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:
            continue                    # markers without a length
        if marker in (0xD9, 0xDA):
            return None                 # end of image / start of scan before any frame
        (length,) = struct.unpack_from(">H", raw, i)
        if marker in _SOF:
            precision, h, w = struct.unpack_from(">BHH", raw, i + 2)
            if h == 0:
                return None             # height given later by a DNL marker
            return "jpeg", w, h, 8 if precision > 8 else 4
        i += length
    return None


def check_source_size(size: int, params) -> None:
    if size > params.max_source_bytes:
        raise TransformError(f"file of {size} bytes is over max_source_bytes={params.max_source_bytes}")


def check_pixels(width: int, height: int, params, what: str = "picture") -> None:
    if width * height > params.max_pixels:
        raise TransformError(f"{what} of {width}x{height} = {width * height} pixels is over "
                             f"max_pixels={params.max_pixels}")


def estimate_bytes(width: int, height: int, bytes_per_px: int, params, kept: int = 1) -> int:
    """Peak bytes of one sample: one decoded source picture, ``kept`` pictures converted to
    rgb24 at the target size, and the output array (cropped, in the output dtype)."""
    tw, th = target_size(width, height, params)
    oh, ow = params.crop if params.crop is not None else (th, tw)
    itemsize = 1 if params.out_dtype == "uint8" else 4
    return width * height * bytes_per_px + kept * tw * th * 3 + kept * oh * ow * 3 * itemsize


def check_bytes(width: int, height: int, bytes_per_px: int, params, kept: int = 1) -> None:
    need = estimate_bytes(width, height, bytes_per_px, params, kept)
    if need > params.max_decoded_bytes:
        raise TransformError(f"sample of {kept} x {width}x{height} pictures needs ~{need} bytes, "
                             f"over max_decoded_bytes={params.max_decoded_bytes}")


def check_picture(width: int, height: int, bytes_per_px: int, params, kept: int = 1,
                  what: str = "picture") -> None:
    check_pixels(width, height, params, what)
    check_bytes(width, height, bytes_per_px, params, kept)


def check_frames(nframes: int, params) -> None:
    if nframes > params.max_frames:
        raise TransformError(f"video of {nframes} frames or more is over "
                             f"max_frames={params.max_frames}")


def check_image_bytes(raw: bytes, params) -> tuple[str, int, int, int] | None:
    """An image's checks before any decoder: not empty, not visibly truncated, and, where the
    header (JPEG/PNG/WebP) gives the picture size, that size within the limits. Returns that
    header (None for formats whose header is not read here)."""
    if not raw:
        raise TransformError("empty image")
    check_complete(raw)
    head = image_header(raw)
    if head is not None:
        _fmt, w, h, bpp = head
        check_picture(w, h, bpp, params)
    return head


def precheck(kind: str, raw: bytes, params) -> None:
    """The checks that need no decoder (pure Python, a header's worth of work): the file
    size, truncation markers, for JPEG/PNG/WebP the picture size against the limits, and for
    videos the container's structure (`check_container`).
    The agent runs them before it hands out a raw container, so a bomb or a visibly
    truncated file is EIO in every mode without spending a decode on it."""
    check_source_size(len(raw), params)
    if kind == "image":
        check_image_bytes(raw, params)
    else:
        if not raw:
            raise TransformError("empty video")
        check_container(raw)


class Deadline:
    """A sample's time limit, checked between steps (each decoded frame, each phase). The agent
    also kills a worker that runs past it, which covers time spent inside one decoder call."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.at = time.monotonic() + self.seconds

    def check(self, what: str = "transform") -> None:
        if time.monotonic() > self.at:
            raise TransformTimeout(f"{what} ran over time_limit_s={self.seconds:g}")


_MP4_TOP = {b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"uuid", b"moof", b"mfra", b"styp",
            b"sidx", b"meta", b"pdin", b"prft", b"emsg", b"ssix", b"pnot", b"junk", b"PICT"}
_MAX_MP4_BOXES = 1 << 16


def check_container(raw: bytes) -> None:
    """The structure of a video's container, in pure Python (no demuxer, no decoder): an MP4/MOV
    (ISO BMFF) file's top-level boxes must tile the file exactly and include `moov`, so a file cut
    short or overwritten at its start is refused; a Matroska/WebM file must start with the EBML
    magic. Other containers, and damage inside the compressed data, are for the decoder to find."""
    if raw[:4] == b"\x1a\x45\xdf\xa3":
        _check_matroska(raw)
        return
    if raw[4:8] not in _MP4_TOP:
        if raw[:4] == b"RIFF" or raw[:3] == b"FLV" or raw[:4] == b"OggS" or _mpegts(raw):
            return                                        # AVI, FLV, Ogg, MPEG-TS: the decoder decides
        raise TransformError("not a video container this transform knows (no MP4 box, no EBML header)")
    off, n, seen = 0, len(raw), set()
    for _ in range(_MAX_MP4_BOXES):
        if off == n:
            break
        if n - off < 8:
            raise TransformError(f"truncated MP4 ({n - off} stray bytes after the last box)")
        size, kind = int.from_bytes(raw[off:off + 4], "big"), raw[off + 4:off + 8]
        head = 8
        if size == 1:
            if n - off < 16:
                raise TransformError("truncated MP4 (a box header is cut short)")
            size, head = int.from_bytes(raw[off + 8:off + 16], "big"), 16
        elif size == 0:
            size = n - off                                # the last box runs to the end of the file
        if size < head or not all(32 <= c < 127 for c in kind):
            raise TransformError(f"damaged MP4 (a box of {size} bytes typed {kind!r} at offset {off})")
        if off + size > n:
            raise TransformError(f"truncated MP4 (box {kind.decode()} of {size} bytes at offset {off} ends "
                                 f"{off + size - n} bytes past the end of the file)")
        seen.add(kind)
        off += size
    else:
        raise TransformError(f"MP4 of more than {_MAX_MP4_BOXES} top-level boxes")
    if b"moov" not in seen:
        raise TransformError("MP4 without a moov box (its index): not playable")


def _ebml_vint(raw: bytes, off: int) -> tuple[int, int, bool]:
    """(value without its length marker, bytes used, all value bits set = "unknown size")."""
    if off >= len(raw) or raw[off] == 0:
        raise TransformError(f"damaged Matroska/WebM (bad element header at offset {off})")
    length = 8 - raw[off].bit_length() + 1
    if off + length > len(raw):
        raise TransformError("truncated Matroska/WebM (an element header is cut short)")
    value = raw[off] & (0xFF >> length)
    for b in raw[off + 1:off + length]:
        value = value << 8 | b
    return value, length, value == (1 << (7 * length)) - 1


def _check_matroska(raw: bytes) -> None:
    """The EBML header, then the Segment: a Segment of known size must end within the file."""
    off = 4
    size, used, _ = _ebml_vint(raw, off)
    off += used + size                                    # past the EBML header
    if raw[off:off + 4] != b"\x18\x53\x80\x67":
        raise TransformError("damaged Matroska/WebM (no Segment after the EBML header)")
    size, used, unknown = _ebml_vint(raw, off + 4)
    end = off + 4 + used + size
    if not unknown and end > len(raw):
        raise TransformError(f"truncated Matroska/WebM (its Segment ends {end - len(raw)} bytes past the "
                             "end of the file)")


def _mpegts(raw: bytes) -> bool:
    return raw[:1] == b"\x47" and (len(raw) <= 188 or raw[188:189] == b"\x47")


def check_complete(raw: bytes) -> None:
    """Cheap structural checks for truncation that FFmpeg decodes silently (a JPEG cut short
    decodes to a grey bottom without an error)."""
    if raw[:2] == b"\xff\xd8":  # JPEG: the last scan (SOS) must be followed by EOI
        sos = raw.rfind(b"\xff\xda")
        if sos < 0 or raw.find(b"\xff\xd9", sos) < 0:
            raise TransformError("truncated JPEG (no end-of-image marker after the last scan)")
    elif raw[:8] == b"\x89PNG\r\n\x1a\n":
        if raw.rfind(b"IEND") < 0:
            raise TransformError("truncated PNG (no IEND chunk)")
    elif raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        riff = int.from_bytes(raw[4:8], "little") + 8
        if len(raw) < riff:
            raise TransformError(f"truncated WebP ({len(raw)} of {riff} bytes)")

"""Video transform: K sampled frames, each converted like an image.

Steps, all from the bytes in memory with one decode thread:

1. **Index** (``build_index``): demux every packet of the first video stream without
   decoding; keep each frame's pts (sorted = presentation order) and the pts of the
   keyframes. Cheap: no pixels are touched.
2. **Targets** (``select_frames``): ``uniform`` takes the centre frame of K equal segments
   of the frame list; ``fps`` takes K frames 1/fps seconds apart from a clip start
   (random from ``Generator([aug_seed, 1])``, or the start, or the centre); a time past the
   end repeats the last frame. Targets are exact frame pts from the index.
3. **Decode** (``decode_frames``): for each target in order, seek to the last keyframe at
   or before it *unless* no keyframe lies between the decoder's position and the target,
   in which case decoding simply continues forward (the seek would only re-decode
   frames). Decoding stops at the target; frames in between are never converted.
4. **Convert**: each kept frame goes decoded-format → rgb24 at the target size in one
   swscale pass (bit-exact flags), then the crop (one offset for all K frames, drawn as for
   images from ``Generator(aug_seed)``), dtype, normalization and layout.

Output: ``{"frames": K x H x W x 3}`` (uint8) or ``K x 3 x H x W`` (float32 by default).
"""
from __future__ import annotations

import bisect
import io
import logging
from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np

from .errors import TransformError
from .image import (bytes_per_px, crop_offset, decoder_options, ffmpeg_max_pixels, finish,
                    target_size, to_rgb)
from .limits import Deadline, check_container, check_frames, check_picture, check_pixels
from .params import VideoParams

log = logging.getLogger(__name__)

_AV_ERRORS = (av.FFmpegError, OSError, EOFError, ValueError, IndexError)


@dataclass(frozen=True)
class VideoIndex:
    """What demuxing (no decoding) tells about the first video stream."""

    frame_pts: tuple[int, ...]       # every frame, presentation order
    keyframe_pts: tuple[int, ...]    # keyframes (random access points), ascending
    time_base: Fraction
    width: int
    height: int
    codec: str
    bytes_per_px: int = 4            # upper estimate of a decoded frame's (8 above 8-bit)

    @property
    def nframes(self) -> int:
        return len(self.frame_pts)

    def seconds(self, pts: int) -> float:
        return float((pts - self.frame_pts[0]) * self.time_base)

    def keyframe_at_or_before(self, pts: int) -> int:
        i = bisect.bisect_right(self.keyframe_pts, pts) - 1
        return self.keyframe_pts[max(i, 0)]

    def keyframe_between(self, after: int, upto: int) -> bool:
        """Is there a keyframe k with after < k <= upto?"""
        i = bisect.bisect_right(self.keyframe_pts, after)
        return i < len(self.keyframe_pts) and self.keyframe_pts[i] <= upto


@dataclass
class DecodeStats:
    seeks: int = 0
    decoded: int = 0          # frames out of the decoder
    skipped_seeks: int = 0    # targets reached by decoding on instead of seeking
    restarts: int = 0         # seeks that landed after their target (re-decoded from start)
    targets: list[int] = field(default_factory=list)


def _open(raw: bytes, params: VideoParams) -> av.container.InputContainer:
    """Open ``raw`` with the picture-size bound given to FFmpeg (its probe decodes frames),
    and check the header's frame size and frame count against the limits. The container's
    structure is checked first, as before a raw container is handed out: both modes refuse the
    same files."""
    check_container(raw)
    try:
        container = av.open(io.BytesIO(raw), mode="r",
                            options={"max_pixels": ffmpeg_max_pixels(params)})
    except MemoryError:
        raise                       # reported by transforms.apply
    except _AV_ERRORS as e:
        raise TransformError(f"cannot open video: {e}") from e
    try:
        if not container.streams.video:
            raise TransformError("no video stream in the file")
        stream = container.streams.video[0]
        cc = stream.codec_context
        if cc is None:
            raise TransformError("no decoder for this video stream (unsupported codec or "
                                 "damaged header)")
        if cc.width and cc.height:
            check_pixels(cc.width, cc.height, params, "video frame")
        if stream.frames:
            check_frames(stream.frames, params)
        cc.options = decoder_options(params)
        cc.thread_count = 1
    except BaseException:
        container.close()
        raise
    return container


def build_index(raw: bytes, params: VideoParams | None = None,
                deadline: Deadline | None = None) -> VideoIndex:
    """Demux ``raw`` (no decoding) into a ``VideoIndex``; raises TransformError when the
    file cannot be demuxed, is visibly truncated, or is over ``params``' limits (frame size,
    ``max_frames``: demuxing stops at the first packet over it)."""
    params = params if params is not None else VideoParams()
    if not raw:
        raise TransformError("empty video")
    container = _open(raw, params)
    try:
        stream = container.streams.video[0]
        pts: list[int] = []
        keys: list[int] = []
        try:
            for packet in container.demux(stream):
                if packet.size == 0:
                    continue
                t = packet.pts if packet.pts is not None else packet.dts
                if t is None:
                    raise TransformError("video packets carry no timestamps")
                pts.append(t)
                if packet.is_keyframe:
                    keys.append(t)
                if len(pts) > params.max_frames:
                    check_frames(len(pts), params)
                if deadline is not None and not len(pts) & 255:
                    deadline.check("video indexing")
        except MemoryError:
            raise                       # reported by transforms.apply
        except _AV_ERRORS as e:
            raise TransformError(f"cannot demux video (corrupt or truncated): {e}") from e
        if not pts:
            raise TransformError("video has no frames")
        frame_pts = tuple(sorted(set(pts)))
        keyframe_pts = tuple(sorted(set(keys))) or (frame_pts[0],)
        tb = stream.time_base or Fraction(1, 1000)
        cc = stream.codec_context
        width, height = cc.width, cc.height
        bpp = bytes_per_px(cc.format) if cc.format is not None else 8
        index = VideoIndex(frame_pts, keyframe_pts, Fraction(tb), width, height, cc.name, bpp)
        _check_truncation(container, stream, index)
        return index
    finally:
        container.close()


def _check_truncation(container, stream, index: VideoIndex) -> None:
    """A file cut short often still demuxes (Matroska, fragmented MP4): compare the frames
    found with the duration the header announces."""
    if stream.duration:
        announced = float(stream.duration * stream.time_base)
    elif container.duration and len(container.streams) == 1:
        announced = container.duration / av.time_base
    else:
        return
    if index.nframes < 2 or announced <= 0:
        return
    span = index.seconds(index.frame_pts[-1])
    step = span / (index.nframes - 1)
    if span + step < 0.9 * announced - 0.05:
        raise TransformError(f"truncated video: frames cover {span + step:.2f} s of the "
                             f"{announced:.2f} s the header announces")


def select_frames(index: VideoIndex, params: VideoParams, aug_seed: int) -> list[int]:
    """The K target pts (with repeats where K exceeds what the video holds)."""
    n, k = index.nframes, params.frames
    if params.mode == "uniform":
        return [index.frame_pts[((2 * i + 1) * n) // (2 * k)] for i in range(k)]
    fps = params.fps
    if fps is None:  # a VideoParams built without validation (model_construct)
        raise TransformError("mode='fps' needs fps")
    times = [index.seconds(p) for p in index.frame_pts]
    clip = (k - 1) / fps
    room = max(0.0, times[-1] - clip)
    if params.clip_start == "start":
        t0 = 0.0
    elif params.clip_start == "center":
        t0 = room / 2
    else:
        t0 = float(np.random.default_rng([int(aug_seed), 1]).random()) * room
    out = []
    for i in range(k):
        t = t0 + i / fps
        j = bisect.bisect_right(times, t + 1e-9) - 1
        out.append(index.frame_pts[min(max(j, 0), n - 1)])
    return out


def frames_to_decode(index: VideoIndex, targets: list[int]) -> int:
    """How many frames ``decode_frames`` (``use_index``) decodes for ``targets``, from the index
    alone (no decoding; frames counted in presentation order): the agent's cost prediction for
    a video before its first transform (issue 40: a clip's size says little of its decode
    work, which its GOP and frame count set)."""
    pos = {p: i for i, p in enumerate(index.frame_pts)}
    cur: int | None = None
    n = 0
    for t in sorted(set(targets)):
        if t not in pos:
            continue
        if cur is not None and cur >= t:
            continue
        if cur is not None and not index.keyframe_between(cur, t):
            n += pos[t] - pos[cur]
        else:
            key = index.keyframe_at_or_before(t)
            n += pos[t] - pos.get(key, 0) + 1
        cur = t
    return n


def _frame_pts(frame) -> int:
    pts: int | None = frame.pts
    if pts is not None:
        return pts
    dts: int | None = frame.dts
    if dts is not None:
        return dts
    raise TransformError("decoded frame has no timestamp")


def decode_frames(raw: bytes, index: VideoIndex, targets: list[int], convert,
                  use_index: bool = True, params: VideoParams | None = None,
                  deadline: Deadline | None = None
                  ) -> tuple[dict[int, np.ndarray], DecodeStats]:
    """Decode the frames at ``targets`` (pts) and return ``{pts: convert(frame)}``.

    With ``use_index`` it seeks by the keyframe index and skips seeks that would not pass a
    keyframe; without it, it decodes everything from the start (the reference). ``deadline``
    is checked after every decoded frame."""
    params = params if params is not None else VideoParams()
    wanted = sorted(set(targets))
    stats = DecodeStats(targets=wanted)
    out: dict[int, np.ndarray] = {}
    container = _open(raw, params)
    try:
        stream = container.streams.video[0]
        gen = None
        cur: int | None = None   # pts of the last frame out of the current generator
        prev = None                 # that frame (a candidate when the exact pts is missing)
        pending = None              # a frame decoded past the previous target

        def start(at: int | None):
            nonlocal gen, cur, prev, pending
            if at is not None:
                container.seek(at, stream=stream, backward=True, any_frame=False)
                stats.seeks += 1
            gen = container.decode(stream)
            cur, prev, pending = None, None, None

        for t in wanted:
            if not use_index:
                if gen is None:
                    start(None)
            else:
                key = index.keyframe_at_or_before(t)
                if gen is None:
                    start(None if key <= index.keyframe_pts[0] else key)
                elif cur is not None and cur >= t:
                    pass  # overshot already: ``pending``/``prev`` decide below
                elif cur is not None and not index.keyframe_between(cur, t):
                    stats.skipped_seeks += 1
                else:
                    start(key)
            # (called within this iteration: the lambda reads this iteration's values, as meant)
            chosen = _advance(gen, t, stats, lambda: (cur, prev, pending), deadline)  # noqa: B023
            frame, cur, prev, pending = chosen
            if frame is None and use_index and stats.seeks:
                # the seek landed after the target (odd index): decode from the start
                stats.restarts += 1
                container.close()
                container = _open(raw, params)
                stream = container.streams.video[0]
                gen = container.decode(stream)
                frame, cur, prev, pending = _advance(gen, t, stats, lambda: (None, None, None),
                                                     deadline)
            if frame is None:
                raise TransformError(f"frame at pts {t} could not be decoded")
            out[t] = convert(frame)
        return out, stats
    except TransformError:
        raise
    except MemoryError:
        raise                       # reported by transforms.apply
    except _AV_ERRORS as e:
        raise TransformError(f"cannot decode video (corrupt or truncated): {e}") from e
    finally:
        container.close()


def _advance(gen, t: int, stats: DecodeStats, state, deadline: Deadline | None = None):
    """Decode until the frame at pts ``t``. Returns (frame, cur, prev, pending).

    Exact pts match wins; if the decoder jumps past ``t`` the frame shown at ``t`` (the
    last one before it) is used; a generator that starts past ``t`` gives ``None``."""
    cur, prev, pending = state()
    if pending is not None:
        p = _frame_pts(pending)
        if p == t:
            return pending, cur, pending, None
        if p > t:
            return (prev, cur, prev, pending) if prev is not None else (None, cur, prev, pending)
        prev, pending = pending, None
    for frame in gen:
        stats.decoded += 1
        if deadline is not None:
            deadline.check("video decoding")
        p = _frame_pts(frame)
        cur = p
        if p == t:
            return frame, cur, frame, None
        if p > t:
            if prev is not None and _frame_pts(prev) < t:
                return prev, cur, prev, frame
            return None, cur, prev, frame
        prev = frame
    # end of stream: the last frame stands for anything after it
    if prev is not None and _frame_pts(prev) <= t:
        return prev, cur, prev, None
    return None, cur, prev, None


def transform_video(raw: bytes, params: VideoParams, aug_seed: int,
                    index: VideoIndex | None = None, use_index: bool = True,
                    deadline: Deadline | None = None) -> dict[str, np.ndarray]:
    """Sample, decode and convert K frames of ``raw``. ``index`` may come from a cache."""
    if index is None:
        index = build_index(raw, params, deadline)
    frames, _ = sample_frames(raw, params, aug_seed, index, use_index, deadline)
    return {"frames": finish(frames, params)}


def sample_frames(raw: bytes, params: VideoParams, aug_seed: int,
                  index: VideoIndex | None = None, use_index: bool = True,
                  deadline: Deadline | None = None) -> tuple[np.ndarray, DecodeStats]:
    """K x H x W x 3 uint8 (resized and cropped, not yet normalized) and decode stats.

    Before anything is decoded the frame count, the frame size and the sample's bytes are
    checked against ``params``' limits."""
    if index is None:
        index = build_index(raw, params, deadline)
    check_frames(index.nframes, params)
    targets = select_frames(index, params, aug_seed)
    w0, h0 = index.width, index.height
    size: dict[str, tuple[int, int]] = {}

    def convert(frame):
        if not size:   # the header had no frame size: check the first decoded frame
            src_w, src_h = (w0, h0) if w0 and h0 else (frame.width, frame.height)
            check_picture(src_w, src_h, bytes_per_px(frame), params, kept=params.frames,
                          what="video frame")
            size["wh"] = target_size(src_w, src_h, params)
        w, h = size["wh"]
        return to_rgb(frame, w, h, params)

    if w0 and h0:
        check_picture(w0, h0, index.bytes_per_px, params, kept=params.frames, what="video frame")
        size["wh"] = target_size(w0, h0, params)
    got, stats = decode_frames(raw, index, targets, convert, use_index=use_index, params=params,
                               deadline=deadline)
    w, h = size["wh"]
    y, x = crop_offset(h, w, params, aug_seed)
    stack = np.stack([got[t] for t in targets])
    if params.crop is not None:
        ch, cw = params.crop
        stack = stack[:, y:y + ch, x:x + cw]
    return np.ascontiguousarray(stack), stats

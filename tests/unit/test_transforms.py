"""transforms: params, image and video transforms, the `.tensor` container.

All media are generated here with PyAV (tiny images and ~2 s videos at 64x48), so the
tests need no data files; a codec this PyAV build lacks is skipped.
"""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

av = pytest.importorskip("av")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from hintfs import transforms  # noqa: E402
from hintfs.transforms import TransformError, apply  # noqa: E402
from hintfs.transforms import container as tc  # noqa: E402
from hintfs.transforms.image import crop_offset, target_size  # noqa: E402
from hintfs.transforms.params import (ImageParams, TransformRule, VideoParams, default_seed,  # noqa: E402
                               match_rule, params_hash)
from hintfs.transforms.video import build_index, frames_to_decode, sample_frames, select_frames  # noqa: E402

from tests.helpers.media import VIDEO_CASES, has_decoder, has_encoder, make_image, make_video, pattern  # noqa: E402,F401


# ---------------------------------------------------------------- media generation

@pytest.fixture(scope="module")
def images():
    return {f"{fmt}-{w}x{h}": make_image(fmt, w, h, seed=w)
            for fmt in ("jpeg", "png", "webp") for (w, h) in ((97, 61), (64, 300))}


_videos: dict[str, bytes] = {}


@pytest.fixture(params=sorted(VIDEO_CASES))
def video(request):
    enc, mux, dec = VIDEO_CASES[request.param]
    if not has_decoder(dec):
        pytest.skip(f"PyAV cannot decode {dec}")
    if request.param not in _videos:
        _videos[request.param] = make_video(enc, mux)
    return request.param, _videos[request.param]


def _h264() -> bytes:
    if "h264-mp4" not in _videos:
        _videos["h264-mp4"] = make_video("libx264", "mp4")
    return _videos["h264-mp4"]


# ---------------------------------------------------------------- params

def test_params_validate_and_forbid_extra():
    assert ImageParams().out_dtype == "uint8" and ImageParams().out_layout == "HWC"
    p = ImageParams(normalize=True)
    assert p.out_dtype == "float32" and p.out_layout == "CHW"
    with pytest.raises(ValidationError):
        ImageParams(sise=3)
    with pytest.raises(ValidationError):
        ImageParams(normalize=True, dtype="uint8")
    with pytest.raises(ValidationError):
        ImageParams(std=(1.0, 0.0, 1.0))
    with pytest.raises(ValidationError):
        VideoParams(mode="fps")
    with pytest.raises(ValidationError):
        VideoParams(frames=0)


def test_rule_and_hash():
    r = TransformRule.model_validate({"glob": "train/*.mp4", "kind": "video",
                                      "params": {"frames": 4, "size": 32}})
    assert isinstance(r.params, VideoParams) and r.params.frames == 4
    with pytest.raises(ValidationError):
        TransformRule.model_validate({"glob": "*.jpg", "kind": "image", "params": {"frames": 4}})
    with pytest.raises(ValidationError):
        TransformRule.model_validate({"glob": "*.jpg", "kind": "audio", "params": {}})
    rules = [TransformRule(glob="*.jpg", kind="image", params=ImageParams()), r]
    assert match_rule(rules, "train/a.mp4") is r
    assert match_rule(rules, "x.jpg").kind == "image"
    assert match_rule(rules, "x.png") is None
    # stable: equal values hash equal; any change changes the hash; kind is part of it
    assert params_hash(ImageParams(size=32)) == params_hash(ImageParams.model_validate_json('{"size":32}'))
    assert params_hash(ImageParams(size=32)) != params_hash(ImageParams(size=33))
    assert params_hash(ImageParams()) != params_hash(VideoParams())
    h = params_hash(ImageParams())
    assert len(h) == 16 and int(h, 16) >= 0
    s = default_seed("a/b.jpg")
    assert s == default_seed("/a/b.jpg") and 0 <= s < 2**63 and s != default_seed("a/c.jpg")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=st.integers(1, 4000), h=st.integers(1, 4000), size=st.none() | st.integers(1, 512),
       ch=st.integers(1, 300), cw=st.integers(1, 300), seed=st.integers(0, 2**63 - 1),
       mode=st.sampled_from(["random", "center"]))
def test_crop_offset_within_bounds(w, h, size, ch, cw, seed, mode):
    p = ImageParams(size=size, crop=(ch, cw), crop_mode=mode)
    tw, th = target_size(w, h, p)
    assert tw >= cw and th >= ch
    y, x = crop_offset(th, tw, p, seed)
    assert 0 <= y <= th - ch and 0 <= x <= tw - cw
    assert (y, x) == crop_offset(th, tw, p, seed)


# ---------------------------------------------------------------- images

@pytest.mark.parametrize("params", [
    {},
    {"size": 32, "crop": [24, 24]},
    {"size": 40, "crop": [32, 16], "normalize": True},
    {"size": 20, "dtype": "float32", "layout": "HWC", "interpolation": "area"},
    {"crop": [48, 48], "crop_mode": "center"},
])
def test_image_shapes_and_determinism(images, params):
    p = ImageParams(**params)
    for name, raw in images.items():
        a = apply("image", raw, params, 12345)["pixels"]
        b = apply("image", raw, p, 12345)["pixels"]
        assert a.tobytes() == b.tobytes() and a.dtype == b.dtype
        assert a.dtype == np.dtype(p.out_dtype) and a.flags.c_contiguous
        w0, h0 = (int(v) for v in name.split("-")[1].split("x"))
        tw, th = target_size(w0, h0, p)
        hw = tuple(p.crop) if p.crop else (th, tw)
        assert a.shape == ((3, *hw) if p.out_layout == "CHW" else (*hw, 3))
        if p.size and not p.crop:
            assert min(a.shape[:2] if p.out_layout == "HWC" else a.shape[1:]) == p.size


def test_image_normalize_matches_formula(images):
    raw = images["png-97x61"]
    u8 = apply("image", raw, {"size": 40, "crop": [32, 32]}, 7)["pixels"]
    f = apply("image", raw, {"size": 40, "crop": [32, 32], "normalize": True}, 7)["pixels"]
    p = ImageParams(normalize=True)
    ref = (u8.astype(np.float32) / 255 - np.float32(p.mean)) / np.float32(p.std)
    np.testing.assert_allclose(f, ref.transpose(2, 0, 1), rtol=1e-6, atol=1e-6)
    # PNG is lossless and no resize: the pixels are the encoded ones
    full = apply("image", raw, {}, 0)["pixels"]
    with av.open(io.BytesIO(raw)) as c:
        assert np.array_equal(full, next(c.decode(video=0)).to_ndarray(format="rgb24"))


def test_image_seed_moves_the_crop(images):
    raw = images["png-97x61"]
    outs = {apply("image", raw, {"crop": [20, 20]}, s)["pixels"].tobytes() for s in range(8)}
    assert len(outs) > 1
    centre = {apply("image", raw, {"crop": [20, 20], "crop_mode": "center"}, s)["pixels"].tobytes()
              for s in range(4)}
    assert len(centre) == 1


@pytest.mark.parametrize("cut", ["half", "tail"])
@pytest.mark.parametrize("fmt", ["jpeg", "png", "webp"])
def test_image_truncated_raises(images, fmt, cut):
    raw = images[f"{fmt}-97x61"]
    bad = raw[: len(raw) // 2] if cut == "half" else raw[:-3]
    with pytest.raises(TransformError):
        apply("image", bad, {}, 0)


@pytest.mark.parametrize("bad", [b"", b"not an image at all" * 10, bytes(1000),
                                 b"\xff\xd8\xff\xe0" + bytes(300)])
def test_image_corrupt_raises(bad):
    with pytest.raises(TransformError):
        apply("image", bad, {}, 0)
    assert issubclass(TransformError, ValueError)


def test_bad_params_raise_transform_error(images):
    with pytest.raises(TransformError):
        apply("image", images["png-97x61"], {"bogus": 1}, 0)
    with pytest.raises(TransformError):
        apply("audio", images["png-97x61"], {}, 0)


# ---------------------------------------------------------------- video

VIDEO_PARAMS = [
    VideoParams(frames=8),
    VideoParams(frames=5, mode="fps", fps=7),
    VideoParams(frames=3, mode="fps", fps=2, clip_start="center"),
    VideoParams(frames=3, size=32, crop=(24, 24)),
    VideoParams(frames=50),  # more than the video holds: repeats
]


def test_video_index(video):
    name, raw = video
    idx = build_index(raw)
    assert idx.nframes == 40 and (idx.width, idx.height) == (64, 48)
    assert len(idx.keyframe_pts) >= 5 and idx.keyframe_pts[0] == idx.frame_pts[0]
    assert set(idx.keyframe_pts) <= set(idx.frame_pts)


def test_video_seek_matches_decode_everything(video):
    name, raw = video
    idx = build_index(raw)
    for p in VIDEO_PARAMS:
        a, s_seek = sample_frames(raw, p, 99, idx, use_index=True)
        b, s_ref = sample_frames(raw, p, 99, idx, use_index=False)
        assert a.shape == b.shape and a.tobytes() == b.tobytes(), (name, p)
        assert s_seek.decoded <= s_ref.decoded and s_seek.restarts == 0
    # K=8 over 40 frames with a keyframe every 8: seeks happen, some are skipped,
    # fewer frames are decoded than by the reference
    _, s = sample_frames(raw, VideoParams(frames=8), 0, idx)
    assert s.seeks >= 1 and s.skipped_seeks >= 1


def test_frames_to_decode_counts_what_the_decoder_decodes(video):
    # the agent's first-pass cost prediction of a video (issue 40): from the index alone, the
    # frames decode_frames decodes for the sample's targets, every mode and GOP
    name, raw = video
    idx = build_index(raw)
    for p in VIDEO_PARAMS:
        for seed in (0, 99):
            _, st = sample_frames(raw, p, seed, idx)
            assert frames_to_decode(idx, select_frames(idx, p, seed)) == st.decoded, (name, p, seed)


def test_video_frames_are_the_right_ones():
    raw = _h264()
    idx = build_index(raw)
    out = apply("video", raw, {"frames": 40}, 0)["frames"]
    assert out.shape == (40, 48, 64, 3) and out.dtype == np.uint8
    # each decoded frame is closest to the source frame of its index (lossy codec)
    for i in (0, 7, 8, 21, 39):
        err = [np.abs(out[i].astype(int) - pattern(j, 64, 48)).mean() for j in range(40)]
        assert int(np.argmin(err)) == i
    assert len(idx.frame_pts) == 40


def test_video_determinism_and_layouts(video):
    name, raw = video
    p = {"frames": 4, "size": 40, "crop": [32, 32], "normalize": True}
    a = apply("video", raw, p, 5)["frames"]
    b = apply("video", raw, p, 5)["frames"]
    assert a.tobytes() == b.tobytes() and a.shape == (4, 3, 32, 32) and a.dtype == np.float32
    u = apply("video", raw, {"frames": 4, "size": 24}, 5)["frames"]
    assert u.shape == (4, 24, 32, 3) and u.dtype == np.uint8


def test_video_fps_mode_random_clip_uses_seed():
    raw = _h264()
    p = {"frames": 3, "mode": "fps", "fps": 10}
    outs = {apply("video", raw, p, s)["frames"].tobytes() for s in range(6)}
    assert len(outs) > 1
    start = {apply("video", raw, dict(p, clip_start="start"), s)["frames"].tobytes()
             for s in range(3)}
    assert len(start) == 1


def test_video_truncated_and_corrupt_raise(video):
    name, raw = video
    for bad in (raw[: len(raw) // 2], raw[:200], b"", b"\x00" * 4096,
                bytes(np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8))):
        with pytest.raises(TransformError):
            apply("video", bad, {"frames": 4}, 0)


def test_video_damaged_h264_raises():
    raw = _h264()
    mid = len(raw) // 2
    bad = raw[:mid] + bytes(b ^ 0x55 for b in raw[mid:mid + 200]) + raw[mid + 200:]
    with pytest.raises(TransformError):
        apply("video", bad, {"frames": 40}, 0)


# ---------------------------------------------------------------- container

def _meta(kind, params, seed=3, raw=b""):
    return tc.make_meta(kind, params, seed, f"data/x.{kind}", len(raw), 1_700_000_000_123)


def test_container_alignment_and_safetensors_compat(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    from safetensors import safe_open
    arrays = {"a": np.arange(7, dtype=np.uint8), "b": np.ones((3, 5), np.float32),
              "c": np.arange(6, dtype=np.int64).reshape(2, 3), "pixels": np.zeros((5, 5, 3), np.uint8)}
    data = tc.encode_tensor(arrays, _meta("image", {"size": 8}))
    assert tc.data_offset(data) % 64 == 0
    for name, (s, e) in tc.tensor_offsets(data).items():
        if not name.startswith("__pad"):
            assert s % 64 == 0, name
    loaded = safetensors_numpy.load(data)
    for k, v in arrays.items():
        assert np.array_equal(loaded[k], v) and loaded[k].dtype == v.dtype
    f = tmp_path / "x.jpg.tensor"
    f.write_bytes(data)
    with safe_open(str(f), framework="np") as st_:
        md = st_.metadata()
        assert np.array_equal(st_.get_tensor("b"), arrays["b"])
    assert md["hintfs"] == "1" and md["mode"] == "tensor" and md["kind"] == "image"
    assert json.loads(md["params"])["size"] == 8 and md["aug_seed"] == "3"
    assert md["source"] == "data/x.image" and md["source_mtime_ns"] == "1700000000123"
    meta, got = tc.decode(data)
    assert set(got) == set(arrays) and meta.mode == "tensor"
    assert all(np.array_equal(got[k], arrays[k]) for k in arrays)
    out = tc.load_sample(f)
    assert set(out) == set(arrays) and out["b"].flags.writeable


def test_container_rejects_garbage():
    for bad in (b"", b"1234567", (10**9).to_bytes(8, "little") + b"{}", b"\x02\0\0\0\0\0\0\0{}"):
        with pytest.raises(TransformError):
            tc.decode(bad)
    data = tc.encode_tensor({"x": np.zeros(100, np.uint8)}, _meta("image", {}))
    with pytest.raises(TransformError):
        tc.decode(data[:-10])


@pytest.mark.parametrize("params", [{"size": 32, "crop": [24, 24]},
                                    {"size": 40, "crop": [32, 32], "normalize": True}])
def test_raw_and_tensor_modes_agree_images(images, params):
    for name, raw in images.items():
        meta = _meta("image", params, seed=default_seed(name), raw=raw)
        t = tc.encode_tensor(apply("image", raw, params, meta.aug_seed), meta)
        r = tc.encode_raw(raw, meta)
        assert tc.data_offset(r) % 64 == 0 and tc.decode(r)[0].mode == "raw"
        assert tc.decode(r)[1]["raw"].tobytes() == raw
        a, b = tc.load_sample(t), tc.load_sample(r)
        assert a.keys() == b.keys() == {"pixels"}
        assert a["pixels"].dtype == b["pixels"].dtype and a["pixels"].tobytes() == b["pixels"].tobytes()


def test_raw_and_tensor_modes_agree_video(video, tmp_path):
    name, raw = video
    params = VideoParams(frames=4, mode="fps", fps=5, size=32, crop=(24, 24), normalize=True)
    meta = _meta("video", params, seed=11, raw=raw)
    t = tc.encode_tensor(transforms.apply("video", raw, params, 11), meta)
    (tmp_path / "r.tensor").write_bytes(tc.encode_raw(raw, meta))
    a, b = tc.load_sample(t), tc.load_sample(tmp_path / "r.tensor")
    assert a["frames"].shape == (4, 3, 24, 24)
    assert a["frames"].tobytes() == b["frames"].tobytes()


# ---------------------------------------------------------------- resource bounds (see also test_media_bounds)

def test_image_header_reads_the_size_every_supported_format_announces(images):
    from hintfs.transforms.limits import image_header
    for name, raw in images.items():
        fmt, size = name.split("-")
        w, h = (int(x) for x in size.split("x"))
        assert image_header(raw) == (fmt, w, h, 4), name
    # lossless WebP (VP8L) and the extended header (VP8X, with alpha)
    for opts, pix in (({"lossless": "1"}, "bgra"), ({}, "yuva420p")):
        if not has_encoder("libwebp"):
            pytest.skip("PyAV has no libwebp encoder")
        buf = io.BytesIO()
        with av.open(buf, "w", format="webp") as c:
            s = c.add_stream("libwebp")
            s.width, s.height, s.pix_fmt = 123, 45, pix
            s.options = opts
            frame = av.VideoFrame.from_ndarray(pattern(0, 123, 45), format="rgb24").reformat(format=pix)
            for p in s.encode(frame):
                c.mux(p)
            for p in s.encode(None):
                c.mux(p)
        raw = buf.getvalue()
        assert image_header(raw)[1:3] == (123, 45), (raw[12:16], opts)
        assert apply("image", raw, {}, 0)["pixels"].shape == (45, 123, 3)
    assert image_header(b"not an image") is None and image_header(b"\xff\xd8\xff") is None


@pytest.mark.parametrize("fmt", ["jpeg", "png", "webp"])
def test_picture_over_max_pixels_is_refused_before_decoding(images, fmt):
    raw = images[f"{fmt}-97x61"]
    with pytest.raises(TransformError, match="97x61 = 5917 pixels is over max_pixels=5916"):
        apply("image", raw, {"max_pixels": 5916}, 0)
    assert apply("image", raw, {"max_pixels": 5917}, 0)["pixels"].shape == (61, 97, 3)


def test_the_resize_runs_in_the_calling_thread():
    """The transforms make no threads of their own (one decode thread per call: they run in
    process pools, and a client's DataLoader workers are forked). PyAV 18's `reformat` asks
    swscale for a pool of one thread per CPU by default, kept while the frame lives; a DataLoader
    worker forked in CI hung in that pool's futex wait. `to_rgb` scales in the calling thread."""
    import os

    from hintfs.transforms.image import decode_image, to_rgb
    from hintfs.transforms.params import ImageParams

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))
    params = ImageParams(size=64)
    frame = decode_image(make_image("jpeg", 640, 480, seed=2), params)
    before = threads()
    rgb = to_rgb(frame, 160, 120, params)
    assert rgb.shape == (120, 160, 3) and threads() == before


def _encoded(codec: str, pix: str, w: int, h: int, options: dict | None = None) -> bytes:
    import fractions

    import av
    if not has_encoder(codec):
        pytest.skip(f"PyAV has no {codec} encoder")
    ctx = av.CodecContext.create(codec, "w")
    ctx.width, ctx.height, ctx.pix_fmt = w, h, pix
    ctx.time_base = fractions.Fraction(1, 25)
    ctx.options = options or {}
    frame = av.VideoFrame.from_ndarray(pattern(5, w, h, 5), format="rgb24").reformat(format=pix)
    return b"".join(bytes(p) for p in list(ctx.encode(frame)) + list(ctx.encode(None)))


def test_a_jpeg_png_or_webp_goes_straight_to_its_decoder(images, monkeypatch):
    """A format whose header `image_header` reads is one packet to its decoder: no demuxer, whose
    probe decoded the picture once more (2.4x the decode's own time for a 2048x1536 JPEG). The
    picture is the one the probed path gives, byte for byte, so tensors made before and after
    agree."""
    from hintfs.transforms import image as im
    params = ImageParams()
    cases = dict(images)
    cases.update({"jpeg-444": _encoded("mjpeg", "yuvj444p", 75, 40),
                  "jpeg-422": _encoded("mjpeg", "yuvj422p", 33, 17),
                  "png-rgba": _encoded("png", "rgba", 31, 9),
                  "png-gray16": _encoded("png", "gray16be", 20, 11),
                  "webp-lossless": _encoded("libwebp", "bgra", 23, 19, {"lossless": "1"})})
    probed = {name: im._decode_probed(raw, params) for name, raw in cases.items()}

    def no_demuxer(*_a, **_k):
        raise AssertionError("a demuxer was opened")
    monkeypatch.setattr(im.av, "open", no_demuxer)
    for name, raw in cases.items():
        frame, before = im.decode_image(raw, params), probed[name]
        assert (frame.format.name, frame.width, frame.height) == \
            (before.format.name, before.width, before.height), name
        assert [bytes(p) for p in frame.planes] == [bytes(p) for p in before.planes], name

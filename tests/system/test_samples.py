"""The agent's sample service: cache, prefetch, single-flight, load-aware fallback."""

import numpy as np
import pytest

from hintfs.stores.local import LocalStore
from hintfs.agent.samples import LoadMonitor, SampleKey, SampleService
from mountconfig import parse_config
from tests.conftest import wait_for

av = pytest.importorskip("av")
PARAMS = {"size": 32, "crop": [24, 24]}


def test_hysteresis():
    m = LoadMonitor(0.8, 0.7, interval_s=3600)
    try:
        for share, busy in [(0.5, False), (0.79, False), (0.8, True), (0.75, True), (0.7, True), (0.69, False)]:
            m.update(share)
            assert m.busy is busy, share
    finally:
        m.stop()


@pytest.fixture(params=[False])
def service(tmp_path, request):
    from tests.helpers.media import jpeg_file as _jpeg
    (tmp_path / "s").mkdir()
    for i in range(3):
        _jpeg(tmp_path / "s" / f"{i}.jpg", seed=i, w=64, h=48)
    cfg = parse_config({"transform_load": {"workers": 1, "deadline_ms": 60000, "fallback": request.param}})
    svc = SampleService(LocalStore(str(tmp_path / "s")), cfg.transform_load)
    svc.monitor.stop()   # the tests set the CPU share themselves; the machine's own load must not count
    svc.monitor.update(0.0)
    yield svc
    svc.close()


def test_prefetch_then_cache_hit_and_forget(service):
    from hintfs.transforms.container import decode
    assert service.prefetch([(f"{i}.jpg", "image", PARAMS, 7) for i in range(3)]) == 3
    assert wait_for(lambda: service.status()["cached"] >= 3, timeout=60)   # made by the worker processes
    data, how = service.get("1.jpg", "image", PARAMS, 7)
    assert how == "cache" and decode(data)[0].mode == "tensor"
    assert service.prefetch([("1.jpg", "image", PARAMS, 7)]) == 0     # nothing to redo
    service.forget({("0.jpg", 7)})
    assert service.status()["cached"] == 1
    data2, how2 = service.get("1.jpg", "image", PARAMS, 7)
    assert how2 == "tensor" and data2 == data                           # deterministic


@pytest.mark.parametrize("service", [True], indirect=True)
def test_busy_storage_serves_raw(service):
    from hintfs.transforms.container import decode, load_sample
    service.monitor.update(0.99)          # as if the CPU were saturated
    data, how = service.get("2.jpg", "image", PARAMS, 3)
    assert how == "raw_busy" and decode(data)[0].mode == "raw"
    service.monitor.update(0.1)
    tensor, how = service.get("2.jpg", "image", PARAMS, 3)
    assert how == "tensor"
    assert np.array_equal(load_sample(data)["pixels"], load_sample(tensor)["pixels"])
    assert service.status()["raw_busy"] == 1


def test_demand_reads_go_ahead_of_the_lookahead(service):
    # One worker, three prefetches: only one runs, two wait in the backlog ...
    service.prefetch([(f"{i}.jpg", "image", PARAMS, 100 + i) for i in range(3)])
    assert service.status()["backlog"] == 2 and service.status()["running"] == 1
    # ... and a sample a reader waits for is made before them.
    data, how = service.get("2.jpg", "image", PARAMS, 999)
    assert how == "tensor"
    assert service.status()["backlog"] >= 1 or service.status()["cached"] >= 1


def _corrupt_png(path, w=64, h=48):
    """A PNG whose header, size and end pass every check that needs no decoder, with one byte of
    its compressed picture flipped (FFmpeg's CRC check refuses it)."""
    from tests.helpers.media import make_image
    from hintfs.transforms.limits import precheck
    from hintfs.transforms.params import parse_params
    data = bytearray(make_image("png", w, h, seed=3))
    idat = data.index(b"IDAT")
    data[idat + 4 + 20] ^= 0x55
    precheck("image", bytes(data), parse_params("image", PARAMS))    # passes the header checks
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("service", [True], indirect=True)
def test_a_corrupt_image_that_passes_the_header_checks_is_never_served_raw(service, tmp_path):
    """Issue 34, finding 12: under load-aware fallback a corrupt PNG was handed out as a raw
    `.tensor` (the header checks passed; only a decoder finds the damage). Now the image is
    decoded once in a worker before its raw container goes out: EIO, as the transform's."""
    from hintfs.transforms import TransformError
    from hintfs.transforms.container import decode
    root = tmp_path / "s"
    _corrupt_png(root / "bad.png")
    service.monitor.update(0.99)            # as if the CPU were saturated: fallback to raw
    with pytest.raises(TransformError):
        service.get("bad.png", "image", PARAMS, 1)
    st = service.status()
    assert st["raw_busy"] == 0 and st["refused"] == 1
    with pytest.raises(TransformError):     # remembered: EIO at once, in every mode
        service.get("bad.png", "image", PARAMS, 2)
    # a sound image still goes out raw, decoded once; its next raw container needs no check
    data, how = service.get("0.jpg", "image", PARAMS, 1)
    assert how == "raw_busy" and decode(data)[0].mode == "raw"
    service.get("0.jpg", "image", PARAMS, 2)
    assert service.status()["decode_checks"] == 1


def test_with_header_checks_only_an_image_goes_out_raw_as_a_video_does(tmp_path):
    """`image_raw_check = "header"`: an image's raw container gets only the checks that need no
    decoder (as a video's): no decode on storage, so it saves storage its whole transform. A
    corrupt image that passes them goes out raw, and the client's `load_sample` is EIO, never a
    tensor; one that fails them (truncated) is EIO at the agent still, in both modes."""
    from hintfs.transforms import SampleEIO, TransformError
    from hintfs.transforms.container import decode, load_sample
    root = tmp_path / "s"
    root.mkdir()
    _corrupt_png(root / "bad.png")
    from tests.helpers.media import jpeg_file
    jpeg_file(root / "0.jpg", seed=0, w=64, h=48)
    (root / "cut.jpg").write_bytes((root / "0.jpg").read_bytes()[:-200])
    cfg = parse_config({"transform_load": {"workers": 1, "deadline_ms": 60000, "fallback": True,
                                           "image_raw_check": "header"}})
    svc = SampleService(LocalStore(str(root)), cfg.transform_load)
    try:
        svc.monitor.stop()
        svc.monitor.update(0.99)            # as if the CPU were saturated: fallback to raw
        assert svc._raw_cost(SampleKey("0.jpg", 1, 1, "p", 1), "image", 0.03) == 0.0   # no check to pay
        data, how = svc.get("0.jpg", "image", PARAMS, 1)
        assert how == "raw_busy" and decode(data)[0].mode == "raw"
        bad, how = svc.get("bad.png", "image", PARAMS, 1)
        assert how == "raw_busy" and decode(bad)[0].mode == "raw"
        with pytest.raises(SampleEIO):      # the client's transform refuses it: EIO, never a tensor
            load_sample(bad)
        with pytest.raises(TransformError):  # the header checks still refuse at the agent
            svc.get("cut.jpg", "image", PARAMS, 1)
        st = svc.status()
        assert st["decode_checks"] == 0 and st["raw_busy"] == 2 and st["refused"] == 1
        svc.monitor.update(0.0)             # idle: the same sample made on storage is the same tensor
        tensor, how = svc.get("0.jpg", "image", PARAMS, 1)
        assert how == "tensor"
        assert np.array_equal(load_sample(data)["pixels"], load_sample(tensor)["pixels"])
    finally:
        svc.close()


@pytest.mark.parametrize("service", [True], indirect=True)
def test_an_image_transformed_once_goes_out_raw_without_a_check(service):
    """A transform decodes the source with the decoder, options and bounds of the decode check:
    once an image was transformed, its raw containers (another seed, a later epoch) need no check
    and cost storage nothing (issue 40, run 10)."""
    from hintfs.transforms.container import decode
    service.get("1.jpg", "image", PARAMS, 1)                 # made on storage (idle)
    key = next(k for k in service.cache if k.path == "1.jpg")
    assert service._raw_cost(key, "image", 0.03) == 0.0
    service.monitor.update(0.99)            # as if the CPU were saturated: fallback to raw
    data, how = service.get("1.jpg", "image", PARAMS, 2)
    assert how == "raw_busy" and decode(data)[0].mode == "raw"
    assert service.status()["decode_checks"] == 0
    # an image never transformed still costs its check
    data, how = service.get("2.jpg", "image", PARAMS, 1)
    assert how == "raw_busy" and service.status()["decode_checks"] == 1


def test_one_jobs_plan_window_never_frees_another_jobs_prefetched_samples(service):
    """Issue 34, finding 8: `forget(keep)` freed every cached sample not in the window of the
    plan that called it, another job's prefetched samples included. Now each job holds its own:
    a job's window frees only what it held itself."""
    want_a = [(f"{i}.jpg", "image", PARAMS, 10 + i) for i in range(2)]
    want_b = [("2.jpg", "image", PARAMS, 50)]
    service.forget({(p, s) for p, _k, _x, s in want_a}, job="job-a")
    assert service.prefetch(want_a, job="job-a") == 2
    assert wait_for(lambda: service.status()["cached"] >= 2, timeout=60)
    # job B registers its plan and moves its window: job A's samples stay
    service.forget({(p, s) for p, _k, _x, s in want_b}, job="job-b")
    service.prefetch(want_b, job="job-b")
    service.forget(set(), job="job-b")      # B's plan ends
    for p, k, x, s in want_a:
        assert service.peek(p, k, x, s) is not None, f"{p} of job A was freed by job B"
    assert service.status()["held"] == 2 and service.status()["jobs"] == 1
    # A's own window moving frees A's sample
    service.forget({("1.jpg", 11)}, job="job-a")
    assert service.peek("0.jpg", "image", PARAMS, 10) is None
    assert service.peek("1.jpg", "image", PARAMS, 11) is not None


def test_a_job_holds_at_most_its_share_of_the_cache(tmp_path):
    """The bounds of the per-job cache, without transforms: a job holds at most JOB_SHARE of
    `cache_bytes`; past it (or past the total) its samples are cached unheld and evicted first,
    and never another job's held samples."""
    from hintfs.agent.samples import JOB_SHARE, SampleKey
    cfg = parse_config({"transform_load": {"workers": 1, "cache_bytes": 1000}})
    svc = SampleService(LocalStore(str(tmp_path)), cfg.transform_load)
    svc.monitor.stop()
    try:
        key = lambda p, s: SampleKey(p, 1, 1, "h", s)   # noqa: E731
        svc.forget({(f"a{i}", 0) for i in range(4)}, job="a")
        svc.forget({(f"b{i}", 0) for i in range(4)}, job="b")
        for i in range(4):
            svc._put(key(f"a{i}", 0), b"x" * 200, ["a"])
        assert svc.jobs["a"].bytes == int(1000 * JOB_SHARE) // 200 * 200 == 400
        for i in range(4):
            svc._put(key(f"b{i}", 0), b"y" * 200, ["b"])
        assert svc.held_bytes == 800 and svc.cache_bytes <= 1000
        held_a = {k.path for k in svc.jobs["a"].held}
        assert held_a == {"a0", "a1"} and all(key(p, 0) in svc.cache for p in held_a)
        svc._put(key("demand", 0), b"z" * 200)          # made for a read: evicted before any held one
        svc._put(key("demand2", 0), b"z" * 200)
        assert all(key(p, 0) in svc.cache for p in ("a0", "a1", "b0", "b1"))
    finally:
        svc.close()

"""The agent's samples scheduled by predicted cost (issue 40): with the plan steps a mount sends,
the samples storage cannot finish before their step go raw (cheapest first), the others are made
in latest-start-time order, the lookahead grows near capacity, and a job's raw sample is the same
tensor for the client. The clock is injected; the transforms run in real workers."""

import os

import numpy as np
import pytest

from hintfs.agent.samples import SampleService
from hintfs.stores.local import LocalStore
from mountconfig import parse_config
from tests.conftest import wait_for

av = pytest.importorskip("av")
PARAMS = {"size": 32, "crop": [24, 24]}


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def svc(tmp_path):
    from tests.helpers.media import jpeg_file
    (tmp_path / "s").mkdir()
    for i in range(12):
        jpeg_file(tmp_path / "s" / f"{i}.jpg", seed=i, w=64 + 16 * i, h=48)
    cfg = parse_config({"transform_load": {"workers": 1, "deadline_ms": 60000, "lookahead_steps": 2,
                                           "lookahead_max_steps": 16}})
    clock = Clock()
    s = SampleService(LocalStore(str(tmp_path / "s")), cfg.transform_load, clock=clock)
    s.monitor.stop()
    s.monitor.update(0.99)          # the old CPU threshold must not decide for a mount that sends steps
    s.clock_ = clock
    yield s
    s.close()


def _window(svc, step, lo, hi, per_step=2, job="j", est_ms=None):
    want = [(f"{(s * per_step + k) % 12}.jpg", "image", PARAMS, 100 + s * per_step + k)
            for s in range(lo, hi + 1) for k in range(per_step)]
    steps = [s for s in range(lo, hi + 1) for _k in range(per_step)]
    costs = [est_ms] * len(want) if est_ms is not None else None
    svc.forget({(p, seed) for p, _k, _x, seed in want}, job=job)
    return svc.prefetch(want, job=job, steps=steps, step=step, costs=costs, lookahead=2), want


def _steps(svc, n, sps, settle=True):
    """The job's readers move `n` steps, `sps` seconds each (as the mount reports them); with
    `settle` the workers finish the window before the clock moves on (a storage that keeps up)."""
    for s in range(n):
        svc.clock_.t += sps
        _window(svc, s, s, s + 2)
        if settle:
            assert wait_for(lambda: svc.status()["running"] == 0 and svc.status()["backlog"] == 0, timeout=60)


def test_with_capacity_left_nothing_goes_raw_and_reads_get_tensors(svc):
    from hintfs.transforms.container import decode
    _steps(svc, 4, 10.0)                     # 10 s per step: ample time
    assert svc.clocks["j"].seconds_per_step == pytest.approx(10.0)
    assert wait_for(lambda: svc.status()["running"] == 0 and svc.status()["cached"] >= 4, timeout=60)
    assert svc.status()["raw_designated"] == 0
    data, how = svc.get("6.jpg", "image", PARAMS, 106)
    assert how in ("cache", "tensor") and decode(data)[0].mode == "tensor"
    assert svc.status()["raw_busy"] == 0


def _overload(svc) -> None:
    """Storage now runs 50x slower than its transforms' CPU time (a measured capacity, as a burner
    would make it) and steps take 0.05 s: the window of steps 3-5 cannot be made in time. An
    image's decode check is taken to cost a tenth of its transform, so that sending one raw saves
    storage enough to be worth it (`MIN_SAVED_SHARE`; the prior is 0.6, the bench's images 0.9)."""
    svc.check_share.value = 0.1
    svc.check_share.add = lambda x: 0.1
    _steps(svc, 3, 10.0)
    assert wait_for(lambda: svc.status()["running"] == 0, timeout=60)
    for _ in range(100):
        svc.capacity.observe(5.0, 0.1)
    svc.clocks["j"].rate.value = 0.05
    svc.clock_.t += 0.05
    _window(svc, 3, 3, 5)


def test_storage_too_slow_sends_the_cheapest_raw_and_the_tensor_is_the_same(svc):
    from hintfs.transforms.container import decode, load_sample
    _overload(svc)
    st = svc.status()
    assert st["raw_designated"] > 0 and st["slowdown"] > 40
    key = next(iter(svc.raw_keys))
    data, how = svc.get(key.path, "image", PARAMS, key.aug_seed)
    assert how == "raw_planned" and decode(data)[0].mode == "raw"
    raw = load_sample(data)
    # the same sample made on storage gives the identical tensor
    made, how = svc.get(key.path, "image", PARAMS, key.aug_seed, allow_raw=False)
    assert how == "tensor" and decode(made)[0].mode == "tensor"
    assert np.array_equal(raw["pixels"], load_sample(made)["pixels"])


def test_the_lookahead_grows_near_capacity(svc):
    _steps(svc, 3, 10.0)
    assert svc.lookahead_for("j") == 2
    # the plan says each sample costs 1 s of CPU and steps take 1 s: the window's load is 2 (2
    # samples a step): the agent asks for more steps, within lookahead_max_steps. (The step rate
    # and the capacity are set, not measured: the rate's EWMA from 10 s steps and a capacity
    # measured from real transforms made this pass only on a busy machine.)
    svc.clocks["j"].rate.value = 1.0
    svc.capacity.ratio.value = 1.0
    svc.capacity.observe = lambda *a, **k: None
    for s in range(3, 9):
        svc.clock_.t += 1.0
        _window(svc, s, s, s + svc.lookahead_for("j"), est_ms=1000.0)
    assert svc.lookahead_for("j") > 2
    assert svc.lookahead_for("j") <= 16


def test_an_older_mounts_window_keeps_the_cpu_threshold(svc):
    # no steps: the LoadMonitor (busy, set by the fixture) decides as before issue 40
    svc.clocks.clear()
    data, how = svc.get("1.jpg", "image", PARAMS, 5)
    assert how == "raw_busy"


def test_images_sent_raw_are_decode_checked_ahead(svc):
    """A raw image's container needs one decode of it on storage (issue 34, finding 12): made
    ahead for the images the schedule sends raw, so the reader's open does not wait for it."""
    _overload(svc)
    assert svc.raw_keys
    raw_images = set(svc.raw_keys)
    assert wait_for(lambda: svc.status()["decode_checks"] >= 1 and svc._checking is None, timeout=60)
    checked = [k for k in raw_images if svc._bad_key(k) in svc.decoded]
    assert checked
    before = svc.status()["decode_checks"]
    key = checked[0]
    if key in svc.raw_keys:
        data, how = svc.get(key.path, "image", PARAMS, key.aug_seed)
        assert how == "raw_planned"
    assert svc.status()["decode_checks"] == before            # no check at the open


def test_raw_images_are_checked_ahead_only_near_their_readers_step(svc):
    """Issue 40, run 7: the images designated raw over the whole grown lookahead were checked at
    once, back to back, on the storage core the transforms due first needed (0.35-0.43 of it in
    the bench's first epoch), and most were made on storage after all. Only those of the next
    CHECK_AHEAD_STEPS steps past the readers are checked ahead, earliest first. The state is
    set, not scheduled; the check is recorded, not run."""
    from concurrent.futures import Future

    from hintfs.agent.samples import CHECK_AHEAD_STEPS, Pending
    from policy.transform_sched import StepClock
    clock = svc.clocks["j"] = StepClock()
    clock.observe(10, svc.clock_())
    asked = []

    def submit(key, *_a):
        asked.append(key)
        return Future()                 # never answered: one check ahead stays in flight
    svc._submit_check = submit
    keys = []
    for i, step in enumerate((10 + CHECK_AHEAD_STEPS + 5, 10 + CHECK_AHEAD_STEPS + 1)):
        key, meta, pjson = svc._key_and_meta(f"{i}.jpg", "image", PARAMS, 50 + i)
        svc.backlog[key] = Pending("image", pjson, meta, "j", step, 0.05, i, {"j"})
        svc.raw_keys.add(key)
        keys.append(key)
    svc._check_ahead()
    assert asked == [] and svc._checking is None          # both past the readers' next steps
    clock.observe(11, svc.clock_())                        # the readers move on: the nearer one is due
    svc._check_ahead()
    assert asked == [keys[1]]
    svc._checking = None
    svc.decoded[svc._bad_key(keys[1])] = None              # (its check passed)
    clock.observe(10 + 5, svc.clock_())
    svc._check_ahead()
    assert asked == [keys[1], keys[0]]


def test_a_raw_image_read_while_its_check_ahead_is_being_read_is_checked_itself(svc):
    """The bench's second run: a reader's raw container found the check made ahead of it still
    reading its source (no future yet) and failed with EIO; it now checks the image itself."""
    from hintfs.transforms.container import decode
    svc.clocks.clear()
    svc.monitor.update(0.99)                     # raw, by the old threshold (no steps)
    key, _meta, _pjson = svc._key_and_meta("3.jpg", "image", PARAMS, 9)
    svc._checking = (svc._bad_key(key), None)    # `_check_ahead` between its pick and its submit
    data, how = svc.get("3.jpg", "image", PARAMS, 9)
    assert how == "raw_busy" and decode(data)[0].mode == "raw"
    assert svc.status()["decode_checks"] == 1


def test_the_capacity_counts_the_checks_beside_a_transform_as_the_agents_work(svc):
    """Issue 40, the L95 stalls: a transform's wall time over its CPU time teaches the capacity,
    less the CPU the decode checks took from it meanwhile (the pool's probe of the check worker:
    the schedule counts the checks already); a worker's first task (its start-up) teaches
    nothing. Futures stand for the pool's answers; the clock is the fixture's."""
    from concurrent.futures import Future
    key, _meta, _pjson = svc._key_and_meta("1.jpg", "image", PARAMS, 5)
    svc.cores = 1

    def answer(wall, cpu, probe, fresh=False):
        f = Future()
        f.cpu_s, f.wall_s, f.probe_s, f.fresh = cpu, wall, probe, fresh
        f.set_result(b"x" * 100)
        return f
    svc._learn(key, "image", answer(0.4, 0.04, 0.0, fresh=True))   # the worker's start-up: not a reading
    assert svc.capacity.ratio.value is None
    for _ in range(30):
        svc._learn(key, "image", answer(0.08, 0.04, 0.04))        # a 40 ms check beside it, one core
    assert svc.status()["slowdown"] == pytest.approx(1.0)
    svc.cores = 2                                                   # a core the worker leaves idle took the check
    for _ in range(60):
        svc._learn(key, "image", answer(0.08, 0.04, 0.04))
    assert svc.status()["slowdown"] == pytest.approx(2.0, rel=0.01)


def test_the_pool_tells_a_fresh_worker_and_the_checks_cpu(svc):
    """The transform pool's answers carry `fresh` (the worker's first task) and `probe_s` (how much
    the check workers' CPU grew meanwhile; 0 before any check)."""
    f1 = svc._start(*_kmp(svc, "2.jpg", 7))
    f1.result(timeout=60)
    f2 = svc._start(*_kmp(svc, "3.jpg", 8))
    f2.result(timeout=60)
    assert f1.fresh is True and f2.fresh is False
    assert f1.probe_s == 0.0 and f2.probe_s == 0.0
    svc.checks.submit(("image", b"", "{}", 0, {}), 5.0).exception(timeout=60)   # starts the check worker
    assert svc._checks_cpu() >= 0.0 and svc._check_procs


def _kmp(svc, path, seed):
    key, meta, pjson = svc._key_and_meta(path, "image", PARAMS, seed)
    return key, "image", pjson, meta


def test_a_videos_cost_is_predicted_from_its_index_before_its_first_transform(svc, tmp_path):
    # issue 40, run 6: a window's new videos are indexed (demuxed, no decoding) and their cost
    # predicted from the frames their targets decode, per codec; two clips of about one size
    # (GOP 1 and GOP 40) decode 8 and ~40 frames for K=8
    from tests.helpers.media import make_video
    root = tmp_path / "s"
    (root / "g1.mp4").write_bytes(make_video("libx264", "mp4", n=40, gop=1))
    (root / "g40.mp4").write_bytes(make_video("libx264", "mp4", n=40, gop=40))
    vp = {"frames": 8, "size": 32, "crop": [24, 24]}
    want = [("g1.mp4", "video", vp, 1), ("g40.mp4", "video", vp, 2)]
    svc.prefetch(want, job="v", steps=[5, 6], step=0, lookahead=2)
    keys = {p: svc._key_and_meta(p, "video", vp, s)[0] for p, _k, _x, s in want}
    # the demux runs in the check worker (never in the agent's process), answered asynchronously
    assert svc._checks is not None
    assert wait_for(lambda: all(svc._bad_key(k) in svc.work for k in keys.values()), timeout=60)
    work = {p: svc.work.get(svc._bad_key(k)) for p, k in keys.items()}
    assert work["g1.mp4"][0] == work["g40.mp4"][0] == "video/.mp4/h264#work"
    mpx = 64 * 48 / 1e6
    assert work["g1.mp4"][1] == pytest.approx(8 * mpx)
    assert work["g40.mp4"][1] > 4 * work["g1.mp4"][1]
    # what transforms teach: the work group's line (here injected; the sources' own costs aside)
    from policy.transform_sched import OnlineCosts
    assert wait_for(lambda: svc.status()["running"] == 0, timeout=60)   # (steps 5-6: past the horizon)
    svc.costs = OnlineCosts()
    svc.costs.observe("video/.mp4", 1, "a", 0.01, ("video/.mp4/h264#work", 0.1))
    svc.costs.observe("video/.mp4", 1, "b", 0.05, ("video/.mp4/h264#work", 0.5))
    svc.costs.observe("video/.mp4", 1, "c", 0.03, ("video/.mp4/h264#work", 0.3))
    svc.costs.observe("video/.mp4", 1, "d", 0.02, ("video/.mp4/h264#work", 0.2))
    with svc.lock:
        p1, p40 = svc._predict(keys["g1.mp4"], "video"), svc._predict(keys["g40.mp4"], "video")
    assert p1 == pytest.approx(0.1 * work["g1.mp4"][1], rel=0.05) and p40 > 4 * p1


def test_a_hostile_video_is_indexed_in_the_check_worker_and_predicted_by_size(svc, tmp_path):
    """A source that does not demux (here garbage named .mp4) gets no index (None) and is
    predicted by its size; the agent's process never demuxed it and goes on serving."""
    root = tmp_path / "s"
    (root / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + os.urandom(4096))
    vp = {"frames": 8, "size": 32, "crop": [24, 24]}
    svc.prefetch([("bad.mp4", "video", vp, 1)], job="h", steps=[5], step=0, lookahead=2)
    key = svc._key_and_meta("bad.mp4", "video", vp, 1)[0]
    assert wait_for(lambda: svc._bad_key(key) in svc.work, timeout=60)
    assert svc.work[svc._bad_key(key)] is None and not svc.indexing
    with svc.lock:
        assert svc._predict(key, "video") > 0


def test_the_client_budget_for_raw_samples_is_kept_per_job_and_step(svc):
    """A raw sample handed out counts against its own job's step: another job whose plan is at the
    same step numbers (another trainer) keeps its whole budget; an entry goes once its job's
    readers are past its step, or the job ended."""
    from policy.transform_sched import Item, schedule
    _overload(svc)
    key = next(iter(svc.raw_keys))
    _data, how = svc.get(key.path, "image", PARAMS, key.aug_seed)
    assert how == "raw_planned"
    assert svc.client_used and {job for job, _step in svc.client_used} == {"j"}
    (job_step, used), = svc.client_used.items()
    assert used > 0

    def work(job):   # 1.1 s due at 1 s: the video must go raw, if the step's budget has room for it
        imgs = [Item(f"i{i}", 1.0, 0.2, raw_cost_s=0.18, seq=i, step=(job, job_step[1])) for i in range(4)]
        return imgs + [Item("v", 1.0, 0.3, seq=9, step=(job, job_step[1]))]
    budget = 0.3 + used / 2          # room for the video only in a step where nothing was handed out
    assert schedule(work("k"), now=0.0, hysteresis=0.0, client_s=budget, client_used=dict(svc.client_used)).raw == {"v"}
    assert schedule(work("j"), now=0.0, hysteresis=0.0, client_s=budget, client_used=dict(svc.client_used)).raw == set()
    svc.clock_.t += 0.05
    _window(svc, job_step[1] + 1, job_step[1] + 1, job_step[1] + 3)   # j's readers pass that step
    assert job_step not in svc.client_used


def test_a_fixed_share_takes_the_order_the_config_names(tmp_path):
    """`fixed_raw_share` (for measurement) ranks by `raw_rank` (the cheapest for the client first),
    or with `fixed_raw_order = "relief"` by the schedule's own order (`relief_rank`); anything
    else is refused at parse."""
    from mountconfig.load import ConfigError
    from policy.transform_sched import raw_rank, relief_rank
    (tmp_path / "s").mkdir()
    for order, rank in (("client", raw_rank), ("relief", relief_rank)):
        cfg = parse_config({"transform_load": {"fixed_raw_share": 0.4, "fixed_raw_order": order}})
        s = SampleService(LocalStore(str(tmp_path / "s")), cfg.transform_load)
        try:
            assert s.fixed is not None and s.fixed.share == 0.4 and s.fixed_rank is rank
        finally:
            s.close()
    with pytest.raises(ConfigError):
        parse_config({"transform_load": {"fixed_raw_share": 0.4, "fixed_raw_order": "random"}})

"""policy/transform_sched.py (issue 40): the pure scheduler of storage-side transforms, with time
passed in (no wall clock anywhere)."""
from __future__ import annotations

import random

import pytest

from policy.transform_sched import (Capacity, FixedShare, Horizon, Item, OnlineCosts, StepClock, late_goes_raw,
                                    own_share, schedule)


def test_latest_start_time_order_starts_heavy_samples_first():
    # two samples due at the same time: the heavy one starts first; a later light one after them
    items = [Item("light", 10.0, 0.1, seq=0), Item("heavy", 10.0, 2.0, seq=1), Item("later", 12.0, 0.1, seq=2)]
    s = schedule(items, now=0.0)
    assert s.order == ["heavy", "light", "later"] and s.raw == set()


def test_items_without_a_step_come_after_in_arrival_order():
    items = [Item("b", None, 1.0, seq=2), Item("a", None, 1.0, seq=1), Item("t", 5.0, 1.0, seq=3)]
    assert schedule(items, now=0.0).order == ["t", "a", "b"]


def test_what_storage_cannot_finish_goes_raw_cheapest_first():
    # 1 s available, 1.5 s of work due at t=1: the cheapest go raw until the rest fits (the client
    # decodes those fastest); the most expensive stays on storage
    items = [Item(f"c{i}", 1.0, c, seq=i) for i, c in enumerate([0.5, 0.1, 0.3, 0.6])]
    s = schedule(items, now=0.0, hysteresis=0.0)
    assert s.raw == {"c1", "c2", "c0"} and s.order == ["c3"]
    # with more time only the cheapest go
    s = schedule([Item(f"c{i}", 1.2, c, seq=i) for i, c in enumerate([0.5, 0.1, 0.3, 0.6])], now=0.0,
                 hysteresis=0.0)
    assert s.raw == {"c1", "c2"}


def test_a_sample_that_cannot_make_it_alone_goes_raw_itself():
    items = [Item("huge", 1.0, 5.0, seq=0)] + [Item(f"s{i}", 2.0, 0.1, seq=i + 1) for i in range(5)]
    s = schedule(items, now=0.0)
    assert s.raw == {"huge"}


def test_no_raw_without_fallback_and_with_slack():
    items = [Item(f"x{i}", 10.0 + i, 0.5, seq=i) for i in range(10)]
    assert schedule(items, now=0.0).raw == set()
    assert schedule(items, now=0.0, slowdown=10.0, fallback=False).raw == set()
    assert schedule(items, now=0.0, slowdown=10.0).raw                # at a tenth of the capacity some go raw


def test_the_check_of_a_raw_image_counts_as_storage_work():
    # a raw container that still costs storage half the transform saves less: more samples must go
    items = [Item(f"i{i}", 1.0, 0.3, raw_cost_s=0.15, seq=i) for i in range(5)]
    free = [Item(f"v{i}", 1.0, 0.3, seq=i) for i in range(5)]
    assert len(schedule(items, now=0.0, hysteresis=0.0).raw) > len(schedule(free, now=0.0, hysteresis=0.0).raw)


def test_a_sample_whose_raw_container_saves_storage_little_is_not_sent_raw():
    """Issue 40, run 7: an image not checked yet costs storage its decode check when sent raw
    (0.86-0.92 of its transform in the bench), and the check runs when it is read or just before,
    beside the transforms due then; the client decodes all of it. Such a sample (saving less than
    MIN_SAVED_SHARE of its cost) is not sent raw by the schedule, late or not: a traced L95 sent
    82-158 images raw in 150 steps and their checks took up to 0.43 of the storage core in the
    first epoch's steps 17-42, where its heavy videos then waited. What saves enough still goes."""
    imgs = [Item(f"i{i}", 1.0, 0.3, raw_cost_s=0.25, seq=i, step=1) for i in range(5)]
    assert schedule(imgs, now=0.0, hysteresis=0.0).raw == set()
    assert schedule(imgs, now=0.0, slowdown=10.0, hysteresis=0.0).raw == set()     # hopeless: still made
    late = [Item("late", 0.01, 0.3, raw_cost_s=0.25, seq=9, step=1)]
    assert schedule(late, now=0.0, hysteresis=0.0).raw == set()
    vid = Item("v", 1.0, 0.3, seq=7, step=1)
    assert schedule(imgs + [vid], now=0.0, hysteresis=0.0).raw == {"v"}
    checked = [Item(f"c{i}", 1.0, 0.3, raw_cost_s=0.0, seq=i, step=1) for i in range(5)]   # checked before
    assert schedule(checked, now=0.0, hysteresis=0.0).raw


def _simulate(slowdowns, steps_per_phase=200, step_s=0.1, G=4, lookahead=16, seed=1, noise=0.0):
    """A storage agent over a plan: every step G samples enter the window `lookahead` steps ahead;
    the schedule is taken at each step; one worker makes samples in its order at the phase's
    slowdown (the Capacity estimate follows the measured wall/CPU). Returns per phase the raw
    share and late share, and the number of samples whose raw decision flipped back and forth."""
    rng = random.Random(seed)
    costs = {}
    cap = Capacity()
    window: dict = {}
    prev_raw: set = set()
    history: dict = {}
    t = 0.0
    busy_until = 0.0
    out = []
    total_steps = steps_per_phase * len(slowdowns)
    for s in range(total_steps + lookahead):
        for g in range(G):
            k = (s, g)
            costs[k] = rng.choice([0.01, 0.015, 0.02, 0.03, 0.05, 0.08])
    for phase, sd in enumerate(slowdowns):
        raw_n = late_n = n = 0
        for s in range(phase * steps_per_phase, (phase + 1) * steps_per_phase):
            t = s * step_s
            for g in range(G):                           # step s + lookahead enters the window
                k = (s + lookahead, g)
                window[k] = (s + lookahead, costs[k])
            # step s is read now: what is not done is late (or raw)
            for g in range(G):
                k = (s, g)
                n += 1
                if k in prev_raw:
                    raw_n += 1
                elif k in window:
                    late_n += 1
                window.pop(k, None)
            prev_raw &= set(window)
            items = [Item(k, (st - 0.5) * step_s, c, seq=st * G + k[1]) for k, (st, c) in window.items()]
            sch = schedule(items, now=t, busy_s=max(0.0, busy_until - t), slowdown=cap.slowdown, prev_raw=prev_raw)
            for k in sch.raw ^ prev_raw:
                history[k] = history.get(k, 0) + 1
            prev_raw = set(sch.raw)
            # the worker makes samples in order until the next step
            clock = max(t, busy_until)
            for k in sch.order:
                if clock >= t + step_s:
                    break
                wall = costs[k] * sd * (1 + noise * rng.uniform(-1, 1))
                cap.observe(wall, costs[k])
                clock += wall
                window.pop(k, None)
            busy_until = clock
        out.append({"raw": raw_n / n, "late": late_n / n})
    flips = sum(1 for v in history.values() if v > 2)
    return out, flips


def test_the_raw_share_follows_a_capacity_step_up_and_down_without_oscillating():
    # mean cost 34 ms x 4 per 100 ms step: load 1.37 at slowdown 1... use a lighter mix: load ~0.68 at
    # slowdown 1, ~1.37 at slowdown 2 (half the capacity: about half the work must go raw)
    phases, flips = _simulate([1.0, 2.0, 1.0], step_s=0.2, noise=0.05)
    before, during, after = phases
    assert before["raw"] < 0.05 and before["late"] < 0.02
    assert 0.3 < during["raw"] < 0.6 and during["late"] < 0.05
    assert after["raw"] < 0.05 and after["late"] < 0.02
    assert flips <= 0.02 * 3 * 200 * 4             # a sample's decision rarely goes back and forth twice


def test_the_share_is_smallest_that_meets_the_deadline():
    # at slowdown 2 and load ~1.37 the storage can do ~73% of the work: cheapest first, the raw
    # share by count is more than the 27% of the work it sheds, and no sample is late
    phases, _ = _simulate([2.0], step_s=0.2)
    assert phases[0]["late"] < 0.02
    # the work sent raw is close to what must be shed (not all or nothing)
    assert phases[0]["raw"] < 0.9


def test_step_clock():
    c = StepClock(alpha=0.5)
    assert c.due(5, 0.0) is None
    c.observe(0, 0.0)          # registration
    c.observe(1, 10.0)         # the first move includes set-up: not counted
    assert c.seconds_per_step is None
    c.observe(2, 10.2)
    c.observe(4, 10.6)
    assert c.seconds_per_step == pytest.approx(0.2)
    assert c.due(6, 10.6) == pytest.approx(11.0)
    assert c.due(6, 12.0) == pytest.approx(12.0 - 0.2 + 0.4)   # the current step overran: later steps move too
    c.observe(0, 20.0)         # registered again from the start
    assert c.step == 0


def test_online_costs_learn_per_source_and_per_group():
    m = OnlineCosts()
    assert m.predict("image/.jpg", 100_000, "a") == pytest.approx(0.05)     # nothing measured yet
    assert m.predict("image/.jpg", 100_000, "a", est_ms=12.0) == pytest.approx(0.012)
    for i in range(20):
        m.observe("video/.mp4", (i + 1) << 20, f"v{i}", 0.01 * (i + 1))     # 10 ms per MiB
    assert m.predict("video/.mp4", 30 << 20, "new") == pytest.approx(0.3, rel=0.05)
    m.observe("video/.mp4", 1 << 20, "heavy", 2.0)                          # a GOP-250 clip
    assert m.predict("video/.mp4", 1 << 20, "heavy") == pytest.approx(2.0)  # the source itself is remembered
    assert 0 < m.predict("image/.png", 1, "x") < 1                          # another group: the overall mean


def test_online_costs_memory_is_bounded():
    m = OnlineCosts(sources_max=10)
    for i in range(100):
        m.observe(f"g{i}", 1, i, 0.01)
    assert len(m.sources) == 10 and len(m.groups) <= 64


def test_capacity_measures_wall_over_cpu():
    c = Capacity(alpha=0.5)
    assert c.slowdown == 1.0
    c.observe(0.001, 0.0005)       # too short to tell
    assert c.slowdown == 1.0
    for _ in range(20):
        c.observe(0.2, 0.1)
    assert c.slowdown == pytest.approx(2.0, rel=0.01)


def test_own_share_is_what_the_checks_took_from_the_workers():
    # one core, one worker: a 30 ms check during an 80 ms transform took all its 30 ms from it
    assert own_share(0.03, 0.08, cores=1, workers=1) == pytest.approx(0.03)
    # a core the workers leave idle takes the checks first
    assert own_share(0.03, 0.08, cores=2, workers=1) == 0.0
    assert own_share(0.10, 0.08, cores=2, workers=1) == pytest.approx(0.02)
    # shared evenly by the workers of a busy machine
    assert own_share(0.04, 0.08, cores=2, workers=2) == pytest.approx(0.02)
    assert own_share(0.0, 0.08, cores=1, workers=1) == 0.0


def _window_raw_share(slowdown: float) -> float:
    """The raw share the schedule gives a window of 8 steps of 0.25 s, five samples a step (0.22 s
    of CPU: load 0.88 of one idle core), at a measured `slowdown`."""
    costs = [0.02, 0.03, 0.04, 0.05, 0.08]
    items = [Item((k, i), (k + 0.5) * 0.25, c, raw_cost_s=0.5 * c, seq=k * 5 + i, step=k)
             for k in range(1, 9) for i, c in enumerate(costs)]
    return len(schedule(items, 0.0, 0.0, 1, slowdown, client_s=0.125).raw) / len(items)


def test_the_agents_own_checks_are_not_lost_capacity():
    """Issue 40, the L95 stalls: the decode checks of the images sent raw ran in the check worker
    beside the transforms on the one storage core, so each transform's wall time was its CPU time
    plus the check's, and the capacity read ~2 (1.7-2.4 in the bench's trace, the check worker busy
    throughout); the schedule, which counts the checks as storage work already (`raw_cost_s`),
    took storage for half as fast as it was and sent 35% raw (whose images needed more checks).
    With the checks' CPU counted as the agent's work (`own_share`) an idle core reads 1 and
    nothing goes raw at load 0.88; a burner taking half the core still reads 2."""
    cpu = 0.04
    before, after, burner = Capacity(), Capacity(), Capacity()
    for _ in range(50):
        wall = 2 * cpu                          # a 40 ms check beside a 40 ms transform, one core
        before.observe(wall, cpu)
        after.observe(wall, cpu, own_share(cpu, wall, cores=1, workers=1))
        wall = 4 * cpu                          # the same, the agent's processes getting half the core
        burner.observe(wall, cpu, own_share(cpu, wall, cores=1, workers=1))
    assert before.slowdown == pytest.approx(2.0) and _window_raw_share(before.slowdown) > 0.3
    assert after.slowdown == pytest.approx(1.0) and _window_raw_share(after.slowdown) == 0.0
    assert burner.slowdown == pytest.approx(2.0)


def test_a_late_sample_goes_raw_when_the_client_has_it_sooner():
    assert not late_goes_raw(0.0, 0.05, 1.0)             # idle worker, idle core: storage does it
    assert not late_goes_raw(0.0, 0.05, 1.2)             # near equal: storage (the client's CPU is saved)
    assert late_goes_raw(0.2, 0.05, 1.0)                 # the worker is busy for 200 ms
    assert late_goes_raw(0.0, 0.05, 2.0)                 # storage at half speed
    assert not late_goes_raw(0.0, 0.05, 2.0, raw_cost_s=0.04)   # its raw container costs a decode there


def test_horizon_grows_near_capacity_within_memory_and_shrinks():
    h = Horizon(4)
    assert h.update(None, 100, 64) == 4
    assert h.update(0.9, 100, 64) == 8
    assert h.update(0.9, 100, 64) == 16
    assert h.update(0.9, 12, 64) == 12                   # the job's memory share holds 12 steps
    assert h.update(0.9, 1000, 20) == 20                 # the mount sends at most 20
    assert h.update(0.5, 1000, 64) == 20                 # in between: kept
    assert h.update(0.2, 1000, 64) == 10
    assert h.update(0.2, 1000, 64) == 5
    assert h.update(0.2, 1000, 64) == 4                  # never below the plan's lookahead
    assert Horizon(4).update(0.9, 0, 64) == 4


def test_fixed_share_sends_the_cheapest_share_raw():
    f = FixedShare(0.3)
    rng = random.Random(3)
    decisions = [(c, f.decide(c)) for c in (rng.random() for _ in range(3000))]
    late = decisions[500:]
    share = sum(d for _c, d in late) / len(late)
    assert share == pytest.approx(0.3, abs=0.04)
    assert max(c for c, d in late if d) < min(c for c, d in late if not d) + 0.1
    assert not any(FixedShare(0.0).decide(1.0) for _ in range(10))
    assert all(FixedShare(1.0).decide(1.0) for _ in range(10))



def test_online_costs_use_a_videos_decode_work_before_its_size():
    # issue 40, run 6: a clip's size says little of its cost (long clips cost what short ones do,
    # a GOP-250 clip several times a GOP-25 one of the same size); its decode work does
    m = OnlineCosts()
    for i in range(20):
        size = (1 << 20) * (1 + 30 * (i % 2))                 # every other one a huge file
        work = ("video/.mp4/h264#work", 1.0 + i)               # frames to decode x megapixels
        m.observe("video/.mp4", size, f"v{i}", 0.02 + 0.01 * (1.0 + i), work)
    w = ("video/.mp4/h264#work", 5.0)
    assert m.predict("video/.mp4", 31 << 20, "new", work=w) == pytest.approx(0.07, rel=0.05)
    assert m.predict("video/.mp4", 1 << 20, "new2", work=("video/.mp4/h264#work", 40.0)) == \
        pytest.approx(0.42, rel=0.05)
    # a codec whose work group saw nothing yet: the size line (all videos learned it too)
    assert m.predict("video/.mp4", 1 << 20, "x", work=("video/.mp4/hevc#work", 5.0)) == \
        pytest.approx(m.predict("video/.mp4", 1 << 20, "x"))
    # the plan's estimate and the source's own cost still come first
    assert m.predict("video/.mp4", 1 << 20, "new", est_ms=9.0, work=w) == pytest.approx(0.009)
    assert m.predict("video/.mp4", 1 << 20, "v3", work=w) == pytest.approx(0.06)


def test_the_raw_kept_by_hysteresis_stays_within_the_client_budget():
    # each shed keeps a step's raw samples within the client's budget, but the samples kept raw
    # from before (prev & hi) came on top of the new ones (lo), past it (here step 1: 0.17 s of
    # client work against 0.13; found by a random search). The union is held to the budget too.
    spec = [(1.0, 0.08, 1), (0.3, 0.12, 1), (0.1, 0.02, 2), (0.3, 0.05, 1), (0.1, 0.12, 2), (0.5, 0.08, 2)]
    items = [Item(f"s{i}", d, c, seq=i, step=st) for i, (d, c, st) in enumerate(spec)]
    prev = {it.key for it in items}
    cost = {it.key: (it.cost_s, it.step) for it in items}

    def per_step(raw):
        out: dict = {}
        for k in raw:
            out[cost[k][1]] = out.get(cost[k][1], 0.0) + cost[k][0]
        return out
    s = schedule(items, now=0.0, slowdown=2.0, prev_raw=prev, client_s=0.13)
    assert s.raw and max(per_step(s.raw).values()) <= 0.13 + 1e-9
    assert s.raw | set(s.order) == set(cost)
    # without a budget the union is what it was
    assert max(per_step(schedule(items, now=0.0, slowdown=2.0, prev_raw=prev).raw).values()) > 0.13


def test_what_goes_raw_saves_storage_the_most_per_client_work():
    # an image's raw container costs its decode check on storage (here 0.9 of its transform):
    # sending it raw saves storage little and costs the client all of it; a video (no check)
    # saves all. The video goes raw first, though the images are cheaper (issue 40, run 6).
    imgs = [Item(f"i{i}", 1.0, 0.2, raw_cost_s=0.18, seq=i, step=1) for i in range(4)]
    vid = Item("v", 1.0, 0.3, seq=9, step=1)
    s = schedule(imgs + [vid], now=0.0, hysteresis=0.0)          # 1.1 s of work due at 1 s
    assert s.raw == {"v"}
    # within the client's budget for the step: the video does not fit it, and the images save
    # too little to go instead (MIN_SAVED_SHARE; before run 7 they went)
    s = schedule(imgs + [vid], now=0.0, hysteresis=0.0, client_s=0.25)
    assert s.raw == set()
    # what was handed out raw in the step already counts against the budget
    s = schedule(imgs + [vid], now=0.0, hysteresis=0.0, client_s=0.35, client_used={1: 0.2})
    assert "v" not in s.raw
    assert schedule(imgs + [vid], now=0.0, hysteresis=0.0, client_s=0.35).raw == {"v"}


def test_a_raw_containers_bytes_count_as_client_work():
    # two videos of the same transform cost, one a 62 MB long clip: its raw container would take
    # the client its bytes' time besides the decode (bench run 8: 1.6 s against a 0.16 s
    # transform), so within a step's client budget only the small one goes raw, and it goes first
    from policy.transform_sched import RAW_CLIENT_BYTES_PER_S, client_cost_s, late_goes_raw
    small = Item("small", 1.0, 0.3, seq=1, step=1, client_s=client_cost_s(0.3, 2_000_000))
    big = Item("big", 1.0, 0.3, seq=0, step=1, client_s=client_cost_s(0.3, 62_000_000))
    filler = [Item(f"i{i}", 1.0, 0.2, raw_cost_s=0.18, seq=2 + i, step=1) for i in range(3)]
    assert big.client_work == pytest.approx(0.3 + 62e6 / RAW_CLIENT_BYTES_PER_S)
    s = schedule([big, small] + filler, now=0.0, hysteresis=0.0, client_s=0.5)   # 1.2 s due at 1 s
    assert s.raw == {"small"}
    # with no budget both may go, the one costing the client less per storage work saved first
    assert "small" in schedule([big, small] + filler, now=0.0, hysteresis=0.0).raw
    # a late sample: the client's time includes the bytes
    assert late_goes_raw(0.0, 0.3, 2.5, client_s=client_cost_s(0.3, 2_000_000))
    assert not late_goes_raw(0.0, 0.3, 2.5, client_s=client_cost_s(0.3, 62_000_000))


def test_the_schedule_sends_raw_the_cheapest_for_the_client_first():
    """Issue 40's order in `_shed` (run 14): of two samples either of which would let the rest
    finish in time, the one the client decodes fastest goes raw, though a dear video saves storage
    a little more per unit of client work (its bytes weigh less against its decode). Before run 14
    the schedule took the dear one, and under the burner the trainer paid ~59 ms a raw sample
    against the 35 ms mean its CPU bound allows."""
    from policy.transform_sched import client_cost_s, raw_rank, relief_rank
    dear = Item("dear", 1.0, 0.6, seq=0, client_s=client_cost_s(0.6, 1_000_000))
    cheap = Item("cheap", 1.0, 0.3, seq=1, client_s=client_cost_s(0.3, 3_000_000))
    unchecked = [Item(f"i{i}", 1.0, 0.1, raw_cost_s=0.09, seq=2 + i) for i in range(3)]  # not worth it
    assert relief_rank(dear) < relief_rank(cheap) and raw_rank(cheap) < raw_rank(dear)
    s = schedule([dear, cheap, *unchecked], now=0.0, hysteresis=0.0)     # 1.2 s due at 1 s
    assert s.raw == {"cheap"}
    # more behind: the next cheapest follows
    s = schedule([dear, cheap, *unchecked], now=0.0, hysteresis=0.0, slowdown=1.5)
    assert s.raw == {"cheap", "dear"}


def test_raw_rank_puts_the_cheapest_for_the_client_first_and_a_long_clip_last():
    # a fixed share's order (issue 40: cheap ones first, since the client decodes them fastest);
    # a clip whose bytes cost the client more than its transform saves storage goes last
    from policy.transform_sched import client_cost_s, raw_rank
    dear = Item("dear", 1.0, 0.10, client_s=client_cost_s(0.10, 2_000_000))
    cheap = Item("cheap", 1.0, 0.04, client_s=client_cost_s(0.04, 2_000_000))
    clip = Item("clip", 1.0, 0.04, client_s=client_cost_s(0.04, 62_000_000))
    checked_image = Item("img", 1.0, 0.02, client_s=client_cost_s(0.02, 200_000))
    assert raw_rank(checked_image) < raw_rank(cheap) < raw_rank(dear) < raw_rank(clip)


def test_a_fixed_share_ranks_by_raw_rank_among_samples_worth_sending():
    from policy.transform_sched import raw_rank, worth_raw
    f = FixedShare(0.5)
    rng = random.Random(5)
    sent = kept = 0
    for i in range(2000):
        c = 0.02 + rng.random() * 0.1
        image_unchecked = i % 2 == 0
        it = Item(i, None, c, raw_cost_s=0.9 * c if image_unchecked else 0.0, client_s=c)
        if worth_raw(it) and f.decide(raw_rank(it)):
            sent += 1
            assert not image_unchecked
        elif not image_unchecked:
            kept += 1
    assert sent / (sent + kept) == pytest.approx(0.5, abs=0.05)


def test_relief_rank_puts_the_most_storage_saved_per_client_work_first():
    """`relief_rank`: a fixed share's order with `fixed_raw_order = "relief"` (the bench's second
    sweep; the schedule's own order until run 14). A dear video saves storage all its cost
    for about as much client work: before a cheap one whose bytes weigh more on the client, and
    before an image whose raw container still costs storage its decode check."""
    from policy.transform_sched import client_cost_s, raw_rank, relief_rank
    dear = Item("dear", 1.0, 0.10, client_s=client_cost_s(0.10, 2_000_000))
    cheap = Item("cheap", 1.0, 0.04, client_s=client_cost_s(0.04, 2_000_000))
    unchecked = Item("img", 1.0, 0.02, raw_cost_s=0.018, client_s=client_cost_s(0.02, 200_000))
    assert relief_rank(dear) < relief_rank(cheap) < relief_rank(unchecked)
    assert raw_rank(cheap) < raw_rank(dear)            # (the order: the other way round)
    f = FixedShare(0.5)
    picked = [it.key for it in [dear, cheap] * 50 if f.decide(relief_rank(it))]
    assert picked.count("dear") > 40 and picked.count("cheap") < 10

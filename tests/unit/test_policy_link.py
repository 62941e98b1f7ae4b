"""policy/link.py: the cross-DC link scheduler, tested with plain values and hypothesis."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from policy.link import (GIB, MAX_WEIGHT, MIN_WEIGHT, LinkClass, LinkScheduler, severity_factor,
                         size_factor, transfer_weight)

FAST = settings(max_examples=40, deadline=None)

# -- the weight formula -------------------------------------------------------------------------


def test_transfer_weight_examples():
    assert transfer_weight(0) == 1.0
    assert transfer_weight(GIB) == 2.0
    assert transfer_weight(3 * GIB) == 3.0
    assert transfer_weight(GIB, importance=2.0) == 4.0
    assert transfer_weight(GIB, importance=1.0, severity=1.5) == 5.0
    assert transfer_weight(GIB, 1.0, 1e9) == 2.0 * 11          # severity is capped
    assert transfer_weight(GIB, 1.0, -3) == 2.0                  # and never below zero
    assert transfer_weight(GIB, 0.0) == MIN_WEIGHT
    for bad in [(-1, 1, 0), (math.inf, 1, 0), (1, -1, 0), (1, math.nan, 0), (1, 1, math.nan)]:
        with pytest.raises(ValueError):
            transfer_weight(*bad)


sizes = st.floats(0, 1e15)
imps = st.floats(0, 100)
sevs = st.floats(-5, 50)


@FAST
@given(sizes, sizes, imps, imps, sevs, sevs)
def test_transfer_weight_is_monotone_and_bounded(b1, b2, i1, i2, s1, s2):
    lo = transfer_weight(min(b1, b2), min(i1, i2), min(s1, s2))
    hi = transfer_weight(max(b1, b2), max(i1, i2), max(s1, s2))
    assert MIN_WEIGHT <= lo <= hi <= MAX_WEIGHT
    w = transfer_weight(b1, i1, s1)
    expect = size_factor(b1) * i1 * severity_factor(s1)
    assert w == pytest.approx(min(max(expect, MIN_WEIGHT), MAX_WEIGHT))
    # sublinear in size: 100x the bytes never gives 100x the weight
    if b1 >= GIB:
        assert size_factor(100 * b1) < 100 * size_factor(b1) / 10


# -- rules, by example ----------------------------------------------------------------------------


def test_strict_priority_and_preemption_at_chunk_boundaries():
    s = LinkScheduler(budget_bytes_s=1e12, quantum_bytes=1000)
    s.add("bg", "background", 1.0, [400] * 6)
    assert s.next_chunk(0.0) == ("bg", 400)                  # bg's turn: deficit 1000 -> 600
    s.add("ev", LinkClass.EVAL, 1.0, [300, 300])
    assert s.next_chunk(0.1) == ("ev", 300)                  # preempted at the chunk boundary
    s.add("an", LinkClass.ANOMALY, 1.0, [50])
    assert s.next_chunk(0.2) == ("an", 50)
    assert s.last_class is LinkClass.ANOMALY and "an" not in s.pending()   # (its last chunk: gone, class kept)
    assert s.next_chunk(0.3) == ("ev", 300)
    assert s.next_chunk(0.4) == ("bg", 400)                  # bg resumes its turn (deficit 600 kept)
    assert s.next_chunk(0.5) == ("bg", 400)                  # new turn
    assert s.pending() == {"bg": [400] * 3}
    assert len(s) == 1


def test_signal_promotes_and_clear_demotes():
    s = LinkScheduler(1e12, 1000)
    s.add("a", "background", 2.0, [100] * 3, job="j1")
    s.add("b", "eval", 1.0, [100] * 3, job="j2")
    assert s.next_chunk(0) == ("b", 100)
    s.signal("j1", severity=1.0)
    assert s.class_of("a") == LinkClass.ANOMALY and s.weight_of("a") == 4.0
    assert s.next_chunk(0) == ("a", 100)
    s.add("a2", "background", 1.0, [100], job="j1")           # later transfers of the job too
    assert s.class_of("a2") == LinkClass.ANOMALY
    s.clear("j1")
    assert s.class_of("a") == LinkClass.BACKGROUND and s.weight_of("a") == 2.0
    assert [s.next_chunk(0)[0] for _ in range(2)] == ["b", "b"]
    assert s.next_chunk(0)[0] in ("a", "a2")
    s.clear("nobody")                                          # no-op


def test_budget_paces_and_ready_in():
    s = LinkScheduler(budget_bytes_s=1000, quantum_bytes=100)   # burst = quantum = 100 B
    s.add("t", "eval", 1.0, [100] * 50)
    assert s.ready_in(0.0) == 0.0
    assert s.next_chunk(0.0) == ("t", 100)
    assert s.next_chunk(0.05) is None                            # 50 B of tokens
    assert s.ready_in(0.05) == pytest.approx(0.05)
    assert s.next_chunk(0.1) == ("t", 100)
    sent, t = 200, 0.1
    while t < 2.0:
        t += 0.001
        r = s.next_chunk(t)
        sent += r[1] if r else 0
    assert sent == pytest.approx(100 + 1000 * 2.0, abs=100)
    with pytest.raises(ValueError):
        s.next_chunk(1.0)                                        # time must not go backwards


def test_a_chunk_larger_than_the_burst_still_goes():
    s = LinkScheduler(budget_bytes_s=100, quantum_bytes=10, burst_bytes=10)
    s.add("big", "eval", 1.0, [1000, 1000])
    assert s.next_chunk(0.0) == ("big", 1000)                  # debt: -990 tokens
    assert s.next_chunk(5.0) is None
    assert s.ready_in(5.0) == pytest.approx(5.0)
    assert s.next_chunk(10.0) == ("big", 1000)
    assert s.next_chunk(10.0) is None and s.ready_in(10.0) is None


def test_tiny_weights_do_not_spin():
    s = LinkScheduler(1e12, quantum_bytes=1)
    s.add("a", "eval", 1e-3, [10**9])
    s.add("b", "eval", 2e-3, [10**9])
    assert s.next_chunk(0) == ("b", 10**9)                     # b reaches its chunk first
    assert s.next_chunk(1) == ("a", 10**9)


def test_bad_arguments():
    with pytest.raises(ValueError):
        LinkScheduler(0, 100)
    with pytest.raises(ValueError):
        LinkScheduler(100, 0)
    s = LinkScheduler(100, 100)
    for args in [("x", "urgent", 1.0, [1]), ("x", "eval", 0.0, [1]), ("x", "eval", 1.0, []),
                 ("x", "eval", 1.0, [0]), ("x", "eval", math.inf, [1])]:
        with pytest.raises(ValueError):
            s.add(*args)
    s.add("x", "eval", 1.0, [1])
    with pytest.raises(ValueError):
        s.add("x", "eval", 1.0, [1])
    s.done("x")
    s.done("x")                                                # idempotent
    assert s.next_chunk(0) is None and len(s) == 0


# -- properties over random programs -------------------------------------------------------------

JOBS = ["j0", "j1", "j2", None]
op = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(list(LinkClass)), st.floats(0.1, 10),
              st.lists(st.integers(1, 5000), min_size=1, max_size=8), st.sampled_from(JOBS)),
    st.tuples(st.just("next"), st.floats(0, 0.01)),
    st.tuples(st.just("next"), st.just(0.0)),
    st.tuples(st.just("signal"), st.sampled_from(JOBS[:3]), st.floats(0, 20)),
    st.tuples(st.just("clear"), st.sampled_from(JOBS[:3])),
    st.tuples(st.just("done"), st.integers(0, 30)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=80), st.integers(1000, 20000), st.integers(100, 8000),
       st.integers(100, 8000))
def test_random_programs_keep_every_rule(ops, budget, quantum, burst):
    s = LinkScheduler(budget, quantum, burst_bytes=burst)
    pending: dict[int, list[int]] = {}          # the model: unsent chunks per transfer
    base: dict[int, tuple[LinkClass, str | None]] = {}
    signals: set[str] = set()
    added: dict[int, list[int]] = {}
    dropped: dict[int, list[int]] = {}
    sent: dict[int, list[int]] = {}
    log: list[tuple[float, int]] = []
    now, next_id = 0.0, 0

    def cls_of(tid):
        c, job = base[tid]
        return LinkClass.ANOMALY if job in signals else c

    def step(now):
        r = s.next_chunk(now)
        if r is None:
            # None only when idle or out of budget
            assert not pending or s.ready_in(now) > 0
            return False
        tid, n = r
        assert tid in pending and pending[tid][0] == n         # whole chunks, in order
        top = min(cls_of(t) for t in pending)
        assert cls_of(tid) == top                              # strict priority
        pending[tid].pop(0)
        if not pending[tid]:
            del pending[tid]
        sent.setdefault(tid, []).append(n)
        log.append((now, n))
        return True

    for o in ops:
        if o[0] == "add":
            _, c, w, chunks, job = o
            s.add(next_id, c, w, chunks, job=job)
            pending[next_id], added[next_id], base[next_id] = list(chunks), list(chunks), (c, job)
            assert s.class_of(next_id) == cls_of(next_id)
            next_id += 1
        elif o[0] == "next":
            now += o[1]
            step(now)
        elif o[0] == "signal":
            s.signal(o[1], o[2])
            signals.add(o[1])
            assert all(s.class_of(t) == LinkClass.ANOMALY for t in pending if base[t][1] == o[1])
        elif o[0] == "clear":
            s.clear(o[1])
            signals.discard(o[1])
        elif o[0] == "done" and o[1] < next_id:
            s.done(o[1])
            if o[1] in pending:
                dropped[o[1]] = pending.pop(o[1])
        assert s.pending() == pending
    # drain: everything left goes, given time
    for _ in range(10_000):
        if not pending:
            break
        now += max(s.ready_in(now) or 0.0, 1e-6)
        step(now)
    assert not pending and len(s) == 0 and s.next_chunk(now) is None
    # every chunk sent exactly once (less those of transfers dropped by done)
    for tid, chunks in added.items():
        got = sent.get(tid, [])
        assert got + dropped.get(tid, []) == chunks
    # the budget over any window of sends
    slack = max(burst, max((n for _, n in log), default=0))
    for i in range(len(log)):
        total = 0
        for j in range(i, len(log)):
            total += log[j][1]
            assert total <= slack + budget * (log[j][0] - log[i][0]) + 1e-6 * total


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.floats(1, 8), st.integers(2048, 16384)), min_size=2, max_size=5),
       st.sampled_from(list(LinkClass)))
def test_drr_shares_are_proportional_to_weights(transfers, cls):
    quantum, rounds = 16384, 60
    s = LinkScheduler(budget_bytes_s=1e15, quantum_bytes=quantum)
    total_w = sum(w for w, _ in transfers)
    target = int(rounds * quantum * total_w)
    for i, (w, chunk) in enumerate(transfers):
        # enough chunks that no transfer runs out before the measurement ends
        s.add(i, cls, w, [chunk] * (int(rounds * quantum * w * 1.5) // chunk + 2))
    got = [0] * len(transfers)
    sent = 0
    while sent < target:
        tid, n = s.next_chunk(float(sent))              # time moves: the budget never binds
        got[tid] += n
        sent += n
    for i, (w, _) in enumerate(transfers):
        assert got[i] / sent == pytest.approx(w / total_w, rel=0.10)


@FAST
@given(st.lists(st.floats(0.5, 4), min_size=1, max_size=4), st.lists(st.floats(0.5, 4), min_size=1, max_size=4))
def test_background_never_sends_while_anomaly_is_pending(bg_w, an_w):
    s = LinkScheduler(1e12, 4096)
    for i, w in enumerate(bg_w):
        s.add(("bg", i), "background", w, [1000] * 5)
    clock = iter(range(1, 100))
    assert s.next_chunk(0)[0][0] == "bg"
    for i, w in enumerate(an_w):
        s.add(("an", i), "anomaly", w, [700] * 3, job=f"j{i}")
    firsts = [s.next_chunk(next(clock))[0][0] for _ in range(3 * len(an_w))]
    assert firsts == ["an"] * (3 * len(an_w))
    assert s.next_chunk(next(clock))[0][0] == "bg"

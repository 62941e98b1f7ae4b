"""Elastic training on CPU: exact gradients under shrinks and data parallelism with gloo."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from hintfs.governor.protocol import CMD_GROW, CMD_SHRINK
from hintfs.governor.training import ElasticTrainer
from governor_simdevice import ScriptedControl, SimulatedMemory
from tests.helpers.ports import free_port

MB = 1 << 20


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4)).to(dtype)


def make_data(n, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g, dtype=dtype)
    w = torch.randn(8, 4, generator=g, dtype=dtype)
    y = (x @ w).argmax(1)
    return x, y


sum_ce = nn.CrossEntropyLoss(reduction="sum")


class Capture(torch.optim.Optimizer):
    """Records the gradient handed to step() (no update)."""

    def __init__(self, params):
        super().__init__(params, {})
        self.grads = None

    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]


def reference_grads(x, y, seed=0):
    m = make_model(seed)
    loss = nn.CrossEntropyLoss(reduction="mean")(m(x), y)
    loss.backward()
    return [p.grad.clone() for p in m.parameters()], float(loss.detach())


def rel_err(a, b):
    num = torch.sqrt(sum(((u - v) ** 2).sum() for u, v in zip(a, b)))
    den = torch.sqrt(sum((v ** 2).sum() for v in b))
    return float(num / den)


def test_shrink_mid_backward_keeps_exact_gradient(tmp_path):
    x, y = make_data(40)
    ref, ref_loss = reference_grads(x, y)
    mem = SimulatedMemory(fixed=10 * MB, per_sample=1 * MB)
    # shrink twice at safe points deep inside backward, then grow
    ctl = ScriptedControl(tmp_path / "blk", {7: (CMD_SHRINK, 14 * MB), 30: (CMD_SHRINK, 12 * MB),
                                             60: (CMD_GROW, 40 * MB)}, quota=30 * MB)
    m = make_model()
    opt = Capture(m.parameters())
    t = ElasticTrainer(m, opt, sum_ce, control=ctl, probe=mem, quota=30 * MB, probe_batch=8)
    res = t.step(x, y)
    assert res.aborted >= 1  # unfinished micro-batches were dropped...
    assert sum(res.micro_batches) == 40  # ...and redone: every sample counted exactly once
    assert len(set(res.micro_batches)) > 1  # micro-batch size followed the quota
    assert mem.releases >= 2
    # a shrink's release is told the command's target: a page allocator frees only down to it
    assert 14 * MB in mem.release_targets
    shrinks = [a for a in res.adjustments if a.cmd == CMD_SHRINK]
    assert len(shrinks) == 2 and all(a.used_after <= a.target for a in shrinks)
    assert any(a.dropped_samples > 0 for a in shrinks)
    # an abort names the pass it unwound, and its drain's unwinding part is within the drain
    for a in shrinks:
        assert (a.where in ("abort_forward", "abort_backward")) == (a.dropped_samples > 0)
        assert 0 <= a.unwind_ms <= a.drain_ms
    assert rel_err(opt.grads, ref) <= 1e-5
    assert res.loss == pytest.approx(ref_loss, rel=1e-5)
    # acked through the words: nothing left pending
    assert ctl.reader.pending() is None


def test_shrink_under_held_memory_acks_without_drain_or_release(tmp_path):
    from hintfs.governor.protocol import ACK_RELEASED, W_ACK_FLAGS
    x, y = make_data(32)
    mem = SimulatedMemory(fixed=10 * MB, per_sample=1 * MB)
    m = make_model()
    t = ElasticTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), sum_ce, probe=mem,
                       quota=60 * MB, probe_batch=8)
    t.step(x, y)  # fit the memory model: micro-batches of 32 need ~42 MB
    releases = mem.releases
    # the quota drops from 60 to 50 MB mid-step: still above what the step can hold
    ctl = ScriptedControl(tmp_path / "blk", {5: (CMD_SHRINK, 50 * MB)}, quota=60 * MB)
    t.control = ctl
    res = t.step(x, y)
    assert res.aborted == 0 and mem.releases == releases
    (a,) = res.adjustments
    assert not a.released and a.drain_ms == 0 and a.release_ms == 0 and a.used_after <= 50 * MB
    assert int(ctl.block.slot(0)[W_ACK_FLAGS]) & ACK_RELEASED == 0
    assert t.quota == 50 * MB and ctl.reader.pending() is None


def test_shrink_below_the_micro_batch_peak_aborts_even_if_the_cache_is_small(tmp_path):
    # After a release the cache is small, but the running micro-batch will grow back to its
    # fitted peak: acking without aborting would break the new quota.
    x, y = make_data(32)
    mem = SimulatedMemory(fixed=10 * MB, per_sample=1 * MB)
    m = make_model()
    t = ElasticTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), sum_ce, probe=mem,
                       quota=60 * MB, probe_batch=8)
    t.step(x, y)
    mem.release(0)
    mem.cached_samples = 0

    class Lazy(SimulatedMemory):  # the cache fills only at the end of the micro-batch
        def begin_micro(self, samples):
            self.peak_samples = samples

    mem.__class__ = Lazy
    ctl = ScriptedControl(tmp_path / "blk", {2: (CMD_SHRINK, 25 * MB)}, quota=60 * MB)
    t.control = ctl
    res = t.step(x, y)
    assert res.aborted == 1
    assert max(res.micro_batches) * MB + 10 * MB <= 25 * MB


def test_micro_batches_fit_the_quota_after_fitting():
    mem = SimulatedMemory(fixed=10 * MB, per_sample=2 * MB)
    m = make_model()
    t = ElasticTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), sum_ce, probe=mem,
                       quota=30 * MB, probe_batch=2)
    x, y = make_data(64)
    t.step(x, y)
    res = t.step(x, y)
    assert max(res.micro_batches) * 2 * MB + 10 * MB <= 30 * MB
    assert max(res.micro_batches) >= 7  # and not needlessly small (margin 10%)


def _dp_worker(rank, world, port, sizes, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x, y = make_data(sum(sizes))
    lo = sum(sizes[:rank])
    xs, ys = x[lo:lo + sizes[rank]], y[lo:lo + sizes[rank]]
    m = make_model()
    opt = Capture(m.parameters())
    # each worker sees a different quota: different micro-batch sizes as well
    mem = SimulatedMemory(fixed=MB, per_sample=MB)
    t = ElasticTrainer(m, opt, sum_ce, probe=mem, quota=(2 + 3 * rank) * MB, probe_batch=1 + rank)
    res = t.step(xs, ys)
    out[rank] = ([g for g in opt.grads], res.global_samples, res.micro_batches)
    dist.destroy_process_group()


def test_data_parallel_uneven_local_batches_match_full_batch():
    sizes = [0, 5, 11]  # a worker with no samples at all still joins the one all-reduce
    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr:
        out = mgr.dict()
        mp.start_processes(_dp_worker, args=(len(sizes), free_port(), sizes, out),
                           nprocs=len(sizes), start_method="spawn", join=True)
        out = dict(out)
    x, y = make_data(sum(sizes))
    ref, _ = reference_grads(x, y)
    for rank in range(len(sizes)):
        grads, total, micro = out[rank]
        assert total == sum(sizes)
        assert rel_err(grads, ref) <= 1e-5, rank
    assert out[1][2] != out[2][2]


def test_dynamic_batches_reach_the_same_loss_as_fixed(tmp_path):
    x, y = make_data(512, seed=3)

    def train(control, probe, quota):
        m = make_model(seed=5)
        opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
        t = ElasticTrainer(m, opt, sum_ce, control=control, probe=probe, quota=quota)
        g = torch.Generator().manual_seed(0)
        t.stats = {"aborted": 0, "sizes": set()}
        for epoch in range(6):
            perm = torch.randperm(512, generator=g)
            for i in range(0, 512, 64):
                idx = perm[i:i + 64]
                r = t.step(x[idx], y[idx])
                t.stats["aborted"] += r.aborted
                t.stats["sizes"].update(r.micro_batches)
        with torch.no_grad():
            return float(nn.functional.cross_entropy(m(x), y)), t

    fixed_loss, _ = train(None, SimulatedMemory(MB, MB), 1 << 40)
    import random
    rnd = random.Random(7)
    script = {}
    for k in range(0, 20000, 97):
        script[k] = (CMD_SHRINK, rnd.randint(3, 20) * MB) if rnd.random() < 0.6 else \
            (CMD_GROW, rnd.randint(20, 80) * MB)
    ctl = ScriptedControl(tmp_path / "blk", script, quota=64 * MB)
    dyn_loss, t = train(ctl, SimulatedMemory(MB, MB), 64 * MB)
    with torch.no_grad():
        initial = float(nn.functional.cross_entropy(make_model(seed=5)(x), y))
    assert t.stats["aborted"] >= 5 and len(t.stats["sizes"]) >= 5  # really dynamic
    assert fixed_loss < 0.5 * initial
    assert dyn_loss == pytest.approx(fixed_loss, rel=1e-3)


def test_yield_to_inference_is_a_time_budget():
    # inference always busy: training pauses max_yield_s, then runs min_run_s before pausing
    # again, however many safe points it passes meanwhile
    import time
    mem = SimulatedMemory(fixed=MB, per_sample=MB)
    m = make_model()
    t = ElasticTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), sum_ce, probe=mem,
                       quota=1 << 40, probe_batch=64, yield_to_inference=lambda: True,
                       max_yield_s=0.03, min_run_s=60.0)
    x, y = make_data(16)
    t0 = time.monotonic()
    t.step(x, y)  # ~6 safe points, one pause
    assert 0.03 <= time.monotonic() - t0 < 5.0   # paused (a loaded machine only adds time)


def test_micro_batches_are_equal_sized():
    # 64 samples, room for ~40 per micro-batch: 32 + 32, not 40 + 24 (allocator reuse)
    mem = SimulatedMemory(fixed=10 * MB, per_sample=1 * MB)
    m = make_model()
    t = ElasticTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), sum_ce, probe=mem,
                       quota=int(55 * MB), probe_batch=4)
    x, y = make_data(64)
    t.step(x, y)
    res = t.step(x, y)
    assert res.micro_batches == [32, 32]


class _LagEvent:
    """A CUDA event stand-in: the GPU runs 5 safe points behind the host, and catches up while
    the host waits (each query is some GPU progress); 2 ms after the event before it."""

    def __init__(self, clock):
        self.clock, self.at = clock, clock[0]
        clock[0] += 1

    def query(self):
        self.clock[1] += 1
        return self.clock[0] - self.at >= 5 or self.clock[1] - self.at >= 8

    def elapsed_time(self, other):
        return 2.0


class _TimedMemory(SimulatedMemory):
    def record_event(self):
        if not hasattr(self, "clock"):
            self.clock = [0, 0]
        return _LagEvent(self.clock)


def test_drain_budget_bounds_the_gpu_work_queued_at_a_safe_point():
    x, y = make_data(32)
    m = make_model()
    mem = _TimedMemory(fixed=10 * MB, per_sample=1 * MB)
    t = ElasticTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), sum_ce, probe=mem,
                       quota=1 << 40, probe_batch=32, max_ahead=1000, max_ahead_ms=3.0)
    assert mem.timing
    pending = []
    check = t._check_command
    t._check_command = lambda where="forward": (pending.append(len(t._events)), check(where))[1]
    t.step(x, y)                        # learns 2 ms per interval
    assert t._cost and t.drain_bound_ms() == pytest.approx(5.0)
    pending.clear()
    t.step(x, y)
    # two pending intervals are 4 ms > 3 ms: the oldest is waited for, one stays queued
    assert pending and max(pending) == 1
    # without a budget only the count bounds the queue
    m2 = make_model()
    t2 = ElasticTrainer(m2, torch.optim.SGD(m2.parameters(), lr=0.1), sum_ce,
                        probe=_TimedMemory(fixed=10 * MB, per_sample=1 * MB), quota=1 << 40,
                        probe_batch=32, max_ahead=1000)
    seen = []
    check2 = t2._check_command
    t2._check_command = lambda where="forward": (seen.append(len(t2._events)), check2(where))[1]
    t2.step(x, y)
    assert max(seen) > 3 and t2.drain_bound_ms() == 0.0


def test_ack_says_how_many_bytes_a_shrink_freed(tmp_path):
    from hintfs.governor.protocol import ACK_FREED, ACK_RELEASED, W_ACK_FLAGS, W_FREED
    x, y = make_data(32)
    mem = SimulatedMemory(fixed=10 * MB, per_sample=1 * MB)
    m = make_model()
    t = ElasticTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), sum_ce, probe=mem,
                       quota=60 * MB, probe_batch=8)
    t.step(x, y)
    held = mem.reserved()
    ctl = ScriptedControl(tmp_path / "blk", {3: (CMD_SHRINK, 25 * MB)}, quota=60 * MB)
    t.control = ctl
    res = t.step(x, y)
    a = [a for a in res.adjustments if a.cmd == CMD_SHRINK][0]
    assert a.released and a.where.startswith("abort") and a.freed_bytes >= held - 10 * MB > 0
    assert a.unwind_cpu_ms >= 0 and a.unwind_nivcsw >= 0 and 0 <= a.propagate_ms <= a.unwind_ms
    flags = int(ctl.block.slot(0)[W_ACK_FLAGS])
    assert flags & ACK_RELEASED and flags & ACK_FREED
    assert int(ctl.block.slot(0)[W_FREED]) == a.freed_bytes


def test_abort_that_frees_nothing_is_not_flagged_freed(tmp_path):
    # the micro-batch is dropped (its fitted peak is over the target) but nothing was held
    # above the fixed part: the ack must not claim that memory moved
    from hintfs.governor.protocol import ACK_FREED, W_ACK_FLAGS
    x, y = make_data(32)
    mem = SimulatedMemory(fixed=10 * MB, per_sample=1 * MB)
    m = make_model()
    t = ElasticTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), sum_ce, probe=mem,
                       quota=60 * MB, probe_batch=8)
    t.step(x, y)
    mem.release(0)

    class Lazy(SimulatedMemory):
        def begin_micro(self, samples):
            self.peak_samples = samples

    mem.__class__ = Lazy
    ctl = ScriptedControl(tmp_path / "blk", {2: (CMD_SHRINK, 25 * MB)}, quota=60 * MB)
    t.control = ctl
    res = t.step(x, y)
    a = [a for a in res.adjustments if a.cmd == CMD_SHRINK][0]
    assert a.where.startswith("abort") and a.freed_bytes == 0
    assert not int(ctl.block.slot(0)[W_ACK_FLAGS]) & ACK_FREED

"""ElasticTrainer.warm_up: the sizes it runs, the aborts, restoring the trainer, bad input (CPU);
one check on CUDA (skipped without it)."""

import time

import pytest
import torch
from torch import nn

from hintfs.governor.protocol import CMD_SHRINK
from hintfs.governor.training import ElasticTrainer, micro_batch_sizes, prefetch_mapped_libraries
from governor_simdevice import ScriptedControl, SimulatedMemory

MB = 1 << 20
sum_ce = nn.CrossEntropyLoss(reduction="sum")


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def make_data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x @ torch.randn(8, 4, generator=g)).argmax(1)


def trainer(control=None, quota=1 << 40, opt=None, **kw):
    m = make_model()
    opt = opt or torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    mem = SimulatedMemory(fixed=10 * MB, per_sample=1 * MB)
    return ElasticTrainer(m, opt, sum_ce, control=control, probe=mem, quota=quota, probe_batch=8, **kw)


def test_sizes_are_the_equal_splits():
    assert micro_batch_sizes(320, 4) == [320, 160, 107, 106, 80]
    assert micro_batch_sizes(256, 4) == [256, 128, 86, 85, 64]
    assert micro_batch_sizes(256, 1) == [256]
    assert micro_batch_sizes(3, 4) == [3, 2, 1]            # no split into more than 3
    assert micro_batch_sizes(256, 2, max_micro_batch=100) == [86, 85, 64]   # k from 3


@pytest.mark.parametrize("batch", [1, 7, 64, 255, 256, 320])
def test_sizes_cover_every_split_the_trainer_makes(batch):
    # whatever the quota, a step split into at most `splits` micro-batches only runs sizes
    # micro_batch_sizes() lists, and every listed size is run at some quota
    splits = 4
    t = trainer()
    t.memory_model.observe(8, 18 * MB)
    t.memory_model.observe(16, 26 * MB)
    listed, seen = set(micro_batch_sizes(batch, splits)), set()
    for quota_mb in range(11, 11 + int(1.1 * batch) + 40):
        t.quota = quota_mb * MB
        rem, run = batch, []
        while rem:
            n = t.next_micro_batch(rem)
            run.append(n)
            rem -= n
        if len(run) <= splits:
            assert set(run) <= listed, (quota_mb, run)
            seen |= set(run)
    assert seen == listed


def test_warm_up_runs_each_size_and_one_abort_per_pass_then_restores(tmp_path):
    ctl = ScriptedControl(tmp_path / "blk", {}, quota=1 << 40)
    t = trainer(control=ctl, max_micro_batch=1000)
    x, y = make_data(64)
    t.step(x[:24], y[:24])   # fitted
    w = t.warm_up(x, y, splits=3, prefetch=False)
    assert w.sizes == [64, 32, 22, 21]
    assert w.micro_batches == [[64], [32], [22], [21]]   # each size as one micro-batch
    assert w.fit is None and w.skipped == []
    assert w.aborts == 2 and w.abort_passes == ["forward", "backward"]
    assert w.prefetched_bytes is None and w.seconds >= 0
    # the trainer is as before: its limit, its own safe point, not warming; no command seen
    assert t.max_micro_batch == 1000 and "_safe_point" not in t.__dict__
    assert t._warming is None and not t._in_micro and ctl.reader.pending() is None
    res = t.step(x, y)
    assert res.micro_batches == [64] and res.aborted == 0
    assert set(w.as_dict()) >= {"sizes", "micro_batches", "aborts", "prefetched_bytes", "seconds"}


def test_abort_is_at_the_middle_safe_point_of_its_pass(tmp_path):
    ctl = ScriptedControl(tmp_path / "blk", {}, quota=1 << 40)
    t = trainer(control=ctl)
    x, y = make_data(32)
    t.step(x[:24], y[:24])
    calls = []
    real = type(t)._safe_point

    class Spy(type(t)):
        def _safe_point(self, where="forward"):
            if self._in_micro:
                calls.append(where)
            return real(self, where)
    t.__class__ = Spy
    w = t.warm_up(x, y, splits=1, prefetch=False)
    assert w.aborts == 2
    # size 32: 3 forward + 3 backward safe points; then the forward abort at the 2nd forward
    # one, its redo (6), the backward abort at the 2nd backward one, its redo (6)
    assert calls[:6] == ["forward"] * 3 + ["backward"] * 3
    assert calls[6:8] == ["forward"] * 2
    assert calls[8:14] == ["forward"] * 3 + ["backward"] * 3
    assert calls[14:19] == ["forward"] * 3 + ["backward"] * 2
    assert len(calls) == 25


def test_aborts_default_to_governed_and_work_without_control():
    t = trainer()
    x, y = make_data(16)
    assert t.warm_up(x, y, splits=2, prefetch=False).aborts == 0   # not governed: none
    w = t.warm_up(x, y, splits=2, prefetch=False, aborts=True)
    assert w.aborts == 2 and "_safe_point" not in t.__dict__


def test_batch_end_baseline_gets_no_abort_by_default(tmp_path):
    ctl = ScriptedControl(tmp_path / "blk", {}, quota=1 << 40)
    t = trainer(control=ctl, reclaim_at="step_end")
    x, y = make_data(16)
    assert t.warm_up(x, y, prefetch=False).aborts == 0


def test_unfitted_memory_model_gets_a_fitting_step_first():
    t = trainer()
    x, y = make_data(64)
    assert not t.memory_model.fitted
    w = t.warm_up(x, y, splits=2, prefetch=False)
    assert w.fit is not None and sum(w.fit) == 24 and w.fit[0] == 8   # 3 x probe_batch
    assert w.micro_batches == [[64], [32]]


def test_update_false_leaves_weights_and_optimizer_alone():
    t = trainer()
    x, y = make_data(32)
    t.step(x, y)   # fitted, momentum buffers exist
    before = [p.detach().clone() for p in t.model.parameters()]
    state = [t.optimizer.state[p]["momentum_buffer"].clone() for p in t.model.parameters()]
    t.warm_up(x, y, splits=3, prefetch=False, aborts=True, update=False)
    assert all(torch.equal(a, p) for a, p in zip(before, t.model.parameters()))
    assert all(torch.equal(s, t.optimizer.state[p]["momentum_buffer"])
               for s, p in zip(state, t.model.parameters()))
    assert all(p.grad is None for p in t.model.parameters())
    t.warm_up(x, y, splits=1, prefetch=False)   # default: the warm-up steps are real steps
    assert not all(torch.equal(a, p) for a, p in zip(before, t.model.parameters()))


class _NoGroup:
    """A process group nothing may be sent to: warm-up steps must not all-reduce."""


def test_data_parallel_warm_up_is_local_and_does_not_update():
    t = trainer(process_group=_NoGroup())
    x, y = make_data(16)
    t.memory_model.observe(8, 18 * MB)
    before = [p.detach().clone() for p in t.model.parameters()]
    w = t.warm_up(x, y, splits=2, prefetch=False, aborts=True)   # no all-reduce: no error
    assert w.micro_batches == [[16], [8]] and w.aborts == 2
    assert all(torch.equal(a, p) for a, p in zip(before, t.model.parameters()))
    with pytest.raises(ValueError, match="update=False"):
        t.warm_up(x, y, update=True)


def test_deadline_stops_starting_steps():
    t = trainer()
    x, y = make_data(16)
    w = t.warm_up(x, y, splits=2, aborts=True, deadline=time.monotonic() - 1, prefetch=True)
    assert w.fit is None and w.micro_batches == [] and w.aborts == 0
    assert w.skipped == ["size 16", "size 8", "abort forward", "abort backward"]
    assert not t.memory_model.fitted and t.max_micro_batch == 1 << 30


def test_command_during_warm_up_is_handled(tmp_path):
    ctl = ScriptedControl(tmp_path / "blk", {}, quota=60 * MB)
    t = trainer(control=ctl, quota=60 * MB)
    x, y = make_data(32)
    t.step(x[:24], y[:24])
    ctl.script[ctl.calls + 4] = (CMD_SHRINK, 20 * MB)   # inside the first warm-up step
    w = t.warm_up(x, y, splits=2, prefetch=False)
    assert ctl.reader.pending() is None and t.quota == 20 * MB
    assert w.aborts == 2 and "_safe_point" not in t.__dict__


def test_an_error_in_a_step_still_restores_the_trainer():
    t = trainer(max_micro_batch=500)
    x, y = make_data(16)
    t.memory_model.observe(8, 18 * MB)

    def boom(out, tgt):
        raise RuntimeError("loss failed")
    t.loss_fn = boom
    with pytest.raises(RuntimeError, match="loss failed"):
        t.warm_up(x, y, prefetch=False, aborts=True)
    assert t.max_micro_batch == 500 and "_safe_point" not in t.__dict__ and t._warming is None


@pytest.mark.parametrize("kwargs, err", [
    (dict(splits=0), ValueError), (dict(splits=1.5), ValueError),
    (dict(sizes=[]), ValueError), (dict(sizes=[0]), ValueError), (dict(sizes=[17]), ValueError),
    (dict(sizes=[4.0]), ValueError), (dict(sizes=[True]), ValueError),
    (dict(deadline="soon"), TypeError),
])
def test_bad_arguments_raise(kwargs, err):
    t = trainer()
    x, y = make_data(16)
    with pytest.raises(err):
        t.warm_up(x, y, prefetch=False, **kwargs)
    assert t.max_micro_batch == 1 << 30 and t._warming is None


def test_bad_batches_raise():
    t = trainer(max_micro_batch=8)
    x, y = make_data(16)
    with pytest.raises(ValueError, match="samples"):
        t.warm_up(x, y[:15])
    with pytest.raises(ValueError, match="at least one"):
        t.warm_up(x[:0], y[:0])
    with pytest.raises(TypeError, match="tensor"):
        t.warm_up(x.tolist(), y)
    with pytest.raises(ValueError):
        t.warm_up(torch.tensor(1.0), y)
    with pytest.raises(ValueError, match="max_micro_batch"):
        t.warm_up(x, y, sizes=[12])   # above the trainer's limit: never run
    for bad in (dict(batch=0), dict(batch=4, splits=0), dict(batch=4, max_micro_batch=0)):
        with pytest.raises(ValueError):
            micro_batch_sizes(**bad)


def test_prefetch_reads_the_mapped_libraries():
    # torch maps its shared libraries; the call only advises readahead
    assert prefetch_mapped_libraries() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_up_on_cuda(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(4)],
                      nn.Linear(1024, 10)).cuda()
    ctl = ScriptedControl(tmp_path / "blk", {}, quota=1 << 40)
    t = ElasticTrainer(m, torch.optim.AdamW(m.parameters(), fused=True), sum_ce, control=ctl,
                       quota=1 << 40, probe_batch=64)
    x, y = torch.randn(300, 1024).pin_memory(), torch.randint(0, 10, (300,)).pin_memory()
    w = t.warm_up(x, y, splits=4)
    assert w.fit is not None and w.sizes == [300, 150, 100, 75]
    assert w.micro_batches == [[300], [150], [100], [75]]
    assert w.aborts == 2 and w.prefetched_bytes and w.prefetched_bytes > 0
    assert "_safe_point" not in t.__dict__
    # the trainer's own safe points still see commands afterwards
    ctl.script[ctl.calls + 3] = (CMD_SHRINK, 1 << 39)
    res = t.step(x, y)
    assert res.micro_batches == [300] and ctl.reader.pending() is None and t.quota == 1 << 39

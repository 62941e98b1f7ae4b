"""Elastic training client: safe points inside backward, micro-batch accounting, exact gradients.

One optimizer step consumes this worker's share of a fixed global batch, split into micro-batches
whose size follows the governor's quota. Gradients of finished micro-batches are *committed*
into an accumulator; a shrink arriving at a safe point (a forward pre-hook or a post-accumulate-
grad hook in backward) aborts only the unfinished micro-batch, releases its memory, acknowledges
through the shared-memory words, and the step goes on with smaller micro-batches. At the end of
the step the accumulated sum (plus the sample count) is all-reduced once and divided by the
global sample count, so workers with different local batch sizes still get the exact full-batch
gradient of a loss that is a *sum* over samples.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import resource
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hintfs.governor.protocol import (
    ACK_ABORTED, ACK_FREED, ACK_LENT, ACK_RELEASED, CMD_GROW, CMD_SHRINK, CMD_STOP, W_T_DETECT, SlotReader, now_ns,
)
from policy.governor_batchsize import MemoryPerSample

if TYPE_CHECKING:
    from hintfs.governor.pagealloc import PageAllocator

log = logging.getLogger("hintfs.governor.training")


_GCS = [0]   # garbage collections started in this process (for the unwind diagnostics)


def _count_gc(phase, info) -> None:
    if phase == "start":
        _GCS[0] += 1


class ShrinkRequested(Exception):
    """Raised from a safe-point hook to unwind the current micro-batch."""


class _LargeOpSafePoints(TorchFunctionMode):
    """Safe points inside layers: after each op in forward whose output (not a view) is at
    least `min_bytes_per_sample` x the micro-batch, and in backward when that output's
    gradient is computed (a tensor hook). A layer such as a Swin stage-1 attention block is one
    interval of 5-7 ms at batch 320 between module safe points; a stop waited for all of it.
    The threshold is per sample, so the same ops get safe points at every micro-batch size
    (the drain budget learns costs per safe-point index)."""

    def __init__(self, trainer: ElasticTrainer, min_bytes_per_sample: int) -> None:
        super().__init__()
        self.trainer = trainer
        self.min_bytes_per_sample = min_bytes_per_sample

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        t = self.trainer
        if (t._in_micro and isinstance(out, torch.Tensor) and out.is_cuda and not out._is_view()
                and out.numel() * out.element_size() >= self.min_bytes_per_sample * max(t._micro_n, 1)):
            name = getattr(func, "__name__", "op")
            if out.requires_grad:
                out.register_hook(lambda grad, name=name: t._op_safe_point("backward", name))
            t._op_safe_point("forward", name)
        return out


class MemoryProbe:
    """How the trainer sees device memory. CUDA: the caching allocator. Override for tests."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.timing = False   # record_event makes timing events (the trainer's drain budget)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device) if self.cuda else 0

    def begin_micro(self, samples: int) -> None:
        """A micro-batch of `samples` starts (resets the peak counter)."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else 0

    def drain(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def release(self, keep_bytes: int) -> None:
        """Give memory back so that at most `keep_bytes` stay held. The caching allocator can
        only empty its whole cache."""
        if self.cuda:
            torch.cuda.empty_cache()

    def record_event(self):
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=self.timing)
        ev.record()
        return ev

    def mark(self) -> int | None:
        """Close an epoch of frees before an event is recorded (page allocator only)."""
        return None

    def release_idle(self, keep_bytes: int, done_mark: int) -> int:
        """Release, without draining, memory no queued kernel can use (page allocator only)."""
        return 0


class PagedMemoryProbe(MemoryProbe):
    """Device memory through the page allocator (hintfs.governor.pagealloc, installed as torch's
    allocator): `reserved` is the mapped pages, and a release unmaps only the empty pages needed
    to get under the target, instead of emptying the whole cache."""

    def __init__(self, device: torch.device, allocator: PageAllocator) -> None:
        super().__init__(device)
        self.alloc = allocator
        self.stream: torch.cuda.Stream | None = None   # the stream mark events are recorded on (set on first use)

    def record_event(self):
        if not self.cuda:   # the host backend (tests): no events
            return None
        ev = torch.cuda.Event(enable_timing=self.timing)
        ev.record(self.stream)
        return ev

    def mark(self) -> int | None:
        if not self.cuda:
            return None
        if self.stream is None:   # the training stream: events and marks pair on it
            stream = torch.cuda.current_stream(self.device)
            self.stream = stream
            self.alloc.set_mark_stream(stream.cuda_stream)
        return self.alloc.mark()

    def release_idle(self, keep_bytes: int, done_mark: int) -> int:
        return self.alloc.release_idle(keep_bytes, done_mark)

    def reserved(self) -> int:
        return self.alloc.mapped()

    def begin_micro(self, samples: int) -> None:
        self.alloc.reset_peak()

    def peak(self) -> int:
        return self.alloc.peak_allocated()

    def release(self, keep_bytes: int) -> None:
        self.alloc.release(keep_bytes)

    def lend(self, keep_bytes: int, defer_unmap: bool = False) -> list[int]:
        """Release down to `keep_bytes`, the pages becoming fds for another process.
        `defer_unmap`: our mappings go later, in finish_lend()."""
        page = self.alloc.page_bytes
        most = max(0, -(-(self.alloc.mapped() - keep_bytes) // page))
        return self.alloc.lend(keep_bytes, most, defer_unmap) if most else []

    def finish_lend(self) -> None:
        self.alloc.finish_lend()


def default_probe(device: torch.device) -> MemoryProbe:
    """The page allocator's view when it is torch's allocator (torch's own memory statistics
    are not available then), otherwise the caching allocator's."""
    from hintfs.governor import pagealloc

    alloc = pagealloc.installed()
    if alloc is not None and torch.device(device).type == "cuda":
        return PagedMemoryProbe(torch.device(device), alloc)
    return MemoryProbe(torch.device(device))


@dataclass
class Adjustment:
    """One acknowledged command, with the client-side split of its latency (ms)."""

    cmd: int
    target: int
    detect_ms: float
    drain_ms: float
    release_ms: float
    used_after: int
    dropped_samples: int
    released: bool = False  # False: already under the target, nothing drained or released
    # where the command was seen: safe_point, poll (between micro-batches), or abort_forward /
    # abort_backward (a safe point in that pass unwound the micro-batch)
    where: str = ""
    # part of drain_ms spent before the synchronize: unwinding the aborted micro-batch (the
    # exception out of forward/backward, freeing its graph); the rest waits for queued kernels
    unwind_ms: float = 0.0
    # of unwind_ms: the exception reaching the step (the rest frees the micro-batch)
    propagate_ms: float = 0.0
    # over the unwind: CPU time of the whole process (all threads), involuntary context
    # switches, and garbage collections that ran. Wall time far above CPU time with context
    # switches means the process waited for a core (or a lock), not that unwinding is slow.
    unwind_cpu_ms: float = 0.0
    unwind_nivcsw: int = 0
    unwind_gcs: int = 0
    freed_bytes: int = 0      # held bytes before the drain minus after the release
    queued_ms: float = 0.0    # GPU work the drain budget estimated queued at the safe point
    early_bytes: int = 0      # of freed_bytes: released at detection, before the drain


class _UnwindDiag(TypedDict, total=False):
    """The unwind fields of an `Adjustment` for a command that aborted a micro-batch."""
    propagate_ms: float
    unwind_cpu_ms: float
    unwind_nivcsw: int
    unwind_gcs: int
    queued_ms: float


@dataclass
class StepResult:
    loss_sum: float
    samples: int
    global_samples: int
    micro_batches: list[int] = field(default_factory=list)
    aborted: int = 0
    adjustments: list[Adjustment] = field(default_factory=list)
    excess_releases: int = 0  # cache emptied because the allocator held more than the quota

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.global_samples, 1)


@dataclass
class WarmUpResult:
    """What `ElasticTrainer.warm_up` ran (all before the job's clock)."""

    sizes: list[int]                      # the micro-batch sizes asked for, largest first
    micro_batches: list[list[int]] = field(default_factory=list)   # per size run: its split
    fit: list[int] | None = None          # the memory model's fitting step, if one was needed
    aborts: int = 0                       # micro-batches aborted on purpose
    abort_passes: list[str] = field(default_factory=list)   # 'forward' / 'backward'
    skipped: list[str] = field(default_factory=list)   # what the deadline cut ('size 80', ...)
    prefetched_bytes: int | None = None   # library bytes advised (None: not asked or not done)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def micro_batch_sizes(batch: int, splits: int = 4, max_micro_batch: int | None = None) -> list[int]:
    """The micro-batch sizes a step of `batch` samples runs when it is split into k equal
    micro-batches (`ElasticTrainer.next_micro_batch`: sizes ceil(batch/k) and floor(batch/k)),
    for the `splits` coarsest splits the trainer can make: k = k0 .. k0 + splits - 1, k0 being
    the fewest micro-batches of at most `max_micro_batch` samples. Largest first, no repeats.
    E.g. 320 and 4 splits: 320, 160, 107, 106, 80."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, not {batch!r}")
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be a positive int, not {splits!r}")
    if max_micro_batch is not None and (not isinstance(max_micro_batch, int) or max_micro_batch < 1):
        raise ValueError(f"max_micro_batch must be a positive int or None, not {max_micro_batch!r}")
    k0 = -(-batch // max_micro_batch) if max_micro_batch else 1
    out: set[int] = set()
    for k in range(k0, min(k0 + splits, batch + 1)):
        out.add(-(-batch // k))
        if batch // k:
            out.add(batch // k)
    return sorted(out, reverse=True)


def prefetch_mapped_libraries() -> int:
    """Ask the kernel to read every shared library this process maps into the page cache
    (`posix_fadvise(WILLNEED)`: asynchronous readahead). On the H200 (issue 16) the backward
    thread waited in file-backed page faults while cuBLAS loaded the kernels of a GEMM shape it
    had not run before, and the C++ unwinder likewise on the first abort. Returns the bytes
    advised (0 where /proc/self/maps or posix_fadvise is missing)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return 0
    seen, total = set(), 0
    try:
        f = open("/proc/self/maps")
    except OSError:
        return 0
    with f:
        for line in f:
            parts = line.split()
            path = parts[5] if len(parts) >= 6 else ""
            if not path.startswith("/") or ".so" not in path or path in seen:
                continue
            seen.add(path)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                total += os.fstat(fd).st_size
            except OSError:
                pass
            finally:
                os.close(fd)
    return total


class ElasticTrainer:
    """
    model, optimizer: as usual. `loss_fn(output, target)` must return the SUM over samples.
    `control`: the client's slot (None: not governed). `notify(seq)`: wakes the daemon after an
    ack. `layers`: modules whose boundaries are safe points (default: every leaf with params).
    `reclaim_at`: 'safe_point' (default) or 'step_end' (the batch-end baseline).
    `max_ahead`: the CPU may run at most this many safe points ahead of the GPU, so that a stop
    drains in a few layers' time. `max_ahead_ms`: also keep the GPU work queued behind the
    current safe point under this many ms (estimated from timing events of earlier micro-batches,
    per safe point and sample), so the drain is bounded in time whatever the layers cost; None:
    count only. `process_group`: data-parallel group or None.
    `yield_to_inference()`: True while inference runs; training pauses at safe points then, for
    at most `max_yield_s` at a time, followed by at least `min_run_s` of running.
    `copy_chunks`: a micro-batch's inputs that are not on the device yet are copied in this many
    pieces, each followed by a safe point (one large host-to-device copy would otherwise be one
    interval of several ms that a stop must wait for). `early_release`: with the page allocator,
    a shrink releases at once, while queued kernels finish, the empty pages that no queued
    kernel can use (freed before a completed safe-point event); the rest after the drain.
    `split_ops_bytes_per_sample`: on CUDA, also a safe point after every op whose output is at
    least this many bytes per sample, and at its gradient in backward (None: module
    boundaries only).
    Before the job's clock, call `warm_up(inputs, targets)`: it runs each micro-batch size a step
    may be split into and one abort per pass, so that first uses (cuBLAS loading the kernels of a
    new GEMM shape, the unwinder paged in) do not stall a safe point later.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                 device: torch.device | str | None = None, control: SlotReader | None = None,
                 notify: Callable[[int], None] | None = None, quota: int | None = None,
                 max_micro_batch: int = 1 << 30, probe_batch: int = 4,
                 layers: Iterable[nn.Module] | None = None, max_ahead: int = 2,
                 max_ahead_ms: float | None = None,
                 probe: MemoryProbe | None = None, process_group=None,
                 yield_to_inference: Callable[[], bool] | None = None,
                 max_yield_s: float = 0.05, min_run_s: float = 0.005,
                 reclaim_at: str = "safe_point", defer_unmap: bool = False,
                 lend_pages: Callable[[list[int], int, int], None] | None = None,
                 copy_chunks: int = 8, early_release: bool = True,
                 split_ops_bytes_per_sample: int | None = 256 << 10) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        if device is None:
            device = next(model.parameters()).device
        self.device = torch.device(device)
        self.control = control
        self.notify = notify
        self.quota = quota if quota is not None else (control.quota() if control else 1 << 62)
        self.max_micro_batch = max_micro_batch
        self.probe_batch = probe_batch
        self.max_ahead = max_ahead
        self.max_ahead_ms = max_ahead_ms
        self.probe = probe or default_probe(self.device)
        if max_ahead_ms is not None:
            self.probe.timing = True
        # marks pair frees with events (page allocator); probes without them (tests) give none
        self._mark: Callable[[], int | None] = getattr(self.probe, "mark", lambda: None)
        # drain budget: GPU ms per sample of the work between safe point i-1 and i (EWMA)
        self._cost: dict[int, float] = {}
        self._sp_idx = 0          # safe points seen in this micro-batch
        self._last_done = None    # the last retired event of this micro-batch
        self._paused = False      # paused for inference since the last event (its gap is idle)
        self._queued_ms = 0.0
        self._done_mark = 0       # the page allocator's mark of the last completed event
        self._held_at_detect: int | None = None   # held bytes when a shrink was detected
        self._early_bytes = 0     # released early for the shrink being handled
        self.copy_chunks = max(1, int(copy_chunks))
        self.early_release = early_release
        self._op_mode = (_LargeOpSafePoints(self, split_ops_bytes_per_sample)
                         if split_ops_bytes_per_sample and self.device.type == "cuda" else None)
        # diagnostics: what each safe point index is (module or parameter name, pass)
        self._label = ""
        self._sp_labels: list[str] = []
        self._names: dict[int, str] = {id(m): n for n, m in model.named_modules()}
        self._names.update({id(p): n for n, p in model.named_parameters()})
        # (ns, rusage, gc count, queued ms) when a safe point raised
        self._detect_usage: tuple[int, resource.struct_rusage, int, float] | None = None
        self._caught_ns = 0
        if _count_gc not in gc.callbacks:
            gc.callbacks.append(_count_gc)
        # lend_pages(fds, page_bytes, seq): hand a shrink's pages on (the governor's page
        # handoff) instead of returning them to the driver; needs a probe that can lend.
        self._lender = self.probe if isinstance(self.probe, PagedMemoryProbe) else None
        self.lend_pages = lend_pages if self._lender is not None else None
        # with lend_pages: hand the pages over (fds sent) before the ack, unmap our own
        # mappings of them after it. The memory is the receiver's once it has the fds, and
        # nothing here touches it after the drain; pages no client takes stay physically held
        # until that unmap, a few ms after the grant.
        self.defer_unmap = defer_unmap
        self.group = process_group
        self.yield_to_inference = yield_to_inference
        self.max_yield_s = max_yield_s
        self.min_run_s = min_run_s
        self._run_until = 0.0
        if reclaim_at not in ("safe_point", "step_end"):
            raise ValueError("reclaim_at must be 'safe_point' or 'step_end'")
        # 'step_end' is the baseline that waits for the batch: commands are only looked at
        # between optimizer steps (compute still yields to inference at safe points).
        self.reclaim_at = reclaim_at
        self.memory_model = MemoryPerSample()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._acc: list[torch.Tensor | None] = [None] * len(self.params)
        self._events: list = []
        self._in_micro = False
        self._micro_n = 0
        self._abort_pass = ""
        self._adjustments: list[Adjustment] = []
        self._stopped = False
        self._warming: bool | None = None   # inside warm_up: its `update`
        self._hooks = []
        layers = list(layers) if layers is not None else [
            m for m in model.modules()
            if not list(m.children()) and any(p.requires_grad for p in m.parameters(recurse=False))]
        for m in layers:
            self._hooks.append(m.register_forward_pre_hook(self._forward_safe_point))
            # In backward a layer is finished once the gradient of its first parameter (first
            # used in forward, so last reached in backward) has been accumulated.
            first = next((p for p in m.parameters() if p.requires_grad), None)
            if first is not None:
                self._hooks.append(first.register_post_accumulate_grad_hook(
                    self._backward_safe_point))

    # --- safe points ---------------------------------------------------------------------
    def _forward_safe_point(self, module, args):
        self._label = self._names.get(id(module), "")
        self._safe_point("forward")

    def _backward_safe_point(self, param):
        self._label = self._names.get(id(param), "")
        self._safe_point("backward")

    def _op_safe_point(self, where: str, name: str) -> None:
        self._label = f"op.{name}"
        self._safe_point(where)

    def _safe_point(self, where: str = "forward") -> None:
        if not self._in_micro:
            return
        # Keep the CPU at most `max_ahead` safe points ahead of the GPU. While waiting, keep
        # reading the control words: a command is seen within microseconds, not one layer later.
        mark = self._mark()   # before the event: frees up to here precede it
        ev = self.probe.record_event()
        if ev is not None:
            self._events.append((ev, self._sp_idx, self._paused, mark))
            if self._sp_idx < len(self._sp_labels):
                self._sp_labels[self._sp_idx] = f"{where}:{self._label}"
            elif self._sp_idx == len(self._sp_labels):
                self._sp_labels.append(f"{where}:{self._label}")
            self._sp_idx += 1
            self._paused = False
            if self.max_ahead_ms is not None:   # learn from what already finished (cheap)
                while len(self._events) > 1 and self._events[0][0].query():
                    self._retire()
            while len(self._events) > self.max_ahead or (
                    self.max_ahead_ms is not None and len(self._events) > 1
                    and self._queued_estimate() > self.max_ahead_ms):
                oldest = self._events[0][0]
                while not oldest.query():
                    self._check_command(where)
                self._retire()
            if self.max_ahead_ms is not None:
                self._queued_estimate()   # what stays queued (the abort diagnostics read it)
        self._check_command(where)
        if (self.yield_to_inference is not None and self.yield_to_inference()
                and time.monotonic() >= self._run_until):
            # Inference has priority on compute: pause here while it runs. Training's
            # guaranteed progress: after a pause of `max_yield_s` it runs `min_run_s` before it
            # pauses again (a time budget, so it does not depend on how dense safe points are).
            # A command that arrives meanwhile is handled at once.
            end = time.monotonic() + self.max_yield_s
            while self.yield_to_inference():
                if time.monotonic() >= end:
                    self._run_until = time.monotonic() + self.min_run_s
                    break
                time.sleep(50e-6)
                self._paused = True
                self._check_command(where)

    def _queued_estimate(self) -> float:
        """GPU ms of the intervals still pending (unknown ones count 0)."""
        n = self._micro_n
        q = sum(self._cost.get(i, 0.0) for _, i, _, _ in self._events) * n
        self._queued_ms = q
        return q

    def _retire(self) -> None:
        """The oldest pending event has completed: learn its interval's GPU time."""
        ev, i, paused, mark = self._events.pop(0)
        if mark is not None:
            self._done_mark = max(self._done_mark, mark)
        if self.max_ahead_ms is not None:
            last = self._last_done
            if last is not None and not paused and self._micro_n > 0:
                per = last.elapsed_time(ev) / self._micro_n
                old = self._cost.get(i)
                self._cost[i] = per if old is None else 0.7 * old + 0.3 * per
            self._last_done = ev

    def drain_bound_ms(self) -> float:
        """About how long a stop waits for queued GPU work at most: the budget plus the costliest
        single interval at the last micro-batch size (0 when not known)."""
        if self.max_ahead_ms is None or not self._cost:
            return 0.0
        return self.max_ahead_ms + max(self._cost.values()) * max(self._micro_n, 1)

    def interval_costs(self) -> list[dict]:
        """Diagnostics: each safe-point interval's learned GPU time per sample (ms) and what the
        safe point ending it is ('forward:<module>' / 'backward:<parameter>' / 'copy:')."""
        return [{"i": i, "at": self._sp_labels[i] if i < len(self._sp_labels) else "",
                 "ms_per_sample": c} for i, c in sorted(self._cost.items())]

    def _release_early(self, target: int) -> None:
        """A shrink was detected and must release: hand the page allocator the empty pages that
        no queued kernel can use now (freed before the last completed event), so that they are
        unmapped while the queued kernels finish and the micro-batch unwinds."""
        self._held_at_detect = self.probe.reserved()
        self._early_bytes = 0
        if not self.early_release or self.lend_pages is not None:
            return
        while self._events and self._events[0][0].query():   # completed in order (one stream)
            self._retire()
        release_idle = getattr(self.probe, "release_idle", None)
        if self._done_mark and release_idle is not None:
            self._early_bytes = release_idle(target, self._done_mark)

    def bound(self) -> int:
        """Most bytes this process can hold before the current micro-batch ends: what the
        allocator holds now or, inside a micro-batch, its fitted peak if that is larger
        (memory still grows in forward). Unknown (no fit yet) inside a micro-batch: no bound."""
        held = self.probe.reserved()
        if not self._in_micro:
            return held
        if not self.memory_model.fitted:
            return 1 << 62
        return max(held, int(self.memory_model.estimate(self._micro_n)))

    def _check_command(self, where: str = "forward") -> None:
        if self.control is None or self.reclaim_at == "step_end":
            return
        cmd = self.control.pending()
        if cmd is None:
            return
        if cmd.cmd == CMD_SHRINK and self.bound() > cmd.target:
            self.control.stamp_detect()
            self._release_early(cmd.target)
            self._abort_pass = where
            self._detect_usage = (now_ns(), resource.getrusage(resource.RUSAGE_SELF), _GCS[0],
                                  self._queued_ms)
            raise ShrinkRequested()
        self._handle_command(self.control, cmd, dropped=0, where="safe_point")

    def poll(self) -> None:
        """Handle a pending command outside a step (call this while idle, e.g. loading data)."""
        if self.control is not None:
            cmd = self.control.pending()
            if cmd is not None:
                self.control.stamp_detect()
                self._handle_command(self.control, cmd, dropped=0)

    def wait_gpu(self) -> None:
        """Wait until the GPU finished the queued work, handling commands meanwhile (a plain
        synchronize would leave a command unseen for the whole wait)."""
        mark = self._mark()
        ev = self.probe.record_event()
        if ev is None:
            return
        while not ev.query():
            self.poll()
            time.sleep(20e-6)
        if mark is not None:
            self._done_mark = max(self._done_mark, mark)

    def _handle_command(self, control: SlotReader, cmd, dropped: int, where: str = "poll") -> None:
        t_handle = now_ns()
        t_detect = int(control.slot[W_T_DETECT])  # stamped at the safe point
        if t_detect == 0 or t_detect < cmd.issued_ns:
            control.stamp_detect()
            t_detect = int(control.slot[W_T_DETECT])
        flags = ACK_ABORTED if dropped else 0
        freed = 0
        deferred = False
        lender = self._lender
        diag: _UnwindDiag = {}
        if dropped and self._detect_usage is not None:
            t0, ru0, gcs0, queued = self._detect_usage
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            diag = _UnwindDiag(
                propagate_ms=max(0, self._caught_ns - t0) / 1e6 if self._caught_ns else 0.0,
                unwind_cpu_ms=(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) * 1e3,
                unwind_nivcsw=ru1.ru_nivcsw - ru0.ru_nivcsw, unwind_gcs=_GCS[0] - gcs0,
                queued_ms=queued)
        self._detect_usage = None
        if cmd.cmd == CMD_SHRINK:
            if self.bound() <= cmd.target and not self._early_bytes:
                # Already under the target (the quota had slack): nothing is physically held
                # beyond it, so there is nothing to drain or release. Ack at once.
                t_drained = t_released = t_detect
            else:
                # Drain before release: no queued kernel may still write memory that changes
                # hands. Release before ack: the daemon grants once it sees the ack. Pages no
                # queued kernel can use went at detection already (their unmaps run meanwhile;
                # the release below waits for them).
                if self._held_at_detect is None:
                    self._release_early(cmd.target)
                held = self._held_at_detect if self._held_at_detect is not None else self.probe.reserved()
                self.probe.drain()
                t_drained = now_ns()
                if self.lend_pages is not None and lender is not None:
                    fds = lender.lend(cmd.target, self.defer_unmap)
                    deferred = self.defer_unmap and bool(fds)
                    try:
                        if fds:   # before the ACK word: the daemon passes them with the grant
                            self.lend_pages(fds, lender.alloc.page_bytes, cmd.seq)
                            flags |= ACK_LENT
                    finally:
                        for fd in fds:
                            os.close(fd)
                else:
                    self.probe.release(cmd.target)
                t_released = now_ns()
                flags |= ACK_RELEASED
                freed = max(0, held - self.probe.reserved())
                if freed:
                    flags |= ACK_FREED
            self.quota = cmd.target
        else:
            t_drained = t_released = now_ns()
            if cmd.cmd == CMD_GROW:
                self.quota = cmd.target
            elif cmd.cmd == CMD_STOP:
                self._stopped = True
        self._held_at_detect = None
        early, self._early_bytes = self._early_bytes, 0
        used = self.probe.reserved()
        control.ack(cmd.seq, used, t_drained, t_released, flags, freed)
        if self.notify is not None and cmd.cmd == CMD_SHRINK:
            self.notify(cmd.seq)
        if deferred and lender is not None:   # the handover is acked: now drop our own mappings of the lent pages
            lender.finish_lend()
        self._adjustments.append(Adjustment(
            cmd.cmd, cmd.target, (t_detect - cmd.issued_ns) / 1e6, (t_drained - t_detect) / 1e6,
            (t_released - t_drained) / 1e6, used, dropped, bool(flags & ACK_RELEASED),
            f"abort_{self._abort_pass}" if dropped else where,
            max(0, t_handle - t_detect) / 1e6 if flags & ACK_RELEASED else 0.0,
            freed_bytes=freed, early_bytes=early, **diag))

    # --- micro-batch sizing -------------------------------------------------------------
    def next_micro_batch(self, remaining: int) -> int:
        upper = min(remaining, self.max_micro_batch)
        if not self.memory_model.fitted:
            return max(1, min(upper, self.probe_batch))
        n = max(1, self.memory_model.max_samples(self.quota, upper))  # one sample always runs
        # Equal micro-batches (256 → 128 + 128, not 209 + 47): the same block sizes each time,
        # so the caching allocator reuses its blocks instead of growing past the quota.
        k = -(-remaining // n)
        return min(n, -(-remaining // k))

    # --- the step -----------------------------------------------------------------------
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepResult:
        """One optimizer step over this worker's `inputs` (any local size, 0 included)."""
        self._adjustments = []
        local = int(inputs.shape[0])
        res = StepResult(0.0, local, local)
        done = 0
        self._acc = [None] * len(self.params)
        self.poll()
        while done < local:
            n = self.next_micro_batch(local - done)
            x = inputs[done:done + n]   # copied to the device inside the micro-batch
            y = targets[done:done + n]
            self.probe.begin_micro(n)
            try:
                loss_value = self._micro_batch(x, y)
            except ShrinkRequested:
                self._caught_ns = now_ns()
                aborted = True
            else:
                aborted = False
            # Outside the except block the traceback (and the micro-batch's graph) is gone.
            del x, y
            if aborted:
                for p in self.params:
                    p.grad = None  # drop the unfinished micro-batch's partial gradients
                self._events.clear()
                control = self.control
                cmd = control.pending() if control is not None else None
                if control is not None and cmd is not None:
                    self._handle_command(control, cmd, dropped=n)
                elif self._held_at_detect is not None:   # the command went away meanwhile
                    self._held_at_detect = None
                    if self._early_bytes:   # wait for the early unmaps all the same
                        self.probe.release(self.probe.reserved())
                        self._early_bytes = 0
                res.aborted += 1
                continue
            self.memory_model.observe(n, max(self.probe.peak(), 1))
            self._commit()
            if self.probe.reserved() > self.quota:
                # The caching allocator kept more than the quota (fragmentation across sizes):
                # give the excess back now rather than at the next shrink.
                self.probe.release(self.quota)
                res.excess_releases += 1
            res.loss_sum += loss_value
            res.micro_batches.append(n)
            done += n
        res.global_samples = self._finish(res)
        res.adjustments = list(self._adjustments)
        return res

    def _micro_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self._micro_n = int(x.shape[0])
        self._in_micro = True
        try:
            y = y.to(self.device, non_blocking=True)
            x = self._to_device(x)
            with self._op_mode if self._op_mode is not None else contextlib.nullcontext():
                out = self.model(x)
            loss = self.loss_fn(out, y)
            loss.backward()
            # Backward is queued: memory no longer grows. Wait for the GPU handling commands
            # (a plain read of the loss would leave one unseen until backward ends); one that
            # comes now is handled without dropping the micro-batch.
            self._in_micro = False
            self.wait_gpu()
            return float(loss.detach())
        finally:
            self._in_micro = False
            self._events.clear()
            self._sp_idx = 0
            self._last_done = None

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """The micro-batch's inputs on the device: a host tensor is copied in `copy_chunks`
        pieces with a safe point after each, so that the copy is not one long interval."""
        if t.device.type != "cpu" or self.device.type != "cuda" or self.copy_chunks <= 1:
            return t.to(self.device, non_blocking=True)
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        rows, k = int(t.shape[0]), self.copy_chunks
        for i in range(k):   # always k safe points: the same indices whatever the size
            lo, hi = rows * i // k, rows * (i + 1) // k
            if hi > lo:
                out[lo:hi].copy_(t[lo:hi], non_blocking=True)
            self._label = "input"
            self._safe_point("copy")
        return out

    def _commit(self) -> None:
        """Move this micro-batch's gradients into the accumulator (the committed part)."""
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            acc = self._acc[i]
            if acc is None:
                self._acc[i] = g  # first micro-batch: take the tensor, no copy
            else:
                acc.add_(g)
            p.grad = None

    def _finish(self, res: StepResult) -> int:
        """One all-reduce of [grads..., loss_sum, count]; divide by the global sample count."""
        grads = [a if a is not None else torch.zeros_like(p)
                 for a, p in zip(self._acc, self.params)]
        flat = torch.cat([g.reshape(-1) for g in grads] + [
            torch.tensor([res.loss_sum, float(res.samples)], dtype=grads[0].dtype,
                         device=grads[0].device)])
        if self._warming is None and self._data_parallel():   # warm-up steps stay local
            torch.distributed.all_reduce(flat, group=self.group)
        self.wait_gpu()  # reading the count below synchronises: keep handling commands
        total = int(round(float(flat[-1])))
        res.loss_sum = float(flat[-2])
        if total > 0:
            flat[:-2].div_(total)
            off = 0
            for p in self.params:
                k = p.numel()
                p.grad = flat[off:off + k].view_as(p)
                off += k
            if self._warming is not False:   # warm_up(update=False): no optimizer step
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._acc = [None] * len(self.params)
        return total

    def _data_parallel(self) -> bool:
        return self.group is not None or (torch.distributed.is_available()
                                          and torch.distributed.is_initialized())

    # --- warm-up ------------------------------------------------------------------------
    def warm_up(self, inputs: torch.Tensor, targets: torch.Tensor, *, splits: int = 4,
                sizes: Iterable[int] | None = None, aborts: bool | None = None,
                prefetch: bool = True, update: bool | None = None,
                deadline: float | None = None) -> WarmUpResult:
        """Run, before the job's clock, the first uses that would otherwise stall a safe point.

        On the H200 (issue 16) every safe point reached over 7 ms late came in the first
        seconds, inside the first backward at a micro-batch size not run before: cuBLAS choosing
        and loading the kernels of the new GEMM shapes (7-45 ms inside one op, where no safe
        point can run), and the first abort's unwinding paging in code from disk. This runs:

        - a step of `inputs[:n]` as one micro-batch for each size n the trainer splits a step of
          `len(inputs)` samples into (`micro_batch_sizes(len(inputs), splits,
          self.max_micro_batch)`: 320 and 4 splits → 320, 160, 107, 106, 80), or for `sizes`;
          first a step fitting the memory model (`3 * probe_batch` samples) if it has no fit;
        - with `aborts` (default: when governed and reclaiming at safe points) a micro-batch of
          the smallest size aborted once at the middle safe point of forward and once of
          backward (exactly as a shrink unwinds it, without a command), then redone;
        - with `prefetch`, `prefetch_mapped_libraries()` in a thread meanwhile (joined at the
          end, or at the deadline).

        `update`: the warm-up steps are optimizer steps on these samples (default: yes, unless
        data parallel). In data parallel (a `process_group`, or torch.distributed initialised)
        warm-up steps are local, without the all-reduce, so workers may warm up different sizes
        or stop at different times; they must not update then (`update=True` raises).
        `deadline`: a `time.monotonic()` value after which no further warm-up step starts.
        A command from the governor meanwhile is handled as in any step. Afterwards the
        trainer's settings are as before (the memory model keeps what it learned). Sizes outside
        these splits (after an abort mid-step the rest may split differently) stay cold.
        """
        t_start = time.monotonic()
        for name, t in (("inputs", inputs), ("targets", targets)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor, not {type(t).__name__}")
            if t.dim() == 0:
                raise ValueError(f"{name} must have a batch dimension")
        batch = int(inputs.shape[0])
        if batch < 1:
            raise ValueError("warm_up needs at least one sample")
        if int(targets.shape[0]) != batch:
            raise ValueError(f"inputs has {batch} samples but targets {int(targets.shape[0])}")
        if self._in_micro or self._warming is not None:
            raise RuntimeError("warm_up cannot run inside a step or another warm-up")
        if deadline is not None and not isinstance(deadline, (int, float)):
            raise TypeError(f"deadline must be a time.monotonic() value, not {deadline!r}")
        if sizes is None:
            sizes = micro_batch_sizes(batch, splits, self.max_micro_batch)
        else:
            given = list(sizes)
            bad = [n for n in given if isinstance(n, bool) or not isinstance(n, int)
                   or not 1 <= n <= min(batch, self.max_micro_batch)]
            if not given or bad:
                raise ValueError(f"sizes must be ints in 1..{min(batch, self.max_micro_batch)} "
                                 f"(the batch and max_micro_batch), got {given!r}")
            sizes = sorted(set(given), reverse=True)
        dp = self._data_parallel()
        if update is None:
            update = not dp
        elif update and dp:
            raise ValueError("data parallel: warm-up steps are local (no all-reduce), so they "
                             "cannot update the weights; pass update=False")
        if aborts is None:
            aborts = self.control is not None and self.reclaim_at == "safe_point"
        res = WarmUpResult(sizes=list(sizes))
        advised: list[int] = []
        pf = None
        if prefetch:   # reading a few GB may take seconds: the steps need not wait for it
            pf = threading.Thread(target=lambda: advised.append(prefetch_mapped_libraries()),
                                  name="warm-up-prefetch", daemon=True)
            pf.start()

        def late() -> bool:
            return deadline is not None and time.monotonic() > deadline

        keep_max = self.max_micro_batch
        had_own = "_safe_point" in self.__dict__
        own = self.__dict__.get("_safe_point")
        real = self._safe_point
        counts: dict[str, int] = {}
        micros = [0]
        self._warming = bool(update)
        try:
            if not self.memory_model.fitted and not late():
                res.fit = self.step(inputs[:min(batch, 3 * self.probe_batch)],
                                    targets[:min(batch, 3 * self.probe_batch)]).micro_batches

            def counting(where: str = "forward") -> None:   # safe points per pass
                if self._in_micro:
                    counts[where] = counts.get(where, 0) + 1
                real(where)
            self.__dict__["_safe_point"] = counting   # (an instance attribute over the method)
            for n in sizes:
                if late():
                    res.skipped.append(f"size {n}")
                    continue
                self.max_micro_batch = n
                r = self.step(inputs[:n], targets[:n])
                res.micro_batches.append(r.micro_batches)
                micros[0] += len(r.micro_batches) + r.aborted
            n = sizes[-1]
            for pass_ in (("forward", "backward") if aborts else ()):
                if late():
                    res.skipped.append(f"abort {pass_}")
                    continue
                per = counts.get(pass_, 0) / max(micros[0], 1)
                # the middle safe point of that pass (unknown: the first)
                at = max(1, int(per / 2 + 0.5)) if per else 1
                seen = [0]

                def aborting(where: str = "forward", pass_=pass_, at=at, seen=seen) -> None:
                    real(where)
                    if where == pass_ and self._in_micro:
                        seen[0] += 1
                        if seen[0] == at:
                            self._abort_pass = where
                            raise ShrinkRequested()
                self.__dict__["_safe_point"] = aborting
                self.max_micro_batch = n
                r = self.step(inputs[:n], targets[:n])
                if seen[0] >= at:   # that pass reached its safe point, and raised there
                    res.aborts += 1
                    res.abort_passes.append(pass_)
        finally:
            self._warming = None
            self.max_micro_batch = keep_max
            if had_own:
                self.__dict__["_safe_point"] = own
            else:
                self.__dict__.pop("_safe_point", None)
        self.wait_gpu()
        if pf is not None:
            pf.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            res.prefetched_bytes = advised[0] if advised else None
        res.seconds = time.monotonic() - t_start
        return res

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []



def governed_trainer(socket_path: str, model: nn.Module, optimizer, loss_fn, *, gpu: int = 0,
                     name: str = "training", handoff: bool = False,
                     **kwargs) -> tuple[ElasticTrainer, object]:
    """Register with the governor and build an ElasticTrainer on its slot. `handoff`: with
    the page allocator installed, a shrink's pages go to the inference client being granted
    (as fds, through the daemon) instead of back to the driver.
    Returns (trainer, client); close the client when done (that returns the memory)."""
    from hintfs.governor.client import GovernorClient

    client = GovernorClient(socket_path, "training", gpu=gpu, name=name)
    trainer = ElasticTrainer(model, optimizer, loss_fn, control=client.slot,
                             notify=client.notify_ack, quota=client.initial_quota,
                             yield_to_inference=client.inference_busy,
                             lend_pages=client.give_pages if handoff else None, **kwargs)
    return trainer, client

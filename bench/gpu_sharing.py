"""GPU sharing with the governor: inference first, training in the memory inference does not use.

One run compares, on one GPU and the same seeded bursty trace: inference alone, training alone,
static 50% / 75% partitions (inference's share), the governor reclaiming at batch end, the
governor reclaiming mid-backward (also pausing training for every request), three stress modes
(one decoder service asked every 0.3-0.45 s with a 12 GiB KV cache, a larger training batch)
whose reclaims must release memory physically, about 80 per 30 s (through
torch's caching allocator, through the page allocator, and with the page handoff), and a
page-handoff micro-benchmark (CUDA VMM pages moved between two processes). Inference runs as one
server process per model kind. The governed card is an *emulated* smaller GPU (`--card-gib`,
the ledger's total), so that memory, not the H200's 141 GB, is what the tenants compete for.
Compute priority is the same in every co-located mode but one: inference runs on high-priority
CUDA streams, and training pauses at its safe points (up to 50 ms at a time) only while a request
that starts cold runs (`--yield-to cold`); `governor_mid_backward_yield` pauses it for every
request, the older scheme. Training and inference alone on the trace give training's physical limit beside inference: training alone x
(1 - the share of time NVML saw inference's kernels running).

    python bench/gpu_sharing.py            # all eleven modes (about 9 min on one H200)
    python bench/gpu_sharing.py --modes inference_alone,training_alone,governor_mid_backward,\
        governor_paged_long_kv,governor_handoff_long_kv     # the issue-16 goals (about 4 min)
    python bench/gpu_sharing.py --modes governor_handoff_12g --skip-handoff-probe --card-gib 48 --big-kv-mult 16
        # page handoffs of >= 12 GiB in one reclaim (32 MiB pages: up to ~750 fds per reclaim,
        # sent in batches of 250 both ways; issue 41). On the default 32 GiB card with
        # --big-kv-mult 9 (13.5 GiB caches) a reclaim moved at most 6 GiB: the rest was free.
    python bench/gpu_sharing.py --role priority --out F.json   # GPU-priority probe (2 min)
    python bench/gpu_sharing.py --role unmap --out F.json      # 4 GiB of VMM pages back to the driver, by variant (1 min)
    python bench/gpu_sharing.py --quick    # short smoke run
    python bench/gpu_sharing.py --modes governor_paged_long_kv --diag 1 --skip-handoff-probe
        # where the trainer's threads are while a command waits unseen (bench/stackwatch.c):
        # safe-point timelines and thread samples per late command, in the JSON and stacks-*.jsonl
Roles `--role train|infer|handoff|prio_load|prio_probe` are child processes; not for direct use.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GiB = 1 << 30
MiB = 1 << 20

MODES = ["inference_alone", "training_alone", "static_50", "static_75", "governor_batch_end",
         "governor_mid_backward", "governor_mid_backward_yield", "governor_mid_backward_long_kv", "governor_paged_long_kv",
         "governor_handoff_long_kv", "inference_alone_repeat"]
# Stress modes: one decoder service reserves a KV cache for an 8x longer context (12 GiB,
# --stress-kv-mult) every 0.3-0.45 s, after training grew back into the last one, so that
# reclaims must physically release memory (and may abort a micro-batch).
LONG_KV = ("governor_mid_backward_long_kv", "governor_paged_long_kv", "governor_handoff_long_kv",
           "governor_handoff_12g")
# Training through the page allocator (hintfs/governor/pagealloc.py as torch's allocator): a release
# unmaps only the empty 32 MiB pages needed to get under the target, no empty_cache.
# Handoff: those pages go (as fds, through the daemon) to the inference server being granted,
# which maps and zeroes them for its KV cache instead of allocating new memory.
PAGED = ("governor_paged_long_kv", "governor_handoff_long_kv", "governor_handoff_12g")
HANDOFF = ("governor_handoff_long_kv", "governor_handoff_12g")
# Not in the default list (--modes names it): the handoff with one reclaim moving >= 12 GiB. The
# decoder's KV cache is 13.5 GiB (--stress-kv-mult 9), training keeps every byte of its quota
# mapped (after each step it maps empty pages up to it, `--hold-quota`), and pages are 32 MiB, so
# each physical reclaim lends 400+ pages: more than one message carries (253 fds), both ways.
BIG_HANDOFF = ("governor_handoff_12g",)
MODE_PAGE_MIB = {"governor_handoff_12g": 32}
# One inference server process per model kind, each with its own FIFO queue (as separate
# services would be): a ResNet request never waits behind a decoder's 80 ms prefill.
SERVERS = ["resnet50", "vit_b_16", "decoder"]
ALONE = ("inference_alone", "inference_alone_repeat")
# Compute priority. Inference runs on high-priority CUDA streams; training pauses at its safe
# points (up to 50 ms, then runs at least 5 ms) only while a request that starts cold runs
# (--yield-to cold). This mode keeps the older scheme for comparison: it pauses for every request.
MODE_YIELD_TO = {"governor_mid_backward_yield": "all"}
INFER_SHARE = {"static_50": 0.5, "static_75": 0.75}


# ============================================================== trace (pure, seeded)

def make_trace(seed: int, duration_s: float, models: list[str]) -> list[tuple[float, str]]:
    """MMPP arrivals (quiet 2/s, burst 25/s, mean sojourn 4 s / 2 s) and Zipf(1.1) popularity."""
    rnd = random.Random(seed)
    weights = [1 / (i + 1) ** 1.1 for i in range(len(models))]
    order = models[:]
    rnd.shuffle(order)
    t, state, out = 0.0, 0, []
    rates, sojourn = (2.0, 25.0), (4.0, 2.0)
    switch = rnd.expovariate(1 / sojourn[0])
    while t < duration_s:
        t += rnd.expovariate(rates[state])
        while t > switch:
            state ^= 1
            switch += rnd.expovariate(1 / sojourn[state])
        if t < duration_s:
            out.append((t, rnd.choices(order, weights)[0]))
    return out


def make_stress_trace(trace: list[tuple[float, str]], seed: int, duration_s: float,
                      gap_s: tuple[float, float]) -> list[tuple[float, str]]:
    """The stress modes' trace: the base trace's ResNet and ViT requests, and one long-context
    decoder service (`decoder-0`) asked every `gap_s` (uniform) seconds. Each of its requests
    reserves a large KV cache after training has grown back into the last one, so most of its
    reclaims must move memory: the physical reclaims the goals are about (80 requests in 30 s)."""
    rnd = random.Random(seed + 1)
    out = [(t, n) for t, n in trace if not n.startswith("decoder")]
    t = rnd.uniform(*gap_s) / 2
    while t < duration_s:
        out.append((t, "decoder-0"))
        t += rnd.uniform(*gap_s)
    return sorted(out)


def instance_names(n_per_kind: int) -> list[str]:
    return [f"{k}-{i}" for k in ("resnet50", "vit_b_16", "decoder") for i in range(n_per_kind)]


# ============================================================== GPU busy share (NVML)

class GpuBusy:
    """Share of the trace's time the GPU was running a kernel: NVML's utilization samples (the
    driver's own, about 6 a second; `nvidia-smi dmon`'s sm column), collected every second
    between start() and stop(), averaged. Inference alone on the trace gives the share of the
    GPU inference keeps busy, which bounds what training can get beside it."""

    def __init__(self) -> None:
        self.samples: list[tuple[int, int]] = []
        self.t0_us = self.t1_us = None
        self.last_poll = 0.0
        self.error = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nv, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as e:   # no NVML: no busy share (the limit is then not reported)
            self.nv, self.error = None, repr(e)

    def _fetch(self) -> None:
        if self.nv is None:
            return
        last = self.samples[-1][0] if self.samples else self.t0_us
        try:
            _, got = self.nv.nvmlDeviceGetSamples(self.h, self.nv.NVML_GPU_UTILIZATION_SAMPLES, last)
        except self.nv.NVMLError as e:
            if "Not Found" not in str(e):   # no new sample since `last` is not an error
                self.error = repr(e)
            return
        self.samples += [(x.timeStamp, x.sampleValue.uiVal) for x in got if x.timeStamp > last]

    def start(self) -> None:
        if self.t0_us is None:
            self.t0_us = int(time.time() * 1e6)
        if self.t1_us is None and time.monotonic() - self.last_poll >= 1.0:
            self.last_poll = time.monotonic()
            self._fetch()

    def stop(self) -> None:
        if self.t0_us is not None and self.t1_us is None:
            self._fetch()
            self.t1_us = int(time.time() * 1e6)

    def result(self) -> dict:
        xs = [v for t, v in self.samples if self.t0_us <= t <= (self.t1_us or t)]
        return {"share": (sum(xs) / len(xs) / 100) if xs else None, "n": len(xs), "error": self.error}


# ============================================================== daemon in a thread

class DaemonThread:
    def __init__(self, cfg) -> None:
        import trio

        from hintfs.governor.daemon import GovernorDaemon

        self.daemon = GovernorDaemon(cfg)
        self.daemon.open()
        started = threading.Event()

        async def main():
            self.token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as cs:
                self.cancel = cs
                async with trio.open_nursery() as n:
                    await n.start(self.daemon.serve)
                    started.set()
        self.thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
        self.thread.start()
        started.wait(10)

    def call(self, fn):
        import trio
        return trio.from_thread.run_sync(fn, trio_token=self.token)

    def stop(self):
        import trio
        try:
            trio.from_thread.run_sync(self.cancel.cancel, trio_token=self.token)
        except trio.RunFinishedError:
            pass
        self.thread.join(10)
        self.daemon.close()


# ============================================================== models

def build_decoder(d=2048, layers=12, vocab=32000):
    from torch import nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x, k_cache, v_cache, pos):
            b, t, _ = x.shape
            h = 16
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, h, d // h).unbind(2)
            k_cache[:, pos:pos + t] = k
            v_cache[:, pos:pos + t] = v
            kk, vv = k_cache[:, :pos + t], v_cache[:, :pos + t]
            a = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2),
                                               vv.transpose(1, 2), is_causal=(t > 1))
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(d, vocab, bias=False)
            self.d, self.layers = d, layers

        def forward(self, tokens, kv, pos):
            x = self.emb(tokens)
            for i, blk in enumerate(self.blocks):
                x = blk(x, kv[i][0], kv[i][1], pos)
            return self.head(x[:, -1])
    return Decoder()


# ============================================================== role: inference

def role_infer(args) -> None:
    import torch
    from torch.func import functional_call

    from hintfs.governor.inference import InferenceClient, KVCache, ModelCache, ReservationRejected

    dev = torch.device("cuda")
    dtype = torch.bfloat16
    try:
        import torchvision.models as tvm
        builders = {"resnet50": tvm.resnet50, "vit_b_16": tvm.vit_b_16}
    except ImportError:  # pragma: no cover
        builders = {}
    templates, host_params, inputs = {}, {}, {}
    my_kinds = args.kinds.split(",")
    for kind in my_kinds:
        with torch.device("cuda"):
            m = builders[kind]() if kind in builders else build_decoder()
        m = m.to(dtype).eval()
        templates[kind] = m
        host_params[kind] = {k: v.detach().to("cpu").pin_memory()
                             for k, v in list(m.named_parameters()) + list(m.named_buffers())}
        for p in m.parameters():  # the template keeps only structure: weights are per instance
            p.data = torch.empty(0, device=dev, dtype=p.dtype)
    torch.cuda.empty_cache()
    inputs["resnet50"] = inputs["vit_b_16"] = torch.randn(1, 3, 224, 224, device=dev, dtype=dtype)
    prompt = torch.randint(0, 32000, (1, 512), device=dev)
    dec = templates.get("decoder")
    kv_tokens = args.kv_context  # KV cache sized for a long context (the elastic part)
    kv_bytes_per_token = 2 * dec.layers * dec.d * 2 if dec else 0
    kv_chunk = -(-kv_tokens * kv_bytes_per_token // (256 * MiB)) * 256 * MiB  # one chunk

    def weight_bytes(kind):
        return sum(t.numel() * t.element_size() for t in host_params[kind].values())

    client = InferenceClient(args.socket, name=f"bench-{args.kinds}", accept_pages=args.mode in HANDOFF)
    events: list = []   # --diag: (what, start, end) in s from t0: reserves, cache frees, KV allocs, loads

    def timed_event(what, fn):
        def wrapped(*a, **k):
            t0 = time.monotonic()
            try:
                return fn(*a, **k)
            finally:
                events.append((what, t0 - args.t0, time.monotonic() - args.t0))
        return wrapped
    if args.diag:
        import hintfs.governor.inference as ginf
        client.reserve = timed_event("reserve", client.reserve)
        ginf._free_device_cache = timed_event("empty_cache", ginf._free_device_cache)
    if args.mode in HANDOFF:   # load cuda-python and bind its context now, not inside a timed map
        from hintfs.governor import vmm_pool
        vmm_pool.ensure_context(0)
    lent_maps: list = []        # PagePools of KV chunks built on lent pages (released after use)
    lent_pages: list[int] = []  # pages used per KV chunk (0: allocated by torch)
    cache = ModelCache(client)
    load_ms: list[float] = []  # weights copied from pinned host memory (cold start)
    map_ms: list[float] = []   # granted KV bytes allocated (cudaMalloc: the driver maps pages)
    zero_ms: list[float] = []  # and zeroed before use (what a page handoff must do)

    def loader(kind):
        def load():
            tm = time.monotonic()
            t0 = time.perf_counter()
            p = {k: v.to(dev, non_blocking=True) for k, v in host_params[kind].items()}
            torch.cuda.synchronize()
            load_ms.append((time.perf_counter() - t0) * 1e3)
            events.append(("load", tm - args.t0, time.monotonic() - args.t0))
            return p
        return load

    def alloc_kv(nbytes):
        t_ev = time.monotonic()
        try:
            return _alloc_kv(nbytes)
        finally:
            events.append(("alloc_kv", t_ev - args.t0, time.monotonic() - args.t0))

    def _alloc_kv(nbytes):
        t0 = time.perf_counter()
        fds, page = client.pop_pages()
        if fds:   # training's pages, lent with the grant: map them, then zero (owner changed)
            from hintfs.governor import vmm_pool as vp
            try:
                need = -(-nbytes // page)
                pool = vp.PagePool.import_fds(0, fds[:need], page)
                if need > len(fds):   # the rest as fresh pages
                    pool.handles += vp.PagePool.create(0, need - len(fds), page).handles
            finally:
                for fd in fds:
                    os.close(fd)
            m = pool.map(list(range(need)))
            t1 = time.perf_counter()
            pool.zero(m)
            torch.cuda.synchronize()
            map_ms.append((t1 - t0) * 1e3)
            zero_ms.append((time.perf_counter() - t1) * 1e3)
            lent_maps.append(pool)
            lent_pages.append(min(len(fds), need))
            return vp.as_tensor(m)[:nbytes]
        lent_pages.append(0)
        t = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        t.zero_()
        torch.cuda.synchronize()
        map_ms.append((t1 - t0) * 1e3)
        zero_ms.append((time.perf_counter() - t1) * 1e3)
        return t

    def serve(name):
        kind = name.rsplit("-", 1)[0]
        with cache.use(name, loader(kind), weight_bytes(kind)) as params:
            with torch.inference_mode():
                if kind != "decoder":
                    functional_call(templates[kind], params, (inputs[kind],))
                else:
                    kv = KVCache(client, kv_bytes_per_token, kv_chunk, alloc_kv)
                    kv.ensure(kv_tokens)
                    flat = kv.chunks[0]
                    per = kv_tokens * dec.d * 2
                    kvs = [(flat[(2 * i) * per:(2 * i + 1) * per].view(dtype).view(1, kv_tokens, 16, dec.d // 16),
                            flat[(2 * i + 1) * per:(2 * i + 2) * per].view(dtype).view(1, kv_tokens, 16, dec.d // 16))
                           for i in range(dec.layers)]
                    logits = functional_call(dec, params, (prompt, kvs, 0))
                    pos = prompt.shape[1]
                    for _ in range(args.decode_tokens):
                        tok = logits.argmax(-1, keepdim=True)
                        logits = functional_call(dec, params, (tok, kvs, pos))
                        pos += 1
                    del kvs, flat, logits
                    torch.cuda.synchronize()
                    kv.shrink_to(0)
                    t_rel = time.monotonic()
                    while lent_maps:   # the chunk's tensor is gone: unmap, free the pages
                        lent_maps.pop().release()
                    events.append(("release_lent", t_rel - args.t0, time.monotonic() - args.t0))
            torch.cuda.synchronize()

    if args.infer_priority == "high":   # warm-up on the stream the trace runs on
        from hintfs.governor.inference import priority_stream
        torch.cuda.set_stream(priority_stream(dev))
    # warm the kernels (not counted), then evict so the trace starts cold. Training is starting
    # too: a reclaim that misses its deadline (the batch-end baseline) is retried, not fatal.
    for kind in templates:
        while True:
            try:
                serve(f"{kind}-warm")
                break
            except ReservationRejected as e:
                if time.monotonic() >= args.t0:
                    print(f"warm-up of {kind} not granted before the trace: {e}", file=sys.stderr)
                    break
                time.sleep(0.05)
    for n in list(cache.models):
        cache.evict(n)
    client.timings.clear()
    for xs in (load_ms, map_ms, zero_ms, lent_pages, events):
        xs.clear()
    gc.collect()
    gc.freeze()  # long-lived objects out of the collector's way: no multi-ms pauses mid-trace
    trace = [(t, n) for t, n in json.loads(Path(args.trace).read_text())
             if n.rsplit("-", 1)[0] in my_kinds]
    if args.infer_priority == "high":   # inference's kernels ahead of training's on the GPU
        from hintfs.governor.inference import priority_stream
        torch.cuda.set_stream(priority_stream(dev))
    while time.monotonic() < args.t0:
        time.sleep(0.001)
    records = []
    mem = []
    for t_arr, name in trace:
        now = time.monotonic() - args.t0
        if now < t_arr:
            time.sleep(t_arr - now)
        start = time.monotonic() - args.t0
        cold_before = cache.cold_starts
        n_timings = len(client.timings)
        # training pauses at its safe points while BUSY is set: for every request, or (the
        # default) only for one that starts cold, whose weight copy and first kernels are what
        # time-slicing with training's context delays (run 1: every SLO miss beside a training
        # that never paused was a cold start, or a request queued behind one)
        busy = args.yield_to == "all" or name not in cache.models
        try:
            with client.busy() if busy else contextlib.nullcontext():
                serve(name)
            ok = True
        except Exception as e:  # a rejected reservation is a failed request, not a crash
            ok = False
            print(f"request {name} failed: {e}", file=sys.stderr)
        done = time.monotonic() - args.t0
        records.append({"t": t_arr, "model": name, "latency_ms": (done - t_arr) * 1e3,
                        "service_ms": (done - start) * 1e3, "ok": ok,
                        "cold": cache.cold_starts > cold_before,
                        "reclaims": len(client.timings) - n_timings})
        mem.append((done, torch.cuda.memory_reserved()))
        cache.evict_expired()
    # stay until the trace is over for everyone: a server that exits early tears its CUDA
    # context down while others still reclaim (the suspected cause of one 27 ms release, the
    # last reclaim of bench/results/gpu_sharing_pages256_nosplit.json; none over 6.4 ms since)
    while time.monotonic() < args.t0 + args.duration + 1.0:
        time.sleep(0.05)
    Path(args.out).write_text(json.dumps({"records": records, "timings": client.timings,
                                          "load_ms": load_ms, "map_ms": map_ms,
                                          "zero_ms": zero_ms, "memory": mem,
                                          "lent_pages": lent_pages, "events": events}))
    client.close()


# ============================================================== diagnostics (--diag)

class _Diag:
    """--diag: where a command waits unseen, or an abort waits to be handled. The trainer's
    class is swapped for a subclass that stamps every safe point (time, thread, pass, label) and
    the phases between micro-batches into a ring; a late command's window of that ring is kept
    with its adjustment. bench/stackwatch.c samples every thread's kernel and user stack meanwhile."""

    def __init__(self, trainer, client, args) -> None:
        import threading
        from collections import deque

        sys.path.insert(0, str(ROOT / "bench"))
        from stackwatch import StackWatch

        from hintfs.governor.protocol import W_CMD_T, W_T_DETECT, now_ns
        from hintfs.governor.training import ShrinkRequested

        self.args = args
        self.thresh_ms = args.diag_thresh_ms
        self.watch = StackWatch(client.block.slot(client.slot_index), W_CMD_T, W_T_DETECT,
                                thresh_ms=args.diag_thresh_ms, period_ms=1.0, max_rounds=40)
        ring = self.ring = deque(maxlen=40000)
        watch = self.watch
        tid = threading.get_native_id
        watch.thread(0, tid())   # the main thread (forward); backward's is set at its first hook
        base = type(trainer)
        self.late: list[dict] = []

        def mark(name, fn):
            def wrapped(self, *a, **k):
                ring.append((now_ns(), tid(), name, "enter", -1))
                try:
                    return fn(self, *a, **k)
                finally:
                    ring.append((now_ns(), tid(), name, "exit", -1))
            return wrapped

        class DiagTrainer(base):
            def _safe_point(self, where="forward"):
                t = tid()
                if where == "backward" and watch.words[3] != t:
                    watch.thread(1, t)
                ring.append((now_ns(), t, where, self._label, self._sp_idx))
                return base._safe_point(self, where)

            def _check_command(self, where="forward"):
                try:
                    base._check_command(self, where)
                except ShrinkRequested:
                    watch.raised(now_ns())
                    raise

            def _handle_command(self, cmd, dropped, where="poll"):
                watch.handled(now_ns())
                ring.append((now_ns(), tid(), "handle", where, cmd.seq))
                base._handle_command(self, cmd, dropped, where)
                self._adjustments[-1].issued_ns = cmd.issued_ns

            wait_gpu = mark("wait_gpu", base.wait_gpu)
            _commit = mark("commit", base._commit)
            _finish = mark("finish", base._finish)
            step = mark("step", base.step)

        trainer.__class__ = DiagTrainer

    def after_step(self, adjustments) -> None:
        for a in adjustments:
            issued = getattr(a, "issued_ns", 0)
            if not issued or (a.detect_ms < self.thresh_ms and a.unwind_ms < self.thresh_ms):
                continue
            lo = issued - 30_000_000
            hi = issued + int((a.detect_ms + a.drain_ms + a.release_ms + 5) * 1e6)
            win = [(round((t - issued) / 1e6, 3), th, w, lab, i) for t, th, w, lab, i in self.ring
                   if lo <= t <= hi]
            before = [e for e in win if e[0] < 0][-40:]
            after = [e for e in win if e[0] >= 0][:200]
            self.late.append({"issued_t": issued / 1e9 - self.args.t0, "issued_ns": issued,
                              "where": a.where, "detect_ms": a.detect_ms, "unwind_ms": a.unwind_ms,
                              "propagate_ms": a.propagate_ms, "drain_ms": a.drain_ms,
                              "release_ms": a.release_ms, "released": a.released,
                              "timeline": before + after})

    def finish(self, stacks_path: str) -> dict:
        self.watch.stop()
        n = self.watch.dump(stacks_path)
        return {"late": self.late, "stack_samples": n, "thresh_ms": self.thresh_ms}


def _diag_trainer(trainer, client, args) -> _Diag:
    return _Diag(trainer, client, args)


# ============================================================== role: training

def role_train(args) -> None:
    from hintfs.governor import pagealloc
    if args.mode in PAGED:   # before CUDA starts: torch cannot swap an allocator in use
        # handoff: pages exported once, at creation, so lending costs no export on the shrink
        alloc = pagealloc.install(0, page_bytes=args.page_mib * MiB, export_fds=args.mode in HANDOFF)
        if args.unmap_threads > 1:
            alloc.set_unmap_threads(args.unmap_threads)
    import torch
    from torch import nn

    from hintfs.governor.client import GovernorClient
    from hintfs.governor.training import ElasticTrainer, governed_trainer

    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = False
    if args.switch_ms:
        sys.setswitchinterval(args.switch_ms / 1e3)
    try:
        from torchvision.models import swin_t
        with torch.device("cuda"):
            model = swin_t(num_classes=100)
        arch = "swin_t"
    except ImportError:  # pragma: no cover
        raise SystemExit("torchvision is needed for the training role")
    # fused: the optimizer step is a stretch without safe points, and the foreach AdamW spent
    # 4-10 ms of host time in it (--diag: commands that came then waited that long)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=bool(args.fused_adamw))
    ce = nn.CrossEntropyLoss(reduction="sum")

    def loss_fn(out, y):
        return ce(out.float(), y)

    class Autocast(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return self.m(x)

    wrapped = Autocast(model)
    governed = args.mode.startswith("governor")
    reclaim_at = "step_end" if args.mode == "governor_batch_end" else "safe_point"
    client = observer = None
    if governed:
        # layers=None: a safe point at every module with parameters (Linear, LayerNorm, conv),
        # about 160 per micro-batch, so that a stop drains in about a millisecond of GPU work
        trainer, client = governed_trainer(args.socket, wrapped, opt, loss_fn, layers=None,
                                           handoff=args.mode in HANDOFF,
                                           defer_unmap=args.mode in HANDOFF,
                                           reclaim_at=reclaim_at, max_ahead=args.max_ahead,
                                           max_ahead_ms=args.max_ahead_ms or None,
                                           max_yield_s=args.yield_ms / 1e3,
                                           copy_chunks=args.copy_chunks,
                                           early_release=bool(args.early_release),
                                           split_ops_bytes_per_sample=args.split_ops_kib * 1024 or None,
                                           name=f"bench-{args.mode}", probe_batch=16, device=dev)
    else:
        # outside the ledger (a static partition), but it yields to inference like the governed
        # trainer: an observer's block carries the daemon's count of busy inference clients
        observer = GovernorClient(args.socket, "observer", name=f"bench-{args.mode}") if args.colocated else None
        trainer = ElasticTrainer(wrapped, opt, loss_fn, device=dev, quota=args.quota,
                                 layers=None, max_ahead=args.max_ahead, probe_batch=16,
                                 max_ahead_ms=args.max_ahead_ms or None,
                                 max_yield_s=args.yield_ms / 1e3, copy_chunks=args.copy_chunks,
                                 split_ops_bytes_per_sample=args.split_ops_kib * 1024 or None,
                                 yield_to_inference=observer.inference_busy if observer else None)
    diag = _diag_trainer(trainer, client, args) if args.diag and client is not None else None
    gb = args.global_batch
    x = torch.randn(gb, 3, 224, 224).pin_memory()
    y = torch.randint(0, 100, (gb,)).pin_memory()
    # fit the memory model with two probe sizes before the clock starts
    trainer.probe_batch = 16
    trainer.step(x[:48], y[:48])
    warm = None
    if args.warm_sizes:
        # the library's warm-up (hintfs/governor/training.py, ElasticTrainer.warm_up): each micro-batch
        # size a step splits into, one abort per pass when governed, the libraries prefetched.
        # --diag found every late safe point over 7 ms inside cuBLAS's first GEMM of a new shape
        w = trainer.warm_up(x, y, splits=args.warm_sizes, aborts=governed, prefetch=True,
                            deadline=args.t0 - 1.0)
        warm = {**w.as_dict(), "left_before_t0_s": args.t0 - time.monotonic()}
    gc.collect()
    gc.freeze()  # as in the servers: a full collection would stall a safe point for ms
    steps, adjustments, mem = [], [], []
    while time.monotonic() < args.t0:
        trainer.poll() if governed else None
        time.sleep(0.001)
    end = args.t0 + args.duration
    while time.monotonic() < end:
        t0 = time.monotonic()
        r = trainer.step(x, y)
        trainer.wait_gpu()  # like synchronize, but commands are still handled meanwhile
        t1 = time.monotonic()
        steps.append({"t": t1 - args.t0, "dt": t1 - t0, "samples": r.global_samples,
                      "micro": r.micro_batches, "aborted": r.aborted, "loss": r.loss,
                      "excess_releases": r.excess_releases})
        adjustments += [a.__dict__ for a in r.adjustments]
        if diag is not None:
            diag.after_step(r.adjustments)
        if args.hold_quota and governed:
            # keep every byte of the quota mapped (empty pages stay mapped in the page
            # allocator), so that the next reclaim must lend all that it takes
            fill = trainer.quota - trainer.probe.reserved() - 64 * MiB
            if fill >= args.page_mib * MiB:
                torch.empty(fill, dtype=torch.uint8, device=dev)
        fixed = sum(p.numel() * p.element_size() * 4 for p in model.parameters())  # w, g, m, v
        reserved = trainer.probe.reserved()
        mem.append((t1 - args.t0, reserved, fixed))
        if client is not None:
            client.report_usage({"weights": fixed // 4, "optimizer_state": fixed * 3 // 4,
                                 "activations": max(0, reserved - fixed)},
                                drain_ms=trainer.drain_bound_ms())
    done = [s for s in steps if s["t"] <= args.duration]
    Path(args.out).write_text(json.dumps({
        "arch": arch, "steps": done, "adjustments": adjustments, "memory": mem,
        "samples_per_s": sum(s["samples"] for s in done) / args.duration,
        "drain_bound_ms": trainer.drain_bound_ms(),
        # what each safe-point interval costs on the GPU (ms per sample; x micro-batch = ms)
        "interval_costs": trainer.interval_costs(),
        "pagealloc": pagealloc.installed().stats() if args.mode in PAGED else None,
        "diag": diag.finish(args.out + ".stacks.jsonl") if diag is not None else None,
        "warm_up": warm,
        "quota_final": trainer.quota}))
    for c in (client, observer):
        if c is not None:
            c.close()


# ============================================================== role: page handoff

def role_handoff(args) -> None:
    """Two processes share 32 MiB VMM pages; pages move A → B: unmap, map, zero."""
    import socket

    import torch

    from hintfs.governor import vmm_pool as vp

    out = {"available": vp.available()}
    if not vp.available():
        Path(args.out).write_text(json.dumps(out))
        return
    page = 32 * MiB
    n_pages = 64  # 2 GiB
    a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # B: the new owner (inference)
        a_sock.close()
        try:
            import torch as _t  # noqa: F401 - CUDA is re-initialised lazily in the child
            vp.ensure_context(0)
            fds = vp.recv_fds(b_sock)
            pool = vp.PagePool.import_fds(0, fds, page)
            for fd in fds:
                os.close(fd)
            res = []
            while True:
                msg = b_sock.recv(64)
                if not msg or msg == b"done":
                    break
                lo, hi = map(int, msg.decode().split(","))
                t0 = time.perf_counter_ns()
                m = pool.map(list(range(lo, hi)))
                t1 = time.perf_counter_ns()
                pool.zero(m)
                vp.cu.cuStreamSynchronize(0)
                t2 = time.perf_counter_ns()
                t = vp.as_tensor(m)
                nonzero = int(t.count_nonzero())
                del t
                pool.unmap(m)
                res.append({"bytes": (hi - lo) * page, "map_ms": (t1 - t0) / 1e6,
                            "zero_ms": (t2 - t1) / 1e6, "nonzero_after_zero": nonzero})
                b_sock.sendall(b"ok")
            b_sock.sendall(json.dumps(res).encode() + b"\n")
        except Exception as e:
            b_sock.sendall(json.dumps({"error": repr(e)}).encode() + b"\n")
        os._exit(0)
    b_sock.close()
    try:
        torch.empty(1, device="cuda")  # CUDA only after the fork: a forked child cannot use it
        pool = vp.PagePool.create(0, n_pages, page)
        fds = pool.export_fds()
        t0 = time.perf_counter()
        vp.send_fds(a_sock, fds)
        out["export_send_ms"] = (time.perf_counter() - t0) * 1e3
        for fd in fds:
            os.close(fd)
        unmap_ms = []
        for k in (8, 16, 32, 64, 8, 16, 32, 64, 32, 32):
            m = pool.map(list(range(k)))
            t = vp.as_tensor(m)
            t.fill_(0xAB)  # the old owner's data, must not be visible to B
            torch.cuda.synchronize()
            del t
            t0 = time.perf_counter_ns()
            pool.unmap(m)
            unmap_ms.append((time.perf_counter_ns() - t0) / 1e6)
            a_sock.sendall(f"0,{k}".encode())
            assert a_sock.recv(2) == b"ok"
        a_sock.sendall(b"done")
        buf = b""
        while not buf.endswith(b"\n"):
            buf += a_sock.recv(1 << 20)
        b_res = json.loads(buf)
        out["b"] = b_res
        out["unmap_ms"] = unmap_ms
        # the empty_cache path for the same sizes, in one process (free, then allocate)
        ec = []
        for k in (8, 16, 32, 64):
            t = torch.empty(k * page, dtype=torch.uint8, device="cuda")
            t.fill_(1)
            torch.cuda.synchronize()
            del t
            t0 = time.perf_counter_ns()
            torch.cuda.empty_cache()
            t1 = time.perf_counter_ns()
            t = torch.empty(k * page, dtype=torch.uint8, device="cuda")
            t.zero_()
            torch.cuda.synchronize()
            t2 = time.perf_counter_ns()
            del t
            torch.cuda.empty_cache()
            ec.append({"bytes": k * page, "release_ms": (t1 - t0) / 1e6,
                       "alloc_zero_ms": (t2 - t1) / 1e6})
        out["empty_cache_path"] = ec
        pool.release()
    except Exception as e:
        out["error"] = repr(e)
    os.waitpid(pid, 0)
    Path(args.out).write_text(json.dumps(out))


# ============================================================== role: unmap cost probe

def role_unmap(args) -> None:
    """What giving 4 GiB of 32 MiB VMM pages back to the driver costs, and what changes it: the
    order of handle release and unmap, exportable or not, one call per page or per run, one
    4 GiB allocation, several threads, the GPU busy (a kernel of this context on another
    stream, or another process's load). Each variant 3 times; ms per call sequence."""
    import ctypes as C

    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    cu = C.CDLL("libcuda.so.1")
    ctx = C.c_void_p()
    cu.cuCtxGetCurrent(C.byref(ctx))

    class Loc(C.Structure):
        _fields_ = [("type", C.c_int), ("id", C.c_int)]

    class Prop(C.Structure):
        _fields_ = [("type", C.c_int), ("handle_types", C.c_int), ("location", Loc),
                    ("win32", C.c_void_p), ("flags", C.c_ubyte * 8)]

    class Access(C.Structure):
        _fields_ = [("location", Loc), ("flags", C.c_int)]

    def ok(rc, what):
        if rc:
            raise RuntimeError(f"{what}: CUDA error {rc}")

    page, n = 32 * MiB, 128
    va = C.c_uint64()
    ok(cu.cuMemAddressReserve(C.byref(va), C.c_size_t(64 * GiB), C.c_size_t(page), C.c_uint64(0),
                              C.c_uint64(0)), "reserve")
    acc = Access(Loc(1, 0), 3)

    def setup(ht=1, size=page, count=n):
        pr = Prop()
        pr.type, pr.handle_types, pr.location = 1, ht, Loc(1, 0)
        hs = []
        for i in range(count):
            h = C.c_uint64()
            ok(cu.cuMemCreate(C.byref(h), C.c_size_t(size), C.byref(pr), C.c_uint64(0)), "create")
            a = va.value + i * size
            ok(cu.cuMemMap(C.c_uint64(a), C.c_size_t(size), C.c_size_t(0), h, C.c_uint64(0)), "map")
            ok(cu.cuMemSetAccess(C.c_uint64(a), C.c_size_t(size), C.byref(acc), C.c_size_t(1)), "access")
            hs.append(h.value)
        ok(cu.cuMemsetD8_v2(C.c_uint64(va.value), C.c_ubyte(1), C.c_size_t(size * count)), "memset")
        ok(cu.cuCtxSynchronize(), "sync")
        return hs

    def rel_unmap(hs, size=page, idx=None):
        for i in (idx if idx is not None else range(len(hs))):
            cu.cuMemRelease(C.c_uint64(hs[i]))
            cu.cuMemUnmap(C.c_uint64(va.value + i * size), C.c_size_t(size))

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def variant(name, reps=3):
        def deco(body):
            xs = []
            for _ in range(reps):
                try:
                    xs.append(body())
                except Exception as e:   # one variant failing must not lose the others
                    out[name] = {"error": repr(e)}
                    return body
            out[name] = {"ms": xs, "mean": sum(xs) / len(xs), "gib": n * page / GiB}
            print(name, [round(x, 2) for x in xs], flush=True)
            return body
        return deco

    out: dict = {}

    @variant("release_then_unmap_per_page")
    def _v1():
        hs = setup()
        return timed(lambda: rel_unmap(hs))

    @variant("unmap_then_release_per_page")
    def _v2():
        hs = setup()

        def go():
            for i, h in enumerate(hs):
                cu.cuMemUnmap(C.c_uint64(va.value + i * page), C.c_size_t(page))
                cu.cuMemRelease(C.c_uint64(h))
        return timed(go)

    @variant("unmap_only_handles_kept")
    def _v3():
        hs = setup()
        t = timed(lambda: [cu.cuMemUnmap(C.c_uint64(va.value + i * page), C.c_size_t(page))
                           for i in range(len(hs))])
        out.setdefault("release_after_unmap_ms", []).append(
            timed(lambda: [cu.cuMemRelease(C.c_uint64(h)) for h in hs]))
        return t

    @variant("not_exportable")
    def _v4():
        hs = setup(ht=0)
        return timed(lambda: rel_unmap(hs))

    @variant("one_call_for_the_run")
    def _v5():
        hs = setup()

        def go():
            for h in hs:
                cu.cuMemRelease(C.c_uint64(h))
            cu.cuMemUnmap(C.c_uint64(va.value), C.c_size_t(n * page))
        return timed(go)

    @variant("one_4gib_allocation")
    def _v6():
        hs = setup(size=n * page, count=1)
        return timed(lambda: rel_unmap(hs, size=n * page))

    for mib in (64, 128, 256, 512):   # the same 4 GiB in fewer, larger pages
        k = n * page // (mib * MiB)
        variant(f"pages_of_{mib}_mib")(
            lambda mib=mib, k=k: (lambda hs: timed(lambda: rel_unmap(hs, size=mib * MiB)))(
                setup(size=mib * MiB, count=k)))
        try:   # and what creating, mapping and filling them costs
            t0 = time.perf_counter()
            hs = setup(size=mib * MiB, count=k)
            out[f"pages_of_{mib}_mib"]["create_map_ms"] = (time.perf_counter() - t0) * 1e3
            rel_unmap(hs, size=mib * MiB)
        except Exception as e:
            out[f"pages_of_{mib}_mib_create"] = {"error": repr(e)}

    def threaded(k):
        hs = setup()
        parts = [list(range(j, n, k)) for j in range(k)]

        def work(idx):
            cu.cuCtxSetCurrent(ctx)
            rel_unmap(hs, idx=idx)
        ths = [threading.Thread(target=work, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        return (time.perf_counter() - t0) * 1e3

    for k in (2, 4, 8):
        variant(f"threads_{k}")(lambda k=k: threaded(k))

    side = torch.cuda.Stream()

    @variant("kernel_running_on_another_stream")
    def _v7():
        hs = setup()
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(2e8))   # ~100 ms of spinning on the GPU
        ev = torch.cuda.Event()
        ev.record(side)
        t = timed(lambda: rel_unmap(hs))
        out.setdefault("kernel_still_running_after", []).append(not ev.query())
        torch.cuda.synchronize()
        return t

    # another process keeps the GPU busy (time-sliced contexts, like inference beside training)
    load = subprocess.Popen([sys.executable, "-c", (
        "import torch,time\n"
        "a=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16)\n"
        "end=time.monotonic()+60\n"
        "while time.monotonic()<end:\n"
        "    a@a; torch.cuda.synchronize()\n")])
    time.sleep(8)
    try:
        variant("busy_other_process_release_then_unmap")(_v1)
        variant("busy_other_process_threads_4")(lambda: threaded(4))
    finally:
        load.kill()
        load.wait()
    Path(args.out).write_text(json.dumps(out, indent=1))


# ============================================================== role: GPU priority probe

def role_prio_load(args) -> None:
    """Training as GPU load: Swin-T steps at batch 128 (bf16 autocast) until killed; each step
    appends its end time to --out, so the parent reads the load's throughput in any window."""
    import torch
    from torch import nn
    from torchvision.models import swin_t

    with torch.device("cuda"):
        m = swin_t(num_classes=100)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    x = torch.randn(128, 3, 224, 224, device="cuda")
    y = torch.randint(0, 100, (128,), device="cuda")
    ce = nn.CrossEntropyLoss()
    with open(args.out, "a", buffering=1) as f:
        while True:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ce(m(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            f.write(f"{time.monotonic()}\n")


def role_prio_probe(args) -> None:
    """Inference requests on the default and on a high-priority stream: ResNet-50 at batch 1
    and the benchmark's decoder (512-token prefill, 16 decode steps), 20 ms apart."""
    import torch
    import torchvision.models as tvm

    from hintfs.governor.inference import priority_stream

    dev = torch.device("cuda")
    with torch.device("cuda"):
        rn = tvm.resnet50().to(torch.bfloat16).eval()
        dec = build_decoder().to(torch.bfloat16).eval()
    x = torch.randn(1, 3, 224, 224, device=dev, dtype=torch.bfloat16)
    prompt = torch.randint(0, 32000, (1, 512), device=dev)
    ctx = 1024
    kv = [(torch.zeros(1, ctx, 16, 128, device=dev, dtype=torch.bfloat16),
           torch.zeros(1, ctx, 16, 128, device=dev, dtype=torch.bfloat16)) for _ in range(dec.layers)]

    def resnet():
        rn(x)

    def decoder():
        logits = dec(prompt, kv, 0)
        pos = 512
        for _ in range(16):
            logits = dec(logits.argmax(-1, keepdim=True), kv, pos)
            pos += 1

    streams = {"default": torch.cuda.current_stream(), "high": priority_stream(dev)}
    out = {}
    with torch.inference_mode():
        for fn in (resnet, decoder):   # warm-up
            for _ in range(5):
                fn()
        torch.cuda.synchronize()
        Path(args.out + ".ready").write_text("1")
        while not Path(args.out + ".go").exists():
            time.sleep(0.01)
        for name, fn, n in (("resnet50", resnet, args.prio_iters), ("decoder", decoder, args.prio_iters // 5)):
            for sname, st in streams.items():
                lat = []
                for _ in range(n):
                    time.sleep(0.02)
                    t0 = time.perf_counter()
                    with torch.cuda.stream(st):
                        fn()
                    st.synchronize()
                    lat.append((time.perf_counter() - t0) * 1e3)
                out[f"{name}_{sname}"] = {"n": n, "mean": sum(lat) / n, "p50": pct(lat, 0.5),
                                          "p99": pct(lat, 0.99), "max": max(lat)}
    Path(args.out).write_text(json.dumps(out))


def role_priority(args) -> None:
    """Does inference keep its latency while training runs beside it on the GPU (no pausing at
    safe points)? Probe alone; beside a training load; and under MPS with the load's active
    threads capped (`--mps-caps`). Each probe measures both stream priorities."""
    import tempfile
    work = Path(tempfile.mkdtemp(prefix="gpu-priority-"))   # the children's files, not beside --out
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = {}

    def probe(tag, load_env=None, probe_env=None):
        pf, lf = work / f"prio-{tag}.json", work / f"prio-{tag}-load.txt"
        for f in (pf, Path(str(pf) + ".ready"), Path(str(pf) + ".go"), lf):
            f.unlink(missing_ok=True)
        load = None
        if load_env is not None:
            load = subprocess.Popen([sys.executable, __file__, "--role", "prio_load", "--out", str(lf)],
                                    env=dict(env, **load_env))
        pr = subprocess.Popen([sys.executable, __file__, "--role", "prio_probe", "--out", str(pf),
                               "--prio-iters", str(args.prio_iters)], env=dict(env, **(probe_env or {})))
        try:
            end = time.monotonic() + 120
            while not Path(str(pf) + ".ready").exists() or (load is not None and (
                    not lf.exists() or len(lf.read_text().split()) < 10)):
                if time.monotonic() > end or pr.poll() is not None or (load is not None and load.poll() is not None):
                    return {"error": "probe or load did not start"}
                time.sleep(0.1)
            t0 = time.monotonic()
            Path(str(pf) + ".go").write_text("1")
            pr.wait(timeout=240)
            t1 = time.monotonic()
            r = json.loads(pf.read_text()) if pf.exists() else {"error": "probe failed"}
            if load is not None:
                ts = [float(v) for v in lf.read_text().split()]
                r["load_steps_per_s"] = sum(1 for t in ts if t0 <= t <= t1) / (t1 - t0)
            return r
        finally:
            for p in (pr, load):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()

    # the load's throughput alone, for the ratio
    lf = work / "prio-loadalone.txt"
    lf.unlink(missing_ok=True)
    load = subprocess.Popen([sys.executable, __file__, "--role", "prio_load", "--out", str(lf)], env=env)
    end = time.monotonic() + 120
    while (not lf.exists() or len(lf.read_text().split()) < 10) and time.monotonic() < end and load.poll() is None:
        time.sleep(0.1)
    time.sleep(5)
    ts = [float(v) for v in lf.read_text().split()] if lf.exists() else []
    load.kill()
    load.wait()
    res["load_alone_steps_per_s"] = (sum(1 for t in ts if t >= ts[-1] - 5) / 5) if ts else None
    res["alone"] = probe("alone")
    res["beside_training"] = probe("beside", load_env={})
    if args.mps_caps:
        pipe, logd = work / "mps-pipe", work / "mps-log"
        pipe.mkdir(exist_ok=True)
        logd.mkdir(exist_ok=True)
        menv = dict(env, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(logd))
        r = subprocess.run(["nvidia-cuda-mps-control", "-d"], env=menv, capture_output=True, text=True)
        if r.returncode != 0:
            res["mps_error"] = (r.stderr or r.stdout).strip()[:500]
        else:
            try:
                m = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logd)}
                for cap in args.mps_caps.split(","):
                    res[f"mps_load_cap_{cap}"] = probe(f"mps{cap}", load_env=dict(m, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=cap),
                                                       probe_env=m)
            finally:
                subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", env=menv, text=True, timeout=30)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


# ============================================================== orchestrator

def pct(xs, q):
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_mode(mode, args, trace_path, stress_trace_path, workdir) -> dict:
    from mountconfig.governor import GovernorConfig, GpuConfig

    card = int(args.card_gib * GiB)
    reserve = GiB // 2
    usable = card - reserve
    sock = str(workdir / f"gov-{mode}.sock")   # workdir: 0700, the daemon's locks live there
    shm_name = f"hintfs-bench-{os.getpid()}-{mode}"
    has_inf = mode != "training_alone"
    has_train = mode not in ALONE
    if mode in INFER_SHARE:
        inf_total = int(usable * INFER_SHARE[mode]) + reserve
        train_quota = int(usable * (1 - INFER_SHARE[mode]))
    else:
        inf_total = card
        train_quota = usable
    stress = mode in LONG_KV
    cfg = GovernorConfig(
        socket_path=sock, shm_name=shm_name,
        gpus=[GpuConfig(index=0, total_bytes=inf_total if mode in INFER_SHARE else card,
                        reserve_bytes=reserve)],
        min_training_fraction=0.0 if mode in INFER_SHARE else 0.1,
        min_headroom_bytes=GiB // 2, reclaim_deadline_ms=200, deadline_miss_action="reject",
        keepalive_min_s=2.0, keepalive_max_s=20.0, log_level="WARNING",
        # stress: training grows back into a released KV cache at once and wholly, and the
        # headroom does not keep a whole KV cache back (at 0.99 one arrival within a reclaim
        # already counts), so the next decoder request must take memory training really holds
        **(dict(grow_after_free_s=0.05, grow_step_fraction=1.0, headroom_quantile=0.95) if stress
           else dict(grow_after_free_s=1.0)))
    d = DaemonThread(cfg)
    t0 = time.monotonic() + args.warmup
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = {}
    common = ["--socket", sock, "--shm-name", shm_name, "--t0", repr(t0),
              "--duration", str(args.duration), "--mode", mode,
              "--max-ahead-ms", str(args.max_ahead_ms),
              "--yield-ms", str(args.yield_ms), "--yield-to", MODE_YIELD_TO.get(mode, args.yield_to),
              "--infer-priority", args.infer_priority, "--copy-chunks", str(args.copy_chunks),
              "--early-release", str(args.early_release), "--unmap-threads", str(args.unmap_threads),
              "--page-mib", str(MODE_PAGE_MIB.get(mode, args.page_mib)),
              "--hold-quota", str(int(mode in BIG_HANDOFF)),
              # safe points inside layers only where reclaims drain (the stress modes): with
              # them in every mode, training alone ran 1860 samples/s against 1894-1946 without
              # (bench/results/gpu_sharing_split_everywhere.json and the three runs)
              "--split-ops-kib", str(args.split_ops_kib if mode in LONG_KV else 0),
              "--diag", str(args.diag), "--diag-thresh-ms", str(args.diag_thresh_ms),
              "--switch-ms", str(args.switch_ms), "--warm-sizes", str(args.warm_sizes),
              "--fused-adamw", str(args.fused_adamw)]
    train_env = dict(env)
    if args.train_thread_pct:
        train_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(args.train_thread_pct)
    if has_train:
        procs["train"] = subprocess.Popen(
            [sys.executable, __file__, "--role", "train", "--out", str(workdir / f"{mode}-train.json"),
             "--quota", str(train_quota),
             "--global-batch", str(args.stress_global_batch if mode in LONG_KV else args.global_batch),
             "--max-ahead", str(args.max_ahead),
             "--colocated", str(int(has_inf))] + common, env=train_env)
    if has_inf:
        for kind in SERVERS:
            procs[f"infer-{kind}"] = subprocess.Popen(
                [sys.executable, __file__, "--role", "infer", "--kinds", kind,
                 "--out", str(workdir / f"{mode}-infer-{kind}.json"),
                 "--trace", str(stress_trace_path if stress else trace_path),
                 "--kv-context", str(args.kv_context * ((args.big_kv_mult if mode in BIG_HANDOFF else args.stress_kv_mult) if stress else 1)),
                 "--decode-tokens", str(args.decode_tokens)] + common, env=env)
    series = []
    busy = GpuBusy()
    while any(p.poll() is None for p in procs.values()):
        now = time.monotonic() - t0
        if 0 <= now <= args.duration:
            busy.start()
        elif now > args.duration:
            busy.stop()
        if 0 <= now <= args.duration + 30:
            snap = d.call(lambda: d.daemon._stats(d.daemon.gpus[0]))
            series.append({"t": now, "by_kind": snap["by_kind"],
                           "training_quota": snap["training_bytes"],
                           "inference": snap["inference_bytes"], "free": snap["free_bytes"]})
        time.sleep(0.1)
    d.stop()
    busy.stop()
    res = {"mode": mode, "series": series, "gpu_busy": busy.result(),
           "exit": {k: p.returncode for k, p in procs.items()}}
    f = workdir / f"{mode}-train.json"
    if f.exists():
        res["train"] = json.loads(f.read_text())
    parts = [json.loads(f.read_text()) for kind in SERVERS
             if (f := workdir / f"{mode}-infer-{kind}.json").exists()]
    if parts:  # the servers' results, merged
        res["infer"] = {k: [x for p in parts for x in p.get(k, [])]
                        for k in ("records", "timings", "load_ms", "map_ms", "zero_ms", "memory",
                                  "lent_pages")}
        res["infer"]["events"] = {kind: p.get("events") for kind, p in zip(SERVERS, parts)}
        res["infer"]["records"].sort(key=lambda r: r["t"])
        res["infer"]["servers_done"] = len(parts)
    return res


def adjust_stats(tim: list[dict]) -> dict:
    """Adjustment = command issued → daemon saw the ack (the grant). The split is averaged over
    the reclaims that have one (granted on this command's ack; see GovernorDaemon._timing)."""
    recl = [t["reclaim"] for t in tim]
    split = [t for t in tim if "detect" in t and t["detect"] >= 0]
    return {"n": len(recl), "mean": sum(recl) / len(recl), "p50": pct(recl, 0.5),
            "p99": pct(recl, 0.99), "max": max(recl),
            "split_n": len(split),
            **{f"{k}_mean": (sum(t[k] for t in split) / len(split)) if split else None
               for k in ("detect", "drain", "release", "ack")}}


def is_physical(t: dict) -> bool:
    """The reclaim moved memory: training's held bytes went down (`freed`). Older timings
    without that field count the release path having run."""
    return bool(t.get("freed")) if "freed" in t else bool(t.get("released"))


def physical_reclaims(table: dict) -> dict:
    """Per stress mode: adjustment latency of the reclaims where training gave memory back.
    With n samples the p99 is the sample at rank int(0.99 n): the maximum below n = 100."""
    out = {}
    for m in LONG_KV:
        row = table.get(m) or {}
        rel = row.get("adjust_ms_released")
        if rel:
            out[m] = {"n": rel["n"], "of": row.get("reclaims"),
                      "mean": rel["mean"], "p50": rel["p50"], "p99": rel["p99"], "max": rel["max"],
                      "freed_mib_mean": rel.get("freed_mib_mean"),
                      "split_mean": {k: rel.get(f"{k}_mean")
                                     for k in ("detect", "drain", "release", "ack")}}
    return out


def summarize(results: dict, handoff: dict, args) -> dict:
    # SLO from the solo (warm) service time of the first inference-alone run
    alone = results.get("inference_alone", {}).get("infer", {})
    solo = {}
    for kind in ("resnet50", "vit_b_16", "decoder"):
        warm = [r["service_ms"] for r in alone.get("records", [])
                if r["model"].startswith(kind) and not r["cold"] and r["ok"]]
        solo[kind] = pct(warm, 0.5)
    slo = {k: 4 * v for k, v in solo.items() if v}
    table = {}
    for mode, r in results.items():
        row = {}
        inf = r.get("infer")
        if inf:
            recs = inf["records"]
            lat = [x["latency_ms"] for x in recs]
            met = [x["ok"] and x["latency_ms"] <= slo.get(x["model"].rsplit("-", 1)[0], math.inf)
                   for x in recs]
            row["service_p50_ms"] = {
                k: pct([x["service_ms"] for x in recs if x["model"].startswith(k) and not x["cold"]], 0.5)
                for k in ("resnet50", "vit_b_16", "decoder")}
            row.update(requests=len(recs), slo_attainment=sum(met) / max(len(met), 1),
                       p50_ms=pct(lat, 0.5), p99_ms=pct(lat, 0.99),
                       cold_starts=sum(x["cold"] for x in recs),
                       failed=sum(not x["ok"] for x in recs))
            tim = inf["timings"]
            if tim:
                row["reclaims"] = len(tim)
                row["adjust_ms"] = adjust_stats(tim)
                # only the reclaims where training physically gave memory back
                phys = [t for t in tim if is_physical(t)]
                row["adjust_ms_released"] = adjust_stats(phys) if phys else None
                if phys and any("freed_mib" in t for t in phys):
                    row["adjust_ms_released"]["freed_mib_mean"] = (
                        sum(t.get("freed_mib", 0) for t in phys) / len(phys))
                row["reclaims_released"] = len(phys)
                row["reclaims_release_path"] = sum(bool(t.get("released")) for t in tim)
                row["reclaims_aborted"] = sum(bool(t.get("aborted")) for t in tim)
                row["reclaim_timings"] = tim  # raw, one per reclaim (small)
            lp = inf.get("lent_pages") or []
            row["kv_chunks_on_lent_pages"] = sum(1 for n in lp if n)
            row["kv_lent_pages"] = [n for n in lp if n]   # pages lent per chunk that got any
            row["kv_chunks"] = len(lp)
            for k in ("load_ms", "map_ms", "zero_ms"):
                xs = inf.get(k) or []
                row[k] = {"mean": sum(xs) / len(xs), "p99": pct(xs, 0.99), "n": len(xs)} if xs else None
        tr = r.get("train")
        if tr:
            row["train_samples_per_s"] = tr["samples_per_s"]
            row["train_steps"] = len(tr["steps"])
            row["aborted_micro_batches"] = sum(s["aborted"] for s in tr["steps"])
            mb = [m for s in tr["steps"] for m in s["micro"]]
            row["micro_batch_mean"] = sum(mb) / len(mb) if mb else None
            row["excess_releases"] = sum(s.get("excess_releases", 0) for s in tr["steps"])
            shr = [a for a in tr.get("adjustments", []) if a["cmd"] == 1]
            row["train_side_shrinks"] = {
                w: {"n": len(xs), "detect_max_ms": max(a["detect_ms"] for a in xs)}
                for w in sorted({a.get("where", "") for a in shr})
                if (xs := [a for a in shr if a.get("where", "") == w])}
            # the physical ones, as training saw them: drain = unwind (exception out of the
            # pass, graph freed) + sync (queued kernels finishing)
            row["train_side_released"] = [
                {"where": a.get("where"), "detect": a["detect_ms"],
                 "unwind": a.get("unwind_ms", 0.0), "propagate": a.get("propagate_ms", 0.0),
                 "unwind_cpu": a.get("unwind_cpu_ms", 0.0), "unwind_nivcsw": a.get("unwind_nivcsw", 0),
                 "unwind_gcs": a.get("unwind_gcs", 0), "queued_est": a.get("queued_ms", 0.0),
                 "sync": a["drain_ms"] - a.get("unwind_ms", 0.0), "release": a["release_ms"],
                 "freed_mib": a.get("freed_bytes", 0) / MiB,
                 "early_mib": a.get("early_bytes", 0) / MiB,
                 "micro_batch": a.get("dropped_samples")}
                for a in shr if a.get("released")]
            row["drain_bound_ms"] = tr.get("drain_bound_ms")
            # the safe-point intervals that bound the drain: GPU ms at the mean micro-batch
            mbm = row["micro_batch_mean"] or 0
            row["costliest_intervals"] = [
                {"i": c["i"], "at": c["at"], "ms": c["ms_per_sample"] * mbm}
                for c in sorted(tr.get("interval_costs") or [], key=lambda c: -c["ms_per_sample"])[:10]]
            row["pagealloc_stats"] = tr.get("pagealloc")
            row["train_quota_final"] = tr.get("quota_final")
            if tr.get("diag"):
                row["diag"] = tr["diag"]
                row["diag"]["infer_events"] = (r.get("infer") or {}).get("events")
        row["gpu_busy"] = r.get("gpu_busy")
        row["exit"] = r.get("exit")
        table[mode] = row
    # the better of the two inference-alone runs is the baseline (conservative for the ratio)
    base_slo = max((table.get(m, {}).get("slo_attainment") or 0) for m in ALONE) or None
    best_static = max((table.get(m, {}).get("train_samples_per_s") or 0) for m in INFER_SHARE)
    gov = table.get("governor_mid_backward", {})
    # training's physical limit beside inference: training alone x (1 - the share of GPU time
    # inference alone keeps busy on the same trace, NVML utilization)
    alone_train = (table.get("training_alone") or {}).get("train_samples_per_s")
    busy = ((table.get("inference_alone") or {}).get("gpu_busy") or {}).get("share")
    limit = alone_train * (1 - busy) if alone_train and busy is not None else None
    out = {
        "device": args.device_name, "card_gib_emulated": args.card_gib,
        "duration_s": args.duration, "slo_ms": slo, "modes": table,
        "global_batch": args.global_batch,
        "stress_global_batch": {m: args.stress_global_batch for m in LONG_KV if m in table},
        "adjust_ms": {"mean": (gov.get("adjust_ms") or {}).get("mean"),
                      "p99": (gov.get("adjust_ms") or {}).get("p99"),
                      "n": gov.get("reclaims"),
                      "split_mean": {k: (gov.get("adjust_ms") or {}).get(f"{k}_mean")
                                     for k in ("detect", "drain", "release", "ack")},
                      # inference side, after the grant: allocate the KV chunk, then zero it
                      "map_mean": (gov.get("map_ms") or {}).get("mean"),
                      "zero_mean": (gov.get("zero_ms") or {}).get("mean"),
                      "released_only": gov.get("adjust_ms_released"),
                      "n_released": gov.get("reclaims_released"),
                      "n_aborted": gov.get("reclaims_aborted")},
        "adjust_ms_batch_end": table.get("governor_batch_end", {}).get("adjust_ms"),
        "adjust_ms_long_kv": {k: table.get("governor_mid_backward_long_kv", {}).get(k) for k in
                              ("adjust_ms", "adjust_ms_released", "reclaims", "reclaims_released",
                               "reclaims_aborted", "map_ms", "zero_ms")},
        # the reclaims that physically gave memory back, in the stress modes (at the headline
        # batch every reclaim is covered by slack): caching allocator, page allocator, handoff
        "adjust_ms_physical": physical_reclaims(table),
        "slo_attainment_vs_alone": (gov.get("slo_attainment") / base_slo)
        if base_slo and gov.get("slo_attainment") is not None else None,
        "train_physical_limit": {"training_alone": alone_train, "inference_busy_share": busy,
                                 "busy_samples": ((table.get("inference_alone") or {}).get("gpu_busy") or {}).get("n"),
                                 "samples_per_s": limit},
        "train_vs_physical_limit": (gov.get("train_samples_per_s") / limit)
        if limit and gov.get("train_samples_per_s") else None,
        "train_vs_alone": (gov.get("train_samples_per_s") / alone_train)
        if alone_train and gov.get("train_samples_per_s") else None,
        "settings": {"max_ahead": args.max_ahead, "max_ahead_ms": args.max_ahead_ms,
                     "copy_chunks": args.copy_chunks, "early_release": args.early_release,
                     "unmap_threads": args.unmap_threads, "page_mib": args.page_mib,
                     "split_ops_kib": args.split_ops_kib,
                     "yield_ms": args.yield_ms, "yield_to": args.yield_to, "infer_priority": args.infer_priority,
                     "stress_kv_mult": args.stress_kv_mult,
                     "stress_gap_s": [args.stress_gap_lo, args.stress_gap_hi],
                     "diag": args.diag, "train_thread_pct": args.train_thread_pct,
                     "switch_ms": args.switch_ms, "warm_sizes": args.warm_sizes,
                     "fused_adamw": args.fused_adamw},
        "train_throughput_vs_best_static": (gov.get("train_samples_per_s") / best_static)
        if best_static and gov.get("train_samples_per_s") else None,
        "page_handoff": handoff,
        # the same stress mode with training's memory behind the page allocator
        "paged_vs_caching_long_kv": {
            m: {k: table.get(m, {}).get(k) for k in
                ("adjust_ms", "adjust_ms_released", "reclaims", "reclaims_released", "reclaims_aborted",
                 "slo_attainment", "train_samples_per_s", "excess_releases", "map_ms", "zero_ms",
                 "kv_chunks", "kv_chunks_on_lent_pages", "kv_lent_pages")}
            for m in LONG_KV if m in table},
    }
    # the goals of issue 16
    out["goals"] = {
        "adjust_mean_lt_2ms": bool(out["adjust_ms"]["mean"] is not None and out["adjust_ms"]["mean"] < 2),
        "adjust_p99_lt_8ms": bool(out["adjust_ms"]["p99"] is not None and out["adjust_ms"]["p99"] < 8),
        "slo_ge_97pct_of_alone": bool((out["slo_attainment_vs_alone"] or 0) >= 0.97),
        "train_ge_95pct_of_physical_limit": bool((out["train_vs_physical_limit"] or 0) >= 0.95),
    }
    for m, key in (("governor_paged_long_kv", "paged"), ("governor_handoff_long_kv", "handoff")):
        ph = out["adjust_ms_physical"].get(m)
        if m in table:   # reclaims that move memory, through the page allocator / the handoff
            out["goals"][f"physical_{key}_n_ge_50"] = bool(ph and ph["n"] >= 50)
            out["goals"][f"physical_{key}_mean_lt_5ms"] = bool(ph and ph["mean"] < 5)
            out["goals"][f"physical_{key}_p99_lt_11ms"] = bool(ph and ph["p99"] < 11)
    for m in BIG_HANDOFF:   # one reclaim moving >= 12 GiB as lent pages (issue 41)
        row = table.get(m)
        if not row:
            continue
        tim = row.get("reclaim_timings") or []
        big = [t for t in tim if t.get("lent") and t.get("freed_mib", 0) >= 12 * 1024]
        lat = [t["reclaim"] for t in big]
        out["big_handoff"] = {
            "mode": m, "n": len(big), "of": len(tim),
            "freed_gib_max": max((t.get("freed_mib", 0) for t in tim), default=0) / 1024,
            "lent_pages_max": max(row.get("kv_lent_pages") or [0]),
            "page_mib": MODE_PAGE_MIB.get(m, args.page_mib),
            "mean": sum(lat) / len(lat) if lat else None, "p99": pct(lat, 0.99),
            "max": max(lat) if lat else None}
        out["goals"]["handoff_moved_ge_12gib_in_one_reclaim"] = bool(big)
    return out


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    modes = [m for m in ("governor_mid_backward", "governor_mid_backward_long_kv", "governor_paged_long_kv",
                          "governor_handoff_long_kv", "governor_batch_end")
             if results.get(m, {}).get("series")]
    if not modes:
        return False
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 4 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        s = results[mode]["series"]
        t = [p["t"] for p in s]
        kinds = ["weights", "kv_cache", "activations", "optimizer_state", "workspace"]
        ys = [[p["by_kind"][k] / GiB for p in s] for k in kinds]
        ax.stackplot(t, ys, labels=kinds, alpha=0.8)
        ax.plot(t, [p["training_quota"] / GiB for p in s], "k--", lw=1, label="training quota")
        ax.plot(t, [p["inference"] / GiB for p in s], "r-", lw=1, label="inference reserved")
        ax.set_title(f"{mode}: memory by kind (ledger of an emulated card)")
        ax.set_xlabel("s")
        ax.set_ylabel("GiB")
        ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="bench", choices=["bench", "train", "infer", "handoff", "priority",
                                                        "prio_load", "prio_probe", "unmap"])
    ap.add_argument("--prio-iters", type=int, default=150)
    ap.add_argument("--mps-caps", default="50", help="priority role: MPS active-thread caps to try ('' : none)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--card-gib", type=float, default=32.0)
    # 10 modes x (18 s warm-up + 30 s trace + start/stop) + the handoff role: about 9 minutes
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=18.0)
    ap.add_argument("--global-batch", type=int, default=256)
    # The stress modes train a larger global batch: at 256 the page allocator holds less than
    # the caching one and every reclaim is slack, so nothing would be released or handed off.
    ap.add_argument("--stress-global-batch", type=int, default=320)
    ap.add_argument("--kv-context", type=int, default=16384)
    # stress modes: one decoder service with an 8x longer context (12 GiB KV per request),
    # asked every 0.3-0.45 s (its trace: make_stress_trace)
    ap.add_argument("--stress-kv-mult", type=int, default=8)
    # governor_handoff_12g: the decoder's KV cache, x the base context (9: 13.5 GiB a request)
    ap.add_argument("--big-kv-mult", type=int, default=9)
    ap.add_argument("--stress-gap-lo", type=float, default=0.3)
    ap.add_argument("--stress-gap-hi", type=float, default=0.45)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=6)
    ap.add_argument("--modes", default=",".join(MODES))
    # child-only
    ap.add_argument("--socket"); ap.add_argument("--shm-name"); ap.add_argument("--t0", type=float)
    ap.add_argument("--mode"); ap.add_argument("--trace"); ap.add_argument("--quota", type=int)
    ap.add_argument("--colocated", type=int, default=1)
    ap.add_argument("--kinds", default=",".join(SERVERS))
    ap.add_argument("--max-ahead", type=int, default=3)
    # the drain budget: GPU work queued behind a safe point, in ms (0: count only)
    ap.add_argument("--max-ahead-ms", type=float, default=2.0)
    # training pauses at safe points while inference runs, at most this long each time (0: it
    # never pauses; inference's kernels go first through stream priority only) ...
    ap.add_argument("--yield-ms", type=float, default=50.0)
    # ... for every request, or only for those that start cold (weights not resident)
    ap.add_argument("--yield-to", choices=["all", "cold"], default="cold")
    ap.add_argument("--infer-priority", choices=["default", "high"], default="high")
    # training copies each micro-batch's inputs in this many pieces, a safe point after each
    # (the whole 190 MB copy of a micro-batch of 320 was one interval)
    ap.add_argument("--copy-chunks", type=int, default=8)
    # page allocator: release the pages no queued kernel uses at detection, before the drain
    ap.add_argument("--early-release", type=int, default=1)
    ap.add_argument("--unmap-threads", type=int, default=1)
    # the page allocator's page for the paged modes. Returning 4 GiB to the driver took 5.2-8.3
    # ms in 32 MiB pages, 1.8 ms in 256 MiB ones (--role unmap: the driver's cost is mostly per
    # allocation freed; unmapping is ~0.6 ms/GiB)
    ap.add_argument("--page-mib", type=int, default=256)
    # training in the stress modes: a safe point after each op whose output is at least this
    # many KiB per sample, and at its gradient (0: module boundaries only); splits Swin's
    # 5-7 ms attention intervals. The other modes keep module boundaries (it costs throughput)
    ap.add_argument("--split-ops-kib", type=int, default=256)
    # diagnostics: stamp the trainer's safe points and sample its threads' stacks while a command
    # waits unseen longer than --diag-thresh-ms (bench/stackwatch.c); servers log their phases
    ap.add_argument("--diag", type=int, default=0)
    ap.add_argument("--diag-thresh-ms", type=float, default=2.5)
    ap.add_argument("--skip-handoff-probe", action="store_true")
    # MPS (the caller starts nvidia-cuda-mps-control): the trainer's active-thread percentage
    ap.add_argument("--train-thread-pct", type=int, default=0)
    # the trainer's sys.setswitchinterval in ms (0: Python's default, 5 ms)
    ap.add_argument("--switch-ms", type=float, default=0.0)
    # the trainer's warm-up before the clock (ElasticTrainer.warm_up, splits=N): the micro-batch
    # sizes of the N coarsest equal splits (ceil and floor of gb/1..gb/N) and one abort per pass
    # (0: only the probe step), and AdamW fused (1) or foreach (0)
    ap.add_argument("--warm-sizes", type=int, default=4)
    # governed trainer: after each step map empty pages up to its quota (governor_handoff_12g)
    ap.add_argument("--hold-quota", type=int, default=0)
    ap.add_argument("--fused-adamw", type=int, default=1)
    args = ap.parse_args()
    if args.role == "infer":
        role_infer(args); return 0
    if args.role == "train":
        role_train(args); return 0
    if args.role == "handoff":
        role_handoff(args); return 0
    if args.role == "priority":
        role_priority(args); return 0
    if args.role == "prio_load":
        role_prio_load(args); return 0
    if args.role == "prio_probe":
        role_prio_probe(args); return 0
    if args.role == "unmap":
        role_unmap(args); return 0
    if args.quick:
        args.duration = min(args.duration, 15.0)
    import torch
    args.device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_sharing-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o700)   # the governor's socket folder: writable by its user only (docs/governor.md)
    trace = make_trace(args.seed, args.duration, instance_names(4))
    trace_path = work / "trace.json"
    trace_path.write_text(json.dumps(trace))
    stress_path = work / "stress_trace.json"
    stress_path.write_text(json.dumps(make_stress_trace(trace, args.seed, args.duration,
                                                        (args.stress_gap_lo, args.stress_gap_hi))))
    results = {}
    if torch.cuda.is_available():  # bring the GPU to steady clocks before the first mode
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            a @ a
            torch.cuda.synchronize()
        del a
        torch.cuda.empty_cache()
    t_start = time.monotonic()
    for mode in args.modes.split(","):
        print(f"== {mode} ({time.monotonic() - t_start:.0f} s)", flush=True)
        try:
            results[mode] = run_mode(mode, args, trace_path, stress_path, work)
        except Exception as e:  # one broken mode must not lose the others
            print(f"mode {mode} failed: {e!r}", flush=True)
            results[mode] = {"mode": mode, "error": repr(e)}
        (out_dir / "gpu_sharing_partial.json").write_text(json.dumps(
            summarize(results, {}, args), indent=1))
        stacks = work / f"{mode}-train.json.stacks.jsonl"
        if stacks.exists():   # --diag: the trainer's thread samples
            os.replace(stacks, out_dir / f"stacks-{mode}.jsonl")
    handoff = {"skipped": True}
    if not args.skip_handoff_probe:
        print(f"== page handoff ({time.monotonic() - t_start:.0f} s)", flush=True)
        hp = work / "handoff.json"
        subprocess.run([sys.executable, __file__, "--role", "handoff", "--out", str(hp)], timeout=120)
        handoff = json.loads(hp.read_text()) if hp.exists() else {"error": "handoff role failed"}
    summary = summarize(results, handoff, args)
    (out_dir / "gpu_sharing.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "gpu_sharing_series.json").write_text(json.dumps(
        {m: {"series": r.get("series"), "train_memory": r.get("train", {}).get("memory"),
             "infer_memory": r.get("infer", {}).get("memory"),
             "infer_records": r.get("infer", {}).get("records"),
             "adjustments": r.get("infer", {}).get("timings"),
             "train_steps": r.get("train", {}).get("steps")} for m, r in results.items()}))
    plot(results, out_dir / "gpu_sharing.png")
    (out_dir / "gpu_sharing_partial.json").unlink(missing_ok=True)
    print(f"{'mode':30} {'SLO':>6} {'p50ms':>7} {'p99ms (n)':>14} {'train/s':>8} {'busy':>5}"
          f" {'adj mean/p99 ms (n)':>20} {'physical mean/p99 ms (n)':>25}")
    nan = float("nan")
    for mode, row in summary["modes"].items():
        adj, ph = row.get("adjust_ms"), row.get("adjust_ms_released")
        adj_s = "%.2f/%.2f (%d)" % (adj["mean"], adj["p99"], adj["n"]) if adj else "-"
        ph_s = "%.2f/%.2f (%d)" % (ph["mean"], ph["p99"], ph["n"]) if ph else "-"
        p99 = "%.1f (%d)" % (row["p99_ms"], row["requests"]) if row.get("p99_ms") else "-"
        b = (row.get("gpu_busy") or {}).get("share")
        print(f"{mode:30} {row.get('slo_attainment', nan):6.3f} {row.get('p50_ms') or nan:7.1f} "
              f"{p99:>14} {row.get('train_samples_per_s') or nan:8.1f} "
              f"{b if b is not None else nan:5.3f} {adj_s:>20} {ph_s:>25}")
    print(json.dumps({k: summary.get(k) for k in ("adjust_ms", "adjust_ms_physical", "slo_attainment_vs_alone",
                                                  "train_physical_limit", "train_vs_physical_limit",
                                                  "train_vs_alone", "big_handoff", "goals")}))
    print(f"total {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

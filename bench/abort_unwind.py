"""Where an aborted micro-batch's time goes between the safe point and the synchronize.

A shrink seen at a safe point raises ShrinkRequested; the trainer then drains the GPU and
releases. The daemon's `drain` covers everything from the safe point to the end of the
synchronize. This script splits it, over many aborts at random safe points of Swin-T steps
(bf16 autocast, as bench/gpu_sharing.py trains):
  propagate  safe point → the exception has left forward/backward (autograd's engine included)
  free       → the trainer handles the command (the micro-batch's graph and partial grads freed)
  sync       → the GPU finished the queued kernels
  release    → memory given back (empty_cache, or the page allocator's partial release)
and counts garbage collections that ran inside the window.

    python3 bench/abort_unwind.py --out /tmp/unwind.json            # torch's caching allocator
    python3 bench/abort_unwind.py --paged --out /tmp/unwind_p.json  # the page allocator
Needs CUDA and torchvision.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--paged", action="store_true")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=320)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-ahead", type=int, default=3)
    ap.add_argument("--max-ahead-ms", type=float, default=0.0, help="drain budget (0: count only)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu-smoke", action="store_true", help="a small MLP on the CPU (checks the script)")
    args = ap.parse_args()
    if args.paged:
        from hintfs.governor import pagealloc
        pagealloc.install(0)
    import torch
    from torch import nn

    from hintfs.governor.protocol import (
        CMD_GROW, CMD_SHRINK, W_QUOTA, W_T_DETECT, ControlBlock, SlotReader, SlotWriter, now_ns,
    )
    from hintfs.governor.training import ElasticTrainer, ShrinkRequested

    dev = "cpu" if args.cpu_smoke else "cuda"
    if args.cpu_smoke:
        model = nn.Sequential(nn.Flatten(), *[nn.Sequential(nn.Linear(3 * 224 * 224 if i == 0 else 256, 256),
                                                            nn.GELU()) for i in range(6)],
                              nn.Linear(256, 100))
    else:
        from torchvision.models import swin_t
        with torch.device("cuda"):
            model = swin_t(num_classes=100)

    class Autocast(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=not args.cpu_smoke):
                return self.m(x)

    ce = nn.CrossEntropyLoss(reduction="sum")
    wrapped = Autocast(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tmpdir = tempfile.TemporaryDirectory()   # the control block's file; removed at exit
    tmp = Path(tmpdir.name)
    block = ControlBlock(tmp / "blk", create=True, max_clients=1)   # a real slot; we are the daemon
    block.slot(0)[W_QUOTA] = 1 << 40
    ctl, daemon = SlotReader(block.slot(0)), SlotWriter(block.slot(0))
    t = ElasticTrainer(wrapped, opt, lambda o, y: ce(o.float(), y), control=ctl, quota=1 << 40,
                       probe_batch=16, max_ahead=args.max_ahead, device=dev,
                       max_ahead_ms=args.max_ahead_ms or None)
    x = torch.randn(args.batch, 3, 224, 224)
    y = torch.randint(0, 100, (args.batch,))
    if not args.cpu_smoke:
        x, y = x.pin_memory(), y.pin_memory()
    t.step(x[:48], y[:48])
    seen = [0]
    orig_safe_point = t._safe_point

    def counting_safe_point(where="forward"):
        seen[0] += 1
        if seen[0] == post_at[0]:   # the daemon's side: post the shrink at this safe point
            daemon.command(CMD_SHRINK, post_at[1])
        return orig_safe_point(where)

    post_at = [0, 0]
    t._safe_point = counting_safe_point
    t.step(x, y)
    per_step = seen[0]   # safe points of one full-batch micro-batch, forward and backward
    full = t.probe.reserved()   # held at the full batch: every shrink asks for 60% of it
    t.wait_gpu()
    gc.collect()
    gc.freeze()

    stamps: dict[str, int] = {}
    orig_micro, orig_handle = t._micro_batch, t._handle_command

    def micro(xb, yb):
        try:
            return orig_micro(xb, yb)
        except ShrinkRequested:
            stamps["caught"] = now_ns()
            raise

    def handle(cmd, dropped, where="poll"):
        if cmd.cmd == CMD_SHRINK and dropped:
            stamps["handle"] = now_ns()
            stamps["detect"] = int(ctl.slot[W_T_DETECT])   # the safe point's stamp
        return orig_handle(cmd, dropped, where)

    # the step time without aborts, for the cost of the bound on running ahead
    import time
    t.step(x, y)
    t.wait_gpu()
    t0 = time.perf_counter()
    for _ in range(5):
        t.step(x, y)
    t.wait_gpu()
    step_ms = (time.perf_counter() - t0) / 5 * 1e3
    t._micro_batch, t._handle_command = micro, handle
    collections: list[tuple[int, int]] = []
    gc.callbacks.append(lambda phase, info: collections.append((now_ns(), info["generation"]))
                        if phase == "start" else None)
    rng = random.Random(args.seed)
    rows = []
    for _ in range(args.steps):
        seen[0] = 0
        post_at[:] = [rng.randrange(1, per_step + 1), int(full * 0.6)]
        stamps.clear()
        collections.clear()
        r = t.step(x, y)
        t.wait_gpu()
        daemon.command(CMD_GROW, 1 << 40)   # back to the full batch for the next step
        t.poll()
        for a in r.adjustments:
            if a.cmd != CMD_SHRINK or not a.where.startswith("abort"):
                continue
            detect = stamps["detect"]
            rows.append({
                "where": a.where, "micro_batch": a.dropped_samples, "released": a.released,
                "propagate": (stamps["caught"] - detect) / 1e6,
                "free": (stamps["handle"] - stamps["caught"]) / 1e6,
                "sync": a.drain_ms - a.unwind_ms, "release": a.release_ms,
                "drain": a.drain_ms,
                "gc_in_window": [g for ts, g in collections if detect <= ts <= stamps["handle"]]})
    out = {"allocator": "page allocator" if args.paged else "caching", "batch": args.batch,
           "max_ahead": args.max_ahead, "max_ahead_ms": args.max_ahead_ms, "step_ms": step_ms,
           "drain_bound_ms": t.drain_bound_ms(), "aborts": rows}
    for part in ("propagate", "free", "sync", "release", "drain"):
        xs = sorted(r[part] for r in rows)
        if xs:
            out[part] = {"mean": sum(xs) / len(xs), "max": xs[-1],
                         "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))]}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "aborts"}))
    for r in rows:
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run by test_gpu.py in a fresh process (the page allocator must be torch's allocator before
CUDA starts): a mid-backward shrink through the page allocator, then pages lent to another
process. Prints one JSON object."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from hintfs.governor import pagealloc  # noqa: E402

alloc = pagealloc.install(0, export_fds=True)   # pages exported at creation: lending is cheap

import torch  # noqa: E402
from torch import nn  # noqa: E402

from hintfs.governor.protocol import CMD_SHRINK  # noqa: E402
from hintfs.governor.training import ElasticTrainer, PagedMemoryProbe  # noqa: E402
from governor_simdevice import ScriptedControl  # noqa: E402

GiB = 1 << 30
PAGE = alloc.page_bytes


def model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(4096, 4096), nn.GELU()) for _ in range(8)],
                         nn.Linear(4096, 10)).cuda()


class Capture(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        self.grads = [p.grad.clone() for g in self.param_groups for p in g["params"]]


BORROWER = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from hintfs.governor import vmm_pool as vp
fds = [int(f) for f in sys.argv[2].split(",")]
page = int(sys.argv[3])
vp.ensure_context(0)
t0 = time.perf_counter_ns()
pool = vp.PagePool.import_fds(0, fds, page)
m = pool.map(list(range(len(fds))))
t1 = time.perf_counter_ns()
t = vp.as_tensor(m)
before = int(t.count_nonzero())   # the old owner's bytes are still there: zeroing is mandatory
torch.cuda.synchronize()
t1z = time.perf_counter_ns()
pool.zero(m)
vp.cu.cuCtxSynchronize()
t2 = time.perf_counter_ns()
after = int(t.count_nonzero())
del t
pool.release()
print(json.dumps({"bytes": len(fds) * page, "nonzero_before_zero": before, "nonzero_after_zero": after,
                  "import_map_ms": (t1 - t0) / 1e6, "zero_ms": (t2 - t1z) / 1e6}))
"""


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    out: dict = {}
    x = torch.randn(8192, 4096)
    y = torch.randint(0, 10, (8192,))
    ce = nn.CrossEntropyLoss(reduction="sum")
    ref_m = model()
    ref_opt = Capture(ref_m.parameters())
    t = ElasticTrainer(ref_m, ref_opt, ce, quota=1 << 40, probe_batch=4096)
    out["default_probe_is_paged"] = isinstance(t.probe, PagedMemoryProbe)
    t.step(x, y)
    del t
    alloc.release(0)

    m = model()
    opt = Capture(m.parameters())
    fixed = alloc.stats()["mapped"]
    target = fixed + GiB

    class WhenOverTarget(ScriptedControl):
        """Posts the shrink at the first safe point where more than target + 512 MiB is mapped
        (inside the micro-batch), so its pages must really be unmapped to get under it."""

        def pending(self):
            if not self.posted and alloc.mapped() > target + GiB // 2:
                self.posted = True
                self.writer.command(CMD_SHRINK, target)
            return self.reader.pending()

    ctl = WhenOverTarget(Path(sys.argv[1]) / "blk", {}, quota=1 << 40)
    ctl.posted = False
    # one micro-batch of 8192 samples (~2.4 GB of activations)
    tr = ElasticTrainer(m, opt, ce, control=ctl, quota=1 << 40, probe_batch=8192, layers=list(m.children()))
    res = tr.step(x, y)
    out["mapped_peak_before_shrink"] = alloc.stats()["peak_mapped"]
    shrink = [a for a in res.adjustments if a.cmd == CMD_SHRINK][0]
    num = sum(((a - b) ** 2).sum() for a, b in zip(opt.grads, ref_opt.grads)) ** 0.5
    den = sum((b ** 2).sum() for b in ref_opt.grads) ** 0.5
    out.update(aborted=res.aborted, used_after=shrink.used_after, target=target, fixed=fixed,
               drain_ms=shrink.drain_ms, release_ms=shrink.release_ms, released=shrink.released,
               rel_err=float(num / den), stats=alloc.stats())

    # a release of adjacent pages (one cuMemUnmap for the run) really gives them to the driver
    big = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    del big
    free0 = torch.cuda.mem_get_info()[0]
    s0 = alloc.stats()
    t0 = time.perf_counter_ns()
    got = alloc.release(s0["mapped"] - 2 * GiB)
    out["run_release_ms"] = (time.perf_counter_ns() - t0) / 1e6
    s1 = alloc.stats()
    out.update(run_released=got, driver_free_gain=torch.cuda.mem_get_info()[0] - free0,
               run_unmaps=s1["unmaps"] - s0["unmaps"], run_unmap_calls=s1["unmap_calls"] - s0["unmap_calls"])

    # lend 1 GiB of pages that held training data to another process
    big = torch.full((GiB,), 0xAB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    del big
    mapped = alloc.stats()["mapped"]
    unmap_ns = alloc.stats()["unmap_ns"]
    t0 = time.perf_counter_ns()
    fds = alloc.lend(mapped - GiB, GiB // PAGE)
    out["lend_ms"] = (time.perf_counter_ns() - t0) / 1e6
    out["lend_pages_ms"] = (alloc.stats()["unmap_ns"] - unmap_ns) / 1e6   # export+unmap+release, no sync
    out["lent_pages"] = len(fds)
    r = subprocess.run([sys.executable, "-c", BORROWER, str(ROOT), ",".join(map(str, fds)), str(PAGE)],
                       pass_fds=fds, capture_output=True, text=True, timeout=120)
    for fd in fds:
        os.close(fd)
    out["borrower"] = json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-2000:]}
    # training keeps working after lending: new pages are mapped on demand
    z = torch.ones(GiB // 4, device="cuda")
    out["after_lend_sum"] = float(z.sum())
    print(json.dumps(out))


if __name__ == "__main__":
    main()

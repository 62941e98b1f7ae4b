"""CPU of one peer copy, copy after copy, between two real `hintfs agent` processes on loopback.

The hot set's fan-out (bench/scale_storm.py, phase `ready`) is 256 peer copies among 128 agents;
on a lent 16-core machine its first hint after the cluster's start cost its agents 4x the CPU of
the third (31.8 against 7.7 CPU-s). This bench asks whether that is a per-process warm-up (the
first copies an agent makes or serves) and what one copy costs once warm: agent A holds
`--files` files of `--mb` MB (copied from the store first), and agent B copies them from A one by
one; each copy's CPU seconds at B and at A are read from /proc around it.

    sudo .venv/bin/python bench/peer_copy_cost.py [--files 12] [--mb 3.9] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers.agent_process import AgentProcess  # noqa: E402
from tests.helpers.procs import proc_cpu_s, rss_mib  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_s(pid: int) -> float:
    """On-CPU seconds of the process's live threads (schedstat: ns, where /proc/PID/stat counts
    10 ms ticks; a thread that ends between two reads takes its time with it)."""
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=12)
    ap.add_argument("--mb", type=float, default=3.9, help="each file's size (rank 0's file of the storm: 3.9 MB)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "peer_copy_cost.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hintfs-peercopy-") as tmp:
        root = Path(tmp)
        store = root / "store"
        store.mkdir()
        size = int(args.mb * 1e6)
        names = [f"ckpt/f{i:03d}.distcp" for i in range(args.files)]
        for n in names:
            (store / n).parent.mkdir(parents=True, exist_ok=True)
            (store / n).write_bytes(os.urandom(size))
        (root / "a").mkdir()
        (root / "b").mkdir()
        a, b = AgentProcess(root / "a", store), AgentProcess(root / "b", store)
        peers = f'[agents]\nlocations = ["{a.location}", "{b.location}"]\ntoken_file = "{a.token_file}"\n'
        b.token_file.write_text(a.token_file.read_text())
        for ag in (a, b):
            ag.cfg.write_text(ag.cfg.read_text().replace("[logging]", peers + "[logging]"))
        ca = a.start()
        try:
            cb = b.start()
            try:
                for n in names:
                    ca.replicate(n, 3600.0)
                rows = []
                cpu0 = {k: proc_cpu_s(ag.p.pid) for k, ag in (("src", a), ("dest", b))}
                for i, n in enumerate(names):
                    a0, b0, t0 = cpu_s(a.p.pid), cpu_s(b.p.pid), time.monotonic()
                    rep = cb.replicate(n, 3600.0, source=a.location)
                    wall = time.monotonic() - t0
                    rows.append({"copy": i + 1, "dest_cpu_ms": round(1e3 * (cpu_s(b.p.pid) - b0), 1),
                                 "src_cpu_ms": round(1e3 * (cpu_s(a.p.pid) - a0), 1),
                                 "wall_ms": round(1e3 * wall, 1), "already": rep.already})
                    print(json.dumps(rows[-1]), flush=True)
                rss_mb = {k: round(rss_mib(ag.p.pid), 1) for k, ag in (("src", a), ("dest", b))}
                # all copies together from /proc/PID/stat (threads that ended included; 10 ms ticks)
                per_copy_ms = {k: round(1e3 * (proc_cpu_s(ag.p.pid) - cpu0[k]) / len(names), 1)
                               for k, ag in (("src", a), ("dest", b))}
            finally:
                cb.close()
                b.stop()
        finally:
            ca.close()
            a.stop()
    late = sorted(r["dest_cpu_ms"] + r["src_cpu_ms"] for r in rows[len(rows) // 2:])
    out = {"benchmark": "peer_copy_cost", "argv": sys.argv[1:], "bytes": size, "cpus": len(os.sched_getaffinity(0)),
           "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "rss_mb_at_end": rss_mb,
           "mean_cpu_ms_per_copy": per_copy_ms,
           "rows": rows, "first_copy_cpu_ms": rows[0]["dest_cpu_ms"] + rows[0]["src_cpu_ms"],
           "later_half_median_cpu_ms": late[len(late) // 2], "n_later": len(late)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

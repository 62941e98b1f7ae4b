"""How much of a busy CPU a niced stream sender takes from the job (docs/cross_dc.md "The sender
process"): the job, a CPU-bound loop in this process's session, shares one CPU with a CPU-bound
"sender", the child of a "mount" that leads a session of its own (as `hintfs mount` does).

- `mount-session`: the sender at `--nice` in the mount's session, as before 2026-12-03.
- `own-autogroup`: the sender calls `fusefs.stream.sender.nice_against_the_job(nice)`, as now.

Prints the job's share of the CPU per rep and their mean; writes bench/results/sender_share.json.

    python bench/sender_share.py [--reps 5] [--seconds 1] [--nice 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"

# the "mount": leads a session of its own, starts the "sender", waits for it
MOUNT = """
import subprocess, sys
sys.exit(subprocess.run([sys.executable, "-c", sys.argv[1], *sys.argv[2:]]).returncode)
"""
# the "sender": niced, then (own-autogroup) its own session's group niced too; then busy
SENDER = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
os.setpriority(os.PRIO_PROCESS, 0, int(sys.argv[4]))
if sys.argv[2] == "own-autogroup":
    from fusefs.stream.sender import nice_against_the_job
    nice_against_the_job(int(sys.argv[4]))
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    pass
"""


def job_share(layout: str, seconds: float, nice: int) -> float:
    """The job's CPU seconds over `seconds` of wall time, beside a busy sender, on one CPU."""
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, [cpu])         # the children inherit it
    mount = subprocess.Popen([sys.executable, "-c", MOUNT, SENDER, str(REPO), layout, str(seconds + 1.0),
                              str(nice)],
                             start_new_session=True)
    try:
        time.sleep(0.3)                    # the sender is up and busy
        c0, t0 = time.process_time(), time.monotonic()
        while time.monotonic() - t0 < seconds:
            pass
        return (time.process_time() - c0) / (time.monotonic() - t0)
    finally:
        mount.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--nice", type=int, default=5, help="the sender's niceness ([stream] sender_nice; its "
                    "default is 5)")
    ap.add_argument("--out", default=str(RESULTS / "sender_share.json"))
    a = ap.parse_args()
    out: dict = {"config": {"reps": a.reps, "seconds": a.seconds, "nice": a.nice, "kernel": os.uname().release,
                            "autogroup": Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
                            if Path("/proc/sys/kernel/sched_autogroup_enabled").exists() else None},
                 "job_share": {}}
    for layout in ("mount-session", "own-autogroup"):
        shares = []
        for _ in range(a.reps):
            shares.append(round(job_share(layout, a.seconds, a.nice), 3))
        out["job_share"][layout] = {"n": len(shares), "mean": round(statistics.mean(shares), 3), "reps": shares}
        print(f"{layout}: the job's share of its CPU, n={len(shares)}: mean {statistics.mean(shares):.3f} "
              f"{shares}", flush=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

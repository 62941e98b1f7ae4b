"""A day compressed (issue 37, item 4): `tests/helpers/soak.py` run for hours. One store, two
storage agents and two mounts (training and eval) as real processes; a checkpoint every 30 s,
evals every 10 s, a restart storm every 10 minutes, a restart (agent or eval mount) every 5
minutes, one SIGKILL (agent or eval mount) every 30 minutes; each daemon's RSS, fds, threads and
CPU sampled every 10 s. Reports errors a user would have seen that the plan did not inject, lost
files (every kept checkpoint read back at the end, from the store and through the mount) and
drift (last quarter over second quarter, per daemon role; the largest).

    sudo .venv/bin/python bench/soak.py                       # 2 hours: bench/results/soak.json
    sudo .venv/bin/python bench/soak.py --duration-s 600 --out /tmp/soak.json

Each eval also reads 4 JPEGs as `.tensor` through the eval mount. Not in it yet: the cross-DC
tier, network namespaces.
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.soak import Soak, SoakPlan  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "soak.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=7200.0)
    ap.add_argument("--files", type=int, default=16, help="files per checkpoint")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # unwinds: mounts and agents stopped
    base = Path(tempfile.mkdtemp(prefix="hintfs-soak-"))
    try:
        soak = Soak(base, SoakPlan(args.duration_s, files_per_checkpoint=args.files, seed=args.seed),
                    log=lambda line: print(line, flush=True))
        result = soak.run()
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    result["benchmark"] = "soak"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("duration_s", "lost_files", "drift", "kills", "restarts", "ops")}))
    print(f"errors: {len(result['errors'])}")
    return 1 if result["errors"] or result["lost_files"] else 0


if __name__ == "__main__":
    sys.exit(main())

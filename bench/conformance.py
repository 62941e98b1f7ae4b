"""POSIX conformance side by side: pjdfstest on hintfs (file:// store) and on bindfs.

    sudo .venv/bin/python bench/conformance.py PJDFSTEST_DIR [--groups mkdir,open] [--jobs 8]

PJDFSTEST_DIR (or the PJDFSTEST environment variable) is a built pjdfstest checkout: the
`pjdfstest` binary next to its `tests/` folder (bench/README.md says how to get it; nothing of it
is part of this repository). Both mounts sit over folders of one private tmpfs (the same backing
filesystem type); each test file runs in a fresh subfolder of the mount, as root, with TAP output
parsed here (a test planned but never reported counts as failed; a file that runs past
`--timeout` counts all its unreported tests as failed). The table of failing tests per group
(total, hintfs, bindfs, ratio) is printed and written to bench/results/conformance.json.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HINTFS = [sys.executable, "-m", "hintfs.cli"]
_PLAN = re.compile(r"^1\.\.(\d+)")
_RESULT = re.compile(r"^(not ok|ok)\b(?:\s+(\d+))?")


def run_file(test: Path, cwd: Path, timeout: float) -> dict:
    """Run one pjdfstest `.t` file in `cwd`; count planned, passed and failed tests."""
    cwd.mkdir()
    t0 = time.monotonic()
    try:
        proc = subprocess.run(["/bin/sh", str(test)], cwd=cwd, capture_output=True, text=True,
                              timeout=timeout, errors="replace")
        out, timed_out = proc.stdout, False
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        timed_out = True
    planned = ok = failed = 0
    failures = []
    for line in out.splitlines():
        m = _PLAN.match(line)
        if m:
            planned = int(m.group(1))
            continue
        m = _RESULT.match(line)
        if m:
            # TAP: a `# TODO` test is expected to fail (pjdfstest marks known Linux deviations
            # so), a `# SKIP` one was not run; neither counts as failed (as `prove` counts them).
            directive = line.partition("#")[2].strip().upper()
            if m.group(1) == "ok" or directive.startswith(("TODO", "SKIP")):
                ok += 1
            else:
                failed += 1
                failures.append(line.strip()[:200])
    missing = max(0, planned - ok - failed)
    return {"file": str(test), "planned": planned, "ok": ok, "failed": failed + missing,
            "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 1), "failures": failures[:20]}


def run_suite(tests: list[Path], tests_dir: Path, root: Path, jobs: int, timeout: float) -> dict[str, dict]:
    out: dict[str, dict] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futs = {pool.submit(run_file, t, root / f"t{i}", timeout): t for i, t in enumerate(tests)}
        for fut in concurrent.futures.as_completed(futs):
            t = futs[fut]
            out[str(t.relative_to(tests_dir))] = fut.result()
    return out


def group_table(results: dict[str, dict[str, dict]]) -> list[dict]:
    groups: dict[str, dict] = {}
    for fs_name, per_file in results.items():
        for rel, r in per_file.items():
            g = groups.setdefault(rel.split("/")[0], {"group": rel.split("/")[0], "total": 0})
            if fs_name == "hintfs":
                g["total"] += r["planned"]
            g[fs_name] = g.get(fs_name, 0) + r["failed"]
    rows = sorted(groups.values(), key=lambda g: g["group"])
    total = {"group": "ALL", "total": sum(g["total"] for g in rows)}
    for fs_name in results:
        total[fs_name] = sum(g.get(fs_name, 0) for g in rows)
    rows.append(total)
    for g in rows:
        h, b = g.get("hintfs"), g.get("bindfs")
        g["ratio"] = None if h is None or b is None else (round(h / b, 2) if b else (1.0 if h == 0 else None))
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'group':<16} {'total':>6} {'hintfs':>7} {'bindfs':>7} {'ratio':>6}")
    for g in rows:
        ratio = "-" if g["ratio"] is None else f"{g['ratio']:.2f}"
        print(f"{g['group']:<16} {g['total']:>6} {g.get('hintfs', '-'):>7} {g.get('bindfs', '-'):>7} {ratio:>6}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pjdfstest", nargs="?", default=os.environ.get("PJDFSTEST"),
                   help="a built pjdfstest checkout (binary `pjdfstest` beside `tests/`); or $PJDFSTEST")
    p.add_argument("--groups", default="", help="comma-separated test groups (default: all)")
    p.add_argument("--jobs", type=int, default=8, help="test files run at once per mount")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per test file")
    p.add_argument("--only", choices=["hintfs", "bindfs"], help="run one side only")
    p.add_argument("--output", default=str(REPO / "bench" / "results" / "conformance.json"))
    args = p.parse_args(argv)
    if not args.pjdfstest:
        p.error("give the pjdfstest checkout as an argument or in PJDFSTEST")
    pjd = Path(args.pjdfstest).resolve()
    tests_dir = pjd / "tests"
    if not (pjd / "pjdfstest").is_file() or not tests_dir.is_dir():
        p.error(f"{pjd} has no built pjdfstest binary beside tests/ (see bench/README.md)")
    if os.geteuid() != 0:
        p.error("pjdfstest must run as root")
    wanted = [g for g in args.groups.split(",") if g]
    tests = sorted(t for t in tests_dir.rglob("*.t") if not wanted or t.relative_to(tests_dir).parts[0] in wanted)
    sides = [args.only] if args.only else ["hintfs", "bindfs"]

    base = Path(tempfile.mkdtemp(prefix="hintfs-conformance-"))
    backing = base / "backing"
    backing.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g,mode=0755", "tmpfs", str(backing)], check=True)
    mounts: list[tuple[str, Path]] = []
    results: dict[str, dict[str, dict]] = {}
    t0 = time.monotonic()
    passthrough = "n/a"
    try:
        for side in sides:
            src = backing / side
            src.mkdir()
            mnt = base / f"mnt-{side}"
            mnt.mkdir()
            if side == "hintfs":
                cfg = base / "hintfs.toml"
                cfg.write_text(f'[store]\nuri = "file://{src}"\n[logging]\nfile = "{base / "hintfs.log"}"\n')
                subprocess.run(HINTFS + ["mount", str(cfg), str(mnt)], check=True, cwd=REPO)
            else:
                subprocess.run(["bindfs", str(src), str(mnt)], check=True)
            mounts.append((side, mnt))
            if side == "hintfs":   # FUSE passthrough on or off (and why) changes what is tested
                passthrough = json.loads((mnt / ".hintfs" / "stats").read_text())["passthrough"]["state"]
                print(f"hintfs passthrough: {passthrough}", file=sys.stderr, flush=True)
            work = mnt / "work"
            work.mkdir()
            print(f"running {len(tests)} test files on {side} ...", file=sys.stderr, flush=True)
            s0 = time.monotonic()
            results[side] = run_suite(tests, tests_dir, work, args.jobs, args.timeout)
            print(f"  {side}: {time.monotonic() - s0:.0f} s", file=sys.stderr, flush=True)
    finally:
        for side, mnt in reversed(mounts):
            if side == "hintfs":
                subprocess.run(HINTFS + ["umount", str(mnt)], cwd=REPO, capture_output=True)
            else:
                subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
            if os.path.ismount(mnt):
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        subprocess.run(["umount", str(backing)], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)

    rows = group_table(results)
    print_table(rows)
    doc = {
        "command": "bench/conformance.py PJDFSTEST_DIR" + (f" --groups {args.groups}" if args.groups else ""),
        "backing": "tmpfs", "jobs": args.jobs, "seconds": round(time.monotonic() - t0),
        "kernel": os.uname().release, "hintfs_passthrough": passthrough,
        "groups": rows,
        "files": {side: {rel: {k: v for k, v in r.items() if k != "file"} for rel, r in sorted(per.items()) if r["failed"]}
                  for side, per in results.items()},
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cross-DC eval at scale (issue 37, item 3): checkpoints of thousands of small files, one after another.

A real DCP checkpoint (`FileSystemWriter(single_file_per_rank=False)`: a file per tensor, ~60% under 16 KiB)
is made once and written `--checkpoints` times as `ckpt/hintfs_stream/main/step_<i>` (data files, then
`.metadata`) through the streaming training mount of `bench/cross_dc_eval.py`'s `Bench` (its S3 gateway,
relay, tier agent with [follow], mounts, writer and merger), `--keep-last` kept in the tier.
- Each checkpoint is merged (`dcp.load` of `--pattern`) through the routed eval mount from its commit on;
  tier-complete = commit -> the follower's `complete_at`. The direct-remote reference: the same merge through
  a mount of S3 without routes, through a third listener of the same relay (same buckets, bytes apart), at the
  first and last checkpoint (and every `--remote-every`-th), after the tier has it.
- `--background-jobs` jobs commit small checkpoints round robin through the copy-after-close mount into
  `ckpt/bg/job<k>` at `--bg-mbit` while the measured ones are written, each deleting those past `--bg-store-keep`.
- Every `--anomaly-every`-th checkpoint is signalled first (severity 3): its commit -> tier-complete against the
  same on the idle link (`idle/step_1`, after an idle warm-up).
- WAN bytes: towards the eval side (store reads, streams; not the reference's), from the first idle checkpoint
  until the background jobs' last commits are in the tier, over the bytes written.

  .venv/bin/python bench/scale_xdc.py --quick      # 2 checkpoints of 256 files, 8 jobs, < 4 min
  .venv/bin/python bench/scale_xdc.py              # 24 x 16,384 files, 200 jobs: hours on 2 vCPUs
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import cross_dc_eval as xdc   # bench/ is the script's folder; it puts the repo on sys.path
import tests.helpers.wan as wan

# Bench's options this bench does not expose: cross_dc_eval.py's defaults.
BASE_ARGS = dict(reps=1, ranks=1, seed_journal=0, eval_nice=0, copy_mount_with_stream=False, first_by_reads=True,
                 others_in_flight=1, others_while_writing=True, stream_poll_ms=20.0, stream_sender="process",
                 stream_sender_nice=5, stream_sender_cpus="inherit", train_host_cache=False, eval_read_ahead_kb=None,
                 floor_sender=None, warm_pages_mb=0, stop_sender_during_write=False, hold_staging=False,
                 no_read_hints=False, rest_s=0.0, link_cpus="all", stream_chunk_kb=1024)

SAVE = textwrap.dedent("""
    import json, sys, torch, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    out, spec, seed = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3])
    g = torch.Generator().manual_seed(seed)
    sd = {name: torch.randn(numel, generator=g) for name, numel in spec}
    # one file per write item (filesystem.py: `for item in plan.items: file_queue.put(... [item])`)
    dcp.save(sd, storage_writer=FileSystemWriter(out, single_file_per_rank=False, sync_files=False), no_dist=True)
""")

# The background jobs' writer (a process: the relay is a thread of the bench's): a checkpoint's files in
# order, then the deletion of the job's checkpoint that left its retention.
WRITE = textwrap.dedent("""
    import json, os, shutil, sys, time
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t0, per_file = time.time(), []
        os.makedirs(req["dst"])
        for n in req["names"]:
            t = time.time()
            shutil.copyfile(os.path.join(req["src"], n), os.path.join(req["dst"], n))
            per_file.append(round(time.time() - t, 4))
        done = time.time()
        if req.get("rm"):
            shutil.rmtree(req["rm"], ignore_errors=True)
        print(json.dumps({"t0": t0, "done": done, "per_file": per_file}), flush=True)
""")

# The tier's completions: `status` without the replica list (their number only: the list of tens of
# thousands was most of the agent's status cost), in a process of its own on the eval side, not
# beside the relay's thread. One line per poll.
POLL = textwrap.dedent("""
    import json, sys, time
    from hintfs.agent.client import AgentClient
    c, every, seen = AgentClient(sys.argv[1]), float(sys.argv[2]), set()
    print("ready", flush=True)
    while True:
        t = time.time()
        try:
            st = c.status(replicas=False)
            f, d = st.follow, st.demand
            new = {p: at for p, at in (f.complete_at if f else {}).items() if p not in seen}
            seen.update(new)
            out = {"t": t, "call_s": round(time.time() - t, 4), "new": new, "replicas": st.replica_count,
                   "queued": f.queued if f else None, "errors": len(f.errors) if f else None,
                   "listings": st.streams.get("versions", {}).get("listings"),
                   "copy_bytes": sum((st.link_bytes_by_class or {}).values()),
                   "demand_bytes": d.get("bytes_fetched", 0) + d.get("bytes_prefetched", 0)}
        except Exception as e:
            out = {"t": t, "error": repr(e)[:300]}
        print(json.dumps(out), flush=True)
        time.sleep(max(every, 4 * (time.time() - t)))   # the agent's status costs grow with its replicas
""")
TIER_KEYS = ("listings", "copy_bytes", "demand_bytes")

SMALL_ROLES = [f"norm{k}.{w}" for k in range(5) for w in ("weight", "bias")]               # 10 of 16: < 16 KiB
LARGE_ROLES = [("attn.q", 1.0), ("attn.k", 1.0), ("attn.v", 1.25), ("attn.o", 1.25), ("mlp.up", 1.5),
               ("mlp.down", 1.5)]                                                             # 6 of 16: larger


def layout(n_tensors: int, total_bytes: int, seed: int = 0) -> list[tuple[str, int]]:
    """(name, float32 elements) of `n_tensors` tensors in blocks of 16 (10 small roles, 6 large), about
    `total_bytes` in all: small ones 1-16 KiB, large ones share the rest by role weight (+-10%)."""
    rng = random.Random(seed)
    roles = [(r, 0.0) for r in SMALL_ROLES] + LARGE_ROLES
    names = [(f"block{b:04d}.{r}", w) for b in range(math.ceil(n_tensors / 16)) for r, w in roles][:n_tensors]
    small = {n: rng.randrange(256, 4096) for n, w in names if not w}
    weights = {n: w * rng.uniform(0.9, 1.1) for n, w in names if w}
    rest = total_bytes // 4 - sum(small.values())
    large = {n: int(rest * w / sum(weights.values())) for n, w in weights.items()}
    if large and min(large.values()) <= 4096:
        need = (sum(small.values()) + 4097 * len(large) * 1.5 / 0.9) * 4 / 2**20
        raise ValueError(f"--checkpoint-mb too small for {n_tensors} tensors (large ones under 16 KiB); "
                         f"use at least {math.ceil(need)}")
    return [(n, small.get(n) or large[n]) for n, _w in names]


def stats(xs: list) -> dict:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": round(statistics.fmean(xs), 4), "median": round(statistics.median(xs), 4),
            "p95": xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))], "max": xs[-1], "min": xs[0]}


def ratio(a, b, nd: int = 4):
    return round(a / b, nd) if a is not None and b else None


class SideRelay(wan.Relay):
    """`Relay` with a third listener towards the store sharing the link's buckets: the direct-remote
    reference reads through it, on the same link, its bytes counted apart (`side_stats`)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._sstats = wan.RelayStats(sample_interval_s=self._stats.sample_interval_s)
        self.side_port: int | None = None

    async def _more_listeners(self, listen, buckets: dict) -> None:
        self.side_port = await listen(0, self.target, self._sstats, buckets)

    def side_stats(self) -> dict:
        return self._snapshot(self._sstats)


class ScaleBench(xdc.Bench):
    def __init__(self, args):
        super().__init__(args)
        shutil.rmtree(self.tmp, ignore_errors=True)     # our scratch folder's name, not hintfs-xdc-*
        self.tmp = Path(tempfile.mkdtemp(prefix="scale_xdc_"))
        if not args.tier_dir:
            self.tier_dir = self.tmp / "tier"
        self.complete_at: dict[str, float] = {}        # checkpoint folder -> when the tier had it (agent clock)
        self.cond = threading.Condition()
        self.poll_last: dict = {}
        self.poll_call_s: list[float] = []
        self.bg_stop = threading.Event()
        self.bg_commits: list[dict] = []
        self.bg_error: str | None = None
        self.watch_until: float | None = None
        self.watch_what, self.watchdog_fired = "", None

    # -- Bench's set-up, with our checkpoint, keep_last and the reference's listener ---------------------
    def make_checkpoint(self) -> Path:
        out, spec = self.tmp / "src_ckpt", self.tmp / "layout.json"
        spec.write_text(json.dumps(layout(self.args.files - 1, self.args.checkpoint_mb << 20)))
        (self.tmp / "save.py").write_text(SAVE)
        t = time.monotonic()
        r = subprocess.run([xdc.PY, str(self.tmp / "save.py"), str(out), str(spec), "0"], cwd=xdc.REPO,
                           capture_output=True, text=True, timeout=1800,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(self.tmp)})
        if r.returncode != 0:
            raise RuntimeError("DCP save failed: " + r.stderr[-2000:])
        self.save_s = round(time.monotonic() - t, 1)
        return out

    def checkpoint_facts(self, src: Path) -> dict:
        from torch.distributed.checkpoint import FileSystemReader
        md = FileSystemReader(str(src)).read_metadata()
        sizes = {k: math.prod(m.size) * m.properties.dtype.itemsize for k, m in md.state_dict_metadata.items()}
        files = {p.name: p.stat().st_size for p in src.iterdir()}
        sub = {k for k in sizes if re.match(self.args.pattern, k)}
        return {"tensors": len(sizes), "files": len(files), "bytes": sum(files.values()),
                "small_fraction": round(sum(v < 16 << 10 for v in sizes.values()) / len(sizes), 3),
                "tensor_bytes": sum(sizes.values()), "metadata_bytes": files.get(".metadata"),
                "file_bytes": stats(list(files.values())), "save_s": self.save_s, "subset_tensors": len(sub),
                "subset_files": len({v.relative_path for i, v in md.storage_data.items() if i.fqn in sub}),
                "subset_bytes": sum(sizes[k] for k in sub)}

    def spawn(self, cmd, **kw):
        if "agent" in cmd and str(cmd[-1]).endswith("agent.toml"):   # Bench.start's tier agent: our [follow]
            a, cfg = self.args, Path(cmd[-1])
            text = cfg.read_text()
            for old, new in (("keep_last = 2\n", f"keep_last = {a.keep_last}\n"),
                             ("poll_interval_s = 0.05\n", f"poll_interval_s = {a.follow_poll_s}\n")):
                assert old in text, f"cross_dc_eval's agent config changed: {old!r} not found"
                text = text.replace(old, new)
            if a.verify_poll_ms is not None:
                text = text.replace("[agent]\n", f"[agent]\nstream_verify_poll_s = {a.verify_poll_ms / 1000}\n")
            cfg.write_text(text)
            self.agent_proc = super().spawn(cmd, **kw)
            return self.agent_proc
        return super().spawn(cmd, **kw)

    def start(self) -> None:
        a = self.args
        orig, wan.Relay = wan.Relay, SideRelay      # Bench.start imports Relay when it runs
        try:
            super().start()
        finally:
            wan.Relay = orig
        self.ev_side = self.mount("eval-remote-side", xdc.s3_store_toml(self.relay.side_port)
                                  + f'\n[cache]\nspool_dir = "{self.tmp / "spool-side"}"\n'
                                  + 'immutable_globs = ["ckpt/*", "ckpt/**"]\n', eval_side=True)
        bg, rng = self.tmp / "bg_src", random.Random(1)
        bg.mkdir()
        self.bg_names = [f"__0_{k}.distcp" for k in range(a.bg_files)] + [".metadata"]
        for n in self.bg_names:
            (bg / n).write_bytes(rng.randbytes(1024 if n == ".metadata" else a.bg_file_kb << 10))
        self.bg_src, self.bg_commit_bytes = bg, sum(p.stat().st_size for p in bg.iterdir())
        self.bg_root, self.bg_prefix = ((self.train_stream, "ckpt/hintfs_stream/bg") if a.bg_stream
                                        else (self.train, "ckpt/bg"))
        self.bg_writer = self.child([xdc.PY, "-c", WRITE], "bg.log")
        self.poller = self.child(self.on_eval_side([xdc.PY, "-c", POLL, self.agent_loc, str(a.poll_s)]), "poll.log")
        threading.Thread(target=self._read_polls, name="scale-poll", daemon=True).start()
        threading.Thread(target=self._watchdog, name="scale-watchdog", daemon=True).start()

    def cleanup(self) -> None:
        """Bench.cleanup after our own steps that cannot abort it: the children writing into or reading the
        mounts stopped first, then each mount unmounted (a `hintfs umount` past its time, seen under load,
        raised out of Bench.cleanup and left the store, the agent and a mount behind), lazily if need be."""
        for p in (getattr(self, n, None) for n in ("writer", "bg_writer", "merger", "poller")):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
        for mnt in reversed(self.mounts):
            for cmd in ([xdc.PY, "-m", "hintfs.cli", "umount", str(mnt), "--timeout", "20"],
                        ["fusermount3", "-u", "-z", str(mnt)]):
                try:
                    if os.path.ismount(mnt):
                        subprocess.run(cmd, cwd=xdc.REPO, capture_output=True, timeout=40)
                except subprocess.SubprocessError:
                    pass
        super().cleanup()

    def child(self, cmd: list, log: str) -> subprocess.Popen:
        """A child of ours that answers each JSON line with one (after "ready")."""
        p = self.spawn(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, stderr=open(self.tmp / log, "w"))
        assert p.stdout.readline().strip() == "ready", f"{log}: the child did not start"
        return p

    @staticmethod
    def ask(p: subprocess.Popen, req: dict) -> dict:
        p.stdin.write(json.dumps(req) + "\n")
        p.stdin.flush()
        return json.loads(p.stdout.readline())

    # -- the tier's completions (from the poller child), the watchdog, CPU -------------------------------
    def _read_polls(self) -> None:
        for line in self.poller.stdout:
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            with self.cond:
                self.complete_at.update(doc.get("new", {}))
                self.poll_last = {k: doc.get(k) for k in ("replicas", "queued", "errors", "call_s", "error",
                                                          *TIER_KEYS)}
                if doc.get("call_s") is not None:
                    self.poll_call_s.append(doc["call_s"])
                self.cond.notify_all()

    def wait_complete(self, rels: list[str], timeout_s: float) -> dict[str, float | None]:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not all(r in self.complete_at for r in rels) and time.monotonic() < deadline:
                if self.poller.poll() is not None:
                    break
                self.cond.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            return {r: self.complete_at.get(r) for r in rels}

    def tier_deltas(self, p0: dict) -> dict:
        return {k: (self.poll_last.get(k) or 0) - (p0.get(k) or 0) for k in TIER_KEYS}

    def arm(self, seconds: float, what: str) -> None:
        self.watch_until, self.watch_what = time.monotonic() + seconds, what

    def _watchdog(self) -> None:
        """Past the armed deadline our own work children are killed: the step waiting on one fails."""
        while True:
            time.sleep(1.0)
            if self.watch_until is not None and time.monotonic() > self.watch_until and not self.watchdog_fired:
                self.watchdog_fired = f"deadline passed: {self.watch_what}"
                print("WATCHDOG:", self.watchdog_fired, file=sys.stderr, flush=True)
                for p in (self.writer, self.merger, self.bg_writer, self.poller):
                    if p.poll() is None:
                        p.kill()

    def cpu(self) -> dict:
        own, sender = self.mount_cpu_split(self.train_stream)
        return {"s3": self.pid_cpu_s(self.s3.proc.pid), "agent": self.pid_cpu_s(self.agent_proc.pid),
                "train_mount": own, "sender": sender}

    # -- background jobs -------------------------------------------------------------------------------
    def bg_loop(self) -> None:
        a = self.args
        gap = self.bg_commit_bytes / (a.bg_mbit * 1e6 / 8) if a.bg_mbit > 0 else 0.0
        k, t_next = 0, time.monotonic()
        try:
            while not self.bg_stop.is_set():
                job, step = f"{self.bg_prefix}/job{k % a.background_jobs:03d}", k // a.background_jobs
                old = f"{job}/step_{step - a.bg_store_keep}" if step >= a.bg_store_keep else None
                res = self.ask(self.bg_writer, {"src": str(self.bg_src), "dst": str(self.bg_root / job / f"step_{step}"),
                                                "names": self.bg_names, "rm": str(self.bg_root / old) if old else None})
                self.bg_commits.append({"rel": f"{job}/step_{step}", "commit": res["done"], "per_file": res["per_file"]})
                k += 1
                t_next = max(t_next + gap, time.monotonic() - gap)     # behind: no burst of more than one
                self.bg_stop.wait(max(0.0, t_next - time.monotonic()))
        except Exception as e:   # (its writer killed at the clean-up, a failed write)
            if not self.bg_stop.is_set():
                self.bg_error = repr(e)[:500]

    # -- one checkpoint --------------------------------------------------------------------------------
    def checkpoint(self, rel: str, anomaly: bool, remote: bool) -> dict:
        a, job = self.args, os.path.dirname(rel)
        if anomaly:
            self.agent.signal(job, severity=3.0)
        t_start = time.time()
        w0, s0, side0 = self.wan_down(), self.relay.reverse_stats()["bytes"]["up"], self.relay.side_stats()
        tc0, ec0, p0, cpu0 = self.counters(self.train_stream), self.counters(self.ev_hint), dict(self.poll_last), self.cpu()
        self.arm(a.step_timeout_s, f"write of {rel}")
        t_write, t_commit = self.write_checkpoint(rel)
        per_file, names = sorted(self.last_write_per_file), sorted(p.name for p in self.src.iterdir()
                                                                   if p.name != ".metadata") + [".metadata"]
        starts = [t_write + x for x in itertools.accumulate(self.last_write_per_file, initial=0)]   # (about)
        stalls = [{"file": n, "s": d, "at_s": round(t - self.t_relay0, 1)}        # (relay clock, as phases)
                  for n, d, t in zip(names, self.last_write_per_file, starts) if d > 1.0]
        at_commit = self.wan_down() - w0
        self.arm(a.step_timeout_s, f"merge of {rel}")
        res = self.merge(self.ev_hint / rel, self.ev_hint)
        self.arm(a.step_timeout_s + 60, f"tier completion of {rel}")    # (a checkpoint never complete: None)
        t_done = self.wait_complete([rel], a.step_timeout_s)[rel]
        if anomaly:
            self.agent.signal(job, clear=True)
        t_end = time.time()
        wan_b = self.wan_down() - w0
        self.phases.append(("anomaly" if anomaly else "checkpoint", t_start - self.t_relay0, t_end - self.t_relay0))
        bg_in = sum(1 for c in list(self.bg_commits) if t_start <= c["commit"] <= t_end)
        tc1, ec1 = self.counters(self.train_stream), self.counters(self.ev_hint)

        def delta(c1, c0):   # the mount's counters over the window (not the per-op ones)
            return {k: round(v - c0.get(k, 0), 1) for k, v in c1.items()
                    if isinstance(v, (int, float)) and v != c0.get(k, 0) and "." not in k}
        row = {"rel": rel, "anomaly": anomaly, "write_s": round(t_commit - t_write, 3),
               "write_file_ms": {q: round(1e3 * per_file[int(f * (len(per_file) - 1))], 2)
                                 for q, f in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))},
               "write_stalls": stalls[:20], "write_stalls_n": len(stalls),   # files that took over 1 s
               "commit_to_merge_s": round(res["done"] - t_commit, 3), "merge_s": round(res["done"] - res["t0"], 3),
               "metadata_s": round(res["t_md"] - res["t0"], 3), "load_s": round(res["done"] - res["t_hint"], 3),
               "merge_tensors": res["tensors"], "merge_bytes": res["bytes"],
               "tier_complete_s": round(t_done - t_commit, 3) if t_done else None,
               # towards the eval side from the first write to the tier's completion: this checkpoint's
               # stream, the background jobs' copies, the tier's listings (not the direct-remote reference)
               "wan_bytes": wan_b, "wan_stream_bytes": self.relay.reverse_stats()["bytes"]["up"] - s0,
               "wan_bytes_at_commit": at_commit, "bg_commits_in_window": bg_in,
               # CPU seconds over the window: the S3 server, the tier agent, the training mount and its sender
               "cpu_s": {k: round(v - cpu0[k], 2) for k, v in self.cpu().items()},
               # the tier's journal listings (stream versions), its pulls through its link scheduler and its
               # demand fetches over the window (as of the poller's last lines), and its last status
               "tier_deltas": self.tier_deltas(p0), "tier_poll": dict(self.poll_last),
               "train_counters": delta(tc1, tc0), "eval_counters": delta(ec1, ec0)}
        if remote:
            self.arm(a.step_timeout_s, f"direct-remote merge of {rel}")
            t_r = time.time()
            r = self.merge(self.ev_side / rel)
            self.phases.append(("remote", t_r - self.t_relay0, time.time() - self.t_relay0))
            row["remote_merge_s"] = round(r["done"] - r["t0"], 3)
            row["remote_wan_bytes"] = self.relay.side_stats()["bytes"]["down"] - side0["bytes"]["down"]
            row["merge_over_remote"] = ratio(row["commit_to_merge_s"], row["remote_merge_s"])
        self.watch_until = None
        print(f"  {rel}: " + json.dumps({k: v for k, v in row.items() if not k.endswith("counters")}), flush=True)
        return row


def summarize(b: ScaleBench, rows: list[dict], idle: list[dict], w_total: int, written: int) -> dict:
    with_remote = [r for r in rows if r.get("remote_merge_s")]
    ratios = [r["merge_over_remote"] for r in with_remote]
    remote_mean = statistics.fmean(r["remote_merge_s"] for r in with_remote) if with_remote else None
    idle_a = next((r for r in idle if r["anomaly"]), None) or {}
    anomalies = [r for r in rows if r["anomaly"]]
    an_tier = [ratio(r["tier_complete_s"], idle_a.get("tier_complete_s"), 3) for r in anomalies]
    an_merge = [ratio(r["commit_to_merge_s"], idle_a.get("commit_to_merge_s"), 3) for r in anomalies]
    first, last = rows[0], rows[-1]
    bg = [round(b.complete_at[c["rel"]] - c["commit"], 3) if c["rel"] in b.complete_at else None
          for c in b.bg_commits]
    out = {
        "merge_over_remote": {"first": first.get("merge_over_remote"), "last": last.get("merge_over_remote"),
                              "max": max(ratios, default=None), "n": len(ratios),
                              "remote_measured_at": [r["rel"] for r in with_remote],
                              # every checkpoint's merge against the mean of the reference's measurements
                              "max_all_vs_mean_remote": ratio(max(r["commit_to_merge_s"] for r in rows), remote_mean),
                              "n_all": len(rows)},
        "remote_merge_s": stats([r["remote_merge_s"] for r in with_remote]),
        "last_over_first_merge": {"value": ratio(last["commit_to_merge_s"], first["commit_to_merge_s"], 3), "n": 2},
        "commit_to_merge_s": stats([r["commit_to_merge_s"] for r in rows]),
        "tier_complete_s": stats([r["tier_complete_s"] for r in rows]),
        "write_s": stats([r["write_s"] for r in rows]),
        "anomaly_over_idle": {"tier_complete_max": max((x for x in an_tier if x), default=None),
                              "tier_complete_mean": round(statistics.fmean([x for x in an_tier if x]), 3)
                              if any(an_tier) else None,
                              "merge_max": max((x for x in an_merge if x), default=None), "n": len(anomalies),
                              "by_checkpoint": dict(zip([r["rel"] for r in anomalies], an_tier)),
                              "idle_tier_complete_s": idle_a.get("tier_complete_s"),
                              "idle_commit_to_merge_s": idle_a.get("commit_to_merge_s")},
        "wan_over_written": {"value": ratio(w_total, written), "wan_bytes": w_total, "written_bytes": written,
                             "n_checkpoints": len(rows) + len(idle), "n_bg_commits": len(b.bg_commits)},
        "background": {"jobs": b.args.background_jobs, "commits": len(b.bg_commits),
                       "commit_bytes": b.bg_commit_bytes, "commit_to_complete_s": stats(bg),
                       # the pace reached (the writer may not keep --bg-mbit up): bytes over first to last commit
                       "achieved_mbit": round(8e-6 * (len(b.bg_commits) - 1) * b.bg_commit_bytes
                                              / (b.bg_commits[-1]["commit"] - b.bg_commits[0]["commit"]), 2)
                       if len(b.bg_commits) > 1 else None,
                       "never_complete": sum(x is None for x in bg), "error": b.bg_error,
                       "write_file_ms": stats([round(1e3 * x, 2) for c in b.bg_commits for x in c["per_file"]]),
                       "write_stalls": [{"rel": c["rel"], "s": max(c["per_file"]),      # a file over 1 s
                                         "commit_at_s": round(c["commit"] - b.t_relay0, 1)}
                                        for c in b.bg_commits if max(c["per_file"]) > 1.0][:50]},
        "tier_status_call_s": stats(b.poll_call_s),
    }
    mr, an = out["merge_over_remote"], out["anomaly_over_idle"]["tier_complete_max"]
    out["goals"] = {
        "merge_le_0_1x_remote_every_checkpoint": (mr["max"] <= 0.1 and (mr["max_all_vs_mean_remote"] or 9) <= 0.1)
        if mr["max"] is not None else None,
        "last_merge_within_20pct_of_first": (out["last_over_first_merge"]["value"] or 9) <= 1.2,
        "anomaly_le_1_5x_idle": an <= 1.5 if an else None,
        "wan_le_1_05x_written": (out["wan_over_written"]["value"] or 9) <= 1.05}
    return out


UNIT_NOFILE = 1 << 20     # the LimitNOFILE of the units in systemd/


def units_open_file_limit() -> int:
    """The open-file limit the daemons this bench starts get (they raise their soft limit to the
    inherited hard one, hintfs/common/fdlimit.py): as the units give them (LimitNOFILE=1048576),
    where this process may raise its hard limit (root); else the hard limit as it is. A
    tier agent then kept one file open per replica: 16,384-file checkpoints kept 3 deep, with 200
    background jobs, passed a shell's hard limit of 20,000 and every copy past it failed with
    EMFILE, retried for ever (2026-12-06, bench/notes/scale_xdc.md; on that VM root could not
    raise it either). It now keeps at most half its limit open; the limit still sizes that cache.
    The JSON records the limit the run had (`settings.open_file_limit`)."""
    import resource
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < UNIT_NOFILE:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (UNIT_NOFILE, UNIT_NOFILE))
        except (ValueError, OSError):
            return hard
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    arg = ap.add_argument
    arg("--quick", action="store_true", help="2 checkpoints of 256 files, 8 jobs (< 4 min)")
    arg("--checkpoints", type=int, default=24)
    arg("--files", type=int, default=16384, help="files per checkpoint, .metadata included")
    arg("--checkpoint-mb", type=int, default=256, help="the checkpoint's bytes in all")
    arg("--background-jobs", type=int, default=200)
    arg("--bg-files", type=int, default=2, help="data files per background checkpoint (+ .metadata)")
    arg("--bg-file-kb", type=int, default=512)
    arg("--bg-mbit", type=float, default=40.0, help="the background commits' pace (bytes written)")
    arg("--bg-store-keep", type=int, default=2, help="background checkpoints each job keeps in the store")
    arg("--bg-stream", action="store_true", help="background jobs write through the streaming mount")
    arg("--keep-last", type=int, default=3, help="[follow] keep_last")
    arg("--anomaly-every", type=int, default=6, help="every k-th checkpoint is an anomaly eval (from the "
                                                    "k/2-th; with fewer checkpoints, the middle one; 0: none, "
                                                    "and no idle baseline)")
    arg("--remote-every", type=int, default=0, help="the direct-remote reference every k-th checkpoint too "
                                                   "(always at the first and the last)")
    arg("--idle-warmup", action=argparse.BooleanOptionalAction, default=True,
        help="a checkpoint on the idle link before the idle anomaly baseline")
    arg("--pattern", default=r"block\d\d[05]0\.", help="the tensors the merge loads (regex)")
    arg("--delay-ms", type=float, default=50.0, help="one way")
    arg("--bandwidth-mbit", type=float, default=400.0)
    arg("--chunk-kb", type=int, default=1024, help="agent link_chunk_bytes")
    arg("--stream-parallel", type=int, default=8, help="[stream] parallel")
    arg("--follow-poll-s", type=float, default=0.05, help="[follow] poll_interval_s (cross_dc_eval.py's)")
    arg("--verify-poll-ms", type=float, default=None, help="[agent] stream_verify_poll_s in ms (product default)")
    arg("--poll-s", type=float, default=0.5, help="the tier status poll (a child process)")
    arg("--step-timeout-s", type=float, default=1800.0, help="deadline of each write, merge and wait")
    arg("--drain-timeout-s", type=float, default=300.0, help="wait for the background jobs' last commits")
    arg("--cpu-split", action=argparse.BooleanOptionalAction, default=True)
    arg("--tier-dir", default=None)
    arg("--keep-logs", action="store_true")
    arg("--out", default=str(xdc.RESULTS / "scale_xdc.json"))
    a = ap.parse_args()
    if a.quick:
        a.checkpoints, a.files, a.checkpoint_mb, a.background_jobs = 2, 256, 12, 8
        a.bg_mbit, a.anomaly_every, a.step_timeout_s = 10.0, 2, 300.0
    for k, v in BASE_ARGS.items():
        setattr(a, k, v)
    t_begin = time.monotonic()
    nofile = units_open_file_limit()

    def on_term(signum, _frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)
    b = ScaleBench(a)
    result: dict = {"settings": {"argv": sys.argv, "bandwidth_mbit": a.bandwidth_mbit, "delay_ms_each_way": a.delay_ms,
                                 **{k: v for k, v in vars(a).items() if k not in BASE_ARGS}, "cpus": os.cpu_count(), "open_file_limit": nofile,
                                 "cpu_split": b.cpu_split, "bg_writes_through": "streaming mount" if a.bg_stream
                                 else "copy-after-close mount"},
                    "files_per_checkpoint": None, "checkpoints": a.checkpoints, "background_jobs": a.background_jobs,
                    "reasons": {}}
    rows: list[dict] = []
    idle: list[dict] = []
    try:
        b.start()
        gc.freeze()      # the relay is a thread of this process: no full collections of what is set up
        result.update(s3_server=b.s3.name, checkpoint=b.facts, files_per_checkpoint=b.facts["files"])
        w0, s0, p0, t0 = b.wan_down(), b.relay.reverse_stats()["bytes"]["up"], dict(b.poll_last), time.time()
        base = "ckpt/hintfs_stream"
        if a.anomaly_every > 0:      # (no anomaly evals: no idle baseline for them)
            if a.idle_warmup:
                idle.append(b.checkpoint(f"{base}/idle/step_0", anomaly=False, remote=False))
            idle.append(b.checkpoint(f"{base}/idle/step_{len(idle)}", anomaly=True, remote=False))
        bg_thread = threading.Thread(target=b.bg_loop, name="scale-bg", daemon=True)
        bg_thread.start()
        for i in range(a.checkpoints):
            remote = i in (0, a.checkpoints - 1) or (a.remote_every and i % a.remote_every == 0)
            anomaly = a.anomaly_every > 0 and i % a.anomaly_every == min(a.anomaly_every, a.checkpoints) // 2
            rows.append(b.checkpoint(f"{base}/main/step_{i}", anomaly=anomaly, remote=bool(remote)))
            rows[-1]["wall_s"] = round(time.monotonic() - t_begin, 1)
        b.bg_stop.set()
        bg_thread.join(60)
        # the background commits still in the store (older ones were deleted: complete by then, or never)
        b.arm(a.drain_timeout_s + 60, "the background jobs' last commits")
        last: dict[str, list[str]] = {}
        for c in b.bg_commits:
            last.setdefault(os.path.dirname(c["rel"]), []).append(c["rel"])
        left = b.wait_complete([r for rels in last.values() for r in rels[-a.bg_store_keep:]], a.drain_timeout_s)
        b.watch_until = None
        result["drain_done_s"] = round(time.time() - t0, 1)
        time.sleep(2 * a.poll_s)    # (the poller's next line: the tier's counters below)
        written = (len(rows) + len(idle)) * b.facts["bytes"] + len(b.bg_commits) * b.bg_commit_bytes
        result.update(summarize(b, rows, idle, b.wan_down() - w0, written))
        result["background"]["not_complete_at_end"] = sum(v is None for v in left.values())
        d, streams = b.tier_deltas(p0), b.relay.reverse_stats()["bytes"]["up"] - s0
        w = result["wan_over_written"]
        # what crossed: streams (the reverse listener), the tier's pulls (copies through its link scheduler,
        # demand fetches), the rest (journal listings, stats, eval mounts' store reads) by difference
        w["breakdown"] = {"streams": streams, "tier_copies": d["copy_bytes"], "tier_demand": d["demand_bytes"],
                          "other": w["wan_bytes"] - streams - d["copy_bytes"] - d["demand_bytes"],
                          "tier_journal_listings": d["listings"]}
        # the store's side of the link by the request each byte answered (the relay reads the plain
        # HTTP; totals since the relay started, set-up included)
        rs = b.relay.stats()
        w["down_by_request"], w["requests"] = rs.get("down_by_request", {}), rs.get("requests", {})
        st = b.agent.status()
        result["tier_at_end"] = {"replicas": len(st.replicas), "streams": st.streams, "demand": st.demand,
                                 "link_bytes_by_class": st.link_bytes_by_class, "copies": st.copies,
                                 "follow_errors": dict(list((st.follow.errors if st.follow else {}).items())[:20])}
    except BaseException as e:   # (Ctrl-C and SIGTERM too: what was measured is written)
        result["reasons"]["error"] = (f"{b.watchdog_fired}: " if b.watchdog_fired else "") + repr(e)[:2000]
        result["reasons"]["interrupted"] = not isinstance(e, Exception)
        print("ERROR:", result["reasons"]["error"], file=sys.stderr, flush=True)
        for name in ("agent.log", "merge.log", "write.log", "bg.log", "poll.log"):
            if (b.tmp / name).exists() and (b.tmp / name).stat().st_size:
                print(f"--- {name}\n" + (b.tmp / name).read_text()[-2000:], file=sys.stderr)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)    # the clean-up runs to its end (its own deadlines)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        b.bg_stop.set()
        b.watch_until = None
        if b.relay is not None:
            try:
                result["wan_total_bytes"] = b.relay.stats()["bytes"]
                result["remote_reference_bytes"] = b.relay.side_stats()["bytes"]
                xdc.plot(b.relay.stats(), b.phases, Path(a.out).with_suffix(".png"), a.bandwidth_mbit * 1e6 / 8)
            except Exception as e:
                result["reasons"]["plot"] = repr(e)[:300]
        b.cleanup()
    result.update(rows=rows, idle_rows=idle, wall_s=round(time.monotonic() - t_begin, 1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result.get(k) for k in ("files_per_checkpoint", "checkpoints", "background_jobs",
                                                  "merge_over_remote", "last_over_first_merge", "anomaly_over_idle",
                                                  "wan_over_written", "commit_to_merge_s", "tier_complete_s",
                                                  "goals", "reasons", "wall_s")}, indent=1))
    if result["reasons"].get("interrupted"):
        return 130
    return 0 if "error" not in result["reasons"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Cross-DC eval benchmark (issue 5): an eval "merge" of a DCP checkpoint across a 100 ms WAN.

One run, side by side, over the same S3 store behind `tests/helpers/wan.py`'s relay:
  remote  eval mount whose store is S3 through the relay, no routes (direct remote reads)
  rclone  `rclone mount --vfs-cache-mode full` of the same S3 through the relay
  hintfs  training mount with [journal] writes the checkpoint to S3 (directly, no relay); an
          eval-side `hintfs agent` with [follow] copies each file through the relay as soon as
          it is closed; the eval mount routes `ckpt` to that agent (attributes and data of what
          the tier holds, a wait for copies in flight, the store for the rest).
  hintfs_stream  write-time streaming (issue 15): a second training mount with [stream] sends each
          file to the same eval agent while it is written, across the same link (the relay's second
          listener shares its bandwidth); the agent's follower finds the files there at their
          journal records, the eval mount is the same as for `hintfs`.
  local   the floor: the same checkpoint written to a local folder and merged from it.
In every mode the merge starts at the commit. Per mode: merge latency (mean, p95), the time the
training side took to write the checkpoint (`write_s_mean`), and `wan_bytes_over_checkpoint`
(bytes towards the eval side across the relay during a rep, over the checkpoint's bytes: the
store's reads plus, for hintfs_stream, the streams). `write_stream_over_copy`: the training side's
write throughput with streaming over without it (hintfs_stream vs hintfs, same run, the two modes
in `--pair-order abba`; `write_ratio` says why the order matters).
Merge latency = commit (`.metadata` closed on the training mount) -> `dcp.load` of the subset done.

Two datacenters on one host: with `--cpu-split` (the default with 2 CPUs or more) the training
side (this process, the S3 server, the training mounts with their stream senders, the writer)
runs on the first half of the CPUs and the eval DC (its agent, the eval mounts and rclone, the
merger) on the other half, so that neither side's work (the stream's tail, the merge) is counted
as the other's CPU time. The eval agent still receives the stream on the eval CPUs, as it would.
The relay is the link, neither datacenter's CPU: it runs on whichever CPU is free
(`--link-cpus all`, the default since 2026-12-02; `training` pins it beside the writer, as
before, `eval` on the eval half). `--no-cpu-split` shares every CPU (bench/notes/cross_dc_eval.md has both).

Second run: 16 eval jobs' checkpoints cross the link at once through the agent's link scheduler
(`[agent] link_bytes_s` = relay bandwidth); two of them signalled as anomaly evals.

The S3 server is JuiceFS's S3 gateway (tests/helpers/s3server.py: a MinIO front end over a JuiceFS
volume with sqlite3 metadata and a file bucket, on loopback; keep-alive connections, ranged GETs
read only their range). Which server ran is recorded as `s3_server` in the JSON.

  python bench/cross_dc_eval.py --quick            # < 3 min
  python bench/cross_dc_eval.py --reps 5 --bandwidth-mbit 400
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from plotting import pyplot_or_none  # noqa: E402  (bench/ is the script dir)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from hintfs.common.procs import child_pids  # noqa: E402  (the repo, just put on the path)
from tests.helpers.ports import free_port, wait_port  # noqa: E402  (the harness of tests and benches)
from tests.helpers.s3server import ACCESS_KEY, SECRET_KEY, JuiceFSGateway  # noqa: E402
from tests.helpers.staging_holder import StagingHolder  # noqa: E402

RESULTS = REPO / "bench" / "results"
BUCKET = "xdc"
PY = sys.executable

SAVE = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    dist.init_process_group("gloo")
    d, layers, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    g = torch.Generator().manual_seed(0)
    sd = {}
    for tower in ("text", "vision", "audio"):
        for i in range(layers):
            p = f"{tower}.layers.{i}."
            for name, shape in (("attn.qkv.weight", (3 * d, d)), ("attn.qkv.bias", (3 * d,)),
                                ("attn.out.weight", (d, d)), ("attn.out.bias", (d,)),
                                ("ln1.weight", (d,)), ("ln1.bias", (d,)), ("ln2.weight", (d,)), ("ln2.bias", (d,)),
                                ("mlp.fc1.weight", (4 * d, d)), ("mlp.fc1.bias", (4 * d,)),
                                ("mlp.fc2.weight", (d, 4 * d)), ("mlp.fc2.bias", (d,))):
                sd[p + name] = torch.randn(*shape, generator=g)
        sd[f"{tower}.norm.weight"] = torch.ones(d)
        sd[f"{tower}.norm.bias"] = torch.zeros(d)
    dcp.save(sd, checkpoint_id=out)
    dist.destroy_process_group()
""")

MERGE = textwrap.dedent("""
    import gc, json, re, sys, time, torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    gc_s = [0.0, None]          # the collector's pauses in this process (a merge allocates a lot)
    def on_gc(phase, info):
        if phase == "start":
            gc_s[1] = time.perf_counter()
        elif gc_s[1] is not None:
            gc_s[0] += time.perf_counter() - gc_s[1]
    gc.callbacks.append(on_gc)
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        gc_s[0] = 0.0
        cpu0 = time.process_time()
        t0 = time.time()
        try:
            md = FileSystemReader(req["path"]).read_metadata()
            t_md = time.time()
            sd = {}
            for k, m in md.state_dict_metadata.items():
                if re.match(req["pattern"], k):
                    sd[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            t_ranges = None
            if req.get("mount"):   # an eval mount with routes: say which ranges come next
                import os
                from hintfs.client import hint_reads
                from hintfs.hintsource import dcp_read_ranges
                ranges = dcp_read_ranges(req["path"], list(sd))       # (hint_dcp_reads, in two steps)
                t_ranges = time.time()
                rel = os.path.relpath(req["path"], req["mount"])
                hint_reads(req["mount"], "merge", [(f"{rel}/{n}", o, m) for n, o, m in ranges])
            t_hint = time.time()
            dcp.load(sd, checkpoint_id=req["path"], no_dist=True)
            need = sum(t.numel() * t.element_size() for t in sd.values())
            out = {"ok": True, "t0": t0, "t_md": t_md, "t_ranges": t_ranges, "t_hint": t_hint,
                   "done": time.time(), "tensors": len(sd), "bytes": need, "gc_s": round(gc_s[0], 4),
                   "cpu_s": round(time.process_time() - cpu0, 4)}
        except Exception as e:
            out = {"ok": False, "error": repr(e)[:500], "done": time.time()}
        # The next merge starts from a collected heap, as a fresh eval process would (this one
        # lives for all the reps; a full collection inside one merge cost it 0.28 s, n = 1).
        # Collected before the answer, so the bench starts the next rep after it.
        gc.collect()
        print(json.dumps(out), flush=True)
""")


# The training job: a process of its own, as on a training host (in the bench's process its copy
# loop would share the GIL with the relay's thread, which is the link, not the training host).
WRITE = textwrap.dedent("""
    import json, os, shutil, sys, time
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.time()
        os.makedirs(req["dst"])
        per_file = []
        for n in req["names"]:
            t = time.time()
            shutil.copyfile(os.path.join(req["src"], n), os.path.join(req["dst"], n))
            per_file.append(round(time.time() - t, 4))
        print(json.dumps({"t0": t0, "done": time.time(), "per_file": per_file}), flush=True)
""")


def s3_store_toml(port: int, spool: Path | None = None, host_cache: Path | None = None) -> str:
    t = (f'[store]\nuri = "s3://{BUCKET}"\nendpoint_override = "127.0.0.1:{port}"\nscheme = "http"\n'
         f'region = "us-east-1"\naccess_key = "{ACCESS_KEY}"\nsecret_key = "{SECRET_KEY}"\nconnect_timeout_s = 5\n'
         f'request_timeout_s = 60\n')
    if spool is not None:
        t += f'\n[cache]\nspool_dir = "{spool}"\n'
        if host_cache is not None:   # a host cache: writes reach the staging file by FUSE passthrough
            t += f'dir = "{host_cache}"\n'
    return t


class Bench:
    def __init__(self, args):
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="hintfs-xdc-"))
        # the eval DC's tier data: beside the training side's S3 bucket and spools (one disk for
        # both datacenters), or in a folder of its own (--tier-dir: another disk, or tmpfs)
        self.tier_dir = (Path(tempfile.mkdtemp(prefix="hintfs-xdc-tier-", dir=args.tier_dir)) if args.tier_dir
                         else self.tmp / "tier")
        self.procs: list[subprocess.Popen] = []
        self.mounts: list[Path] = []
        self.relay = None
        self.s3: JuiceFSGateway | None = None
        self.phases: list[tuple[str, float, float]] = []
        self.t_relay0 = None
        self.log_level = "INFO" if args.keep_logs else "WARNING"
        self.eval_cpus = ""       # taskset list of the eval DC's CPUs (--cpu-split), "" = all
        cpus = sorted(os.sched_getaffinity(0))
        if args.cpu_split and len(cpus) >= 2:
            half = len(cpus) // 2
            os.sched_setaffinity(0, cpus[:half])   # this process, its threads and children
            self.eval_cpus = ",".join(map(str, cpus[half:]))
            # The link is neither datacenter's CPU; with two halves it runs on one of them.
            self.link_cpus = {"training": cpus[:half], "eval": cpus[half:], "all": cpus}[args.link_cpus]
            self.cpu_split = {"training": cpus[:half], "eval": cpus[half:], "link": self.link_cpus}
        else:
            self.cpu_split = None
            self.link_cpus = None

    def host_cache(self, name: str) -> Path | None:
        """The training mount's `[cache] dir` with --train-host-cache, else none."""
        return self.tmp / f"hostcache-{name}" if self.args.train_host_cache else None

    def sender_cpus_toml(self) -> str:
        """`[stream] sender_cpus` for --stream-sender-cpus (a line of the [stream] table)."""
        which = self.args.stream_sender_cpus
        if which == "inherit" or self.cpu_split is None:
            return ""
        return f"sender_cpus = {self.cpu_split[which]}\n"

    # -- processes -----------------------------------------------------------------------------
    def on_eval_side(self, cmd: list) -> list:
        """`cmd` run on the eval DC's CPUs (--cpu-split), else as is."""
        return ["taskset", "-c", self.eval_cpus, *cmd] if self.eval_cpus else list(cmd)

    def spawn(self, cmd, **kw) -> subprocess.Popen:
        p = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, **kw)
        self.procs.append(p)
        return p

    def mount(self, name: str, toml: str, eval_side: bool = False) -> Path:
        base = self.tmp / name
        mnt = base / "mnt"
        mnt.mkdir(parents=True)
        cfg = base / "hintfs.toml"
        cfg.write_text(toml + f'\n[logging]\nfile = "{base / "mount.log"}"\nlevel = "{self.log_level}"\n')
        cmd = [PY, "-m", "hintfs.cli", "mount", str(cfg), str(mnt)]
        r = subprocess.run(self.on_eval_side(cmd) if eval_side else cmd, cwd=REPO,
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"mount {name}: {r.stderr[-1500:]}")
        self.mounts.append(mnt)
        return mnt

    def cleanup(self) -> None:
        for mnt in reversed(self.mounts):
            if os.path.ismount(mnt):
                try:
                    subprocess.run([PY, "-m", "hintfs.cli", "umount", str(mnt), "--timeout", "20"], cwd=REPO,
                                   capture_output=True, timeout=40)
                except subprocess.TimeoutExpired:   # (under load): the lazy unmount below, and on
                    print(f"umount of {mnt} timed out: unmounting it lazily", flush=True)
            if os.path.ismount(mnt):
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        for mnt in self.mounts:   # rclone mounts: after its process is gone
            if os.path.ismount(mnt):
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        for relay in (self.relay, getattr(self, "floor_relay", None)):
            if relay is not None:
                try:
                    relay.stop()
                except Exception:
                    pass
        if self.s3 is not None:
            self.s3.close()
        if self.args.keep_logs:
            for f in self.tmp.rglob("*"):
                if f.is_file() and f.suffix not in (".log", ".toml"):
                    f.unlink(missing_ok=True)
            print(f"logs kept in {self.tmp}", flush=True)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if self.tier_dir.parent != self.tmp:
            shutil.rmtree(self.tier_dir, ignore_errors=True)

    # -- setup ---------------------------------------------------------------------------------
    def make_checkpoint(self) -> Path:
        out = self.tmp / "src_ckpt"
        script = self.tmp / "save.py"
        script.write_text(SAVE)
        cmd = [PY, "-m", "torch.distributed.run", f"--nproc-per-node={self.args.ranks}", "--master-port=0",
               "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", str(script), str(self.args.d_model),
               str(self.args.layers), str(out)]
        (self.tmp / "tmp").mkdir(exist_ok=True)   # torchrun leaves its log folder there, not in /tmp
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(self.tmp / "tmp")})
        if r.returncode != 0:
            raise RuntimeError("DCP save failed: " + r.stderr[-2000:])
        return out

    def checkpoint_facts(self, src: Path) -> dict:
        from torch.distributed.checkpoint import FileSystemReader
        md = FileSystemReader(str(src)).read_metadata()
        sizes = {}
        for k, m in md.state_dict_metadata.items():
            n = 1
            for s in m.size:
                n *= s
            sizes[k] = n * m.properties.dtype.itemsize
        small = sum(1 for v in sizes.values() if v < 16 << 10)
        sub = {k: v for k, v in sizes.items() if re.match(self.args.pattern, k)}
        files = {p.name: p.stat().st_size for p in src.iterdir()}
        return {"tensors": len(sizes), "small_fraction": round(small / len(sizes), 3),
                "bytes": sum(files.values()), "files": files, "subset_tensors": len(sub),
                "subset_bytes": sum(sub.values()), "ranks": self.args.ranks}

    def start(self):
        a = self.args
        self.src = self.make_checkpoint()
        self.facts = self.checkpoint_facts(self.src)
        print("checkpoint:", json.dumps(self.facts), flush=True)
        self.s3 = JuiceFSGateway(str(self.tmp / "s3"), remove=False).start()
        s3_port = self.s3.port
        self.s3.filesystem().create_dir(BUCKET)
        if a.seed_journal:
            # records of files nobody follows, one every 10 s back from now, where the training
            # mounts write them: what a journal holds after many checkpoints
            from hintfs.common.journal import record_key, record_name
            fs3 = self.s3.filesystem()
            now_ns = time.time_ns()
            for k in range(a.seed_journal):
                name = f"{now_ns - (k + 1) * 10**10:020d}" + record_name(f"other/step_{k}/f", 1, 1)[20:]
                key = f"{BUCKET}/.hintfs-journal/{record_key(name)}"
                fs3.create_dir(key.rpartition("/")[0])
                with fs3.open_output_stream(key) as f:
                    f.write(b"")
        from tests.helpers.wan import Relay
        self.bw = a.bandwidth_mbit * 1e6 / 8
        aport = free_port()
        # the second listener: training hosts stream to the eval agent over the same link
        self.relay = Relay(("127.0.0.1", s3_port), a.delay_ms / 1000, self.bw, reverse_target=("127.0.0.1", aport),
                           nice=a.eval_nice, cpus=self.link_cpus)
        rport = self.relay.start()
        self.t_relay0 = time.time()
        self.rport = rport
        # training side: S3 directly, journal on
        # --copy-mount-with-stream (a diagnostic): the copy-after-close mount has a [stream] table
        # too, for a prefix nothing is written under: a sender process, no streams
        idle_stream = (f'\n[stream]\nprefixes = ["elsewhere"]\nagents = ["grpc://127.0.0.1:{self.relay.reverse_port}"]\n'
                       if a.copy_mount_with_stream else "")
        self.train = self.mount("train", s3_store_toml(s3_port, self.tmp / "spool-train", self.host_cache("train"))
                                + '\n[journal]\nenabled = true\n' + idle_stream)
        # eval-side agent: S3 through the relay, follows ckpt/
        self.agent_loc = f"grpc://127.0.0.1:{aport}"
        acfg = self.tmp / "agent.toml"
        acfg.write_text(s3_store_toml(rport) + textwrap.dedent(f"""
            [agent]
            location = "{self.agent_loc}"
            auth = "none"
            data_dir = "{self.tier_dir}"
            link_bytes_s = {int(self.bw)}
            link_chunk_bytes = {a.chunk_kb << 10}
            local_socket = "{self.tmp / 'tier.sock'}"
            [follow]
            prefixes = ["ckpt"]
            poll_interval_s = 0.05
            keep_last = 2
            parallel = 16
            [logging]
            level = "{self.log_level}"
            file = "{self.tmp / 'agent.log'}"
        """))
        # The eval DC's agent and the link are other machines; --eval-nice can run them niced.
        nice = a.eval_nice
        self.spawn(self.on_eval_side([PY, "-m", "hintfs.cli", "agent", str(acfg)]), stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, preexec_fn=(lambda: os.nice(nice)) if nice else None)
        wait_port(aport)
        from hintfs.agent.client import AgentClient
        self.agent = AgentClient(self.agent_loc)
        # training side with write-time streaming: its sends cross the link's second listener
        self.train_stream = self.mount("train-stream", s3_store_toml(s3_port, self.tmp / "spool-ts",
                                                                     self.host_cache("ts"))
                                       + '\n[journal]\nenabled = true\n' + textwrap.dedent(f"""
            [stream]
            prefixes = ["ckpt/hintfs_stream"]
            agents = ["grpc://127.0.0.1:{self.relay.reverse_port}"]
            chunk_bytes = {a.stream_chunk_kb << 10}
            parallel = {a.stream_parallel}
            first_by_reads = {str(a.first_by_reads).lower()}
            others_in_flight = {a.others_in_flight}
            others_while_writing = {str(a.others_while_writing).lower()}
            poll_interval_s = {a.stream_poll_ms / 1000}
            sender = "{a.stream_sender}"
            sender_nice = {a.stream_sender_nice}
        """) + self.sender_cpus_toml())
        # checkpoints are immutable once written: both eval mounts may cache their names/attributes
        imm = '\n[cache]\nimmutable_globs = ["ckpt/*", "ckpt/**", "base/*", "base/**"]\n'
        self.ev_remote = self.mount("eval-remote", s3_store_toml(rport) + imm.replace(
            "[cache]", f'[cache]\nspool_dir = "{self.tmp / "spool-er"}"'), eval_side=True)
        self.ev_hint = self.mount("eval-hintfs", s3_store_toml(rport) + imm.replace(
            "[cache]", f'[cache]\nspool_dir = "{self.tmp / "spool-eh"}"')
                                  + f'\n[[routes]]\nprefix = "ckpt"\nlocal_agent = "{self.agent_loc}"\n'
                                  + f'local_socket = "{self.tmp / "tier.sock"}"\n'
                                  + (f'\n[mount]\nread_ahead_kb = {a.eval_read_ahead_kb}\n'
                                     if a.eval_read_ahead_kb is not None else ""), eval_side=True)
        self.merger = self.spawn(self.on_eval_side([PY, "-c", MERGE]), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 stderr=open(self.tmp / "merge.log", "w"))
        assert self.merger.stdout.readline().strip() == "ready"
        self.writer = self.spawn([PY, "-c", WRITE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 stderr=open(self.tmp / "write.log", "w"))
        assert self.writer.stdout.readline().strip() == "ready"
        self.floor_port = None
        if a.floor_sender:   # a link of its own to a sink on the eval side (the real link is idle then)
            sport = free_port()
            sink = self.spawn(self.on_eval_side([PY, str(REPO / "bench" / "send_floor.py"), "sink", str(sport),
                                                 str(a.reps)]), stdout=subprocess.PIPE, text=True)
            assert sink.stdout.readline().strip() == "ready"
            self.floor_port = sport
            if a.floor_sender == "relay":
                self.floor_relay = Relay(("127.0.0.1", sport), a.delay_ms / 1000, self.bw, nice=a.eval_nice,
                                         cpus=self.link_cpus)
                self.floor_port = self.floor_relay.start()
        self.floor_result: dict | None = None
        self.last_held: int | None = None   # --hold-staging: staging files held in the last write

    def start_rclone(self) -> Path | None:
        base = self.tmp / "rclone"
        mnt = base / "mnt"
        mnt.mkdir(parents=True)
        env = {**os.environ, "RCLONE_CONFIG_XDC_TYPE": "s3", "RCLONE_CONFIG_XDC_PROVIDER": "Other",
               "RCLONE_CONFIG_XDC_ENDPOINT": f"http://127.0.0.1:{self.rport}",
               "RCLONE_CONFIG_XDC_ACCESS_KEY_ID": ACCESS_KEY, "RCLONE_CONFIG_XDC_SECRET_ACCESS_KEY": SECRET_KEY,
               "RCLONE_CONFIG_XDC_REGION": "us-east-1", "RCLONE_CONFIG_XDC_FORCE_PATH_STYLE": "true",
               "RCLONE_CONFIG": str(base / "none.conf")}
        env.pop("AWS_CA_BUNDLE", None)   # rclone's AWS SDK refuses a custom CA bundle on plain http
        p = subprocess.Popen(self.on_eval_side(["rclone", "mount", f"xdc:{BUCKET}", str(mnt), "--vfs-cache-mode",
                                                "full", "--cache-dir", str(base / "cache"), "--dir-cache-time",
                                                "1s", "--log-file", str(base / "rclone.log")]), env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(p)
        self.mounts.append(mnt)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not os.path.ismount(mnt):
            if p.poll() is not None:
                return None
            time.sleep(0.1)
        return mnt if os.path.ismount(mnt) else None

    # -- one repetition ------------------------------------------------------------------------
    def write_checkpoint(self, rel: str, root: Path | None = None) -> tuple[float, float]:
        """The training side (the writer process) writes a checkpoint through its mount (or into
        `root`, the local-disk floor): data files, then .metadata. Its first write's and its
        commit's times."""
        if root is None and rel.startswith("ckpt/hintfs_stream/"):
            root = self.train_stream
        dst = (root or self.train) / rel
        names = sorted(p.name for p in self.src.iterdir() if p.name != ".metadata")
        if self.args.warm_pages_mb:
            warm_free_pages(self.args.warm_pages_mb)
        # --stop-sender-during-write (a diagnostic): the stream sender gets no CPU until the commit
        stopping = (self.args.stop_sender_during_write or self.args.floor_sender) and root == self.train_stream
        stopped = self.sender_pids() if stopping else []
        # --floor-sender (a diagnostic): the least a sender could cost, sending the same bytes
        # at the link's pace beside the write (bench/send_floor.py)
        floor = None
        if self.floor_port and root == self.train_stream:
            floor = subprocess.Popen([PY, str(REPO / "bench" / "send_floor.py"), "send", str(self.floor_port),
                                      str(self.args.stream_sender_nice),
                                      str(0 if self.args.floor_sender == "relay" else self.bw)]
                                     + [str(self.src / n) for n in names + [".metadata"]],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
            assert floor.stdout.readline().strip() == "ready"
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        training_mount = self.train if root is None else root if root == self.train_stream else None
        holder = StagingHolder(self.mount_pid(training_mount)) if self.args.hold_staging and training_mount else None
        try:
            if floor is not None:
                floor.stdin.write("go\n")
                floor.stdin.flush()
            self.writer.stdin.write(json.dumps({"src": str(self.src), "dst": str(dst),
                                                "names": names + [".metadata"]}) + "\n")
            self.writer.stdin.flush()
            res = json.loads(self.writer.stdout.readline())
        except BaseException:
            if floor is not None:
                floor.kill()
                floor.wait()
            raise
        finally:
            if holder is not None:
                self.last_held = holder.release()
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        if floor is not None:
            out, _ = floor.communicate(timeout=60)
            self.floor_result = {**json.loads(out), "after_commit_s": None}
            self.floor_result["after_commit_s"] = round(self.floor_result.pop("done") - res["done"], 3)
        self.last_write_per_file = res["per_file"]
        return res["t0"], res["done"]

    def sender_pids(self) -> list[int]:
        """The streaming training mount's sender processes (`[stream] sender = "process"`)."""
        pid = self.mount_pid(self.train_stream)
        return child_pids(pid) if pid is not None else []

    def merge(self, path: Path, mount: Path | None = None) -> dict:
        req = {"path": str(path), "pattern": self.args.pattern}
        if mount is not None and not self.args.no_read_hints:
            req["mount"] = str(mount)
        self.merger.stdin.write(json.dumps(req) + "\n")
        self.merger.stdin.flush()
        res = json.loads(self.merger.stdout.readline())
        if not res.get("ok"):
            raise RuntimeError(f"merge of {path} failed: {res}")
        return res

    @staticmethod
    def counters(mnt: Path) -> dict:
        """The mount's counters, and per FUSE op its count and total time (ms) as "op.count" and
        "op.ms" (the stats give each op's mean; differences of totals give a rep's own)."""
        try:
            doc = json.loads((mnt / ".hintfs" / "stats").read_text())
        except (OSError, ValueError):
            return {}
        out = dict(doc.get("counters", {}))
        for op, o in doc.get("ops", {}).items():
            out[f"{op}.count"] = o["count"]
            out[f"{op}.ms"] = round(o["count"] * o["mean_us"] / 1000, 1)
        return out

    @classmethod
    def mount_cpu_split(cls, mnt: Path) -> tuple[float, float]:
        """CPU seconds (user + system, all threads) the hintfs daemon of `mnt` has used: its own,
        and its child processes' (the stream sender, `[stream] sender = "process"`)."""
        pid = cls.mount_pid(mnt)
        if pid is None:
            return 0.0, 0.0
        return cls.pid_cpu_s(pid), sum(cls.pid_cpu_s(c) for c in child_pids(pid))

    @staticmethod
    def mount_pid(mnt: Path) -> int | None:
        """The pid of the hintfs daemon of `mnt` (its `.hintfs/stats`); None if it does not answer."""
        try:
            return int(json.loads((mnt / ".hintfs" / "stats").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None

    @staticmethod
    def pid_cpu_s(pid: int) -> float:
        """CPU seconds (user + system, all threads) of process `pid`; 0 if it is gone."""
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return 0.0

    def cpu_times(self) -> dict:
        """Seconds the training side's CPUs (--cpu-split; else all) spent in softirq (on loopback,
        a TCP receiver's protocol work runs on the sender's CPU and is charged to whatever task
        it interrupts) and stolen by the hypervisor, from /proc/stat."""
        cpus = {f"cpu{c}" for c in self.cpu_split["training"]} if self.cpu_split else None
        tick = os.sysconf("SC_CLK_TCK")
        out = {"softirq": 0.0, "steal": 0.0}
        with open("/proc/stat") as f:
            for line in f:
                name, *vals = line.split()
                if name.startswith("cpu") and name != "cpu" and (cpus is None or name in cpus):
                    out["softirq"] += int(vals[6]) / tick
                    out["steal"] += int(vals[7]) / tick
        return out

    def wan_down(self) -> int:
        """Bytes that crossed the link towards the eval side: store reads and streams."""
        return self.relay.stats()["bytes"]["down"] + self.relay.reverse_stats()["bytes"]["up"]

    def rep(self, mode: str, i: int, eval_mnt: Path) -> dict:
        rel = f"{'ckpt' if mode.startswith('hintfs') else 'base'}/{mode}/step_{i}"
        if self.args.rest_s and mode.startswith("hintfs"):
            time.sleep(self.args.rest_s)     # --rest-s: what the rep before freed goes back to the host
        t_start = time.time()
        b0 = self.wan_down()
        n0 = self.relay.stats()["accepted"]
        train_mnt = None if mode == "local" else self.train_stream if mode == "hintfs_stream" else self.train
        own0, sender0 = self.mount_cpu_split(train_mnt) if train_mnt else (0.0, 0.0)
        tc0 = self.counters(train_mnt) if train_mnt else {}
        link_cpu0 = time.process_time()   # this process's threads: the relay (the emulated link)
        s3_cpu0 = self.pid_cpu_s(self.s3.proc.pid)
        host0 = self.cpu_times()
        # "local": the floor, the same checkpoint written to and merged from a local folder
        t_write, t_commit = self.write_checkpoint(rel, eval_mnt if mode == "local" else None)
        link_cpu = round(time.process_time() - link_cpu0, 3)
        own_w, sender_w = self.mount_cpu_split(train_mnt) if train_mnt else (0.0, 0.0)
        sender_write = round(sender_w - sender0, 3) if train_mnt else None
        own_write = round(own_w - own0, 3) if train_mnt else None
        s3_cpu = round(self.pid_cpu_s(self.s3.proc.pid) - s3_cpu0, 3)
        host = {k: round(v - host0[k], 3) for k, v in self.cpu_times().items()}
        wan_at_commit = self.wan_down() - b0   # how far the link kept up with the writer
        # The eval starts at the commit in every mode; with hintfs the eval mount reads what the
        # tier holds already, waits for files whose copy is in flight, and reads the rest remotely.
        c0 = self.counters(eval_mnt)
        d0 = self.agent.status().get("demand", {}) if mode.startswith("hintfs") else {}
        res = self.merge(eval_mnt / rel, eval_mnt if mode.startswith("hintfs") else None)
        c1 = self.counters(eval_mnt)
        d1 = self.agent.status().get("demand", {}) if mode.startswith("hintfs") else {}
        t_ready = None
        if mode.startswith("hintfs"):   # for the record: when the tier had the whole checkpoint
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                st = self.agent.status().get("follow", {})
                if rel in st.get("complete", []):
                    t_ready = st.get("complete_at", {}).get(rel, time.time())
                    break
                time.sleep(0.02)
            else:
                raise TimeoutError(f"{rel} never completed in the tier")
        # the training host's cost of this checkpoint: its mount's CPU time from the first write
        # to the tier's completion (the stream's tail included)
        own1, sender1 = self.mount_cpu_split(train_mnt) if train_mnt else (0.0, 0.0)
        train_cpu = round(own1 + sender1 - own0 - sender0, 3) if train_mnt else None
        sender_cpu = round(sender1 - sender0, 3) if train_mnt else None
        tc1 = self.counters(train_mnt) if train_mnt else {}
        # the follower may still be trailing: give the link a moment to be quiet before counting
        wan = self.wan_down() - b0
        self.phases.append((mode, t_start - self.t_relay0, res["done"] - self.t_relay0))
        r = {"latency_s": round(res["done"] - t_commit, 3), "merge_s": round(res["done"] - res["t0"], 3),
             "write_s": round(t_commit - t_write, 3), "train_mount_cpu_s": train_cpu,
             # each file's copy (open to close) in the writer's order: data files, .metadata last
             "write_s_by_file": self.last_write_per_file,
             # of which the stream sender process's (a child of the mount), over the rep and
             # during the write (first write to commit)
             "train_sender_cpu_s": sender_cpu, "train_sender_cpu_s_during_write": sender_write,
             # the mount daemon's own CPU seconds (its sender child not counted) during the write
             "train_mount_own_cpu_s_during_write": own_write,
             # CPU seconds of the relay during the write (on the training side's CPUs here)
             "link_cpu_s_during_write": link_cpu,
             # CPU seconds of the S3 server (JuiceFS's gateway) during the write, same CPU
             "s3_cpu_s_during_write": s3_cpu,
             # the training CPUs' softirq and stolen seconds during the write (cpu_times)
             "train_softirq_s_during_write": host["softirq"], "train_steal_s_during_write": host["steal"],
             # where the merge's time went: .metadata found and read, the read hint, the loads
             "metadata_s": round(res["t_md"] - res["t0"], 3), "hint_s": round(res["t_hint"] - res["t_md"], 3),
             "load_s": round(res["done"] - res["t_hint"], 3),
             # of hint_s: the ranges from .metadata (read again), then the control file write
             "ranges_s": round(res["t_ranges"] - res["t_md"], 3) if res.get("t_ranges") else None,
             # the merger's own CPU seconds and its garbage collector's pauses during the merge
             "merger_cpu_s": res.get("cpu_s"), "merger_gc_s": res.get("gc_s"),
             "tier_complete_s": round(t_ready - t_commit, 3) if t_ready else None, "wan_bytes": wan,
             "wan_bytes_at_commit": wan_at_commit, "needed_bytes": res["bytes"],
             "tensors": res["tensors"], "wan_connections": self.relay.stats()["accepted"] - n0}
        if self.last_held is not None:
            r["staging_files_held"], self.last_held = self.last_held, None
        if self.floor_result is not None and mode == "hintfs_stream":
            r["floor_sender"], self.floor_result = self.floor_result, None
        if d1:   # the tier's demand reads during the merge (hintfs/agent/demand.py)
            r["tier_demand"] = {k: v - d0.get(k, 0) for k, v in d1.items()}
        if c1:
            r["mount_counters"] = {k: v - c0.get(k, 0) for k, v in c1.items()
                                   if isinstance(v, (int, float)) and v != c0.get(k, 0)}
        if tc1:   # the training mount's side of the rep: its write path, its streams
            r["train_mount_counters"] = {k: round(v - tc0.get(k, 0), 1) for k, v in tc1.items()
                                         if isinstance(v, (int, float)) and v != tc0.get(k, 0)}
        print(f"  {mode} rep {i}: {json.dumps(r)}", flush=True)
        return r

    def run_mode(self, mode: str, mnt: Path, reps: int) -> dict:
        print(f"mode {mode}", flush=True)
        return self.summarize([self.rep(mode, i, mnt) for i in range(reps)])

    def summarize(self, out: list[dict]) -> dict:
        lat = sorted(r["latency_s"] for r in out)
        p95 = lat[min(len(lat) - 1, int(round(0.95 * (len(lat) - 1))))]
        return {"reps": out, "mean_s": round(sum(lat) / len(lat), 3), "p95_s": p95,
                "write_s_mean": round(sum(r["write_s"] for r in out) / len(out), 3),
                "train_mount_cpu_s_mean": (round(sum(r["train_mount_cpu_s"] for r in out) / len(out), 3)
                                           if out[0].get("train_mount_cpu_s") is not None else None),
                "wan_over_needed": round(sum(r["wan_bytes"] for r in out) / sum(r["needed_bytes"] for r in out), 2),
                "wan_bytes_over_checkpoint": round(sum(r["wan_bytes"] for r in out)
                                                   / (len(out) * self.facts["bytes"]), 3)}

    # -- second run: 16 jobs share the link ---------------------------------------------------
    def shared_link(self, n_jobs: int) -> dict:
        """n_jobs checkpoints committed at once; two are anomaly evals (signalled first).
        Each job's time = commit -> complete in the eval tier (+ its merge from the tier)."""
        def commit_all(jobs, tag):
            t = {}
            for j in jobs:                        # every job's data files first, then the markers:
                dst = self.train / f"ckpt/{tag}/{j}/step_1"   # all checkpoints in flight together
                dst.mkdir(parents=True)
                for p in sorted(self.src.iterdir()):
                    if p.name != ".metadata":
                        shutil.copyfile(p, dst / p.name)
            for j in jobs:
                shutil.copyfile(self.src / ".metadata", self.train / f"ckpt/{tag}/{j}/step_1/.metadata")
                t[j] = time.time()
            return t

        def wait_done(tag, commits, timeout):
            done = {}
            deadline = time.monotonic() + timeout
            while len(done) < len(commits) and time.monotonic() < deadline:
                complete = set(self.agent.status().get("follow", {}).get("complete", []))
                for j in commits:
                    if j not in done and f"ckpt/{tag}/{j}/step_1" in complete:
                        done[j] = time.time()
                time.sleep(0.02)
            return {j: round(done[j] - commits[j], 3) if j in done else None for j in commits}

        # idle baselines: one normal and one anomaly job alone on the link
        t0 = time.time() - self.t_relay0
        idle_n = wait_done("idle", commit_all(["n"], "idle"), 120)["n"]
        self.agent.signal("ckpt/idle_a", severity=3.0)
        idle_a = wait_done("idle_a", commit_all(["a"], "idle_a"), 120)["a"]
        jobs = [f"job{k:02d}" for k in range(n_jobs)]
        anomalies = jobs[-2:]                     # committed last: they must overtake the others
        for j in anomalies:
            self.agent.signal(f"ckpt/shared/{j}", severity=3.0)
        times = wait_done("shared", commit_all(jobs, "shared"), 600)
        self.phases.append(("shared-link", t0, time.time() - self.t_relay0))
        for j in anomalies:
            self.agent.signal(f"ckpt/shared/{j}", clear=True)
        others = [times[j] for j in jobs[:-2] if times[j] is not None]
        # "others" lose time only to the anomalies: their ideal is the fair-share finish of the
        # same bytes without anomalies, i.e. the whole batch's link time (n_jobs x idle copy).
        ideal_others = n_jobs * idle_n
        anomaly = [times[j] for j in anomalies if times[j] is not None]
        return {"jobs": n_jobs, "idle_normal_s": idle_n, "idle_anomaly_s": idle_a, "times_s": times,
                "anomaly_slowdown": round(max(anomaly) / idle_a, 3) if anomaly and idle_a else None,
                "others_mean_s": round(sum(others) / len(others), 3) if others else None,
                "others_ideal_s": round(ideal_others, 3),
                "others_slowdown": round(max(others) / ideal_others - 1, 3) if others else None}


def plot(stats: dict, phases, path: Path, bw: float) -> None:
    plt = pyplot_or_none()
    if plt is None:
        return
    dt = stats["sample_interval_s"]
    xs = [t for t, _ in stats["samples"]["down"]]
    ys = [b * 8 / dt / 1e6 for _, b in stats["samples"]["down"]]
    fig, ax = plt.subplots(figsize=(11, 4))
    colors = {"remote": "tab:red", "rclone": "tab:orange", "hintfs": "tab:green", "shared-link": "tab:blue"}
    seen = set()
    for mode, a, b in phases:
        ax.axvspan(a, b, alpha=0.12, color=colors.get(mode, "grey"), label=None if mode in seen else mode)
        seen.add(mode)
    ax.plot(xs, ys, lw=0.8, color="black", label="WAN down (eval side)")
    ax.axhline(bw * 8 / 1e6, ls="--", color="grey", lw=0.8, label="link bandwidth")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("Mbit/s")
    ax.set_title("Cross-DC link utilization (relay, 50 ms each way)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def warm_free_pages(mb: int) -> None:
    """Touch `mb` MiB of fresh memory on this CPU and free it (--warm-pages-mb). On this VM free
    memory left idle goes back to the host (virtio-balloon free page reporting); the next page
    cache write into it faults each page in on the host, about 15x slower than into memory freed
    just before (bench/notes/cross_dc_eval.md, "the VM's cold free pages"). The idea: freed just now, the
    pages are backed when the write takes them. Measured, it did not work: a 28 MiB page-cache
    write after warming 256 MiB or 1 GiB this way cost what a cold one does (bench/notes/cross_dc_eval.md,
    "the order of the reps")."""
    buf = bytearray(mb << 20)
    buf[::4096] = b"\1" * (len(buf) // 4096)
    del buf


def write_ratio(modes: dict) -> dict:
    """The training write with streaming against without it (`write_stream_over_copy`: the
    means of all reps), and each mode's write by the hintfs mode of the rep before it.

    What came before matters here. A copy rep right after a stream rep wrote faster than one
    after a copy rep in 7 of 8 comparisons, and a stream rep after a copy rep wrote slower, on
    average, than one after a stream rep in every run. After a 3 s rest (`--rest-s`) the copy
    reps' head start was gone. On this VM free memory goes back to the host within seconds, and
    a page-cache write into it costs several times one into memory freed just before
    (`bench/free_page_cost.py`); a stream rep frees its staging pages when its sender finishes,
    just before the next rep, which is the likely cause. With every pair copy-first, every copy rep had that head start and every
    stream rep followed a copy rep: the ratio came out about 0.03 low (bench/notes/cross_dc_eval.md, "the
    order of the reps").
    `--pair-order abba` (the default) gives each mode as many reps after either mode;
    `--rest-s` lets every write start in cold memory."""
    if not modes.get("hintfs") or not modes.get("hintfs_stream"):
        return {"write_stream_over_copy": None}

    def mean(xs: list[float]) -> float | None:
        return round(sum(xs) / len(xs), 3) if xs else None

    cells = {f"{m}_after_{b}": [r["write_s"] for r in modes[m]["reps"] if r.get("after") == b]
             for m in ("hintfs", "hintfs_stream") for b in ("hintfs", "hintfs_stream")}
    return {"write_stream_over_copy": round(modes["hintfs"]["write_s_mean"]
                                            / modes["hintfs_stream"]["write_s_mean"], 3),
            "write_s_by_rep_before": {k: {"n": len(v), "mean": mean(v)} for k, v in cells.items()}}


def pair_order(how: str, i: int) -> tuple[str, str]:
    """The two hintfs modes of rep `i`, in the order they run (--pair-order)."""
    copy_first = how == "copy-first" or (how == "abba" and i % 2 == 0)
    return ("hintfs", "hintfs_stream") if copy_first else ("hintfs_stream", "hintfs")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small run, < 3 minutes")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--remote-reps", type=int, default=None, help="reps of the slow direct-remote mode")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--pattern", default=r"vision\.", help="regex of the tensors the merge loads")
    ap.add_argument("--delay-ms", type=float, default=50.0, help="one way")
    ap.add_argument("--bandwidth-mbit", type=float, default=400.0)
    ap.add_argument("--chunk-kb", type=int, default=1024, help="agent link_chunk_bytes")
    ap.add_argument("--stream-chunk-kb", type=int, default=1024, help="[stream] chunk_bytes")
    ap.add_argument("--first-by-reads", action=argparse.BooleanOptionalAction, default=True,
                    help="[stream] first_by_reads: the chunks the previous checkpoint's merge read go first")
    ap.add_argument("--others-in-flight", type=int, default=1, help="[stream] others_in_flight")
    ap.add_argument("--others-while-writing", action=argparse.BooleanOptionalAction, default=True,
                    help="[stream] others_while_writing")
    ap.add_argument("--stream-poll-ms", type=float, default=20.0, help="[stream] poll_interval_s, in ms")
    ap.add_argument("--stream-parallel", type=int, default=8, help="[stream] parallel")
    ap.add_argument("--stream-sender", choices=("process", "threads"), default="process", help="[stream] sender")
    ap.add_argument("--train-host-cache", action="store_true",
                    help="give the training mounts a host cache ([cache] dir): their writes then reach "
                         "the staging file by FUSE passthrough, not through the daemon")
    ap.add_argument("--stream-sender-nice", type=int, default=5, help="[stream] sender_nice")
    ap.add_argument("--rest-s", type=float, default=0.0,
                    help="a diagnostic: sleep this long before each hintfs rep, so that each write starts "
                         "in memory that has gone back to the host, whatever the rep before freed "
                         "(write_ratio says why it matters)")
    ap.add_argument("--warm-pages-mb", type=int, default=0,
                    help="a diagnostic: touch and free this many MiB of anonymous memory just before each "
                         "checkpoint write (both modes). It did not make the page-cache writes warm here "
                         "(bench/notes/cross_dc_eval.md, \"the order of the reps\")")
    ap.add_argument("--copy-mount-with-stream", action="store_true",
                    help="a diagnostic: the copy-after-close training mount gets a [stream] table for a "
                         "prefix nothing is written under (a sender process, no streams)")
    ap.add_argument("--pair-order", choices=("copy-first", "stream-first", "abba"), default="abba",
                    help="the order of the two hintfs modes in each rep: swapped every other rep (the "
                         "default: each mode follows either mode equally often), copy after close "
                         "first (before 2026-12-03: every copy rep followed a stream rep), or streaming "
                         "first")
    ap.add_argument("--stop-sender-during-write", action="store_true",
                    help="a diagnostic: SIGSTOP the stream sender from the first write to the commit, "
                         "so that streaming's cost to the writer without the sender's CPU shows")
    ap.add_argument("--hold-staging", action="store_true",
                    help="a diagnostic: during each hintfs write the bench holds every staging file the "
                         "training mount opens until the commit (StagingHolder), in both modes")
    ap.add_argument("--floor-sender", choices=("relay", "direct"), default=None,
                    help="a diagnostic: the stream sender stopped during the write (as "
                         "--stop-sender-during-write), and beside the write bench/send_floor.py sends "
                         "the same bytes the cheapest way (mmap CRC + sendfile) to a sink on the eval "
                         "side: through an emulated link of its own (relay), or straight, paced at the "
                         "link's rate (direct: the emulated link's CPU left out)")
    ap.add_argument("--stream-sender-cpus", choices=("inherit", "training", "eval"), default="inherit",
                    help="with --cpu-split, [stream] sender_cpus: the training half (as inherited, but "
                         "set), the eval half (a host whose sender has a core the job leaves free; here "
                         "that core is the eval DC's, so it measures the writer's side only), or unset")
    ap.add_argument("--eval-nice", type=int, default=0,
                    help="CPU niceness of the emulated other side: the relay (the link) and the eval DC's "
                         "agent (0: none, the default; 19 starves the link while the writer runs and did "
                         "not change the writer's time here)")
    ap.add_argument("--cpu-split", action=argparse.BooleanOptionalAction, default=True,
                    help="training side and link on half the CPUs, the eval DC on the other half "
                         "(default; --no-cpu-split: all processes share all CPUs)")
    ap.add_argument("--link-cpus", choices=("training", "eval", "all"), default="all",
                    help="with --cpu-split, the CPUs that run the relay that emulates the link (default "
                         "all: either half, whichever is free, as a link with resources of its own would; "
                         "training: beside the writer, the default until 2026-12-02, which charges the "
                         "link's forwarding of the stream to the writer's CPU; eval: the eval half)")
    ap.add_argument("--tier-dir", default=None,
                    help="folder for the eval tier agent's data (default: the bench's temporary folder, on "
                         "the same disk as the training side's S3 bucket and spools)")
    ap.add_argument("--seed-journal", type=int, default=0,
                    help="put this many records of unfollowed files in the journal first (its listing's cost)")
    ap.add_argument("--modes", default="local,remote,rclone,hintfs,hintfs_stream",
                    help="comma-separated modes to run (the rest are null with a reason)")
    ap.add_argument("--jobs", type=int, default=16, help="second run: jobs sharing the link (0: skip)")
    ap.add_argument("--skip-rclone", action="store_true")
    ap.add_argument("--no-read-hints", action="store_true",
                    help="the merge does not tell the eval mount which ranges it reads (hintfs modes)")
    ap.add_argument("--eval-read-ahead-kb", type=int, default=None,
                    help="[mount] read_ahead_kb of the hintfs eval mount (default: the mount's default)")
    ap.add_argument("--keep-logs", action="store_true", help="INFO logs of the mounts and the agent, kept")
    ap.add_argument("--out", default=str(RESULTS / "cross_dc_eval.json"))
    a = ap.parse_args()
    if a.quick:
        a.reps = 2
        a.remote_reps = 1 if a.remote_reps is None else a.remote_reps
    remote_reps = a.remote_reps or a.reps
    t_begin = time.monotonic()
    b = Bench(a)
    result: dict = {"config": {"delay_ms_each_way": a.delay_ms, "bandwidth_mbit": a.bandwidth_mbit, "reps": a.reps,
                         "eval_nice": a.eval_nice, "link_cpus": a.link_cpus, "stream_chunk_kb": a.stream_chunk_kb,
                         "first_by_reads": a.first_by_reads, "others_in_flight": a.others_in_flight,
                         "others_while_writing": a.others_while_writing, "tier_dir": a.tier_dir,
                         "stream_poll_ms": a.stream_poll_ms,
                         "stream_parallel": a.stream_parallel, "cpus": os.cpu_count(),
                         "stream_sender": a.stream_sender, "stream_sender_nice": a.stream_sender_nice,
                         "stop_sender_during_write": a.stop_sender_during_write, "floor_sender": a.floor_sender,
                         "hold_staging": a.hold_staging,
                         "pair_order": a.pair_order, "warm_pages_mb": a.warm_pages_mb, "rest_s": a.rest_s,
                         "copy_mount_with_stream": a.copy_mount_with_stream,
                         "stream_sender_cpus": a.stream_sender_cpus, "train_host_cache": a.train_host_cache,
                         "remote_reps": remote_reps, "pattern": a.pattern, "quick": a.quick,
                         "s3_server": None, "cpu_split": None},
              "s3_server": None,
              "merge_latency_s": {"remote": None, "rclone": None, "hintfs": None, "hintfs_stream": None,
                                  "local": None},
              "wan_bytes_over_checkpoint": {},
              "anomaly_slowdown": None, "others_slowdown": None, "reasons": {}}
    try:
        result["config"]["cpu_split"] = b.cpu_split
        b.start()
        # The WAN relay is a thread of this process: a full garbage collection here (torch is
        # imported for the checkpoint's facts) held the interpreter lock, and so the link, for
        # 119-188 ms once a run. What exists now is never freed before the end: leave it out.
        gc.freeze()
        result["s3_server"] = result["config"]["s3_server"] = b.s3.name if b.s3 else None
        result["checkpoint"] = b.facts
        modes = {}
        wanted = set(a.modes.split(","))
        for m in ("local", "remote", "rclone", "hintfs", "hintfs_stream"):
            if m not in wanted:
                result["reasons"][m] = "not run (--modes)"
        if "local" in wanted:
            local = b.tmp / "local"
            local.mkdir()
            modes["local"] = b.run_mode("local", local, a.reps)
        if "remote" in wanted:
            modes["remote"] = b.run_mode("remote", b.ev_remote, remote_reps)
        if "rclone" not in wanted:
            pass
        elif a.skip_rclone:
            result["reasons"]["rclone"] = "skipped (--skip-rclone)"
        else:
            rmnt = b.start_rclone()
            if rmnt is None:
                result["reasons"]["rclone"] = "rclone mount did not come up"
            else:
                    modes["rclone"] = b.run_mode("rclone", rmnt, a.reps)
        # the two hintfs modes alternate rep by rep: their write times are compared (same run)
        for m in ("hintfs", "hintfs_stream"):
            if m in wanted:
                modes[m] = {"reps": []}
        after = None     # the hintfs mode of the rep before (write_ratio says why it matters)
        for i in range(a.reps):
            for m in pair_order(a.pair_order, i):
                if m in wanted:
                    r = b.rep(m, i, b.ev_hint)
                    r["after"], after = after, m
                    modes[m]["reps"].append(r)
        for m in ("hintfs", "hintfs_stream"):
            if m in wanted:
                modes[m] = b.summarize(modes[m]["reps"])
        result["modes"] = modes
        for m, v in modes.items():
            result["merge_latency_s"][m] = v["mean_s"]
        result["merge_latency_p95_s"] = {m: v["p95_s"] for m, v in modes.items()}
        result["wan_over_needed"] = {m: v["wan_over_needed"] for m, v in modes.items()}
        result["wan_bytes_over_checkpoint"] = {m: v["wan_bytes_over_checkpoint"] for m, v in modes.items()}
        result["write_s_mean"] = {m: v["write_s_mean"] for m, v in modes.items()}
        result["train_mount_cpu_s_mean"] = {m: v["train_mount_cpu_s_mean"] for m, v in modes.items()}
        if a.jobs:
            print(f"second run: {a.jobs} jobs share the link", flush=True)
            sl = b.shared_link(a.jobs)
            result["shared_link"] = sl
            result["anomaly_slowdown"] = sl["anomaly_slowdown"]
            result["others_slowdown"] = sl["others_slowdown"]
        else:
            result["reasons"]["shared_link"] = "skipped (--jobs 0)"
        hs = result["merge_latency_s"]["hintfs_stream"]
        result.update(write_ratio(modes))
        r, h = result["merge_latency_s"]["remote"], result["merge_latency_s"]["hintfs"]
        rc = result["merge_latency_s"]["rclone"]
        lo = result["merge_latency_s"]["local"]
        result["goals"] = {
            "hintfs_vs_remote_reduction": round(1 - h / r, 3) if r and h else None,
            "hintfs_over_remote": round(h / r, 3) if r and h else None,
            "hintfs_over_local": round(h / lo, 2) if lo and h else None,
            "ge_90pct_below_remote": bool(r and h and h <= 0.1 * r),
            "below_rclone": bool(rc and h and h < rc) if rc else None,
            "stream_over_remote": round(hs / r, 3) if r and hs else None,
            "stream_over_local": round(hs / lo, 2) if lo and hs else None,
            "stream_le_0_3s": bool(hs is not None and hs <= 0.3),
            "stream_wan_le_1_05x": (result["wan_bytes_over_checkpoint"].get("hintfs_stream", 9) <= 1.05)
            if hs else None,
            "stream_write_ge_0_95x": (result["write_stream_over_copy"] >= 0.95)
            if result["write_stream_over_copy"] else None,
            "anomaly_le_1_5x": (result["anomaly_slowdown"] <= 1.5) if result["anomaly_slowdown"] else None,
            "others_lt_20pct": (result["others_slowdown"] < 0.2) if result["others_slowdown"] is not None else None,
        }
    except Exception as e:
        result["reasons"]["error"] = repr(e)[:2000]
        print("ERROR:", repr(e), file=sys.stderr, flush=True)
        for name in ("agent.log", "merge.log", "s3/gateway.log"):
            p = b.tmp / name
            if p.exists():
                print(f"--- {name}\n" + p.read_text()[-2000:], file=sys.stderr)
    finally:
        if b.relay is not None:
            stats = b.relay.stats()
            result["wan_total_bytes"] = stats["bytes"]
            try:
                plot(stats, b.phases, Path(a.out).with_suffix(".png"), a.bandwidth_mbit * 1e6 / 8)
            except Exception as e:
                result["reasons"]["plot"] = repr(e)
        b.cleanup()
    result["wall_s"] = round(time.monotonic() - t_begin, 1)
    for k in ("rclone", "hintfs", "hintfs_stream", "remote", "local"):
        if result["merge_latency_s"][k] is None and k not in result["reasons"]:
            result["reasons"][k] = "not measured (see error)"
    if result["anomaly_slowdown"] is None and "shared_link" not in result["reasons"]:
        result["reasons"]["shared_link"] = "not measured (see error)"
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result.get(k) for k in ("s3_server", "merge_latency_s", "merge_latency_p95_s",
                                                  "wan_over_needed", "wan_bytes_over_checkpoint",
                                                  "write_s_mean", "write_stream_over_copy",
                                                  "write_s_by_rep_before",
                                                  "anomaly_slowdown", "others_slowdown", "goals", "reasons",
                                                  "wall_s")}, indent=1))
    return 0 if "error" not in result["reasons"] else 1


if __name__ == "__main__":
    sys.exit(main())

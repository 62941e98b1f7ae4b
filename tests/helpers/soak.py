"""A day compressed (issue 37, item 4): one store, two storage agents and two mounts (a training
host's that writes checkpoints, an eval host's that reads them and hints restart storms), all real
processes started through the CLI, run for a while on a plan of what happens when:

- a checkpoint every `checkpoint_every_s` (files of random sizes, `.metadata` last, written through
  the training mount; the oldest beyond `keep_last` removed through it);
- an eval every `eval_every_s`: the latest checkpoint read through the eval mount, and each of
  `media_files` JPEGs of the store as `.tensor` (decoded by the mount's `[[transforms]]` rule;
  every read must give the arrays of the first);
- a restart storm every `storm_every_s`: a replication hint of the latest checkpoint on the eval
  mount, then `storm_readers` threads read all of it at once;
- a restart every `restart_every_s`, in turn of an agent (SIGTERM, start) and of the eval mount
  (`hintfs umount`, mount);
- a SIGKILL every `kill_every_s`, in turn of an agent and of the eval mount's daemon, then `hintfs
  umount` of the dead mount and a new one;
- a sample every `sample_every_s` of each daemon's RSS, open fds, threads and CPU time (/proc).

Every read is checked against the SHA-256 of what was written; at the end every checkpoint kept
is read back from the store and through the eval mount. A user-visible error the plan did not
inject is recorded in `errors`; a kept file that is missing or differs counts in `lost_files`.
Drift: per daemon role, the mean of the last quarter of the run over the second quarter's (RSS,
fds) and the CPU seconds per operation of the same quarters. `bench/soak.py` runs it for hours;
`tests/system/test_soak.py` for seconds (errors and lost files, not drift). Only for root with
/dev/fuse, like the tests. Every loop is bounded by the plan's duration.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.helpers.mounts import force_unmount, mount_in_process
from tests.helpers.ports import free_port
from tests.helpers.procs import REPO, wait_for

TOKEN = "soak-token"


@dataclass
class SoakPlan:
    duration_s: float
    checkpoint_every_s: float = 30.0
    files_per_checkpoint: int = 16
    min_file_bytes: int = 4096
    max_file_bytes: int = 1 << 20
    keep_last: int = 3
    eval_every_s: float = 10.0
    storm_every_s: float = 600.0
    storm_readers: int = 16
    restart_every_s: float = 300.0
    kill_every_s: float = 1800.0
    sample_every_s: float = 10.0
    media_files: int = 4          # JPEGs in the store, read as `.tensor` through the eval mount at each eval
    seed: int = 0


@dataclass
class Sample:
    t: float
    role: str
    pid: int
    rss_kb: int
    fds: int
    threads: int
    cpu_s: float
    ops: int


def proc_sample(pid: int) -> tuple[int, int, int, float] | None:
    """(RSS KiB, open fds, threads, CPU seconds) of a live process, None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    info = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss = int(info.get("VmRSS", "0 kB").split()[0])
    threads = int(info.get("Threads", "0"))
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks   # utime + stime (fields 14, 15 of stat)
    return rss, fds, threads, cpu


def drift_by_role(samples: list[Sample], duration_s: float) -> dict[str, dict[str, float | None]]:
    """Per daemon role and metric, (last quarter's mean) / (second quarter's mean); for CPU, seconds
    per operation over each quarter (a restarted daemon's CPU counts from its start). A role
    without samples in both quarters is left out."""
    out: dict[str, dict[str, float | None]] = {}
    q = duration_s / 4
    for role in sorted({s.role for s in samples}):
        mine = [s for s in samples if s.role == role]
        second = [s for s in mine if q <= s.t < 2 * q]
        last = [s for s in mine if s.t >= 3 * q]
        if not second or not last:
            continue
        row: dict[str, float | None] = {"rss": None, "fds": None, "cpu_per_op": None}
        for key, attr in (("rss", "rss_kb"), ("fds", "fds")):
            a = sum(getattr(s, attr) for s in second) / len(second)
            b = sum(getattr(s, attr) for s in last) / len(last)
            if a > 0:
                row[key] = b / a
        per_op = []
        for part in (second, last):
            cpu = ops = 0.0
            for x, y in zip(part, part[1:]):
                if x.pid == y.pid and y.ops > x.ops:
                    cpu += y.cpu_s - x.cpu_s
                    ops += y.ops - x.ops
            per_op.append(cpu / ops if ops else None)
        if per_op[0] and per_op[1] is not None:
            row["cpu_per_op"] = per_op[1] / per_op[0]
        out[role] = row
    return out


def drift(samples: list[Sample], duration_s: float) -> dict:
    """Per metric, the largest over roles of `drift_by_role`."""
    out: dict[str, float | None] = {"rss": None, "fds": None, "cpu_per_op": None}
    for row in drift_by_role(samples, duration_s).values():
        for key, value in row.items():
            if value is not None:
                out[key] = max(out[key] or 0.0, value)
    return out


@dataclass
class Soak:
    base: Path
    plan: SoakPlan
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep      # (a test passes a virtual clock and its sleep)
    log: Callable[[str], None] = lambda line: None
    errors: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    kills: int = 0
    restarts: int = 0
    ops: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.plan.seed)
        self.store = self.base / "store"
        self.store.mkdir(parents=True, exist_ok=True)
        token = self.base / "token"
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)
        self.token = token
        self.locations = [f"grpc://127.0.0.1:{free_port()}" for _ in range(2)]
        self.agents: list[subprocess.Popen | None] = [None, None]
        self.expected: dict[str, dict[str, str]] = {}    # checkpoint -> file -> sha256
        self.order: list[str] = []
        self.mounts: dict[str, tuple[Path, Path, Path]] = {}   # role -> (config, mountpoint, log)
        self.tensors: dict[str, str] = {}     # media file -> digest of its `.tensor`'s arrays (first read)
        if self.plan.media_files:
            from tests.helpers.media import jpeg_file
            (self.store / "media").mkdir(exist_ok=True)
            for k in range(self.plan.media_files):
                jpeg_file(self.store / "media" / f"{k}.jpg", seed=self.plan.seed * 100 + k, w=96, h=64)

    # -- processes ------------------------------------------------------------------------------
    def _agent_config(self, i: int) -> Path:
        loc = self.locations[i]
        cfg = self.base / f"agent{i}.toml"
        others = [x for x in self.locations if x != loc]
        cfg.write_text(f'[store]\nuri = "file://{self.store}"\n[agent]\nlocation = "{loc}"\n'
                       f'data_dir = "{self.base / f"agent{i}"}"\ntoken_file = "{self.token}"\n'
                       f'[agents]\nlocations = {json.dumps(others)}\ntoken_file = "{self.token}"\n'
                       f'[logging]\nfile = "{self.base / f"agent{i}.log"}"\n')
        return cfg

    def start_agent(self, i: int) -> None:
        from hintfs.agent.client import AgentClient
        self.agents[i] = subprocess.Popen([sys.executable, "-m", "hintfs.cli", "agent", str(self._agent_config(i))],
                                          cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def up() -> bool:
            try:
                return bool(AgentClient(self.locations[i], token=TOKEN, timeout_s=1).ping())
            except OSError:
                return False
        if not wait_for(up, timeout=30):
            raise RuntimeError(f"agent {i} did not start: {self.base / f'agent{i}.log'}")

    def stop_agent(self, i: int, sig: int = signal.SIGTERM) -> None:
        p = self.agents[i]
        if p is None or p.poll() is not None:
            return
        p.send_signal(sig)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def start_mount(self, role: str) -> None:
        mnt = self.base / role
        mnt.mkdir(exist_ok=True)
        log = self.base / f"{role}.log"
        cfg = self.base / f"{role}.toml"
        cfg.write_text(f'[store]\nuri = "file://{self.store}"\n'
                       f'[agents]\nlocations = {json.dumps(self.locations)}\ntoken_file = "{self.token}"\n'
                       f'[logging]\nfile = "{log}"\n'
                       '[[transforms]]\nglob = "media/*.jpg"\nkind = "image"\n'
                       'params = { size = 32, crop = [24, 24] }\n')
        mount_in_process(cfg, mnt, log)
        self.mounts[role] = (cfg, mnt, log)

    def stop_mount(self, role: str) -> None:
        import argparse
        from hintfs.cli.umount import cmd_umount
        _cfg, mnt, _log = self.mounts[role]
        if os.path.ismount(mnt):
            try:
                cmd_umount(argparse.Namespace(mountpoint=str(mnt), timeout=None))
            except Exception as err:  # noqa: BLE001 - a dead daemon's mount: forced below
                self.log(f"umount {mnt}: {err}")
        force_unmount(mnt)

    def mount_pid(self, role: str) -> int:
        return int(json.loads((self.mounts[role][1] / ".hintfs" / "stats").read_text())["pid"])

    def pids(self) -> dict[str, int]:
        out = {f"agent{i}": p.pid for i, p in enumerate(self.agents) if p is not None and p.poll() is None}
        for role in self.mounts:
            try:
                out[role] = self.mount_pid(role)
            except (OSError, ValueError, KeyError):
                pass
        return out

    # -- the plan's actions ---------------------------------------------------------------------
    def _error(self, what: str, err: BaseException | str) -> None:
        line = f"{self.clock() - self.t0:.1f}s {what}: {err}"
        self.errors.append(line)
        self.log("ERROR " + line)

    def checkpoint(self, step: int) -> None:
        name = f"ckpt/step_{step:06d}"
        train = self.mounts["train"][1]
        folder = train / name
        files: dict[str, str] = {}
        try:
            folder.mkdir(parents=True)
            for k in range(self.plan.files_per_checkpoint):
                data = self.rng.randbytes(self.rng.randint(self.plan.min_file_bytes, self.plan.max_file_bytes))
                (folder / f"__{k}_0.distcp").write_bytes(data)
                files[f"__{k}_0.distcp"] = hashlib.sha256(data).hexdigest()
                self.ops += 1
            meta = self.rng.randbytes(4096)
            (folder / ".metadata").write_bytes(meta)
            files[".metadata"] = hashlib.sha256(meta).hexdigest()
            self.ops += 1
        except OSError as err:
            self._error(f"write {name}", err)
            return
        self.expected[name] = files
        self.order.append(name)
        while len(self.order) > self.plan.keep_last:
            old = self.order.pop(0)
            try:
                for f in self.expected.pop(old):
                    (train / old / f).unlink()
                (train / old).rmdir()
                self.ops += 1
            except OSError as err:
                self._error(f"remove {old}", err)

    def _read_checked(self, root: Path, name: str, files: dict[str, str]) -> int:
        bad = 0
        for f, digest in files.items():
            data = (root / name / f).read_bytes()
            self.ops += 1
            if hashlib.sha256(data).hexdigest() != digest:
                bad += 1
                self._error(f"read {name}/{f} through {root.name}", f"{len(data)} bytes, not what was written")
        return bad

    def evaluate(self) -> None:
        self.read_tensors()
        if not self.order:
            return
        name = self.order[-1]
        try:
            self._read_checked(self.mounts["eval"][1], name, self.expected[name])
        except OSError as err:
            self._error(f"eval {name}", err)

    def read_tensors(self) -> None:
        """Each media file's `.tensor` through the eval mount: the same arrays at every read
        (tensor mode or raw mode decoded here, `load_sample`)."""
        from hintfs.transforms.container import load_sample
        mnt = self.mounts["eval"][1]
        for k in range(self.plan.media_files):
            name = f"media/{k}.jpg"
            try:
                arrays = load_sample(mnt / f"{name}.tensor")
            except OSError as err:
                self._error(f"read {name}.tensor", err)
                continue
            self.ops += 1
            h = hashlib.sha256()
            for key in sorted(arrays):
                h.update(key.encode() + str(arrays[key].shape).encode() + arrays[key].tobytes())
            digest = self.tensors.setdefault(name, h.hexdigest())
            if h.hexdigest() != digest:
                self._error(f"read {name}.tensor", "arrays differ from the first read")

    def storm(self) -> None:
        from hintfs import client
        if not self.order:
            return
        name = self.order[-1]
        files = self.expected[name]
        mnt = self.mounts["eval"][1]
        try:
            client.set_replication_hints(str(mnt), f"storm{self.restarts + self.kills}",
                                         {f"{name}/{f}": 4096 for f in files}, ttl_s=60, deadline_s=30)
        except (OSError, ValueError) as err:
            self._error(f"hint {name}", err)
            return

        def reader() -> None:
            try:
                self._read_checked(mnt, name, files)
            except OSError as err:
                self._error(f"storm read {name}", err)
        threads = [threading.Thread(target=reader) for _ in range(self.plan.storm_readers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def restart(self, n: int) -> None:
        self.restarts += 1
        if n % 2 == 0:
            i = (n // 2) % 2
            self.log(f"restart agent{i}")
            self.stop_agent(i)
            self.start_agent(i)
        else:
            self.log("restart the eval mount")
            self.stop_mount("eval")
            self.start_mount("eval")

    def kill(self, n: int) -> None:
        self.kills += 1
        if n % 2 == 0:
            i = (n // 2) % 2
            self.log(f"SIGKILL agent{i}")
            self.stop_agent(i, signal.SIGKILL)
            self.start_agent(i)
        else:
            self.log("SIGKILL the eval mount's daemon")
            os.kill(self.mount_pid("eval"), signal.SIGKILL)
            self.stop_mount("eval")
            self.start_mount("eval")

    def sample(self) -> None:
        t = self.clock() - self.t0
        for role, pid in self.pids().items():
            got = proc_sample(pid)
            if got is not None:
                self.samples.append(Sample(t, role, pid, *got, self.ops))

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> dict:
        p = self.plan
        self.t0 = self.clock()
        for i in range(2):
            self.start_agent(i)
        self.start_mount("train")
        self.start_mount("eval")
        every = {"checkpoint": p.checkpoint_every_s, "eval": p.eval_every_s, "storm": p.storm_every_s,
                 "restart": p.restart_every_s, "kill": p.kill_every_s, "sample": p.sample_every_s}
        due = {k: v for k, v in every.items()}
        due["checkpoint"] = 0.0
        due["sample"] = 0.0
        counts = dict.fromkeys(every, 0)
        try:
            while True:
                now = self.clock() - self.t0
                if now >= p.duration_s:
                    break
                what = min(due, key=lambda k: due[k])
                if due[what] > now:
                    self.sleep(min(due[what] - now, p.duration_s - now, 1.0))
                    continue
                n = counts[what]
                counts[what] += 1
                due[what] += every[what]
                if what == "checkpoint":
                    self.checkpoint(n)
                elif what == "eval":
                    self.evaluate()
                elif what == "storm":
                    self.storm()
                elif what == "restart":
                    self.restart(n)
                elif what == "kill":
                    self.kill(n)
                else:
                    self.sample()
            lost = self.verify()
        finally:
            for role in list(self.mounts):
                self.stop_mount(role)
            for i in range(2):
                self.stop_agent(i)
        duration = self.clock() - self.t0
        return {"duration_s": round(duration, 1), "errors": self.errors, "lost_files": lost,
                "drift": drift(self.samples, duration),
                "drift_by_role": drift_by_role(self.samples, duration), "kills": self.kills, "restarts": self.restarts,
                "ops": self.ops, "checkpoints": counts["checkpoint"], "evals": counts["eval"],
                "storms": counts["storm"], "samples": len(self.samples), "tensor_files": len(self.tensors),
                "plan": asdict(p)}

    def verify(self) -> int:
        """Every kept checkpoint's files, from the store itself and through the eval mount."""
        lost = 0
        for name, files in self.expected.items():
            for root in (self.store, self.mounts["eval"][1]):
                for f, digest in files.items():
                    try:
                        ok = hashlib.sha256((root / name / f).read_bytes()).hexdigest() == digest
                    except OSError:
                        ok = False
                    if not ok:
                        lost += 1
                        self._error(f"verify {name}/{f} in {root}", "missing or different")
        return lost

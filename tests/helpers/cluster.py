"""A cluster on one machine: K storage hosts and M training hosts as network namespaces.

Each host is a network namespace with its own address on a private /24, joined to one bridge by a
veth pair; its NIC's bandwidth is a `tc tbf` qdisc on both ends of the pair (the namespace's end
shapes what the host sends, the bridge's end what it receives). This kernel has tbf but no netem:
latency between datacenters is the WAN relay's (`tests/helpers/wan.py`).

- A storage host runs `hintfs agent CONFIG` (started as `ip netns exec NS python -m hintfs.cli
  agent CONFIG`), with a token file, listening on its own address; every agent trusts the others
  as copy sources (`[agents] locations`, the tree fan-out).
- A training host runs `hintfs mount CONFIG MNT` (started as `ip netns exec NS python -m hintfs.cli
  mount CONFIG MNT`), with the config an operator would write: the store, the agents' addresses,
  the token file, `[replicas]`. `ip netns exec` gives the command a mount namespace of its own
  (a slave of the machine's: the store and the repository are seen, nothing mounted inside leaks
  out), so each training host has its own mount table, as a real host has: its FUSE mount is seen
  by processes that join the daemon's namespaces (`Cluster.exec_argv`: `nsenter -t PID -m -n`),
  and it goes away with the daemon.

Everything is named with one prefix, `hfc<4 hex>-` (namespaces `hfcXXXX-s0`, `hfcXXXX-t0`, host-side
veths of the same names, the bridge `hfcXXXX-br`, the run's folder `<tmp>/hfcXXXX-cluster`, and a
bench's data beside it, `<tmp>/hfcXXXX-cluster-*`, marked with `write_owner`), and
torn down by `Cluster.close()` (on exit, error, and SIGINT/SIGTERM/SIGHUP through
`signals_raise()`). After a SIGKILL of the harness, `cleanup()` (`python -m tests.helpers.cluster
cleanup`, or `python bench/cluster.py cleanup`) finds the leftovers by the prefix: namespaces and
links by name, processes by their network namespace (or a command line naming the run's folder),
mounts in any process's mount table under the run's folder; it kills, unmounts and deletes them.
Without `--prefix` it touches only runs whose harness process is gone (the run's `owner.json`).

Part of the harness the tests and the benches share (`tests/helpers/`); no pytest here.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.helpers.procs import REPO, wait_for

PREFIX_ROOT = "hfc"
RUN_RE = re.compile(r"^hfc[0-9a-f]{4}-")
AGENT_PORT = 8815
HOST_BASE = {"s": 2, "t": 130}          # storage hosts .2-.129, training hosts .130-.253
MAX_HOSTS = {"s": 128, "t": 124}
TOKEN = "cluster-token"


def _run(argv, check=True, timeout=60, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def _tempdir() -> Path:
    return Path(tempfile.gettempdir())


# -- what this machine can do ----------------------------------------------------------------
def missing_features() -> str | None:
    """None if this machine can run a cluster (root, /dev/fuse, `ip`, `nsenter`, `tc`, network
    namespaces, veth, a bridge, tbf), else the first reason it cannot. Probes with objects of a
    prefix of its own and removes them."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, FUSE mounts)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    for tool in ("ip", "tc", "nsenter", "fusermount3"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH"
    probe = f"{PREFIX_ROOT}{secrets.token_hex(2)}-"
    ns, br, veth = probe + "probe", probe + "br", probe + "v"
    steps = [
        (["ip", "netns", "add", ns], "cannot create a network namespace"),
        (["ip", "link", "add", br, "type", "bridge"], "cannot create a bridge"),
        (["ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "p"], "cannot create a veth pair"),
        (["ip", "link", "set", veth + "p", "netns", ns], "cannot move a veth into a namespace"),
        (["ip", "link", "set", veth, "master", br], "cannot attach a veth to a bridge"),
        (["tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", "8mbit", "burst", "64kb", "latency", "100ms"],
         "no tc tbf qdisc"),
        (["ip", "netns", "exec", ns, "true"], "cannot run a command in a namespace (`ip netns exec`)"),
    ]
    try:
        for argv, why in steps:
            r = _run(argv, check=False)
            if r.returncode != 0:
                return f"{why}: {r.stderr.strip()}"
        return None
    finally:
        _run(["ip", "link", "del", veth], check=False)
        _run(["ip", "link", "del", br], check=False)
        _run(["ip", "netns", "del", ns], check=False)


# -- the cluster -----------------------------------------------------------------------------
@dataclass
class Host:
    name: str               # "s0", "t3"
    ns: str                 # network namespace (also the host-side veth's name)
    ip: str
    dir: str                # its folder: config, log, data, mountpoint
    config: str = ""
    log: str = ""
    pid: int = 0            # the agent, or the mount daemon
    location: str = ""      # storage: the agent's Flight location
    mnt: str = ""           # training: the mountpoint
    mac: str = ""


@dataclass
class ClusterSpec:
    storage: int = 1
    training: int = 1
    storage_nic_mbit: float | None = 1000.0      # per storage host, each direction (None: no tbf)
    training_nic_mbit: float | None = 1000.0
    agent: dict = field(default_factory=dict)      # extra [agent] keys (max_concurrent_reads, ...)
    replicas: dict = field(default_factory=dict)   # the mounts' [replicas]
    mount_extra: str = ""                          # more TOML for the mounts
    mount_agents: int | None = None                # the mounts know the first n agents (None: all)
    log_level: str = "WARNING"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)


def _section(name: str, keys: dict) -> str:
    return f"[{name}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in keys.items())


class Cluster:
    """K storage hosts with agents, M training hosts with mounts, over one bridge.

    `with Cluster(ClusterSpec(storage=2, training=2)) as c:` builds the network, starts the agents
    and the mounts, and tears everything down at the end (also on error). `c.exec_argv(host, argv)`
    runs a command on a training host (its network and mount namespaces)."""

    def __init__(self, spec: ClusterSpec, store: str | None = None, run_id: str | None = None,
                 keep_root: bool = False):
        if spec.storage > MAX_HOSTS["s"] or spec.training > MAX_HOSTS["t"]:
            raise ValueError(f"at most {MAX_HOSTS['s']} storage and {MAX_HOSTS['t']} training hosts")
        self.spec = spec
        self.run_id = run_id or secrets.token_hex(2)
        self.prefix = f"{PREFIX_ROOT}{self.run_id}-"
        self.root = _tempdir() / f"{self.prefix}cluster"
        self.store = Path(store) if store else self.root / "store"
        self.keep_root = keep_root
        self.bridge = self.prefix + "br"
        self.subnet = ""
        self.storage: list[Host] = []
        self.training: list[Host] = []
        self._procs: dict[int, subprocess.Popen] = {}
        self._closed = False
        self.timings: dict[str, float] = {}

    # -- life cycle --------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        self.root.mkdir(parents=True)
        self.store.mkdir(parents=True, exist_ok=True)
        write_owner(self.root, self.prefix)
        t = time.monotonic()
        self._network()
        self.timings["network_s"] = round(time.monotonic() - t, 3)
        t = time.monotonic()
        self._agents()
        self.timings["agents_s"] = round(time.monotonic() - t, 3)
        t = time.monotonic()
        self._mounts()
        self.timings["mounts_s"] = round(time.monotonic() - t, 3)

    def close(self) -> None:
        """Unmount (`hintfs umount` in each host), stop the agents (SIGTERM, then SIGKILL), kill
        whatever is left in the namespaces, delete links and namespaces, remove the run's folder.
        Idempotent; never raises (leftovers are reported by `leftovers()`)."""
        if self._closed:
            return
        self._closed = True
        old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)} \
            if threading.current_thread() is threading.main_thread() else {}
        try:
            ths = [threading.Thread(target=self._umount, args=(h,)) for h in self.training if h.pid]
            for th in ths:
                th.start()
            for th in ths:
                th.join(60)
            for h in self.storage:
                p = self._procs.get(h.pid)
                if p is not None and p.poll() is None:
                    p.terminate()
            deadline = time.monotonic() + 15
            for h in self.storage:
                p = self._procs.get(h.pid)
                if p is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(max(0.1, deadline - time.monotonic()))
            cleanup(self.prefix, force=True, remove_root=False)
            if not self.keep_root:      # only this cluster's folder (a bench's data beside it stays)
                shutil.rmtree(self.root, ignore_errors=True)
            for p in self._procs.values():
                with contextlib.suppress(Exception):
                    p.wait(1)
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    # -- the network -------------------------------------------------------------------------
    def _pick_subnet(self) -> str:
        used = _run(["ip", "-o", "-4", "addr", "show"]).stdout + _run(["ip", "-4", "route"]).stdout
        for i in range(250):
            third = (int(self.run_id, 16) + i) % 250 + 2
            net = f"10.213.{third}"
            if f"{net}." not in used:
                return net
        raise RuntimeError("no free 10.213.x.0/24 subnet")

    def _tbf(self, ns: str | None, dev: str, mbit: float | None) -> None:
        if mbit is None:
            return
        rate_bytes = mbit * 1e6 / 8
        burst = max(64 * 1024, int(rate_bytes * 0.01))   # GSO frames of veths are up to 64 KiB
        argv = ["tc"] + (["-n", ns] if ns else []) + ["qdisc", "add", "dev", dev, "root", "tbf",
                                                      "rate", f"{int(mbit * 1e6)}bit", "burst", str(burst),
                                                      "latency", "500ms"]
        _run(argv)

    def _network(self) -> None:
        self.subnet = self._pick_subnet()
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        # Bridged frames skip iptables (a CI container's FORWARD policy may be DROP).
        _run(["ip", "link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0"], check=False)
        _run(["ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for kind, count, mbit in (("s", self.spec.storage, self.spec.storage_nic_mbit),
                                  ("t", self.spec.training, self.spec.training_nic_mbit)):
            for i in range(count):
                name = f"{kind}{i}"
                ns = self.prefix + name
                host = Host(name, ns, f"{self.subnet}.{HOST_BASE[kind] + i}", str(self.root / name),
                            mac=_mac(kind, i))
                os.makedirs(host.dir)
                (self.storage if kind == "s" else self.training).append(host)
                _run(["ip", "netns", "add", ns])
                _run(["ip", "link", "add", ns, "type", "veth", "peer", "name", ns + "p"])
                _run(["ip", "link", "set", ns + "p", "netns", ns])
                _run(["ip", "-n", ns, "link", "set", ns + "p", "name", "eth0"])
                _run(["ip", "-n", ns, "link", "set", "eth0", "address", host.mac])
                _run(["ip", "-n", ns, "addr", "add", f"{host.ip}/24", "dev", "eth0"])
                _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                _run(["ip", "link", "set", ns, "master", self.bridge])
                _run(["ip", "link", "set", ns, "up"])
                self._tbf(ns, "eth0", mbit)      # what the host sends
                self._tbf(None, ns, mbit)        # what it receives
        self._neighbours()

    def _neighbours(self) -> None:
        """Every host knows every other's MAC (permanent entries, as a cluster's static ARP would):
        under a shaped NIC's full queue, dropped ARP packets made hosts unreachable for seconds
        (EHOSTUNREACH) at 64 + 64 hosts."""
        _run(["ip", "link", "set", self.bridge, "address", _mac("b", 0)])
        hosts = self.storage + self.training
        entries = [(h.ip, h.mac) for h in hosts] + [(f"{self.subnet}.1", _mac("b", 0))]
        for h in [None, *hosts]:
            dev = "eth0" if h else self.bridge
            batch = os.path.join(self.root, f"neigh-{h.name if h else 'br'}")
            with open(batch, "w") as f:
                for ip, mac in entries:
                    if h is None or ip != h.ip:
                        f.write(f"neigh replace {ip} lladdr {mac} dev {dev} nud permanent\n")
            _run(["ip"] + (["-n", h.ns] if h else []) + ["-batch", batch])

    # -- daemons -----------------------------------------------------------------------------
    def _token_file(self, host: Host) -> str:
        path = os.path.join(host.dir, "token")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(TOKEN + "\n")
        return path

    def _agents(self) -> None:
        locations = [f"grpc://{self.subnet}.{HOST_BASE['s'] + i}:{AGENT_PORT}" for i in range(self.spec.storage)]
        for h, loc in zip(self.storage, locations):
            h.location = loc
            token = self._token_file(h)
            h.config = os.path.join(h.dir, "agent.toml")
            h.log = os.path.join(h.dir, "agent.log")
            agent = {"location": loc, "data_dir": os.path.join(h.dir, "replicas"), "token_file": token,
                     "reclaim_interval_s": 5.0, **self.spec.agent}
            Path(h.config).write_text(
                _section("store", {"uri": f"file://{self.store}"}) + "\n"
                + _section("agent", agent) + "\n"
                + _section("agents", {"locations": locations, "token_file": token}) + "\n"
                + _section("logging", {"file": h.log, "level": self.spec.log_level}))
            out = open(os.path.join(h.dir, "agent.out"), "wb")
            p = subprocess.Popen(["ip", "netns", "exec", h.ns, sys.executable, "-m", "hintfs.cli", "agent", h.config],
                                 cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            out.close()
            h.pid = p.pid
            self._procs[p.pid] = p
        from hintfs.agent.client import AgentClient

        def up(h: Host) -> bool:
            if self._procs[h.pid].poll() is not None:
                raise RuntimeError(f"agent {h.name} exited {self._procs[h.pid].returncode}: "
                                   + _tail(os.path.join(h.dir, "agent.out")) + _tail(h.log))
            try:
                return AgentClient(h.location, token=TOKEN, timeout_s=2.0).ping()
            except OSError:
                return False
        for h in self.storage:
            if not wait_for(lambda h=h: up(h), timeout=120, interval=0.1):
                raise RuntimeError(f"agent {h.name} at {h.location} did not answer: " + _tail(h.log))

    def mount_config(self, host: Host, replicas: dict | None = None, extra: str | None = None,
                     agents: int | None = None) -> str:
        """The config an operator would write for a training host's mount (it knows the first
        `agents` storage hosts' agents; default: the spec's `mount_agents`, or all)."""
        token = self._token_file(host)
        reps = {**self.spec.replicas, **(replicas or {})}
        n = agents or self.spec.mount_agents or len(self.storage)
        return (_section("store", {"uri": f"file://{self.store}"}) + "\n"
                + _section("agents", {"locations": [h.location for h in self.storage[:n]], "token_file": token})
                + "\n"
                + (_section("replicas", reps) + "\n" if reps else "")
                + _section("logging", {"file": host.log, "level": self.spec.log_level}) + "\n"
                + (self.spec.mount_extra if extra is None else extra))

    def _mount(self, h: Host) -> None:
        r = _run(["ip", "netns", "exec", h.ns, sys.executable, "-m", "hintfs.cli", "mount", h.config, h.mnt],
                 check=False, timeout=180, cwd=REPO)
        if r.returncode != 0:
            raise RuntimeError(f"hintfs mount on {h.name}: {r.stderr.strip()}\n" + _tail(h.log))
        pid = _daemon_pid(h.ns, h.mnt)
        if pid is None:
            raise RuntimeError(f"hintfs mount on {h.name}: no daemon found in {h.ns}\n" + _tail(h.log))
        h.pid = pid

    def _mounts(self) -> None:
        errors: list[str] = []
        for h in self.training:
            h.mnt = os.path.join(h.dir, "mnt")
            os.makedirs(h.mnt)
            h.config = os.path.join(h.dir, "mount.toml")
            h.log = os.path.join(h.dir, "mount.log")
            Path(h.config).write_text(self.mount_config(h))

        def one(h: Host) -> None:
            try:
                self._mount(h)
            except Exception as err:  # noqa: BLE001 - collected, raised below
                errors.append(str(err))
        ths = [threading.Thread(target=one, args=(h,)) for h in self.training]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        if errors:
            raise RuntimeError(errors[0])

    def remount(self, host: Host, replicas: dict | None = None, extra: str | None = None,
                agents: int | None = None) -> None:
        """Unmount, write a new config (other `[replicas]`, other agents, ...), mount again."""
        self._umount(host)
        Path(host.config).write_text(self.mount_config(host, replicas, extra, agents))
        self._mount(host)

    def umount(self, host: Host) -> None:
        """`hintfs umount` on the host (a later `remount` mounts it again)."""
        self._umount(host)

    def _umount(self, h: Host) -> None:
        if not h.pid or not alive(h.pid):
            return
        r = _run(self.exec_argv(h, [sys.executable, "-m", "hintfs.cli", "umount", h.mnt]), check=False, timeout=90)
        if r.returncode != 0:
            sys.stderr.write(f"cluster: hintfs umount on {h.name}: {r.stderr.strip()}\n")
        h.pid = 0

    # -- running things on hosts ---------------------------------------------------------------
    def exec_argv(self, host: Host, argv: list[str]) -> list[str]:
        """`argv` run on a host: in its network namespace, and for a training host in its mount
        daemon's mount namespace (where its mount is), from the repository's root."""
        if host.mnt:
            return ["nsenter", "-t", str(host.pid), "-m", "-n", f"--wd={REPO}", "--", *argv]
        return ["ip", "netns", "exec", host.ns, *argv]

    def popen(self, host: Host, argv: list[str], **kw) -> subprocess.Popen:
        kw.setdefault("cwd", REPO)
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.exec_argv(host, argv), **kw)
        self._procs[p.pid] = p
        return p

    def describe(self) -> dict:
        return {"prefix": self.prefix, "root": str(self.root), "store": str(self.store), "subnet": f"{self.subnet}.0/24",
                "bridge": self.bridge, "storage": [asdict(h) for h in self.storage],
                "training": [asdict(h) for h in self.training], "token": TOKEN, "timings": self.timings}


def _mac(kind: str, i: int) -> str:
    return f"02:68:66:{'stb'.index(kind):02x}:{i >> 8:02x}:{i & 255:02x}"


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _netns_inode(ns: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{ns}").st_ino
    except OSError:
        return None


def _proc_netns(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _daemon_pid(ns: str, mnt: str) -> int | None:
    ino = _netns_inode(ns)
    for pid in _pids():
        if _proc_netns(pid) == ino and " -m fusefs " in f" {_cmdline(pid)} " and mnt in _cmdline(pid):
            return pid
    return None


# -- leftovers and cleanup -------------------------------------------------------------------
def _runs(prefix: str) -> set[str]:
    """The run prefixes (hfcXXXX-) with anything left: namespaces, links, folders."""
    names = _run(["ip", "netns", "list"], check=False).stdout.split()
    names += [line.split(":")[1].strip().split("@")[0]
              for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines()
              if line.count(":") >= 2]
    names += [p.name for p in _tempdir().glob(f"{PREFIX_ROOT}*-cluster*")]
    return {m.group(0) for n in names if n.startswith(prefix) for m in [RUN_RE.match(n)] if m}


def write_owner(folder: Path | str, prefix: str) -> None:
    """Mark a run's folder (`<tmp>/<prefix>cluster*`) as this process's: `cleanup` leaves the run
    alone while it lives."""
    (Path(folder) / "owner.json").write_text(json.dumps(
        {"prefix": prefix, "pid": os.getpid(), "start": _start_time(os.getpid())}))


def _owner_alive(run: str) -> bool:
    for path in _tempdir().glob(f"{run}cluster*/owner.json"):
        try:
            owner = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if alive(owner["pid"]) and _start_time(owner["pid"]) == owner.get("start"):
            return True
    return False


def leftovers(prefix: str = PREFIX_ROOT) -> dict[str, list]:
    """What is left of the runs whose names start with `prefix`: namespaces, links (root
    namespace), processes (in those namespaces, or naming a run's folder), mounts (in any
    process's mount table, under a run's folder or of its namespaces), folders."""
    ns = [n for n in _run(["ip", "netns", "list"], check=False).stdout.split() if n.startswith(prefix)
          and RUN_RE.match(n)]
    links = [line.split(":")[1].strip().split("@")[0]
             for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines() if line.count(":") >= 2]
    links = [n for n in links if n.startswith(prefix) and RUN_RE.match(n)]
    inodes = {i for i in (_netns_inode(n) for n in ns) if i is not None}
    roots = [str(p) for p in _tempdir().glob(f"{PREFIX_ROOT}*-cluster*") if p.name.startswith(prefix)]
    me = {os.getpid(), os.getppid()}
    procs, mounts = [], set()
    for pid in _pids():
        if pid in me:
            continue
        cmd = _cmdline(pid)
        if (inodes and _proc_netns(pid) in inodes) or any(r in cmd for r in roots):
            procs.append({"pid": pid, "cmdline": cmd[:200]})
        try:
            with open(f"/proc/{pid}/mountinfo") as f:
                for line in f:
                    point = line.split()[4]
                    if any(point.startswith(r) for r in roots):
                        mounts.add(point)
        except OSError:
            pass
    return {"namespaces": ns, "links": links, "processes": procs, "mounts": sorted(mounts), "folders": roots}


def cleanup(prefix: str = PREFIX_ROOT, force: bool = False, remove_root: bool = True) -> dict:
    """Remove what is left of the runs named `prefix`* (all `hfc` runs by default). Without
    `force`, a run whose harness is still alive is left alone. Returns what was found before."""
    runs = sorted(_runs(prefix))
    if not force:
        runs = [r for r in runs if not _owner_alive(r)]
    found: dict[str, list] = {"namespaces": [], "links": [], "processes": [], "mounts": [], "folders": []}
    for run in runs:
        left = leftovers(run)
        for k, v in left.items():
            found[k] += v
        # 1. processes: SIGKILL (a mount daemon's death takes its private mount namespace along)
        pids = [p["pid"] for p in left["processes"]]
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda pids=pids: not any(alive(p) for p in pids), timeout=15)
        # 2. mounts still seen somewhere (a mount in the machine's namespace): detach them
        for point in leftovers(run)["mounts"]:
            _run(["fusermount3", "-u", "-z", point], check=False)
            _run(["umount", "-l", point], check=False)
        # 3. links, then namespaces (their ends of the pairs go with them)
        for link in left["links"]:
            _run(["ip", "link", "del", link], check=False)
        for ns in left["namespaces"]:
            _run(["ip", "netns", "del", ns], check=False)
        wait_for(lambda run=run: not (leftovers(run)["links"] or leftovers(run)["namespaces"]), timeout=15)
        if remove_root:
            for root in left["folders"]:
                shutil.rmtree(root, ignore_errors=True)
    return found


@contextlib.contextmanager
def signals_raise():
    """SIGTERM and SIGHUP raise KeyboardInterrupt (as SIGINT does) in the main thread, so `with
    Cluster(...)` tears down on them too."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# -- command line ----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="A cluster of network namespaces on one machine: "
                                             "storage hosts with agents, training hosts with mounts.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a cluster; hold it until SIGINT/SIGTERM (--hold)")
    up.add_argument("--storage", type=int, default=2)
    up.add_argument("--training", type=int, default=2)
    up.add_argument("--storage-nic-mbit", type=float, default=1000.0)
    up.add_argument("--training-nic-mbit", type=float, default=1000.0)
    up.add_argument("--hold", action="store_true", help="stay up until a signal")
    up.add_argument("--describe", help="write the cluster's description (JSON) to this file once up")
    cl = sub.add_parser("cleanup", help="remove leftovers of runs whose harness is gone")
    cl.add_argument("--prefix", default=None, help="only this run (hfcXXXX-), even if its harness lives")
    ls = sub.add_parser("list", help="what is left of cluster runs")
    ls.add_argument("--prefix", default=PREFIX_ROOT)
    args = ap.parse_args(argv)

    if args.cmd == "list":
        print(json.dumps(leftovers(args.prefix), indent=1))
        return 0
    if args.cmd == "cleanup":
        found = cleanup(args.prefix or PREFIX_ROOT, force=args.prefix is not None)
        left = leftovers(args.prefix or PREFIX_ROOT)
        print(json.dumps({"removed": found, "left": left}, indent=1))
        if args.prefix is None:   # runs whose harness still lives are not "left" by this command
            return 0
        return 1 if any(left.values()) else 0
    why = missing_features()
    if why:
        print(f"cluster: {why}", file=sys.stderr)
        return 2
    spec = ClusterSpec(storage=args.storage, training=args.training, storage_nic_mbit=args.storage_nic_mbit,
                       training_nic_mbit=args.training_nic_mbit)
    with signals_raise():
        try:
            with Cluster(spec) as c:
                desc = json.dumps(c.describe(), indent=1)
                if args.describe:
                    tmp = args.describe + ".tmp"
                    Path(tmp).write_text(desc)
                    os.replace(tmp, args.describe)
                print(desc, flush=True)
                while args.hold:
                    time.sleep(3600)
        except KeyboardInterrupt:
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

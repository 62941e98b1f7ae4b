"""Running a mount: build the store and the operations from a config, mount, serve, unmount.

`run_mount` is what `hintfs mount --foreground` runs (directly, or as the child of the
background launcher and of systemd). Pre-flight checks raise `MountError` with one line.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from typing import Callable, Optional

import pyfuse3
import trio

from common.secrets import read_token_file
from common.systemd import sd_notify
from mountconfig import MountConfig, effective_config_json
from stores import check_store, open_store
from fusefs.control import ControlDir, ControlFile, loglevel_file
from fusefs.operations import Operations
from fusefs.stats import Stats
from stores.base import Store

log = logging.getLogger("hintfs.mount")


class MountError(Exception):
    """A problem the user can fix (mountpoint, /dev/fuse, store); one line, no traceback."""


def open_checked_store(cfg: MountConfig, store: Optional[Store] = None) -> Store:
    """The config's store (or `store`, given by a test), checked per `[store] startup_check`."""
    try:
        if store is None:
            store = open_store(cfg.store, cfg.cache.spool_dir)
        check_store(store, cfg.store)
        return store
    except OSError as err:
        raise MountError(err.strerror or str(err)) from None


def check_mountpoint(mountpoint: str) -> str:
    mp = os.path.abspath(mountpoint)
    if not os.path.exists(mp):
        raise MountError(f"mountpoint {mp} does not exist")
    if not os.path.isdir(mp):
        raise MountError(f"mountpoint {mp} is not a directory")
    if os.path.ismount(mp):
        raise MountError(f"mountpoint {mp} is busy: something is already mounted there")
    return mp


def check_fuse_device() -> None:
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except FileNotFoundError:
        raise MountError("/dev/fuse does not exist: load the fuse module (modprobe fuse) "
                         "or pass the device into the container") from None
    except PermissionError:
        raise MountError("/dev/fuse is not accessible: run as root or grant access to /dev/fuse") from None
    except OSError as err:
        raise MountError(f"/dev/fuse cannot be opened: {err.strerror}") from None
    os.close(fd)


def build_control(cfg: MountConfig, stats: Stats) -> ControlDir:
    root = ControlDir(".hintfs")
    root.add(ControlFile("stats", render=lambda: (json.dumps(stats.snapshot(), indent=2) + "\n").encode()))
    config_bytes = effective_config_json(cfg)
    root.add(ControlFile("config", render=lambda: config_bytes))
    root.add(loglevel_file())
    return root


def fuse_options(cfg: MountConfig) -> set[str]:
    options = set(pyfuse3.default_options)
    options.add(f"fsname={cfg.mount.fsname}")
    options.add("subtype=hintfs")
    if cfg.mount.allow_other:
        options.add("allow_other")
    return options


def run_mount(cfg: MountConfig, mountpoint: str, store: Optional[Store] = None,
              on_ready: Optional[Callable[[], None]] = None) -> int:
    """Mount and serve until unmounted or signalled; return an exit status."""
    mp = check_mountpoint(mountpoint)
    check_fuse_device()
    store = open_checked_store(cfg, store)
    stats = Stats()
    control = build_control(cfg, stats)
    hints, replica_reads, agent_server = build_replication(cfg, store, stats, control)
    from fusefs.tensorfile import TensorFiles
    tensors = TensorFiles(cfg, store, hints.agents, hints.clients, stats)
    control.add_dir(tensors.control_dir())
    from fusefs.signals import SignalForwarder
    signals = SignalForwarder(list(dict.fromkeys(r.local_agent for r in cfg.routes)), hints.clients, stats)
    control.add_dir(signals.control_dir())
    view = store
    if cfg.routes:   # eval side: metadata of routed paths from the local tier, not across the WAN
        from fusefs.routedstore import RoutedStore
        view = RoutedStore(store, cfg.routes, hints.clients, stats)
    ops = Operations(view, cfg, stats, control, replica_reads, tensors)
    replica_reads.store_read = ops.store_read
    if cfg.metrics.enabled:
        from fusefs.metrics import start_metrics
        port = start_metrics(stats, cfg.metrics.bind, cfg.metrics.port)
        stats.counters["metrics_port"] = port
    try:
        pyfuse3.init(ops, mp, fuse_options(cfg))
    except RuntimeError as err:
        raise MountError(f"cannot mount at {mp}: {err}") from None
    log.info("mounted %s at %s", store.description, mp)
    unmount = True
    try:
        trio.run(_serve, ops, mp, on_ready, cfg, hints, tensors, signals)
    except BaseException:
        log.exception("mount loop failed")
        raise
    finally:
        dropped = ops.abandon_open_writes()
        if dropped:
            log.warning("%d open writes dropped at unmount", dropped)
        sd_notify("STOPPING=1")
        try:
            pyfuse3.close(unmount=unmount)
        except Exception as err:  # already unmounted by fusermount3 -u
            log.debug("close: %s", err)
        if agent_server is not None:
            agent_server.shutdown()
        log.info("unmounted %s", mp)
    return 0


def build_replication(cfg: MountConfig, store: Store, stats: Stats, control: ControlDir):
    """Agents (configured, or one started in this process), the hints manager and replica reads."""
    from agent.client import AgentClient
    from fusefs.hints import HintsManager
    from fusefs.replicaread import ReplicaReads

    server = None
    locations = list(cfg.agents.locations)
    if not locations:
        from agent.server import start_in_process
        try:
            server, loc = start_in_process(cfg, store)
        except PermissionError as err:
            # Not allowed to use agent.data_dir (not root?): keep replicas in a private temp dir.
            import tempfile
            fallback = tempfile.mkdtemp(prefix="hintfs-replicas-")
            log.warning("in-process agent cannot use %s (%s); replicas go to %s", cfg.agent.data_dir,
                        err.strerror, fallback)
            cfg = cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"data_dir": fallback})})
            server, loc = start_in_process(cfg, store)
        except OSError as err:
            raise MountError(f"cannot start the in-process agent in {cfg.agent.data_dir}: {err}") from None
        locations = [loc]
    token = None
    if cfg.agents.token_file:
        try:
            token = read_token_file(cfg.agents.token_file)
        except OSError as err:
            raise MountError(f"[agents] {err.strerror}") from None
    tls_root = None
    if cfg.agents.tls_root_file:
        with open(cfg.agents.tls_root_file, "rb") as f:
            tls_root = f.read()
    route_agents = [r.local_agent for r in cfg.routes]
    clients = {loc: AgentClient(loc, token=token, tls_root=tls_root, timeout_s=cfg.replicas.read_timeout_s * 10)
               for loc in dict.fromkeys(locations + route_agents)}
    hints = HintsManager(cfg, locations, clients, stats)
    control.add_dir(hints.control_dir())
    reads = ReplicaReads(hints.router, clients, cfg, stats, store_read=None)
    return hints, reads, server


async def _serve(ops: Operations, mp: str, on_ready, cfg: MountConfig, hints=None, tensors=None,
                 signals=None) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_signals, nursery.cancel_scope)
        if hints is not None:
            nursery.start_soon(hints.run)
        if tensors is not None:
            nursery.start_soon(tensors.run)
        if signals is not None:
            nursery.start_soon(signals.run)
        nursery.start_soon(_announce_ready, mp, on_ready, cfg)
        if cfg.journal.enabled:
            nursery.start_soon(_prune_journal, ops.store, cfg)
        await pyfuse3.main(min_tasks=1, max_tasks=cfg.mount.max_tasks)
        nursery.cancel_scope.cancel()


async def _watch_signals(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("received %s: unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


async def _prune_journal(store: Store, cfg: MountConfig) -> None:
    from common.journal import prune, prune_interval_s
    retention_ns = int(cfg.journal.retention_s * 1e9)
    while True:
        await trio.sleep(prune_interval_s(cfg.journal.retention_s))
        try:
            gone = await trio.to_thread.run_sync(prune, store, cfg.journal.dir, time.time_ns() - retention_ns,
                                                 abandon_on_cancel=True)
        except OSError as err:
            log.warning("journal pruning failed: %s", err)
            continue
        if gone:
            log.debug("journal: %d old records deleted", gone)


def set_read_ahead(mp: str, kb: int) -> None:
    """Widen the kernel's read-ahead for this mount (sysfs knob of its backing device info)."""
    dev = os.stat(mp).st_dev
    knob = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(knob, "w") as f:
            f.write(str(kb))
    except OSError as err:
        log.warning("cannot set %s to %d: %s", knob, kb, err.strerror)


async def _announce_ready(mp: str, on_ready, cfg: MountConfig) -> None:
    # Prove the mount answers (a stat served by our own loop, from a thread) before saying so.
    # Both stats below are answered by this very loop: if a signal stops pyfuse3.main first,
    # they never return, so the threads are abandoned on cancel (closing the mount then fails
    # their stat with ENOTCONN) instead of holding the nursery open forever.
    def probe():
        os.stat(os.path.join(mp, ".hintfs", "stats"))

    try:
        await trio.to_thread.run_sync(probe, abandon_on_cancel=True)
    except OSError as err:
        log.error("mount does not answer: %s", err)
        pyfuse3.terminate()
        return
    if cfg.mount.read_ahead_kb:
        await trio.to_thread.run_sync(set_read_ahead, mp, cfg.mount.read_ahead_kb,
                                      abandon_on_cancel=True)
    sd_notify("READY=1")
    if on_ready is not None:
        on_ready()


__all__ = ["MountError", "run_mount"]

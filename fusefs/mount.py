"""Running a mount: assemble the filesystem from a config, mount, serve, unmount.

`run_mount` is what `hintfs mount --foreground` runs (directly, or as the child of the
background launcher and of systemd). Pre-flight checks raise `MountError` with one line; the
launcher runs the same `check_mountpoint` before it starts the daemon.

Unmounting (SIGTERM/SIGINT/SIGHUP, which `hintfs umount` sends): the mount keeps serving for up to
`mount.unmount_timeout_s` while files are open for writing, so a `cp` into it can finish; what is
still open then is abandoned (never published), named in the log, and the daemon exits with
`EXIT_ABANDONED`. docs/operations.md has the whole story.
"""
from __future__ import annotations

import functools
import gc
import json
import logging
import os
import signal
import sys
import tempfile
import stat as stat_mod
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from collections.abc import Awaitable, Callable
from urllib.parse import urlparse

import pyfuse3
import trio

from hintfs.agent.client import AgentClient
from hintfs.agent.fdserver import receive_replica_fd, receive_tier_bytes
from hintfs.common import paths
from hintfs.common.fdlimit import raise_open_file_limit, reserve_fd_table
from hintfs.common.journal import prune, prune_interval_s
from hintfs.common.logline import ABANDONED_MARK   # the log line `hintfs umount` looks for (_report_abandoned)
from hintfs.common.mounts import dead_mount_at, detach_lazily
from hintfs.common.secrets import read_tls_roots, read_token_file
from hintfs.common.systemd import sd_notify
from fusefs.control import ControlDir, ControlFile, loglevel_file
from fusefs.filesystem import Filesystem, fuse_device_of
from fusefs.interfaces import StreamHooks
from fusefs.fastpath import MARK_SWEEP_S, mark_limit
from fusefs.fuse import FuseOperations, KernelNotices, names_listings, queued_reads, spun_reads, statx_dir
from fusefs.hints import HintsManager
from fusefs.journal_writer import JournalWriter
from fusefs.replicaread import ReplicaReads
from fusefs.readpath import ReadPath
from fusefs.routes import RoutedStore
from fusefs.readhints import ReadHints
from fusefs.signals import SignalForwarder
from fusefs.stats import ErrnoLog, Stats, log_is_private
from fusefs.stream import open_stream
from fusefs.tensorfile import TensorFiles
from mountconfig import MountConfig, effective_config_json
from mountconfig.schema import AgentsConfig, JournalConfig, LoggingConfig, MountOptions, StreamConfig
from hintfs.stores import check_store, open_store
from hintfs.stores.base import Store
from hintfs.stores.hostcache import HostCachedStore

if TYPE_CHECKING:
    from hintfs.agent.server import AgentServer   # started in process only without configured agents

log = logging.getLogger("hintfs.mount")

EXIT_ABANDONED = 3      # the daemon's status when files still open for writing were abandoned


class MountError(Exception):
    """A problem the user can fix (mountpoint, /dev/fuse, store); one line, no traceback."""


def open_checked_store(cfg: MountConfig, store: Store | None = None) -> Store:
    """The config's store (or `store`, given by a test), checked per `[store] startup_check`."""
    try:
        if store is None:
            store = open_store(cfg.store, cfg.cache.spool_dir, cfg.cache)
        check_store(store, cfg.store)
        return store
    except OSError as err:
        raise MountError(err.strerror or str(err)) from None


def check_mountpoint(mountpoint: str, cfg: MountConfig | None = None,
                     on_replace: Callable[[str], None] | None = None) -> str:
    """The absolute mountpoint, once it is fit to mount on; else MountError (one line).

    A dead hintfs mount there (its daemon killed: stat fails with ENOTCONN) is detached lazily
    first, with a log line (and `on_replace(line)`); a dead mount of another type is refused and
    left alone. With `cfg`, the layout is checked too (`check_layout`), and a folder that holds
    files is refused unless `[mount] nonempty` (`check_empty`)."""
    mp = os.path.abspath(mountpoint)
    dead = dead_mount_at(mp)
    if dead is not None:
        if not dead.is_hintfs:
            raise MountError(f"mountpoint {mp} is a dead {dead.fstype} mount (its daemon is gone), not a "
                             f"hintfs mount: not touching it (detach it with fusermount3 -u -z {mp})")
        try:
            detach_lazily(mp)
        except OSError as err:
            raise MountError(f"mountpoint {mp} is a dead hintfs mount and cannot be detached: "
                             f"{err.strerror}") from None
        note = f"{mp} was a dead hintfs mount (its daemon is gone): detached it lazily"
        log.warning(note)
        if on_replace is not None:
            on_replace(note)
    try:
        st = os.stat(mp)
    except FileNotFoundError:
        raise MountError(f"mountpoint {mp} does not exist") from None
    except OSError as err:
        raise MountError(f"mountpoint {mp} cannot be used: {err.strerror}") from None
    if not stat_mod.S_ISDIR(st.st_mode):
        raise MountError(f"mountpoint {mp} is not a directory")
    if os.path.ismount(mp):
        raise MountError(f"mountpoint {mp} is busy: something is already mounted there")
    if cfg is not None:
        check_layout(mp, cfg)
        if not cfg.mount.nonempty:
            check_empty(mp)
    return mp


def check_empty(mp: str) -> None:
    """MountError (one line) if the folder `mp` holds anything: a mount would hide it (on a training
    host: checkpoints written locally while the mount was down). `[mount] nonempty = true` or
    `hintfs mount --nonempty` allows it. Only the first entry is read."""
    try:
        with os.scandir(mp) as entries:
            first = next(entries, None)
    except OSError as err:
        raise MountError(f"mountpoint {mp} cannot be listed: {err.strerror}") from None
    if first is not None:
        raise MountError(f"mountpoint {mp} is not empty (it holds {first.name!r}, ...), and a mount would hide "
                         "its files: move them away, or mount anyway with --nonempty ([mount] nonempty = true)")


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _lineage(path: str):
    """`path` and each of its ancestors up to /, symlinks resolved, as (path, (st_dev, st_ino));
    ancestors that cannot be stat'ed are skipped. Device and inode, not names: a bind mount of a
    folder has the folder's own identity, so a mountpoint reached through one is still found."""
    p = os.path.realpath(path)
    while True:
        ident = _identity(p)
        if ident is not None:
            yield p, ident
        if p == "/":
            return
        p = os.path.dirname(p)


def local_paths(cfg: MountConfig) -> list[tuple[str, str]]:
    """(what, local path) the daemon works in while it serves: a file:// store's root; for
    remote stores the spool where writes stage."""
    if urlparse(cfg.store.uri).scheme == "file":
        return [("the store root", urlparse(cfg.store.uri).path)]
    return [("cache.spool_dir", cfg.cache.spool_dir)] + ([("cache.dir", cfg.cache.dir)] if cfg.cache.dir else [])


def check_layout(mp: str, cfg: MountConfig) -> None:
    """Refuse a mountpoint that is the store root or inside it, and a store root (or a remote
    store's spool) inside the mountpoint: the first makes the daemon serve its own requests
    (lookups and `ls` hang for good), the second hides what the daemon needs behind the mount.
    Compared by device and inode, so symlinks and bind mounts do not slip past."""
    mp_id = _identity(mp)
    for what, path in local_paths(cfg):
        root_id = _identity(path)
        if mp_id is not None and root_id == mp_id:
            raise MountError(f"mountpoint {mp} is {what} {path}: the mount would have to serve its own "
                             "requests and hang; mount it outside the store")
        if root_id is not None and what == "the store root":
            for ancestor, ident in _lineage(mp):
                if ident == root_id:
                    via = "" if ancestor == os.path.realpath(path) else f" (through {ancestor})"
                    raise MountError(f"mountpoint {mp} is inside {what} {path}{via}: the mount would have to "
                                     "serve its own requests and hang; mount it outside the store")
        if mp_id is not None:
            for _ancestor, ident in _lineage(path):
                if ident == mp_id:
                    raise MountError(f"{what} {path} is inside mountpoint {mp}: the mount would hide it "
                                     "from the daemon that serves it; mount it elsewhere")


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


def usage_by_uid(root: ControlDir, replicas_of: Callable[[str], int] | None = None) -> dict:
    """`usage` of `.hintfs/stats`: what each uid holds of what users may create: job files per
    control folder (bounded per user: docs/security.md), and the replicas their hints made."""
    files: dict[str, dict[str, int]] = {}
    for name, d in sorted(root.dirs.items()):
        for uid, n in d.usage().items():
            files.setdefault(str(uid), {})[name] = n
    replicas: dict[str, int] = {}
    hints = root.dirs.get("hints")
    if hints is not None and replicas_of is not None:
        for name, f in list(hints.files.items()):
            if f.writable:
                replicas[str(f.uid)] = replicas.get(str(f.uid), 0) + replicas_of(name)
    return {"job_files_by_uid": files, "replicas_by_uid": replicas}


def build_control(root: ControlDir, stats: Stats, config_json: bytes, usage: Callable[[], dict] = dict) -> ControlDir:
    """The mount's own files in `.hintfs/`: stats (with each user's `usage`), the effective
    config, the log level."""
    root.add(ControlFile("stats", render=lambda: (json.dumps(stats.snapshot(usage()), indent=2) + "\n").encode()))
    root.add(ControlFile("config", render=lambda: config_json))
    root.add(loglevel_file())
    return root


def unmount_document(options: MountOptions, logging_cfg: LoggingConfig, fs: Filesystem) -> bytes:
    """`.hintfs/unmount`: what `hintfs umount` needs to know before it signals the daemon: how
    long it will wait for open writes, and the log where it names the files it abandoned. Only a
    count of open writes: the names are for the log, not for every reader of the mount."""
    return (json.dumps({"pid": os.getpid(), "timeout_s": options.unmount_timeout_s,
                        "log_file": logging_cfg.file or os.environ.get("HINTFS_LOG_FILE"),
                        "open_writes": len(fs.open_write_paths())}) + "\n").encode()


def fuse_options(options: MountOptions) -> set[str]:
    out = set(pyfuse3.default_options)
    out.add(f"fsname={options.fsname}")
    out.add("subtype=hintfs")
    if options.allow_other:
        out.add("allow_other")
    return out


@dataclass
class Assembly:
    """Everything a mount runs, built by `assemble`."""
    fs: Filesystem
    ops: FuseOperations
    store: Store                 # the store itself (the filesystem may see it through routes)
    stats: Stats
    background: list[Callable[[], Awaitable[None]]]   # tasks that run beside pyfuse3.main
    usage: Callable[[], dict] = dict                   # what each user holds (stats, metrics)
    agent_server: AgentServer | None = None         # an in-process agent, shut down at unmount
    streams: StreamHooks | None = None              # [stream]: sends to eval tiers, closed at unmount


def assemble(cfg: MountConfig, store: Store) -> Assembly:
    """The one place the mount is put together: control files, agents and hints, tensors,
    signals, routes, replica reads, journal, the filesystem and its FUSE adapter. Each part is
    handed the slice of the config it uses, and its collaborators in its constructor."""
    private = log_is_private()   # errno lines name an example path only in a log other users cannot read
    if not private:
        log.warning("the log is readable by other users: its errno lines leave out paths (chmod 600 the log file)")
    stats = Stats(queued_reads=queued_reads, errno_log=ErrnoLog(with_paths=private), spun_reads=spun_reads)
    host_cache = store if isinstance(store, HostCachedStore) else None
    attach = getattr(store, "attach_stats", None)   # the store's own counters (S3: requests, stats
    if attach is not None:                          # answered from listings), with a host cache or not
        attach(stats)
    control = ControlDir(paths.CONTROL_DIR)
    io_limiter = trio.CapacityLimiter(cfg.mount.io_threads)   # store calls in worker threads
    # (with a host cache, hinted files are fetched into it ahead)
    hints, clients, agent_server = build_agents(cfg, store, stats, control,
                                                prefetch=host_cache.prefetch if host_cache is not None else None)
    usage = functools.partial(usage_by_uid, control, hints.replicas_held)
    build_control(control, stats, effective_config_json(cfg), usage)
    tensors = TensorFiles(cfg.transforms, cfg.transform_load, store, hints.agents, clients, stats)
    control.add_dir(tensors.control_dir())
    signals = SignalForwarder(list(dict.fromkeys(r.local_agent for r in cfg.routes)), clients, stats)
    control.add_dir(signals.control_dir())
    routes = None
    if cfg.routes:   # eval side: routed paths from the local tier, not across the WAN
        # (a tier agent on this host hands out fds of its replicas and of what it is receiving)
        routes = RoutedStore(store, cfg.routes, clients, stats, io_limiter=io_limiter,
                             fetch_fd=receive_replica_fd, tier_bytes=receive_tier_bytes)
    read_hints = ReadHints(routes, stats)
    control.add_dir(read_hints.control_dir())
    # (the in-process agent's replicas are files on this host: passthrough opens)
    replicas = ReplicaReads(hints.router, clients, cfg.replicas, stats, io_limiter=io_limiter,
                            local_copy=agent_server.local_replica_fd if agent_server is not None else None)
    journal = JournalWriter(store, cfg.journal.dir, stats, io_limiter) if cfg.journal.enabled else None
    streams = build_streams(cfg.stream, cfg.agents, cfg.logging, stats, store)
    fs = Filesystem(routes or store, options=cfg.mount, cache=cfg.cache, journal_dir=cfg.journal.dir, stats=stats,
                    control_root=control, reads=ReadPath(stats, routes=routes, replicas=replicas), tensors=tensors,
                    journal=journal, streams=streams, io_limiter=io_limiter, kernel=KernelNotices())
    fs.names_listings = names_listings
    control.add(ControlFile("unmount", render=lambda: unmount_document(cfg.mount, cfg.logging, fs)))
    background = [hints.run, tensors.run, signals.run, read_hints.run] + ([journal.run] if journal else [])
    return Assembly(fs, FuseOperations(fs, cfg.mount), store, stats, background, usage,
                    agent_server,
                    streams)


def build_streams(sc: StreamConfig, agents: AgentsConfig, logging_cfg: LoggingConfig, stats: Stats,
                  store: Store) -> StreamHooks | None:
    """`[stream]`: one streamer per eval tier agent, behind one link gate for this mount, in a
    child process (`sender = "process"`) or in threads of the mount."""
    if not sc.prefixes:
        return None
    token, tls_root = _agent_credentials(agents, sc.token_file or agents.token_file, "[stream]")
    log.info("streaming %s to %s as they are written (sender: %s)", ", ".join(sc.prefixes), ", ".join(sc.agents),
             sc.sender)
    def read_store(path: str):
        return _read_whole(store, path)
    return open_stream(sc, stats, token, tls_root, read_store, logging_cfg.level,
                       logging_cfg.file or os.environ.get("HINTFS_LOG_FILE"))


def _agent_credentials(agents: AgentsConfig, token_file: str | None,
                       table: str) -> tuple[str | None, bytes | None]:
    """The token (from `token_file`, checked by `read_token_file`) and the TLS roots
    (`[agents] tls_root_file`) the mount sends to agents; a bad token file names `table`."""
    token = None
    if token_file:
        try:
            token = read_token_file(token_file)
        except OSError as err:
            raise MountError(f"{table} {err.strerror}") from None
    tls_root = None
    if agents.tls_root_file:
        try:
            tls_root = read_tls_roots(agents.tls_root_file)
        except OSError as err:
            raise MountError(f"[agents] {err.strerror}") from None
    return token, tls_root


def _read_whole(store: Store, path: str):
    reader, st = store.open_reader(path)
    try:
        return reader.read(0, st.size), st
    finally:
        reader.close()


# The daemon's cyclic garbage collector: a collection of the youngest objects every
# GC_THRESHOLDS[0] allocations of tracked objects, not Python's 700. A pass over a dataset keeps
# every inode, mark and name it makes alive, so each collection of the older generations went
# through all of them: 1.2-2.3 µs of the daemon's CPU a small file at eight readers (5,000 and
# 20,000 files, n = 3 runs each, interleaved; docs/operations.md, "The mount daemon's garbage
# collector").
GC_THRESHOLDS = (20_000, 10, 10)


def quiet_collector() -> None:
    """Before serving: what setting the mount up made (modules, config, store) leaves the
    collector's scans for good (`gc.freeze`: it is never garbage), and its young generation is
    collected every GC_THRESHOLDS[0] allocations. Cycles are still collected, at most that many
    allocations later."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def run_mount(cfg: MountConfig, mountpoint: str, store: Store | None = None,
              on_ready: Callable[[], None] | None = None) -> int:
    """Mount and serve until unmounted or signalled; return an exit status: 0, or
    EXIT_ABANDONED when files still open for writing were abandoned at unmount."""
    mp = check_mountpoint(mountpoint, cfg)
    check_fuse_device()
    raise_open_file_limit()   # passthrough opens, fast-path marks and the in-process agent's replicas hold fds
    if cfg.mount.fast_path_inodes:
        # Each fast-path mark holds an fd: the table is grown now, before the daemon's threads
        # start, not by doublings on first-pass opens (each waits for an RCU grace period).
        reserve_fd_table(2 * mark_limit(cfg.mount.fast_path_inodes) + 1024)
    store = open_checked_store(cfg, store)
    mount = assemble(cfg, store)
    try:
        pyfuse3.init(mount.ops, mp, fuse_options(cfg.mount))
    except RuntimeError as err:
        raise MountError(f"cannot mount at {mp}: {err}") from None
    log.info("mounted %s at %s", store.description, mp)
    exporter = None
    if cfg.metrics.enabled:   # the host's exporter: this mount serves the port, or another does
        from fusefs.metrics import start_metrics   # (prometheus_client only when asked for)
        exporter = start_metrics(mount.stats, mount.usage, cfg.metrics, mp)
    mount.fs.refuse_device(fuse_device_of(mp), statx_dir())   # never serve this mount through itself
    unmount = True
    status = 0
    quiet_collector()
    try:
        trio.run(_serve, mount, mp, on_ready, cfg.mount, cfg.journal)
    except BaseException:
        log.exception("mount loop failed")
        raise
    finally:
        abandoned = mount.fs.open_write_paths()
        mount.fs.abandon_open_writes()
        if mount.streams is not None:
            mount.streams.close()   # published files still on their way get a few seconds
        if abandoned:
            _report_abandoned(mp, abandoned)
            status = EXIT_ABANDONED
        sd_notify("STOPPING=1")
        try:
            pyfuse3.close(unmount=unmount)
        except Exception as err:  # already unmounted by fusermount3 -u
            log.debug("close: %s", err)
        if exporter is not None:
            exporter.stop()   # another mount of this host takes the port over
        if mount.agent_server is not None:
            mount.agent_server.shutdown()
        if isinstance(mount.store, HostCachedStore):
            mount.store.close()   # fetches in flight are dropped; complete files stay for the next mount
        log.info("unmounted %s", mp)
    return status


def _report_abandoned(mp: str, paths: list[str]) -> None:
    """One log line naming the abandoned files (a JSON list of store paths: `hintfs umount`
    parses it), and the same on a terminal when the daemon runs in one."""
    log.error("%s: %d files still open for writing (what was written since their last close or fsync "
              "is not published): %s", ABANDONED_MARK, len(paths), json.dumps(paths))
    if sys.stderr.isatty():
        print(f"hintfs: {mp}: {len(paths)} files still open for writing were abandoned (writes since their "
              "last close or fsync not published): " + ", ".join(paths), file=sys.stderr)


def build_agents(cfg: MountConfig, store: Store, stats: Stats, control: ControlDir,
                 prefetch: Callable[[str], object] | None = None):
    """Agents (configured, or one started in this process), their clients and the hints manager
    (`prefetch`: a host cache's, for hinted files)."""
    server = None
    locations = list(cfg.agents.locations)
    if not locations:
        from hintfs.agent.server import start_in_process   # only without configured agents
        try:
            server, loc = start_in_process(store, cfg.agent, peers=cfg.agents, follow=cfg.follow,
                                           transform_load=cfg.transform_load)
        except PermissionError as err:
            # Not allowed to use agent.data_dir (not root?): keep replicas in a private temp dir.
            fallback = tempfile.mkdtemp(prefix="hintfs-replicas-")
            log.warning("in-process agent cannot use %s (%s); replicas go to %s", cfg.agent.data_dir,
                        err.strerror, fallback)
            server, loc = start_in_process(store, cfg.agent.model_copy(update={"data_dir": fallback}),
                                           peers=cfg.agents, follow=cfg.follow, transform_load=cfg.transform_load)
        except OSError as err:
            raise MountError(f"cannot start the in-process agent in {cfg.agent.data_dir}: {err}") from None
        locations = [loc]
    token, tls_root = _agent_credentials(cfg.agents, cfg.agents.token_file, "[agents]")
    route_agents = [r.local_agent for r in cfg.routes]
    clients = {loc: AgentClient(loc, token=token, tls_root=tls_root, timeout_s=cfg.replicas.read_timeout_s * 10)
               for loc in dict.fromkeys(locations + route_agents)}
    hints = HintsManager(cfg.replicas, locations, clients, stats, prefetch=prefetch)
    control.add_dir(hints.control_dir())
    return hints, clients, server


async def _serve(mount: Assembly, mp: str, on_ready, options: MountOptions, journal: JournalConfig) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_signals, mount.fs, options.unmount_timeout_s)
        for task in mount.background:
            nursery.start_soon(task)
        nursery.start_soon(_announce_ready, mp, on_ready, options.read_ahead_kb)
        if journal.enabled:
            nursery.start_soon(_prune_journal, mount.store, journal)
        nursery.start_soon(_release_listings, mount.fs)
        nursery.start_soon(_fast_sweep, mount.fs)
        await pyfuse3.main(min_tasks=1, max_tasks=options.max_tasks)
        nursery.cancel_scope.cancel()


async def _release_listings(fs: Filesystem) -> None:
    """Directory handles whose RELEASEDIR pyfuse3 answered (`Filesystem.listings_released`) go
    at the next opendir; an idle mount lets them go within a second."""
    while True:
        await trio.sleep(1.0)
        await fs.listings_released()


async def _fast_sweep(fs: Filesystem) -> None:
    """Every MARK_SWEEP_S: fast-path marks of files the store no longer has go, and checked names
    past their time (`Filesystem.fast_sweep`)."""
    while True:
        await trio.sleep(MARK_SWEEP_S)
        await fs.fast_sweep()


async def _watch_signals(fs: Filesystem, timeout_s: float) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("received %s: unmounting", signal.Signals(signum).name)
            await _drain_writes(fs, timeout_s, signals)
            pyfuse3.terminate()
            return


async def _drain_writes(fs: Filesystem, timeout_s: float, signals) -> None:
    """Keep serving until no file is open for writing, at most `timeout_s` (a second signal
    ends the wait at once): a writer that closes in time has its file published."""
    paths = fs.open_write_paths()
    if not paths:
        return
    log.warning("waiting up to %gs for %d files still open for writing: %s", timeout_s, len(paths),
                json.dumps(paths))
    async with trio.open_nursery() as nursery:
        async def second_signal() -> None:
            async for signum in signals:
                log.warning("received %s again: not waiting for open writes any longer",
                            signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                return

        nursery.start_soon(second_signal)
        with trio.move_on_after(timeout_s):
            while fs.open_write_paths():
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    if not fs.open_write_paths():
        log.info("all files open for writing were closed; unmounting")


async def _prune_journal(store: Store, journal: JournalConfig) -> None:
    retention_ns = int(journal.retention_s * 1e9)
    while True:
        await trio.sleep(prune_interval_s(journal.retention_s))
        try:
            gone = await trio.to_thread.run_sync(prune, store, journal.dir, time.time_ns() - retention_ns,
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


async def _announce_ready(mp: str, on_ready, read_ahead_kb: int) -> None:
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
    if read_ahead_kb:
        await trio.to_thread.run_sync(set_read_ahead, mp, read_ahead_kb,
                                      abandon_on_cancel=True)
    sd_notify("READY=1")
    if on_ready is not None:
        on_ready()


__all__ = ["MountError", "run_mount", "assemble", "Assembly"]

"""The storage agent's parts, assembled in one place (`Agent`); the Flight adapter
(hintfs/agent/server.py) hands each call to one of them through the dispatch table (hintfs/agent/actions.py).

    catalog   replicas within the budget, eviction, TTLs, removals     hintfs/agent/catalog.py
    streams   write-time streams held apart until published            hintfs/agent/streams.py
    arrivals  copies in flight, versions awaited (the catalog's lock)  hintfs/agent/tier.py
    view      what the tier holds (tier_stat, bytes of one version)    hintfs/agent/tier.py
    demand    reads of a version still arriving; read hints            hintfs/agent/demand.py
    copier    copies from the store or a peer, resumed after a cut     hintfs/agent/copier.py
    intake    the stream actions; versions confirmed by the store      hintfs/agent/intake.py, versions.py
    reads     byte ranges and transformed samples served               hintfs/agent/reads.py, samples.py
    link      the cross-DC link's scheduler (with `link_bytes_s`)      hintfs/agent/linkgate.py
    follower  predictive copies of new checkpoints (with `[follow]`)   hintfs/agent/follower.py
    folder    this instance's folder; adoption after a restart         hintfs/agent/persist.py

Each part is handed the slice of the config it uses and a clock; none is handed the agent.
"""
from __future__ import annotations

import logging
import os
import resource
import threading

from hintfs.agent import persist
from hintfs.agent.catalog import Catalog
from hintfs.agent.copier import Copier
from hintfs.agent.demand import DemandReads, ReadHints
from hintfs.agent.fdserver import ReplicaFdServer
from hintfs.agent.follower import Follower
from hintfs.agent.intake import StreamIntake
from hintfs.agent.linkgate import LinkGate
from hintfs.agent.readmemory import ReadMemory
from hintfs.agent.reads import Reads
from hintfs.common.refusals import RefusalLog
from hintfs.agent.rpc import StatusReply
from hintfs.agent.streams import REFUSAL_LOG_S, StreamTier
from hintfs.agent.tier import Arrivals, TierView
from hintfs.common.clock import SYSTEM_CLOCK, Clock
from hintfs.common.secrets import read_tls_roots, read_token_file
from mountconfig.schema import AgentConfig, AgentsConfig, FollowConfig, TransformLoadConfig
from policy.stream import StreamLimits
from hintfs.stores.base import Store

log = logging.getLogger("hintfs.agent")


class Agent:
    """`config`: `[agent]`; `peers`: `[agents]` (the agents a copy may come from, and the token
    sent to them); `follow`: `[follow]` (off without prefixes; its prefixes are also where
    streams are taken when `[agent] stream_prefixes` is unset); `transform_load`: the samples'.
    `persistent`: `hintfs agent` (its folder stays for the next agent to adopt)."""

    def __init__(self, store: Store, config: AgentConfig, *, peers: AgentsConfig, follow: FollowConfig,
                 transform_load: TransformLoadConfig, persistent: bool = False, clock: Clock = SYSTEM_CLOCK) -> None:
        self.store = store
        self.config = config
        self.persistent = persistent
        self.clock = clock
        self.folder = persist.InstanceFolder(config.data_dir, persistent)
        self.data_dir = self.folder.path
        self.catalog = Catalog(self.data_dir, config.budget_bytes, persistent, clock)
        # Write-time streams of training mounts, bounded per sender and in total (each stream holds
        # a descriptor: at most a quarter of this process's open-file limit); their bytes count in
        # the budget (the catalog is their `StreamBudget`).
        limits = StreamLimits(config.stream_max_open, config.stream_max_per_peer, config.stream_max_per_token,
                              int(config.budget_bytes * config.stream_peer_share)
                              ).capped(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self.streams = StreamTier(os.path.join(self.data_dir, "streams"), clock.monotonic, persistent,
                                  idle_s=config.stream_idle_s, limits=limits, budget=self.catalog)
        self.arrivals = Arrivals(self.catalog)
        self.view = TierView(self.catalog, self.arrivals, self.streams, config.link_bytes_s, clock)
        self.demand = DemandReads(store, self.arrivals.changed, self.view.held_bytes, self.view.arriving,
                                  stream_behind_s=self.view.stream_behind_s if config.link_bytes_s else None,
                                  clock=clock)
        # What eval jobs read of each checkpoint file: the next checkpoint's streams send it first.
        self.memory = ReadMemory()
        self.hints = ReadHints(self.demand, self.memory, self.view.announced_version)
        self.link: LinkGate | None = (LinkGate(config.link_bytes_s, config.link_chunk_bytes, clock=clock)
                                         if config.link_bytes_s else None)
        refusals = RefusalLog(REFUSAL_LOG_S, clock.monotonic)
        self.copier = Copier(store, self.catalog, self.arrivals, self.streams, self.hints,
                             peers=list(peers.locations),
                             token=read_token_file(peers.token_file) if peers.token_file else None,
                             tls_root=read_tls_roots(peers.tls_root_file) if peers.tls_root_file else None,
                             link=self.link, link_chunk_bytes=config.link_chunk_bytes,
                             stream_idle_s=config.stream_idle_s, refusals=refusals, clock=clock)
        self.reads = Reads(store, self.catalog, self.demand, self.memory, max_concurrent=config.max_concurrent_reads,
                           bandwidth_bytes_s=config.bandwidth_bytes_s, transform_load=transform_load, clock=clock)
        if persistent:
            persist.adopt_stopped_instances(config.data_dir, self._adopt)
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reclaim_loop, name="hintfs-agent-reclaim", daemon=True)
        self._reaper.start()
        self.fd_server: ReplicaFdServer | None = None
        if config.local_socket:   # replica fds for mounts on this host (FUSE passthrough)
            self.fd_server = ReplicaFdServer(config.local_socket, self.catalog.local_fd, self.streams.verified_view)
        self.intake = StreamIntake(store, self.streams, self.catalog, self.arrivals, self.hints, self.memory,
                                   prefixes=config.stream_prefixes if config.stream_prefixes is not None
                                   else follow.prefixes,
                                   journal_dir=follow.journal_dir if follow.prefixes else None,
                                   record_wait_s=config.stream_record_wait_s,
                                   verify_poll_s=config.stream_verify_poll_s, refusals=refusals, clock=clock)
        self.follower: Follower | None = None
        if follow.prefixes:
            self.follower = Follower(follow, store, self.catalog, self.copier, versions=self.intake.versions,
                                     link=self.link, clock=clock).start()

    def _adopt(self, folder: str) -> None:
        """What a stopped persistent agent left in `folder`: replicas, cut copies, streams."""
        adopted = self.catalog.adopt(folder)
        self.copier.adopt(folder)
        if os.path.isdir(os.path.join(folder, "streams")):
            n = self.streams.adopt(os.path.join(folder, "streams"))
            if n:
                log.info("adopted %d write-time streams from %s", n, folder)
        if adopted:
            log.info("catalog rebuilt from disk: %d replicas (%d bytes)", adopted, self.catalog.used_bytes())

    # -- the reclaim loop ------------------------------------------------------------------------
    def _reclaim_loop(self) -> None:
        while not self._stop.wait(self.config.reclaim_interval_s):
            self.reclaim()

    def reclaim(self) -> None:
        """One round: close the store readers retired a round ago, drop the replicas and streams
        whose time ran out, save the streams' progress."""
        readers = self.reads.take_retired()
        self._stop.wait(min(self.config.reclaim_interval_s, 1.0))   # let reads that picked them up finish
        for r in readers:
            r.close()
        self.catalog.expire()
        self.intake.expire()

    def status(self, replicas: bool = True) -> StatusReply:
        """The agent's state; `replicas`: with every replica (else their number only)."""
        listed, count, budget = self.catalog.status(replicas)
        return StatusReply(replicas=listed, replica_count=count, load=self.reads.status(), budget=budget,
                           resumed_ranges=self.copier.resumed_ranges, copies=self.copier.copies,
                           streams=self.intake.status(), demand=self.demand.status(),
                           samples=self.reads.samples_status(),
                           follow=self.follower.status() if self.follower is not None else None,
                           link_bytes_by_class=dict(self.link.sent) if self.link is not None else None,
                           replica_fds=self.catalog.fd_status())

    def stop(self) -> None:
        """Stop the threads (before the Flight server stops taking calls)."""
        self._stop.set()
        self.copier.stop()
        self.intake.close()
        if self.follower is not None:
            self.follower.stop()
        if self.link is not None:
            self.link.stop()
        self.reads.close()
        if self.fd_server is not None:
            self.fd_server.close()

    def close(self) -> None:
        """Release what is left (after the Flight server stopped): a persistent agent keeps each
        stream's part and progress, and its replicas, for the next agent to adopt."""
        self.demand.close()
        self.streams.close()
        self.catalog.close()
        self.folder.close()


__all__ = ["Agent"]

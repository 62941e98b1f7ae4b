"""Replication hints in the mount: `.hintfs/hints/<job>` in, replicas on the agents out.

A job writes `{"files": {relpath: expected_readers}, "safe_readers_per_replica"?, "ttl_s",
"deadline_s"}`. The document is validated whole before anything happens (EINVAL and a reason
otherwise). The manager then plans replicas with `policy.replicas`, copies them to agents as a
tree (hottest file first; each finished replica is a source in the next round), reports
progress in `.hintfs/hints/<job>.status`, and drops the extra replicas when the TTL passes.
Reads of a hinted file are spread over its ready replicas by `ReplicaRouter`.
"""
from __future__ import annotations

import collections
import functools
import itertools
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Sequence

import trio

from hintfs.common.documents import HintDocument, parse_hint
from hintfs.agent.rpc import without_grpc_context
from policy.replicas import ReplicaTarget, choose_least_sent, hash_order, place, plan_replicas
from fusefs.control import ControlDir, ControlFile, ControlInputError
from mountconfig.schema import ReplicasConfig

log = logging.getLogger("hintfs.hints")

SENT_HALF_LIFE_S = 10.0   # how fast a host forgets the bytes it asked of each agent (ReplicaRouter)
FILES_AT_ONCE = 16     # hinted files whose replicas are copied at the same time, hottest first


@dataclass
class FileState:
    target: int
    readers: int
    ready: list[str] = field(default_factory=list)   # agent locations holding a complete copy
    places: list[str] | None = None   # where its copies go (counted in `placed`); [] once unplaced
    error: str = ""


@dataclass
class Job:
    name: str
    doc: HintDocument
    files: dict[str, FileState]
    expires_at: float
    deadline_at: float
    done: bool = False


class ReplicaRouter:
    """Where a hinted file's replicas are (written by the hints manager only), and which replica
    to read next: the one this host has asked for the fewest bytes (`choose_least_sent`: each
    host spreads its own bytes evenly, so all hosts' sum is even), fewer reads in flight first
    among equals."""

    def __init__(self, rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic,
                 half_life_s: float = SENT_HALF_LIFE_S) -> None:
        self.replicas: dict[str, list[str]] = {}
        self.in_flight: dict[str, int] = {}
        # agent -> bytes this host has asked of it lately (+ its start level), halved every
        # `half_life_s`: what a host read in an earlier storm does not steer this one's reads
        # (scale_storm: after a default-policy storm had sent 42 MB to each of three agents, every
        # host kept the next storm's reads off them: those three served 0.5 MB, the busiest 1.5x the mean)
        self.sent: dict[str, float] = {}
        self.asked: dict[str, int] = {}    # agent -> bytes this host has asked of it, in all
        self.clock = clock
        self.half_life_s = half_life_s
        self._decayed_at = clock()
        # Seeded apart on each host: with one seed, every mount of a storm picked the same replica
        # for its first reads of a hot file (bench/scale_storm.py: 16 hosts, all on one of 3 agents).
        self.rng = rng or random.Random()
        # Told when a path gets its first replica: reads of it go elsewhere from now on (the
        # filesystem ends its fast-path mark, fusefs/fastpath.py).
        self.routed: Callable[[str], None] = lambda path: None

    def _decay(self) -> None:
        now = self.clock()
        if now - self._decayed_at >= self.half_life_s / 8:       # (a step every 1/8 half-life)
            f = 0.5 ** ((now - self._decayed_at) / self.half_life_s)
            for loc in self.sent:
                self.sent[loc] *= f
            self._decayed_at = now

    def pick(self, path: str, exclude: tuple[str, ...] = (), among: Sequence[str] | None = None,
             size: int = 0) -> str | None:
        """The next replica of `path` to read `size` bytes from, of `among` (None: its hinted
        replicas). An agent new to this host starts level with the least asked of the others (not
        at 0, which would send it every read until it caught up)."""
        ready = [loc for loc in (self.replicas.get(path, ()) if among is None else among) if loc not in exclude]
        if not ready:
            return None
        self._decay()
        known = [self.sent[loc] for loc in ready if loc in self.sent]
        floor = min(known) if known else 0
        sent = [self.sent.setdefault(loc, floor) for loc in ready]
        loc = ready[choose_least_sent(sent, [self.in_flight.get(loc, 0) for loc in ready], self.rng)]
        self.sent[loc] += size
        self.asked[loc] = self.asked.get(loc, 0) + size
        return loc


class HintsManager:
    def __init__(self, options: ReplicasConfig, agents: list[str], clients, stats, *,
                 prefetch: Callable[[str], object] | None = None, holder: str | None = None):
        self.options = options
        # This mount's name as a replica's holder at the agents (one per mount process): each job's
        # copies are claimed as "<holder>/<job>", so that a job that ends releases only its own claim
        self.holder = holder or f"mount-{random.getrandbits(64):016x}"
        self.agents = agents
        self.clients = clients              # location -> AgentClient (blocking; used in threads)
        self.stats = stats
        self.jobs: dict[str, Job] = {}
        self.router = ReplicaRouter()
        self.placed: dict[str, int] = {}    # agent -> replicas of this mount's live jobs placed on it
        self.limiter = trio.CapacityLimiter(max(4, 2 * len(agents)))
        self._send, self._recv = trio.open_memory_channel(1000)
        # A host cache's `prefetch` (remote stores with `[cache] dir`): hinted files fetched ahead.
        self.prefetch = prefetch

    # -- control files ---------------------------------------------------------------------------
    def control_dir(self) -> ControlDir:
        d = ControlDir("hints", on_remove=self.remove)
        d.make_file = lambda name: self._job_file(d, name)
        return d

    def _job_file(self, d: ControlDir, name: str) -> ControlFile:
        def render() -> bytes:
            job = self.jobs.get(name)
            return (job.doc.model_dump_json() + "\n").encode() if job else b""

        d.add(ControlFile(name + ".status", render=lambda: self.status_json(name)))
        return ControlFile(name, render=render,
                           parse=lambda doc: parse_hint(doc, self.options.max_hint_files),
                           names=lambda doc: list(doc.files), apply=lambda doc: self.submit(name, doc))

    def replicas_held(self, name: str) -> int:
        """Replicas the job's hint made that are ready now."""
        job = self.jobs.get(name)
        return sum(len(s.ready) for s in job.files.values()) if job is not None else 0

    def remove(self, name: str) -> None:
        """The job's hint file was removed: its replicas go at the next reclaim, as at its TTL."""
        job = self.jobs.get(name)
        if job is not None:
            job.expires_at = 0.0

    def status(self, name: str) -> dict:
        job = self.jobs.get(name)
        if job is None:
            return {}
        files: dict[str, dict[str, Any]] = {
            p: {"target": s.target, "ready": len(s.ready), "at": list(s.ready),
                **({"error": s.error} if s.error else {})}
            for p, s in job.files.items()}
        return {"job": name, "ready": all(v["ready"] >= v["target"] for v in files.values()),
                "done": job.done, "deadline_in_s": round(job.deadline_at - time.time(), 3),
                "expires_in_s": round(job.expires_at - time.time(), 3), "agents": len(self.agents),
                "files": files,
                # the bytes this host has asked of each agent for hinted files (every job's)
                "asked": {loc: self.router.asked[loc] for loc in sorted(self.router.asked)}}

    def status_json(self, name: str) -> bytes:
        return (json.dumps(self.status(name), indent=1, sort_keys=True) + "\n").encode()

    # -- planning --------------------------------------------------------------------------------
    def submit(self, name: str, doc: HintDocument) -> None:
        """Validated document in, plan recorded; the copying happens in `run` (never inline)."""
        now = time.time()
        r = self.options
        safe = doc.safe_readers_per_replica or r.safe_readers_per_replica
        targets = plan_replicas(doc.files, safe, r.default_replicas, r.max_replicas, len(self.agents),
                                now, doc.ttl_s)
        job = Job(name, doc, {t.path: FileState(t.replicas, t.readers) for t in targets},
                  now + doc.ttl_s, now + doc.deadline_s)
        old = self.jobs.get(name)
        if old is not None:
            self._unplace(old)
        self.jobs[name] = job
        self.stats.add("hint_jobs")
        if self.prefetch is not None:
            for path in doc.files:
                self.prefetch(path)   # non-blocking: the host cache's own threads fetch
        try:
            self._send.send_nowait((job, targets))
        except trio.WouldBlock:
            raise ControlInputError("too many hint jobs queued; try again") from None

    def _agents_for(self, path: str, n: int) -> list[str]:
        """Where `path`'s `n` replicas go (`policy.replicas.place`: among its hash order's first
        agents, those this mount has placed the fewest replicas on); counted as placed."""
        places = place(hash_order(path, self.agents), n, self.placed)
        for loc in places:
            self.placed[loc] = self.placed.get(loc, 0) + 1
        return places

    async def run(self) -> None:
        """Background task: copy planned replicas, tree fan-out, hottest file first; reclaim at TTL."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._reclaim_loop)
            async for job, targets in self._recv:
                nursery.start_soon(self._materialize, job, targets)

    async def _materialize(self, job: Job, targets: list[ReplicaTarget]) -> None:
        # A failure here is recorded in the job's status and logged; it never reaches the mount.
        # Files with the same expected readers fan out together (up to FILES_AT_ONCE at a time),
        # the hottest group first, the next group once it is done: one file after another, a hint
        # of 140 files at 3 replicas took 41-44 s to be ready on a mount of bench/scale_storm.py,
        # and its 2 hottest files waited for each other.
        files = trio.CapacityLimiter(FILES_AT_ONCE)
        # Placed here, in the targets' order (hottest first), before any copy starts: the fan-outs
        # run concurrently in an order trio does not fix, and hosts that hint the same files must
        # place them alike (policy.replicas.place).
        for t in targets:
            job.files[t.path].places = self._agents_for(t.path, t.replicas)
        try:
            for _readers, group in itertools.groupby(targets, key=lambda t: t.readers):
                async with trio.open_nursery() as n:
                    for t in group:
                        await files.acquire_on_behalf_of(t)
                        n.start_soon(self._fan_out, job, t, files)
        except Exception:
            log.exception("hint %s: replication stopped", job.name)
        job.done = True
        log.info("hint %s: %d files planned, replication finished", job.name, len(targets))

    async def _fan_out(self, job: Job, t: ReplicaTarget, files: trio.CapacityLimiter) -> None:
        """One copy from the store, then a tree fan-out without rounds: each replica, once
        complete, copies to the next agents still waiting, one after another, so the replicas
        double with every copy's time (`policy.replicas.fanout_rounds`) and none waits for the
        slowest copy of a round (held to rounds, 128 replicas of the hot set took 3.0-4.2 s in
        bench/scale_storm.py). An agent that fails is skipped and its slot stays empty."""
        try:
            state = job.files[t.path]
            if state.places is None:
                state.places = self._agents_for(t.path, t.replicas)
            places = state.places
            if not places:
                return
            await self._copy(job, t.path, places[0], None)
            pending = collections.deque(places[1:])

            async def serve(source: str, nursery: trio.Nursery) -> None:
                while pending:
                    dest = pending.popleft()
                    await self._copy(job, t.path, dest, source)
                    if dest in state.ready:
                        nursery.start_soon(serve, dest, nursery)

            if state.ready and pending:
                async with trio.open_nursery() as n:
                    n.start_soon(serve, state.ready[0], n)
            if len(state.ready) < state.target:
                log.warning("hint %s: %s has %d of %d replicas: %s", job.name, t.path, len(state.ready),
                            state.target, state.error or "agents unavailable")
        finally:
            files.release_on_behalf_of(t)

    async def _copy(self, job: Job, path: str, dest: str, source: str | None) -> None:
        client = self.clients[dest]
        state = job.files[path]
        try:
            copy = functools.partial(client.replicate, path, max(job.expires_at - time.time(), 1.0), source,
                                     holder=self.claim(job.name))
            await trio.to_thread.run_sync(copy, limiter=self.limiter)
        except OSError as err:
            state.error = without_grpc_context(str(err))
            self.stats.add("replica_copy_errors")
            return
        if dest not in state.ready:
            state.ready.append(dest)
        locs = self.router.replicas.setdefault(path, [])
        if not locs:
            self.router.routed(path)
        if dest not in locs:
            locs.append(dest)
        self.stats.add("replicas_made")

    def _unplace(self, job: Job) -> None:
        """`job`'s replicas no longer count as placed by this mount (it ended, or was replaced)."""
        for state in job.files.values():
            for loc in state.places or ():
                if self.placed.get(loc, 0) > 0:
                    self.placed[loc] -= 1
            state.places = []

    def claim(self, job: str) -> str:
        """The holder name of `job`'s copies at the agents."""
        return f"{self.holder}/{job}"

    async def _reclaim_loop(self) -> None:
        while True:
            await trio.sleep(1.0)
            await self.reclaim(time.time())

    async def reclaim(self, now: float) -> None:
        """Jobs whose TTL ran out (or whose hint file was removed) release their claims on their
        replicas: an agent drops a replica once no claim on it is live, so a file that another
        job (of this mount or of another host's) hinted keeps its replicas, and this mount keeps
        reading them while one of its own live jobs has them."""
        for name, job in list(self.jobs.items()):
            if job.expires_at > now:
                continue
            del self.jobs[name]
            self._unplace(job)
            for path, state in job.files.items():
                for loc in state.ready:
                    try:
                        release = functools.partial(self.clients[loc].drop, path, holder=self.claim(name))
                        await trio.to_thread.run_sync(release, limiter=self.limiter)
                    except OSError as err:
                        log.warning("release of %s at %s failed: %s", path, loc, err)
                live = [loc for other in self.jobs.values() if path in other.files
                        for loc in other.files[path].ready]
                if live:
                    self.router.replicas[path] = list(dict.fromkeys(live))
                else:
                    self.router.replicas.pop(path, None)
            log.info("hint %s expired: its claims on %d files' replicas released", name, len(job.files))

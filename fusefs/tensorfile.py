"""`x.mp4.tensor`: virtual files whose bytes are made by an agent's transform, and the plans
that tell the agents which samples come next.

- A path `P.tensor` exists when `P` exists in the store, matches a `[[transforms]]` rule and the
  store has no real file named `P.tensor`. It is not listed in directories (listings stay the
  store's), it is read-only, and it is opened with direct I/O: its content (transformed tensor or
  raw fallback) is fixed at the first open and shared by every handle open at the same time, so
  its size is exact once open and concurrent readers see the same bytes.
- `.hintfs/plans/<job>` registers a Parquet plan (`step, rank, slot, sample, aug_seed, ...`) and
  the current step. Each sample's `aug_seed` comes from the plan (the occurrence nearest the step
  its rank has reached, see `_locate`), else from a hash of its path. Reads move each rank's step
  on; the agents are asked to make the steps from the slowest local rank's to the fastest one's
  + W and to free what is before the slowest. With each window go the step of every wanted sample,
  the readers' step and the plan's `est_cost_ms` (issue 40): the agents schedule by deadline and
  answer the lookahead they want (grown near their capacity, at most `lookahead_max_steps`).
"""
from __future__ import annotations

import bisect
import errno
import functools
import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from collections.abc import Sequence

import trio
from cachetools import LRUCache

from fusefs.attrs import Refused
from hintfs.agent.rpc import MAX_EST_MS
from hintfs.common import access
from hintfs.common.access import Principal
from hintfs.common.documents import parse_plan_registration
from fusefs.control import ControlDir, ControlFile, ControlInputError
from mountconfig.schema import TransformLoadConfig
from hintfs.transforms.params import TransformRule, default_seed, match_rule, params_json

if TYPE_CHECKING:
    from hintfs.agent.client import AgentClient

log = logging.getLogger("hintfs.tensorfile")

SUFFIX = ".tensor"
CONSUMED_PENALTY = 2   # steps: see TensorFiles._locate
MAX_PLAN_BYTES = 1 << 30          # a plan file larger than this is refused at registration
MAX_WINDOW_SAMPLES = 50_000       # samples asked of the agents in one plan window
FAILED_REMEMBERED = 4096          # sources whose failed `.tensor` open was logged (then DEBUG)
UNREACHABLE_LOG_S = 60.0          # an agent that does not answer: one line per agent this often
MAX_REASON = 300                  # characters of an agent's reason in a log line


def agent_reason(err: BaseException) -> str:
    """The one line an agent sent with a failed call (the transform's limit or decoder error),
    without gRPC's context (which is ~300 characters of client state); for a call the agent
    never answered, the client's text up to that context."""
    from hintfs.agent.rpc import error_message, without_grpc_context
    flight = err.__cause__ or err.__context__
    if isinstance(flight, Exception) and getattr(flight, "extra_info", None):
        text = error_message(flight)
    else:
        text = without_grpc_context(str(err.strerror if isinstance(err, OSError) and err.strerror else err))
    return text if len(text) <= MAX_REASON else text[:MAX_REASON] + "..."


@dataclass
class Plan:
    job: str
    path: str
    step: int
    lookahead: int
    steps: list[int]                       # sorted distinct steps
    base: int                              # the registered step: where every rank starts
    by_step: dict[int, list[tuple[str, int, int]]]                                 # step -> (sample, seed, rank)
    seeds: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)   # sample -> (steps, seeds)
    ranks: dict[str, list[int]] = field(default_factory=dict)                     # sample -> ranks, by occurrence
    local_ranks: set[int] = field(default_factory=set)   # ranks whose samples this mount has served
    rank_step: dict[int, int] = field(default_factory=dict)   # inferred step of each local rank
    front: int = 0                                        # the most advanced local rank's step
    pulled: set[int] = field(default_factory=set)        # steps whose ready tensors were pulled here
    read: set[tuple[str, int, int]] = field(default_factory=set)   # (sample, step, rank) occurrences read
    # Who registered it, when that is neither root nor the mount's owner: every sample is checked
    # against them (`hintfs.common.access`) before an agent is asked to transform it.
    reader: Principal | None = None
    allowed: dict[str, bool] = field(default_factory=dict)   # sample -> may `reader` read it (checked)
    cost: dict[str, float] = field(default_factory=dict)      # sample -> the plan's est_cost_ms (> 0 only)
    agent_lookahead: dict[str, int] = field(default_factory=dict)   # agent -> the lookahead it asked for
    route: dict = field(default_factory=dict)    # sample -> (agent, kind, params JSON) or None (no rule)


def _load_plan_rows(store, rel: str):
    import pyarrow as pa
    import pyarrow.parquet as pq
    reader, st = store.open_reader(rel)
    if st.size > MAX_PLAN_BYTES:
        reader.close()
        raise ValueError(f"{st.size} bytes is over the {MAX_PLAN_BYTES}-byte limit for plans")
    try:
        data = reader.read(0, st.size)
    finally:
        reader.close()
    # ParquetFile, not read_table: the latter imports pyarrow.dataset (~0.1 s of CPU) for nothing.
    pf = pq.ParquetFile(pa.BufferReader(data))
    has_cost = "est_cost_ms" in pf.schema_arrow.names
    table = pf.read(columns=["step", "rank", "sample", "aug_seed"] + (["est_cost_ms"] if has_cost else []))
    costs = table.column("est_cost_ms").to_pylist() if has_cost else [None] * table.num_rows
    return (table.column("step").to_pylist(), table.column("rank").to_pylist(),
            table.column("sample").to_pylist(), table.column("aug_seed").to_pylist(), costs)


class TensorFiles:
    def __init__(self, rules: Sequence[TransformRule], load: TransformLoadConfig, store, agents: list[str],
                 clients: dict[str, AgentClient], stats):
        self.rules = list(rules)
        self.lookahead_default = load.lookahead_steps
        self.lookahead_max = load.lookahead_max_steps
        self.store = store
        self.agents = agents
        self.clients = clients
        self.stats = stats
        self.plans: dict[str, Plan] = {}
        self._pjson: dict[int, str] = {}
        self.pull_bytes = load.mount_pull_bytes
        # (sample, seed) -> tensor pulled ahead, at most `pull_bytes` in all (taken at its open)
        self._pulled: LRUCache = LRUCache(maxsize=max(self.pull_bytes, 1), getsizeof=len)
        self._pulling: dict[tuple[str, int], trio.Event] = {}
        self.limiter = trio.CapacityLimiter(16)
        self._send, self._recv = trio.open_memory_channel(256)
        self._ended: set[str] = set()          # jobs whose plan ended: an empty window goes out
        self._failed: LRUCache = LRUCache(maxsize=FAILED_REMEMBERED)   # sources whose failure was logged
        self._unreachable: dict[str, float] = {}   # agent -> when its last "no answer" line was logged
        self._unscheduled: set[str] = set()        # agents that refused plan steps (older than issue 40)
        if self.rules:   # plans are Parquet: import it now, not during the first registration
            import pyarrow.parquet  # noqa: F401

    # -- which paths are virtual -------------------------------------------------------------------
    def match(self, path: str) -> tuple[str, TransformRule] | None:
        """The (source relpath, rule) of a `.tensor` path, or None."""
        if not self.rules or not path.endswith(SUFFIX):
            return None
        source = path[: -len(SUFFIX)]
        rule = match_rule(self.rules, source)
        return (source, rule) if rule is not None else None

    def _params_json(self, rule) -> str:
        """The canonical JSON of a rule's parameters, computed once per rule."""
        pj = self._pjson.get(id(rule))
        if pj is None:
            pj = self._pjson[id(rule)] = params_json(rule.params)
        return pj

    def _agent_for(self, source: str) -> str:
        return self.agents[int(hashlib.sha256(source.encode()).hexdigest(), 16) % len(self.agents)]

    # -- seeds and progress from plans -------------------------------------------------------------
    def seed_for(self, source: str) -> int:
        return self._locate(source)[0]

    def _locate(self, source: str) -> tuple[int, Plan | None]:
        """The sample's seed, and the plan it is read under (None without one).

        Progress is kept per rank: a read is the sample's occurrence nearest (at or after) the step
        its rank has reached, so ranks reading at different paces each get their own step's seed,
        and it moves that rank to that step. A read does not say which rank reads: when two ranks'
        occurrences are equally near, the earlier step wins. `plan.step` is the slowest local
        rank's step (what the agents may free before), `plan.front` the fastest one's (what they
        prepare after)."""
        for plan in self.plans.values():
            entry = plan.seeds.get(source)
            if entry:
                steps, seeds = entry
                ranks = plan.ranks[source]
                # Of the occurrences not behind their rank, the one nearest its rank's progress
                # (each rank reads its steps in order; a rank not seen yet is at `base`). One
                # already read counts as CONSUMED_PENALTY steps farther: a re-read of it still
                # wins over a later epoch, another rank's unread one one step ahead does not.
                best = None
                for j in range(bisect.bisect_left(steps, plan.base), len(steps)):
                    ahead = steps[j] - plan.rank_step.get(ranks[j], plan.base)
                    if ahead < 0:
                        continue
                    score = ahead + (CONSUMED_PENALTY if (source, steps[j], ranks[j]) in plan.read else 0)
                    if best is None or score < best[0]:
                        best = (score, j)
                i = best[1] if best is not None else len(steps) - 1
                plan.read.add((source, steps[i], ranks[i]))
                self._advance(plan, ranks[i], steps[i])
                return seeds[i], plan
        return default_seed(source), None

    def _advance(self, plan: Plan, rank: int, step: int) -> None:
        plan.local_ranks.add(rank)
        if step <= plan.rank_step.get(rank, plan.base) and rank in plan.rank_step:
            return
        plan.rank_step[rank] = max(step, plan.rank_step.get(rank, plan.base))
        slowest, front = min(plan.rank_step.values()), max(plan.rank_step.values())
        if (slowest, front) != (plan.step, plan.front):
            if front > plan.front:
                self.stats.add("plan_steps_inferred")
            moved = slowest > plan.step
            plan.step, plan.front = slowest, front
            if moved:   # occurrences behind every rank are never candidates again
                plan.read = {o for o in plan.read if o[1] >= slowest}
                self._prune_pulled(plan)
            self._queue(plan)

    def _queue(self, plan: Plan) -> None:
        self._queue_job(plan.job)

    def _queue_job(self, job: str) -> None:
        try:
            self._send.send_nowait(job)
        except trio.WouldBlock:
            pass

    async def fetch(self, source: str, rule) -> bytes:
        """The `.tensor` bytes of `source`, made by its agent (never in this event loop)."""
        seed, plan = self._locate(source)
        key = (source, seed)
        if plan is not None and self.pull_bytes:
            self._pull_ahead(plan)
            pending = self._pulling.get(key)
            if pending is not None:
                await pending.wait()
            data: bytes | None = self._pulled.pop(key, None)
            if data is not None:
                self.stats.add("tensor_opens")
                self.stats.add("tensor_pulled_hits")
                return data
        loc = self._agent_for(source)
        try:
            data = await trio.to_thread.run_sync(self.clients[loc].sample, source, rule.kind,
                                                 self._params_json(rule), seed, True, limiter=self.limiter)
        except OSError as err:
            raise self._open_failed(source, loc, err) from None
        self._failed.pop(source, None)
        self.stats.add("tensor_opens")
        return data

    def _open_failed(self, source: str, loc: str, err: OSError) -> Refused:
        """A `.tensor` the agent could not make (EIO: a corrupt source, or one over a limit of its
        rule's params) or did not answer for: one log line naming the file and the agent's reason
        (once per source while remembered; every call at DEBUG with the whole error), and the
        errno for the reader, whose reason the errno line of the mount (fusefs/fuse.py) shows."""
        code = err.errno or errno.EIO
        reason = agent_reason(err)
        log.debug("%s%s: agent %s: %s", source, SUFFIX, loc, err)
        answered = bool(getattr(err.__cause__ or err.__context__, "extra_info", None))   # its own reason
        now = trio.current_time()
        if answered and source not in self._failed:
            self._failed[source] = None
            log.warning("%s%s: %s (agent %s, %s)", source, SUFFIX, reason, loc,
                        errno.errorcode.get(code, code))
        elif not answered and now >= self._unreachable.get(loc, -UNREACHABLE_LOG_S) + UNREACHABLE_LOG_S:
            self._unreachable[loc] = now
            log.warning("%s%s: agent %s failed: %s (%s; one line per agent a minute)", source,
                        SUFFIX, loc, reason, errno.errorcode.get(code, code))
        return Refused(code, reason)

    # -- pulling a step's ready tensors in one call per agent -----------------------------------------
    def _pull_ahead(self, plan: Plan) -> None:
        """At the first read of step N, fetch the tensors of steps N and N+1 (this host's ranks)
        that the agents have ready, one call per agent: later opens of those samples are served
        from here without a call and a thread hand-off each. Bounded by `mount_pull_bytes`."""
        for step in (plan.step, plan.step + 1):
            if step in plan.pulled or step not in plan.by_step:
                continue
            plan.pulled.add(step)
            want: dict[str, list] = {}
            for sample, seed, rank in plan.by_step[step]:
                key = (sample, seed)
                if rank not in plan.local_ranks or key in self._pulled or key in self._pulling:
                    continue
                if plan.reader is not None and not plan.allowed.get(sample):
                    continue   # not checked for its registrant yet (or refused): opened on its own
                m = self.match(sample + SUFFIX)
                if m is None:
                    continue
                self._pulling[key] = trio.Event()
                want.setdefault(self._agent_for(sample), []).append([sample, m[1].kind, self._params_json(m[1]), seed])
            for loc, samples in want.items():
                trio.lowlevel.spawn_system_task(self._pull, loc, samples)

    def _prune_pulled(self, plan: Plan) -> None:
        """When the slowest rank moves on: what was pulled for steps that are over (opened under
        another seed, or never) goes."""
        plan.pulled = {s for s in plan.pulled if s >= plan.step - 1}
        live = {(sa, se) for st in (plan.step, plan.step + 1) for sa, se, _r in plan.by_step.get(st, ())}
        for key in [k for k in self._pulled if k not in live and k[0] in plan.seeds]:
            del self._pulled[key]

    async def _pull(self, loc: str, samples: list) -> None:
        try:
            got = await trio.to_thread.run_sync(self.clients[loc].samples_ready, samples, limiter=self.limiter)
        except OSError as err:
            log.warning("pulling ready tensors from %s failed: %s", loc, agent_reason(err))
            log.debug("pulling ready tensors from %s: %s", loc, err)
            got = []
        for path, seed, data in got:
            if self._pulled.currsize + len(data) > self.pull_bytes:
                break    # full: what is pulled stays until opened or its step is over
            self._pulled[(path, seed)] = data
        for sample, _kind, _params, seed in samples:
            ev = self._pulling.pop((sample, seed), None)
            if ev is not None:
                ev.set()

    # -- plan registration ---------------------------------------------------------------------------
    def control_dir(self) -> ControlDir:
        d = ControlDir("plans", on_remove=self.remove)
        d.make_file = lambda name: ControlFile(name, render=lambda: self._render(name),
                                               parse=parse_plan_registration,
                                               names=lambda reg: [reg.plan] if reg.plan is not None else [],
                                               prepare=lambda reg, caller: self.prepare(name, reg, caller),
                                               apply=lambda prepared: self.install(name, prepared))
        return d

    def remove(self, job: str) -> None:
        """The job's plan file was removed: its plan ends, and the agents free its samples (an
        empty window for the job, sent by `run`)."""
        if self.plans.pop(job, None) is not None:
            self.stats.add("plans_removed")
            self._ended.add(job)
            self._queue_job(job)

    def _render(self, job: str) -> bytes:
        plan = self.plans.get(job)
        if plan is None:
            return b""
        return (json.dumps({"plan": plan.path, "step": plan.front, "slowest_step": plan.step,
                            "rank_steps": {str(r): s for r, s in sorted(plan.rank_step.items())},
                            "lookahead": plan.lookahead, "steps": len(plan.steps)}) + "\n").encode()

    def prepare(self, job: str, reg, caller: Principal | None = None):
        """Read a registration's plan (blocking: a worker thread); nothing changes. `reg` is a
        validated `plan.PlanRegistration`: a step-only update carries no plan. A plan registered by
        a user who is neither root nor the mount's owner acts for them: its samples are checked
        against them (`_allowed`) before any is transformed."""
        step = reg.step
        lookahead = reg.lookahead if reg.lookahead is not None else self.lookahead_default
        if reg.plan is None:
            return ("step", step, lookahead)
        path = reg.plan
        try:
            steps, ranks, samples, seeds, costs = _load_plan_rows(self.store, path)
        except FileNotFoundError:
            raise ControlInputError(f"plan: {path} does not exist") from None
        except Exception as err:
            raise ControlInputError(f"plan: {path} is not a readable plan: {err}") from None
        by_step: dict[int, list[tuple[str, int, int]]] = {}
        per_sample: dict[str, list[tuple[int, int, int]]] = {}
        for st, rk, sa, se in zip(steps, ranks, samples, seeds):
            by_step.setdefault(st, []).append((sa, se, rk))
            per_sample.setdefault(sa, []).append((st, se, rk))
        plan = Plan(job, path, step, lookahead, sorted(by_step), step, by_step, front=step,
                    reader=caller if caller is not None and not caller.privileged() else None)
        for sa, co in zip(samples, costs):
            if co is not None and co > 0 and co == co and co < MAX_EST_MS:   # (NaN != NaN)
                plan.cost[sa] = float(co)
        for sample, occ in per_sample.items():
            occ.sort()
            plan.seeds[sample] = ([o[0] for o in occ], [o[1] for o in occ])
            plan.ranks[sample] = [o[2] for o in occ]
        return ("plan", plan)

    def install(self, job: str, prepared) -> None:
        """Apply a prepared registration (in the trio loop)."""
        if prepared[0] == "step":
            _kind, step, lookahead = prepared
            existing = self.plans.get(job)
            if existing is None:
                raise ControlInputError("plan: required when registering a job")
            # a step update: every rank is there now
            existing.step = existing.front = existing.base = step
            existing.rank_step = {r: step for r in existing.rank_step}
            existing.lookahead = lookahead
            self._queue(existing)
            return
        plan = prepared[1]
        self.plans[job] = plan
        self.stats.add("plans_registered")
        self._queue(plan)

    async def _check_samples(self, plan: Plan, samples: list[str]) -> None:
        """Check the samples of a window not checked yet against the plan's registrant, by the one
        access rule (in a worker thread; each sample once per plan). A refused sample is never
        transformed or pulled for this plan (its `.tensor` open is checked on its own)."""
        todo = sorted({s for s in samples if s not in plan.allowed})
        if not todo or plan.reader is None:
            return
        checker = access.Checker(self.store, plan.reader)
        verdicts = await trio.to_thread.run_sync(lambda: [checker.may_read(s) for s in todo], limiter=self.limiter)
        refused = [s for s, ok in zip(todo, verdicts) if not ok]
        plan.allowed.update(zip(todo, verdicts))
        if refused:
            self.stats.add("plan_samples_refused", len(refused))
            log.warning("plan %s of uid %d: %d samples are not readable by that user (e.g. %r): not transformed",
                        plan.job, plan.reader.uid, len(refused), refused[0])

    async def run(self) -> None:
        """Background task: ask the agents for steps N+1..N+W and let them free steps before N."""
        async for job in self._recv:
            plan = self.plans.get(job)
            if plan is None:
                if job in self._ended:          # its plan ended: the agents free its samples
                    self._ended.discard(job)
                    for loc in self.agents:
                        try:
                            await trio.to_thread.run_sync(self.clients[loc].plan_window, [], [], job,
                                                          limiter=self.limiter)
                        except OSError as err:
                            log.warning("plan %s: agent %s: %s", job, loc, agent_reason(err))
                            log.debug("plan %s: agent %s: %s", job, loc, err)
                continue
            want: dict[str, list] = {}
            keep: dict[str, list] = {}
            wsteps: dict[str, list] = {}
            wcosts: dict[str, list] = {}
            # Only steps the plan has, from the slowest rank to the front + lookahead (grown to what
            # the agents ask, at most lookahead_max_steps and MAX_WINDOW_SAMPLES): the work is
            # bounded by the plan's rows in that window, never by the numbers in a document, and
            # the loop yields to the mount at every step.
            lookahead = max([plan.lookahead] + [min(v, self.lookahead_max) for v in plan.agent_lookahead.values()])
            lo = bisect.bisect_left(plan.steps, plan.step)
            hi = bisect.bisect_right(plan.steps, plan.front + lookahead)
            items = 0
            for s in plan.steps[lo:hi]:
                await trio.lowlevel.checkpoint()
                if items >= MAX_WINDOW_SAMPLES:
                    if s > plan.front + plan.lookahead:
                        break       # the agents' grown lookahead: as far as the bound goes
                    log.warning("plan %s: window past step %d holds over %d samples; the rest waits",
                                job, s, MAX_WINDOW_SAMPLES)
                    break
                for sample, seed, _rank in plan.by_step.get(s, ()):
                    items += 1
                    route = plan.route.get(sample, False)
                    if route is False:      # its rule and agent, once per sample of the plan
                        m = self.match(sample + SUFFIX)
                        route = plan.route[sample] = (None if m is None else
                                                      (self._agent_for(sample), m[1].kind, self._params_json(m[1])))
                    if route is None:
                        continue
                    loc, kind, pjson = route
                    keep.setdefault(loc, []).append([sample, seed])
                    # Step N too: at registration its samples are not being made yet; the agent
                    # skips what is cached or running, and demand reads go ahead of prefetches.
                    want.setdefault(loc, []).append([sample, kind, pjson, seed])
                    wsteps.setdefault(loc, []).append(s)
                    wcosts.setdefault(loc, []).append(plan.cost.get(sample, 0.0))
            if plan.reader is not None:
                await self._check_samples(plan, [w[0] for ws in want.values() for w in ws])
                for loc, ws in want.items():
                    ok = [plan.allowed.get(w[0], False) for w in ws]
                    want[loc] = [w for w, y in zip(ws, ok) if y]
                    wsteps[loc] = [x for x, y in zip(wsteps[loc], ok) if y]
                    wcosts[loc] = [x for x, y in zip(wcosts[loc], ok) if y]
                keep = {loc: [k for k in ks if plan.allowed.get(k[0])] for loc, ks in keep.items()}
            for loc in self.agents:
                costs = wcosts.get(loc, [])
                # per job: one job's window never frees another's samples at the agents
                window = functools.partial(self.clients[loc].plan_window, keep.get(loc, []), want.get(loc, []), job)
                try:
                    if loc in self._unscheduled:     # an agent from before issue 40: the window alone
                        await trio.to_thread.run_sync(window, limiter=self.limiter)
                        continue
                    try:
                        reply = await trio.to_thread.run_sync(
                            functools.partial(window, steps=wsteps.get(loc, []), step=plan.front,
                                              costs=costs if any(costs) else None, lookahead=plan.lookahead),
                            limiter=self.limiter)
                    except OSError as err:
                        if err.errno != errno.EINVAL or "steps" not in str(err):
                            raise
                        log.warning("plan %s: agent %s does not take plan steps (an older agent): windows "
                                    "without them; upgrade the agents first (docs/versions.md)", job, loc)
                        self._unscheduled.add(loc)
                        await trio.to_thread.run_sync(window, limiter=self.limiter)
                        continue
                    if reply.lookahead is not None:
                        plan.agent_lookahead[loc] = reply.lookahead
                except OSError as err:
                    log.warning("plan %s: agent %s: %s", job, loc, agent_reason(err))
                    log.debug("plan %s: agent %s: %s", job, loc, err)

"""`x.mp4.tensor`: virtual files whose bytes are made by an agent's transform, and the plans
that tell the agents which samples come next.

- A path `P.tensor` exists when `P` exists in the store, matches a `[[transforms]]` rule and the
  store has no real file named `P.tensor`. It is not listed in directories (listings stay the
  store's), it is read-only, and it is opened with direct I/O: its content (transformed tensor or
  raw fallback) is fixed at the first open and shared by every handle open at the same time, so
  its size is exact once open and concurrent readers see the same bytes.
- `.hintfs/plans/<job>` registers a Parquet plan (`step, rank, slot, sample, aug_seed, ...`) and
  the current step. Each sample's `aug_seed` comes from the plan (the occurrence at or after the
  current step), else from a hash of its path. When a read shows that a later step has started,
  the current step moves on; the agents are asked to make steps N+1..N+W ahead and to free what is
  before N.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Optional

import trio

from .control import ControlDir, ControlFile, ControlInputError

log = logging.getLogger("hintfs.tensorfile")

SUFFIX = ".tensor"


@dataclass
class Plan:
    job: str
    path: str
    step: int
    lookahead: int
    steps: list[int]                       # sorted distinct steps
    by_step: dict[int, list[tuple[str, int]]]
    seeds: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)   # sample -> (steps, seeds)


def _load_plan_rows(store, rel: str):
    import pyarrow.parquet as pq
    reader, st = store.open_reader(rel)
    try:
        data = reader.read(0, st.size)
    finally:
        reader.close()
    import pyarrow as pa
    table = pq.read_table(pa.BufferReader(data), columns=["step", "sample", "aug_seed"])
    return table.column("step").to_pylist(), table.column("sample").to_pylist(), table.column("aug_seed").to_pylist()


class TensorFiles:
    def __init__(self, cfg, store, agents: list[str], clients, stats):
        self.rules = list(cfg.transforms)
        self.lookahead_default = cfg.transform_load.lookahead_steps
        self.store = store
        self.agents = agents
        self.clients = clients
        self.stats = stats
        self.plans: dict[str, Plan] = {}
        self.limiter = trio.CapacityLimiter(16)
        self._send, self._recv = trio.open_memory_channel(256)

    # -- which paths are virtual -------------------------------------------------------------------
    def match(self, path: str):
        """The (source relpath, rule) of a `.tensor` path, or None."""
        if not self.rules or not path.endswith(SUFFIX):
            return None
        from transforms.params import match_rule
        source = path[: -len(SUFFIX)]
        rule = match_rule(self.rules, source)
        return (source, rule) if rule is not None else None

    def _agent_for(self, source: str) -> str:
        return self.agents[int(hashlib.sha256(source.encode()).hexdigest(), 16) % len(self.agents)]

    # -- seeds and progress from plans -------------------------------------------------------------
    def seed_for(self, source: str) -> int:
        for plan in self.plans.values():
            entry = plan.seeds.get(source)
            if entry:
                steps, seeds = entry
                # The sample's first occurrence at or after the current step; a read of a later
                # step's sample shows that step has started.
                i = min(bisect.bisect_left(steps, plan.step), len(steps) - 1)
                self._advance(plan, steps[i])
                return seeds[i]
        from transforms.params import default_seed
        return default_seed(source)

    def _advance(self, plan: Plan, step: int) -> None:
        if step > plan.step:
            plan.step = step
            self.stats.add("plan_steps_inferred")
            self._queue(plan)

    def _queue(self, plan: Plan) -> None:
        try:
            self._send.send_nowait(plan.job)
        except trio.WouldBlock:
            pass

    async def fetch(self, source: str, rule) -> bytes:
        """The `.tensor` bytes of `source`, made by its agent (never in this event loop)."""
        from transforms.params import params_json
        seed = self.seed_for(source)
        client = self.clients[self._agent_for(source)]
        data = await trio.to_thread.run_sync(client.sample, source, rule.kind, params_json(rule.params), seed,
                                             True, limiter=self.limiter)
        self.stats.add("tensor_opens")
        return data

    # -- plan registration ---------------------------------------------------------------------------
    def control_dir(self) -> ControlDir:
        d = ControlDir("plans")
        d.make_file = lambda name: ControlFile(name, render=lambda: self._render(name),
                                               apply=lambda doc: self.register(name, doc))
        return d

    def _render(self, job: str) -> bytes:
        plan = self.plans.get(job)
        if plan is None:
            return b""
        return (json.dumps({"plan": plan.path, "step": plan.step, "lookahead": plan.lookahead,
                            "steps": len(plan.steps)}) + "\n").encode()

    def register(self, job: str, doc: object) -> None:
        if not isinstance(doc, dict) or not set(doc) <= {"plan", "step", "lookahead"} or "step" not in doc:
            raise ControlInputError('expected {"plan": relpath, "step": N, "lookahead"?: W}')
        step = doc["step"]
        if not isinstance(step, int) or step < 0:
            raise ControlInputError("step: must be an integer >= 0")
        lookahead = doc.get("lookahead", self.lookahead_default)
        if not isinstance(lookahead, int) or lookahead < 0:
            raise ControlInputError("lookahead: must be an integer >= 0")
        existing = self.plans.get(job)
        if "plan" not in doc:
            if existing is None:
                raise ControlInputError("plan: required when registering a job")
            existing.step = step   # a step update
            existing.lookahead = lookahead
            self._queue(existing)
            return
        from .plan import parse_plan_registration
        reg = parse_plan_registration(doc)   # one validation for the mount and the helpers
        path, step = reg.plan, reg.step
        lookahead = reg.lookahead if reg.lookahead is not None else self.lookahead_default
        try:
            steps, samples, seeds = _load_plan_rows(self.store, path)   # validated before anything changes
        except FileNotFoundError:
            raise ControlInputError(f"plan: {path} does not exist") from None
        except Exception as err:
            raise ControlInputError(f"plan: {path} is not a readable plan: {err}") from None
        by_step: dict[int, list[tuple[str, int]]] = {}
        per_sample: dict[str, list[tuple[int, int]]] = {}
        for st, sa, se in zip(steps, samples, seeds):
            by_step.setdefault(st, []).append((sa, se))
            per_sample.setdefault(sa, []).append((st, se))
        plan = Plan(job, path, step, lookahead, sorted(by_step), by_step)
        for sample, occ in per_sample.items():
            occ.sort()
            plan.seeds[sample] = ([o[0] for o in occ], [o[1] for o in occ])
        self.plans[job] = plan
        self.stats.add("plans_registered")
        self._queue(plan)

    async def run(self) -> None:
        """Background task: ask the agents for steps N+1..N+W and let them free steps before N."""
        from transforms.params import params_json
        async for job in self._recv:
            plan = self.plans.get(job)
            if plan is None:
                continue
            want: dict[str, list] = {}
            keep: dict[str, list] = {}
            for s in range(plan.step, plan.step + plan.lookahead + 1):
                for sample, seed in plan.by_step.get(s, ()):
                    m = self.match(sample + SUFFIX)
                    if m is None:
                        continue
                    loc = self._agent_for(sample)
                    keep.setdefault(loc, []).append([sample, seed])
                    # Step N too: at registration its samples are not being made yet; the agent
                    # skips what is cached or running, and demand reads go ahead of prefetches.
                    want.setdefault(loc, []).append([sample, m[1].kind, params_json(m[1].params), seed])
            for loc in self.agents:
                try:
                    await trio.to_thread.run_sync(self.clients[loc].forget, keep.get(loc, []), limiter=self.limiter)
                    if want.get(loc):
                        await trio.to_thread.run_sync(self.clients[loc].prefetch, want[loc], limiter=self.limiter)
                except OSError as err:
                    log.warning("plan %s: agent %s: %s", job, loc, err)

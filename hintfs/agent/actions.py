"""The agent's dispatch table, beside its wire models (hintfs/agent/rpc.py): for each Flight action, the
typed request it takes, the handler that answers it (a line into one part of the agent,
hintfs/agent/node.py) and the typed reply it sends; for each `do_get` ticket, its request and handler.
The Flight adapter (hintfs/agent/server.py) parses with the request model, calls the handler and sends
the reply; `AgentClient` builds the same requests and parses the same replies.
"""
from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from collections.abc import Callable, Mapping

import pyarrow as pa

from hintfs.agent import rpc
from hintfs.agent.node import Agent
from hintfs.agent.rpc import Body, Reply, Request, rpc_error
from policy.stream import Sender

Req = TypeVar("Req", bound=Request)
Rep = TypeVar("Rep", bound=Reply)


@dataclass(frozen=True)
class Action(Generic[Req, Rep]):
    request: type[Req]
    handler: Callable[[Agent, Req, Sender], Rep]
    reply: type[Rep]
    doc: str


@dataclass(frozen=True)
class Ticket(Generic[Req]):
    request: type[Req]
    handler: Callable[[Agent, Req], pa.Table]


def _prefetch(a: Agent, req: rpc.PrefetchRequest, _s: Sender) -> rpc.PrefetchReply:
    ranges = [(int(o), int(n)) for o, n in req.ranges]
    if req.expect is None:
        return rpc.PrefetchReply(fetching=a.hints.hint_unversioned(req.path, ranges))
    return rpc.PrefetchReply(fetching=a.hints.prefetch(req.path, (int(req.expect[0]), int(req.expect[1])), ranges))


def _replicate(a: Agent, req: rpc.ReplicateRequest, _s: Sender) -> rpc.ReplicateReply:
    # a network caller's `expect` is checked against the store, its `record` ignored (trusted=False)
    reply = a.copier.replicate(req.path, req.ttl_s, req.source, priority=req.priority, job=req.job,
                               importance=req.importance, expect=req.expect, record=req.record, trusted=False)
    if req.holder is not None:
        a.catalog.hold(req.path, req.holder, req.ttl_s)
    return reply


def _drop(a: Agent, req: rpc.DropRequest, _s: Sender) -> rpc.DropReply:
    if req.holder is not None:
        return rpc.DropReply(dropped=a.catalog.unhold(req.path, req.holder))
    return rpc.DropReply(dropped=a.catalog.drop(req.path))


def _signal(a: Agent, req: rpc.SignalRequest, _s: Sender) -> rpc.SignalReply:
    if a.link is None:
        return rpc.SignalReply(applied=False)
    if req.clear:
        a.link.clear(req.job)
    else:
        a.link.signal(req.job, req.severity)
    return rpc.SignalReply(applied=True)


def _plan_window(a: Agent, req: rpc.PlanWindowRequest, _s: Sender) -> rpc.PlanWindowReply:
    """forget + prefetch in one call: one per plan step (per job); with the wanted samples' steps
    (issue 40) the agent schedules them by deadline and answers the lookahead it wants"""
    samples = a.reads.samples
    samples.forget({(p, s) for p, s in req.keep}, job=req.job)
    started = samples.prefetch(list(req.want), job=req.job, steps=req.steps, step=req.step, costs=req.costs,
                               lookahead=req.lookahead) if req.want else 0
    lookahead = samples.lookahead_for(req.job) if req.steps is not None else None
    return rpc.PlanWindowReply(started=started, lookahead=lookahead)


ACTIONS: dict[str, Action[Any, Any]] = {
    "replicate": Action(rpc.ReplicateRequest, _replicate, rpc.ReplicateReply,
                        "copy a file here and keep it ttl_s (blocks until complete)"),
    "drop": Action(rpc.DropRequest, _drop, rpc.DropReply,
                   "remove a replica (with a holder: release that holder's claim)"),
    "signal": Action(rpc.SignalRequest, _signal, rpc.SignalReply,
                     "move a job's copies on the link into the anomaly class (or clear)"),
    "plan_window": Action(rpc.PlanWindowRequest, _plan_window, rpc.PlanWindowReply,
                          "free transformed samples not in keep, start making want"),
    "tier_stat": Action(rpc.TierStatRequest, lambda a, r, s: a.view.stat(r.path, r.wait_s, r.appear_s),
                        rpc.TierStatReply,
                        "what this agent holds at a path: ready, copying, streaming, dir or absent"),
    "stream_open": Action(rpc.StreamOpenRequest, lambda a, r, s: a.intake.open(r, s), rpc.StreamOpenReply,
                          "start or resume a write-time stream; answers the chunks held"),
    "stream_publish": Action(rpc.StreamPublishRequest, lambda a, r, s: a.intake.publish(r, s),
                             rpc.StreamPublishReply,
                             "a streamed file was published as (size, mtime_ns): verify it"),
    "stream_abort": Action(rpc.StreamAbortRequest, lambda a, r, s: a.intake.abort(r.stream, s),
                           rpc.StreamAbortReply, "drop a stream (its file was unlinked or abandoned)"),
    "prefetch": Action(rpc.PrefetchRequest, _prefetch, rpc.PrefetchReply,
                       "fetch at once the ranges of a file still arriving that an eval will read"),
    "has": Action(rpc.HasRequest, lambda a, r, s: rpc.HasReply(has=a.catalog.has(r.path, r.size, r.mtime_ns)),
                  rpc.HasReply, "whether a complete replica of exactly this version is here"),
    "status": Action(rpc.StatusRequest, lambda a, r, s: a.status(replicas=r.replicas), rpc.StatusReply,
                     "replicas, load, budget, samples, follow, link"),
    "ping": Action(rpc.EmptyRequest, lambda a, r, s: rpc.PingReply(), rpc.PingReply, "liveness"),
}


def _one_range(data: bytes) -> pa.Table:
    return pa.table({"data": pa.array([data], type=pa.large_binary())})


def _read_reply(payload: tuple[bytes, int | None]) -> pa.Table:
    """A read's answer: its bytes; a compressed range (ReadRequest.compress) also carries its raw
    size in `raw_size` (a client that did not ask never gets one)."""
    data, raw_size = payload
    table = _one_range(data)
    return table if raw_size is None else table.append_column("raw_size", pa.array([raw_size], type=pa.int64()))


TICKETS: dict[str, Ticket[Any]] = {
    "read": Ticket(rpc.ReadRequest, lambda a, r: _read_reply(
        a.reads.read_range(r.path, r.offset, r.length, r.replica_only, r.expect, r.demand, r.compress is not None))),
    "sample": Ticket(rpc.SampleRequest, lambda a, r: _one_range(a.reads.sample(r))),
    "samples_ready": Ticket(rpc.SamplesReadyRequest, lambda a, r: a.reads.samples_ready(r)),
}
TICKET_MODELS: Mapping[str, type[Request]] = {op: t.request for op, t in TICKETS.items()}


def parse_action(kind: str, body: Body) -> tuple[Action[Any, Any], Request]:
    """The action `kind` names and its request, parsed (EINVAL for an unknown kind)."""
    action = ACTIONS.get(kind)
    if action is None:
        raise rpc_error(errno.EINVAL, f"unknown action {kind!r}")
    return action, rpc.parse(action.request, body)


def parse_ticket(body: Body) -> tuple[Ticket[Any], Request]:
    """The ticket's request ("read" when it names no op) and its entry."""
    req = rpc.parse_ticket(body, TICKET_MODELS)
    return TICKETS[getattr(req, "op", "read")], req


def act(agent: Agent, kind: str, body: Body, sender: Sender) -> Reply:
    """Parse, handle, check: the reply an action sends."""
    action, req = parse_action(kind, body)
    reply: Reply = action.handler(agent, req, sender)
    expected: type[Reply] = action.reply
    if not isinstance(reply, expected):
        raise TypeError(f"{kind} answered {type(reply).__name__}, not {expected.__name__}")
    return reply


__all__ = ["ACTIONS", "TICKETS", "Action", "Ticket", "act", "parse_action", "parse_ticket"]

"""The agent's dispatch table and wire models (hintfs/agent/actions.py, hintfs/agent/rpc.py): every action has a
typed request, a handler and a typed reply; what `AgentClient` sends parses back into the same
request; a reply crosses the wire without its unset fields (the JSON of the dicts it replaced) and
reads like them meanwhile."""
from __future__ import annotations

import errno
import json

import pyarrow.flight as fl
import pytest

from hintfs.agent import actions, rpc
from policy.stream import Sender

ANYONE = Sender("-", "-")


def test_every_action_has_a_typed_request_a_handler_and_a_typed_reply():
    assert set(actions.ACTIONS) == {"replicate", "drop", "signal", "plan_window", "tier_stat", "stream_open",
                                    "stream_publish", "stream_abort", "prefetch", "has", "status", "ping"}
    for kind, a in actions.ACTIONS.items():
        assert issubclass(a.request, rpc.Request) and issubclass(a.reply, rpc.Reply), kind
        assert callable(a.handler) and a.doc, kind
    assert set(actions.TICKETS) == {"read", "sample", "samples_ready"}


@pytest.mark.parametrize("kind,req", [
    ("replicate", rpc.ReplicateRequest.model_construct(path="ckpt/a", ttl_s=60.0, source=None, priority="eval",
                                                       job="ckpt", importance=1.0, expect=(10, 7))),
    ("tier_stat", rpc.TierStatRequest.model_construct(path="ckpt/a", wait_s=0.0, appear_s=2.0)),
    ("prefetch", rpc.PrefetchRequest.model_construct(path="ckpt/a", expect=None, ranges=[(0, 10), (20, 5)])),
    ("stream_publish", rpc.StreamPublishRequest.model_construct(stream="s1", gen=0, path="ckpt/a", size=5000,
                                                                mtime_ns=7, crcs=[1, 2], record=None)),
    ("plan_window", rpc.PlanWindowRequest.model_construct(keep=[("a", 1)], want=[("a", "image", "{}", 1)],
                                                          job=None)),
    ("status", rpc.StatusRequest.model_construct()),
    ("status", rpc.StatusRequest.model_construct(replicas=False)),
])
def test_what_the_client_sends_parses_back_into_the_same_request(kind, req):
    body = rpc.encode(req)
    doc = json.loads(body)
    assert all(v is not None for v in doc.values())            # defaults are left out, None too
    _action, parsed = actions.parse_action(kind, body)
    assert parsed == type(req).model_validate(req.model_dump())


def test_an_unknown_action_or_ticket_op_is_einval():
    for call in (lambda: actions.parse_action("nope", b"{}"), lambda: actions.parse_ticket(b'{"op": "nope"}')):
        with pytest.raises(fl.FlightServerError) as exc:
            call()
        assert json.loads(exc.value.extra_info)["errno"] == errno.EINVAL


def test_a_ticket_without_an_op_is_a_read():
    ticket, req = actions.parse_ticket(json.dumps({"path": "f", "offset": 0, "length": 1}).encode())
    assert isinstance(req, rpc.ReadRequest) and ticket is actions.TICKETS["read"]


def test_a_reply_leaves_out_what_is_unset_and_reads_like_the_dict_it_was():
    absent = rpc.TierStatReply(state="absent")
    assert absent.wire() == b'{"state":"absent"}'
    assert absent == {"state": "absent"} and absent["state"] == "absent" and absent.get("size") is None
    assert "size" not in absent and absent.get("expected", False) is False
    with pytest.raises(KeyError):
        absent["size"]
    ready = rpc.TierStatReply.model_validate_json(b'{"state": "ready", "size": 3, "mtime_ns": 4, "new": 1}')
    assert (ready.size, ready["mtime_ns"]) == (3, 4)           # a newer agent's extra key is ignored
    status = rpc.StatusReply.model_validate_json(rpc.StatusReply().wire())
    assert status["budget"]["used"] == 0 and status.get("follow", {}) == {}


def test_act_checks_the_handler_answers_its_reply_model():
    class Stub:
        class catalog:
            @staticmethod
            def has(path, size, mtime_ns):
                return (path, size, mtime_ns) == ("ckpt/a", 1, 2)

    reply = actions.act(Stub(), "has", b'{"path": "ckpt/a", "size": 1, "mtime_ns": 2}', ANYONE)
    assert reply == rpc.HasReply(has=True) and reply.wire() == b'{"has":true}'
    assert actions.act(Stub(), "ping", b"", ANYONE).wire() == b'{"ok":true}'


def _huge_publish() -> bytes:
    """A publish of a 10-byte file with 2^20 CRCs: ~12 MiB of JSON, above LARGE_BODY."""
    return json.dumps({"stream": "tiny", "gen": 0, "path": "ckpt/t/tiny", "size": 10, "mtime_ns": 1,
                       "crcs": [4294967295] * (1 << 20)}).encode()


def test_large_bodies_are_parsed_one_at_a_time_and_small_ones_never_wait(monkeypatch):
    """Callers arriving together cannot multiply a large parse's memory (50-100 MiB each): what
    tests/system/test_security_streams.py sees from outside as the agent's peak, here exactly."""
    import threading
    import time

    inside, most, lock = [0], [0], threading.Lock()
    real = rpc._load

    def load(body):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.02)          # (a parse takes long enough for the others to arrive)
        try:
            return real(body)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(rpc, "_load", load)
    big = json.dumps({"stream": "s", "gen": 0, "path": "ckpt/a", "size": 5000, "mtime_ns": 1,
                      "crcs": [1], "record": None, "pad": "x" * (rpc.LARGE_BODY + 1)}).encode()
    errors = []

    def one():
        try:
            rpc.parse(rpc.StreamPublishRequest, big)
        except fl.FlightServerError as err:   # (the pad is an unknown key)
            errors.append(json.loads(err.extra_info)["errno"])

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [errno.EINVAL] * 6 and most[0] == 1
    # small bodies do not queue behind a large one being parsed
    most[0] = 0
    with rpc._large_parse:
        small = json.dumps({"stream": "s", "gen": 0, "path": "ckpt/a", "size": 5000, "mtime_ns": 1,
                            "crcs": [1, 2]}).encode()
        assert rpc.parse(rpc.StreamPublishRequest, small).crcs == [1, 2]


def test_a_body_over_max_body_is_refused_before_it_is_parsed(monkeypatch):
    monkeypatch.setattr(rpc, "_load", lambda body: pytest.fail("parsed"))
    with pytest.raises(fl.FlightServerError) as err:
        rpc.parse(rpc.StreamPublishRequest, b" " * (rpc.MAX_BODY + 1))
    assert json.loads(err.value.extra_info)["errno"] == errno.EINVAL


def test_a_refused_huge_publish_leaves_nothing_behind_without_a_collection():
    """The refusal keeps no reference to what was parsed: before the fix, the validator's exception
    held the 2^20 parsed CRCs (~40 MiB) in a reference cycle until a full collection."""
    import gc
    import sys

    body = _huge_publish()
    gc.collect()
    gc.disable()
    try:
        before = sys.getallocatedblocks()
        with pytest.raises(fl.FlightServerError) as err:
            rpc.parse(rpc.StreamPublishRequest, body)
        assert json.loads(err.value.extra_info)["errno"] == errno.EINVAL
        del err
        kept = sys.getallocatedblocks() - before
    finally:
        gc.enable()
    assert kept < 10_000, f"{kept} blocks kept (the 2^20 CRCs are a million)"

"""The plan window's issue-40 fields (each wanted sample's step, the readers' step, the plan's
costs, the lookahead): optional, so an older mount's window parses as before; hostile until
checked: lengths bounded and aligned with `want`, ints and floats in range, one EINVAL line."""
from __future__ import annotations

import json

import pytest

from hintfs.agent import actions, rpc

WANT = [["a.jpg", "image", "{}", 1], ["b.mp4", "video", "{}", 2]]


def _parse(doc: dict):
    return actions.parse_action("plan_window", json.dumps(doc).encode())[1]


def test_an_older_mounts_window_parses_without_the_new_fields():
    req = _parse({"keep": [["a.jpg", 1]], "want": WANT})
    assert req.steps is None and req.step is None and req.costs is None and req.lookahead is None


def test_the_new_fields_round_trip():
    req = rpc.PlanWindowRequest.model_construct(keep=[("a.jpg", 1)], want=[tuple(w) for w in WANT], job="j",
                                                steps=[3, 4], step=3, costs=[12.5, 0.0], lookahead=4)
    parsed = actions.parse_action("plan_window", rpc.encode(req))[1]
    assert parsed.steps == [3, 4] and parsed.step == 3 and parsed.costs == [12.5, 0.0] and parsed.lookahead == 4


@pytest.mark.parametrize("extra,why", [
    ({"steps": [1], "step": 0}, "steps has 1 entries for 2"),
    ({"steps": [1, 2]}, "steps without step"),
    ({"steps": [1, -2], "step": 0}, "greater than or equal to 0"),
    ({"steps": [1, 2], "step": 1 << 63}, "less than or equal"),
    ({"costs": [1.0]}, "costs has 1 entries for 2"),
    ({"costs": [1.0, -1.0]}, "greater than or equal to 0"),
    ({"costs": [1.0, 1e300]}, "less than or equal"),
    ({"costs": [1.0, "NaN"]}, ""),
    ({"lookahead": 5000}, "less than or equal to 4096"),
    ({"steps": ["x", 1], "step": 0}, ""),
])
def test_hostile_values_are_one_einval_line(extra, why):
    with pytest.raises(Exception) as info:
        _parse({"keep": [], "want": WANT, **extra})
    text = str(info.value)
    assert text.startswith("EINVAL") and "\n" not in text and why in text


def test_list_lengths_are_bounded():
    n = rpc.MAX_BATCH + 1
    with pytest.raises(Exception) as info:
        _parse({"keep": [], "want": [], "steps": [0] * n, "step": 0})
    assert str(info.value).startswith("EINVAL")


def test_the_reply_carries_the_lookahead_and_an_older_reply_parses():
    assert rpc.PlanWindowReply.model_validate({"started": 1}).lookahead is None
    assert rpc.PlanWindowReply.model_validate({"started": 1, "lookahead": 9}).lookahead == 9

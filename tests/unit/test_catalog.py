"""The agent's replica catalog keeps the bytes it holds as a running sum (hintfs/agent/catalog.py)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from hintfs.agent.catalog import ReplicaCatalog


@dataclass
class _Rep:
    size: int


def test_the_sum_follows_every_change_it_allows():
    c: ReplicaCatalog[_Rep] = ReplicaCatalog()
    c["a"] = _Rep(10)
    c["b"] = _Rep(5)
    assert c.used_bytes == 15
    c["a"] = _Rep(3)                        # a new version replaces the old one
    assert c.used_bytes == 8
    del c["b"]
    assert c.used_bytes == 3
    assert c.pop("a").size == 3 and c.used_bytes == 0
    assert c.pop("gone", None) is None
    with pytest.raises(KeyError):
        c.pop("gone")
    c["x"] = _Rep(7)
    c.clear()
    assert c.used_bytes == 0 and len(c) == 0


def test_the_changes_that_would_bypass_the_sum_are_refused():
    c: ReplicaCatalog[_Rep] = ReplicaCatalog()
    c["a"] = _Rep(1)
    for change in (lambda: c.update({"b": _Rep(2)}), lambda: c.setdefault("b", _Rep(2)), c.popitem):
        with pytest.raises(TypeError):
            change()
    with pytest.raises(TypeError):
        c |= {"b": _Rep(2)}
    assert dict(c) == {"a": _Rep(1)} and c.used_bytes == 1

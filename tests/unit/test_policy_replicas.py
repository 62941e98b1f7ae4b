"""Replica policy (issue 3), pure functions tested with plain values and hypothesis."""
import math
import random

import pytest
from hypothesis import given, strategies as st

from policy.replicas import (ReplicaTarget, choose_replica, expired, fanout_rounds, fit_to_budget,
                             plan_replicas, replica_count)


def test_replica_count_examples():
    assert replica_count(256, 32, 3, 16, 10) == 8       # ceil(256/32)
    assert replica_count(10, 32, 3, 16, 10) == 3        # never below the default
    assert replica_count(2048, 32, 3, 16, 10) == 10     # never more than agents
    assert replica_count(2048, 32, 3, 16, 100) == 16    # nor more than max
    assert replica_count(100, 32, 3, 16, 2) == 2        # two agents: two replicas at most
    with pytest.raises(ValueError):
        replica_count(1, 0, 3, 16, 4)


@given(st.integers(0, 100_000), st.integers(1, 1000), st.integers(1, 10), st.integers(1, 64), st.integers(0, 200))
def test_replica_count_is_a_clamp(readers, safe, default, max_r, agents):
    n = replica_count(readers, safe, default, max_r, agents)
    upper = max(1, min(max_r, agents))
    assert 1 <= n <= upper
    if upper >= default:
        assert n >= default
    if math.ceil(readers / safe) <= upper:
        assert n >= min(math.ceil(readers / safe), upper)
    else:
        assert n == upper


def test_plan_is_hottest_first_with_ttl():
    plan = plan_replicas({"a": 8, ".metadata": 512, "b": 64}, 32, 1, 16, 8, now=100.0, ttl_s=60)
    assert [t.path for t in plan] == [".metadata", "b", "a"]
    assert [t.replicas for t in plan] == [8, 2, 1]
    assert all(t.expires_at == 160.0 for t in plan)
    assert expired(plan, 159.9) == [] and len(expired(plan, 160.0)) == 3


@given(st.integers(1, 5000), st.integers(1, 8))
def test_fanout_doubles_and_reaches_target(target, sources):
    rounds = fanout_rounds(target, sources)
    have = sources
    for started in rounds:
        assert 1 <= started <= have        # each copy has its own source
        have += started
    assert have == max(target, sources)
    if target > sources:
        assert len(rounds) == math.ceil(math.log2(target / sources))


def test_budget_drops_replicas_of_the_least_loaded_first():
    targets = [ReplicaTarget("hot", 512, 8, 0), ReplicaTarget("warm", 64, 4, 0)]
    sizes = {"hot": 100, "warm": 100}
    new, dropped = fit_to_budget(targets, sizes, budget_bytes=700)
    extra = sum((t.replicas - 1) * sizes[t.path] for t in new)
    assert extra <= 700
    # Copies go first from the file with the most replicas per reader: the per-replica load
    # evens out (512/8 = 64/1 = 64 readers per replica) and the hottest file keeps its copies.
    assert {t.path: t.replicas for t in new} == {"hot": 8, "warm": 1}
    assert dropped == {"warm": 3}
    new, dropped = fit_to_budget(targets, sizes, budget_bytes=0)
    assert all(t.replicas == 1 for t in new)


@given(st.lists(st.tuples(st.integers(1, 1000), st.integers(1, 16), st.integers(0, 10**6)), min_size=1, max_size=20),
       st.integers(0, 10**7))
def test_budget_is_respected_when_possible(rows, budget):
    targets = [ReplicaTarget(f"f{i}", r, n, 0) for i, (r, n, _) in enumerate(rows)]
    sizes = {f"f{i}": s for i, (_, _, s) in enumerate(rows)}
    new, dropped = fit_to_budget(targets, sizes, budget)
    assert sum((t.replicas - 1) * sizes[t.path] for t in new) <= budget
    assert all(t.replicas >= 1 for t in new)
    assert all(o.replicas - n.replicas == dropped.get(o.path, 0) for o, n in zip(targets, new))


def test_power_of_two_choices_balances_load():
    def gap(pick):
        rng = random.Random(1)
        load = [0] * 16
        for _ in range(16_000):
            load[pick(load, rng)] += 1
        return max(load) - min(load)

    p2c = gap(choose_replica)
    uniform = gap(lambda load, rng: rng.randrange(len(load)))
    assert p2c <= 4 < uniform
    rng = random.Random(0)
    assert choose_replica([5], rng) == 0
    assert choose_replica([9, 0], rng) == 1

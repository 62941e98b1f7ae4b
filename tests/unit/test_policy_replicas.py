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


def test_least_sent_spreads_each_hosts_bytes_so_all_hosts_sum_is_even():
    """A restart storm's shape (bench/scale_storm.py): 32 hosts each read the hot files (0.75 and
    3.9 MB) and 8 files of 0.9 MB that every agent holds, and 64 small files with 3 replicas on
    consecutive agents, each choosing alone. Read in whole blocks (4 MiB), the busiest agent serves
    ~2x the mean whatever each host does; in pieces of 256 KiB (`replicas.stripe_bytes`) and by
    the bytes each host asked of each agent, at most 1.15x, fewer than random pieces give."""
    from policy.replicas import choose_least_sent
    agents, hosts = 32, 32

    def busiest_over_mean(pick, piece: int = 256 << 10) -> float:
        served = [0] * agents
        where_small = random.Random(9)
        homes = [where_small.randrange(agents) for _ in range(hosts * 64)]
        for h in range(hosts):
            rng = random.Random(h)
            sent = [0] * agents
            everywhere = list(range(agents))
            files = [(everywhere, 746_288), (everywhere, 3_925_700)] + [(everywhere, 913_808)] * 8
            files += [([(homes[h * 64 + k] + j) % agents for j in range(3)], 17_000) for k in range(64)]
            rng.shuffle(files)
            for where, size in files:
                for start in range(0, size, piece):
                    i = where[pick([sent[a] for a in where], rng)]
                    sent[i] += min(piece, size - start)
                    served[i] += min(piece, size - start)
        return max(served) / (sum(served) / agents)

    def least_sent(sent, rng):
        return choose_least_sent(sent, [0] * len(sent), rng)

    def at_random(sent, rng):
        return rng.randrange(len(sent))

    least, rand = busiest_over_mean(least_sent), busiest_over_mean(at_random)
    whole = busiest_over_mean(least_sent, piece=4 << 20)
    assert least <= 1.15 and least < rand and whole >= 1.5, (least, rand, whole)
    rng = random.Random(0)
    assert choose_least_sent([5, 3, 3], [0, 2, 1], rng) == 2       # fewest bytes, then fewer in flight
    assert choose_least_sent([7], [9], rng) == 0
    with pytest.raises(ValueError):
        choose_least_sent([], [], rng)


def test_router_starts_a_new_agent_level_with_the_others():
    from fusefs.hints import ReplicaRouter
    r = ReplicaRouter(random.Random(0), clock=lambda: 0.0)
    r.replicas["f"] = ["a", "b"]
    for _ in range(10):
        r.pick("f", size=100)
    assert r.sent == {"a": 500, "b": 500}
    r.replicas["f"] = ["a", "b", "c"]              # a replica made since: not every read goes there
    picks = [r.pick("f", size=100) for _ in range(9)]
    assert picks.count("c") == 3 and r.sent == {"a": 800, "b": 800, "c": 800}
    assert r.pick("f", exclude=("a", "b", "c")) is None


def test_router_forgets_what_an_earlier_storm_asked():
    """A host that read 42 MB from three agents in an earlier storm (scale_storm's default policy,
    minutes before) spreads the next storm's reads over every replica, those three too: what a
    host asked is halved every half-life (an injected clock here)."""
    from fusefs.hints import ReplicaRouter
    now = [0.0]
    r = ReplicaRouter(random.Random(0), clock=lambda: now[0], half_life_s=10.0)
    r.replicas["old"] = ["a0", "a1", "a2"]
    for _ in range(30):
        r.pick("old", size=1_400_000)                   # 14 MB each of a0, a1, a2
    now[0] += 600.0                                    # ten minutes later: the next storm
    r.replicas["hot"] = [f"a{i}" for i in range(8)]
    picks = [r.pick("hot", size=100_000) for _ in range(80)]
    assert {loc: picks.count(loc) for loc in set(picks)} == {f"a{i}": 10 for i in range(8)}
    assert r.asked["a0"] == 14_000_000 + 1_000_000     # `asked` keeps every byte (hint status)
    # within one storm (no time passes) the bytes asked still steer: a0..a2 were just read more
    r2 = ReplicaRouter(random.Random(0), clock=lambda: 0.0)
    r2.replicas["hot"] = [f"a{i}" for i in range(8)]
    r2.replicas["old"] = ["a0", "a1", "a2"]
    assert len({r2.pick("hot", size=1_000_000) for _ in range(8)}) == 8
    for _ in range(3):
        r2.pick("old", size=1_000_000)
    assert {r2.pick("hot", size=1_000_000) for _ in range(5)} == {"a3", "a4", "a5", "a6", "a7"}


# -- placement (policy.replicas.place) ------------------------------------------------------------
def _spread(hosts: int, files_per_host: int, agents: int, balanced: bool, spread: int | None = None) -> float:
    """max/mean replicas per agent after every host places its own single-replica files."""
    from policy.replicas import hash_order, place
    names = [f"a{i}" for i in range(agents)]
    total = {a: 0 for a in names}
    for h in range(hosts):
        placed: dict[str, int] = {}
        for f in range(files_per_host):
            order = hash_order(f"ckpt/__{h * files_per_host + f}_0.distcp", names)
            chosen = place(order, 1, placed, spread) if balanced else order[:1]
            for a in chosen:
                placed[a] = placed.get(a, 0) + 1
                total[a] += 1
    return max(total.values()) / (sum(total.values()) / agents)


def test_each_host_spreading_its_own_replicas_evens_the_sum():
    # bench/scale_storm.py's weak scaling at 4,096: 64 hosts, 64 per-rank files each, 64 agents
    by_hash = _spread(64, 64, 64, balanced=False)
    assert by_hash > 1.3          # balls in bins
    assert _spread(64, 64, 64, balanced=True) == 1.0
    assert _spread(64, 64, 64, balanced=True, spread=2) < by_hash


def test_place_keeps_the_hash_order_among_equals_and_takes_all_when_asked():
    from policy.replicas import hash_order, place
    order = hash_order("x", ["a", "b", "c", "d"])
    assert sorted(order) == ["a", "b", "c", "d"]
    assert place(order, 2, {}) == order[:2]
    assert place(order, 4, {}) == order
    assert place(order, 0, {}) == []
    # the second candidate of the first slot is taken when the first is fuller
    assert place(order, 1, {order[0]: 3}) == [order[1]]
    # with a spread, candidates are only the first n x spread: a far agent with nothing placed is not chosen
    assert place(order, 1, {order[0]: 3, order[1]: 3}, spread=2) == [order[0]]
    assert place(order, 1, {order[0]: 3, order[1]: 3}) == [order[2]]

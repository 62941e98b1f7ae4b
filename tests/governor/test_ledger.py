import pytest
from hypothesis import given, settings, strategies as st

from hintfs.governor.ledger import ClientEntry, GpuLedger, LedgerError, MemoryKind, Role


def make():
    l = GpuLedger(0, 1000, 100)
    l.add(ClientEntry(1, Role.TRAINING, 11, "t", 0))
    l.add(ClientEntry(2, Role.INFERENCE, 12, "i", 1))
    return l


def test_grants_and_quota_never_exceed_usable():
    l = make()
    l.set_quota(1, 600)
    l.grant(2, MemoryKind.WEIGHTS, 300)
    assert l.free_bytes() == 0
    with pytest.raises(LedgerError):
        l.grant(2, MemoryKind.KV_CACHE, 1)
    with pytest.raises(LedgerError):
        l.set_quota(1, 601)
    assert l.by_kind()["weights"] == 300


def test_role_checks():
    l = make()
    with pytest.raises(LedgerError):
        l.grant(1, MemoryKind.WEIGHTS, 1)
    with pytest.raises(LedgerError):
        l.set_quota(2, 1)


def test_remove_returns_memory():
    l = make()
    l.set_quota(1, 500)
    l.grant(2, MemoryKind.KV_CACHE, 200)
    assert l.remove(2) == 200 and l.free_bytes() == 400
    assert l.remove(1) == 500 and l.free_bytes() == 900
    assert l.remove(1) == 0


def test_a_shrink_ack_trims_trainings_last_report_elastic_kinds_first():
    l = make()
    l.set_quota(1, 800)
    l.report(1, {MemoryKind.WEIGHTS: 100, MemoryKind.OPTIMIZER_STATE: 300,
                 MemoryKind.ACTIVATIONS: 350})
    l.set_quota(1, 500)
    l.trim_reported(1, 450)  # the ack says 450 held: 300 of activations went back
    assert (l.by_kind()["activations"], l.by_kind()["optimizer_state"],
            l.by_kind()["weights"]) == (50, 300, 100)
    l.trim_reported(1, 300)  # more than the activations: optimizer state next, weights last
    assert (l.by_kind()["activations"], l.by_kind()["optimizer_state"],
            l.by_kind()["weights"]) == (0, 200, 100)
    l.trim_reported(1, 900)  # a report already under what is held is left alone
    assert sum(l.by_kind().values()) == 300
    l.trim_reported(99, 0)   # an unknown (departed) client: nothing to trim


def test_plan_shrink_respects_floor_and_takes_largest_first():
    l = GpuLedger(0, 1000, 0)
    l.add(ClientEntry(1, Role.TRAINING, 1, "a", 0))
    l.add(ClientEntry(2, Role.TRAINING, 2, "b", 1))
    l.set_quota(1, 300)
    l.set_quota(2, 600)
    assert l.plan_shrink(0, 0) == {}
    assert l.plan_shrink(100, 0) == {2: 500}
    plan = l.plan_shrink(700, 0)
    assert plan == {2: 0, 1: 200}
    plan = l.plan_shrink(10_000, 400)  # floor binds: only 500 can be taken
    assert sum(l.clients[c].quota - q for c, q in plan.items()) == 500


ops = st.lists(st.tuples(st.sampled_from(["grant", "release", "quota", "shrink", "remove", "add"]),
                         st.integers(0, 3), st.integers(0, 1500)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_invariants_under_random_operations(seq):
    l = GpuLedger(0, 2000, 500)
    next_id = 10
    for i in range(4):
        l.add(ClientEntry(i, Role.TRAINING if i % 2 == 0 else Role.INFERENCE, i, "", i))
    for op, cid, n in seq:
        try:
            if op == "grant":
                l.grant(cid, MemoryKind.KV_CACHE, n)
            elif op == "release":
                before = l.free_bytes()
                freed = l.release(cid, MemoryKind.KV_CACHE, n)
                assert l.free_bytes() == before + freed
            elif op == "quota":
                l.set_quota(cid, n)
            elif op == "shrink":
                floor = n // 3
                plan = l.plan_shrink(n, floor)
                before = l.training_bytes()
                for c, q in plan.items():
                    l.set_quota(c, q)
                freed = before - l.training_bytes()
                assert freed <= max(n, 0)
                assert l.training_bytes() >= min(before, floor)
                assert freed == min(n, max(0, before - floor))
            elif op == "remove":
                before = l.free_bytes()
                held = l.clients[cid].held() if cid in l.clients else 0
                assert l.remove(cid) == held and l.free_bytes() == before + held
            elif op == "add":
                l.add(ClientEntry(next_id, Role.INFERENCE, 1, "", 9))
                next_id += 1
        except LedgerError:
            pass
        assert 0 <= l.free_bytes() <= l.usable_bytes
        assert l.inference_bytes() + l.training_bytes() + l.free_bytes() == l.usable_bytes

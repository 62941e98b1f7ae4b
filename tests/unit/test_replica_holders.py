"""Claims on a replica (issue 37, item 6): two hint jobs, or two hosts' mounts, that hinted the
same file each hold its replicas; a job that ends releases its own claim only, and the replica
goes with the last live claim (`Catalog.hold`, `Catalog.unhold`, `HintsManager.reclaim`). Before,
a job's expiry dropped the file's replicas under every other job that still wanted them."""
from __future__ import annotations

import json

import trio

from fusefs.hints import FileState, HintsManager, Job
from fusefs.stats import Stats
from hintfs.agent.catalog import MAX_HOLDERS, Catalog
from hintfs.common.clock import FakeClock
from mountconfig import parse_config


def _catalog(tmp_path, clock: FakeClock, persistent: bool = False, name: str = "c") -> Catalog:
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    return Catalog(str(folder), 1 << 30, persistent, clock=clock)


def _replica(cat: Catalog, path: str, ttl_s: float = 60.0) -> None:
    part = cat.local_name(path) + ".part"
    with open(part, "wb") as f:
        f.write(b"x" * 100)
    assert cat.add_unless_removed(cat.replica_from(part, path, 100, 1, ttl_s, None))


def test_the_replica_goes_with_the_last_live_claim(tmp_path):
    clock = FakeClock()
    cat = _catalog(tmp_path, clock)
    _replica(cat, "ckpt/hot")
    assert cat.hold("ckpt/hot", "hostA/job1", 100) and cat.hold("ckpt/hot", "hostB/job7", 50)
    assert not cat.hold("ckpt/none", "hostA/job1", 100)          # nothing to hold
    assert cat.unhold("ckpt/hot", "hostA/job1") is False           # hostB's claim lasts
    assert cat.get("ckpt/hot") is not None
    assert cat.unhold("ckpt/hot", "hostA/job1") is False           # (released already: no effect)
    assert cat.unhold("ckpt/hot", "hostB/job7") is True            # the last claim
    assert cat.get("ckpt/hot") is None


def test_an_expired_claim_keeps_nothing_and_an_unclaimed_replica_is_not_touched(tmp_path):
    clock = FakeClock()
    cat = _catalog(tmp_path, clock)
    _replica(cat, "a")
    cat.hold("a", "short", 10)
    cat.hold("a", "long", 100)
    clock.advance(20)                       # "short" ran out
    assert cat.unhold("a", "long") is True
    _replica(cat, "tier-copy")              # the follower's or a stream's replica: nobody's claim
    assert cat.unhold("tier-copy", "hostA/job1") is False and cat.get("tier-copy") is not None


def test_claims_are_bounded_per_replica_and_the_soonest_ending_goes(tmp_path):
    clock = FakeClock()
    cat = _catalog(tmp_path, clock)
    _replica(cat, "a")
    for i in range(MAX_HOLDERS + 10):
        cat.hold("a", f"h{i}", 1000 + i)
    rep = cat.get("a")
    assert rep is not None and len(rep.holders) == MAX_HOLDERS
    assert "h0" not in rep.holders and f"h{MAX_HOLDERS + 9}" in rep.holders


def test_claims_survive_an_agent_restart(tmp_path):
    clock = FakeClock()
    old = _catalog(tmp_path, clock, persistent=True, name="old")
    _replica(old, "a")
    old.hold("a", "hostA/job1", 100)
    old.hold("a", "hostB/job2", 100)
    rep = old.get("a")
    assert rep is not None
    meta = json.loads(open(rep.local + ".meta").read())
    assert set(meta["holders"]) == {"hostA/job1", "hostB/job2"}
    old.close()                        # the old agent stops (its files stay for the next)
    new = _catalog(tmp_path, clock, persistent=True, name="new")
    assert new.adopt(str(tmp_path / "old")) == 1
    assert new.unhold("a", "hostA/job1") is False and new.get("a") is not None
    assert new.unhold("a", "hostB/job2") is True


class _Agent:
    """An agent's claims as `Catalog.unhold` keeps them, for the mount's side."""

    def __init__(self, held: dict[str, set[str]]):
        self.held = held
        self.calls: list[tuple[str, str | None]] = []

    def drop(self, path: str, holder: str | None = None):
        self.calls.append((path, holder))
        self.held[path].discard(holder or "")


def test_a_job_that_expires_releases_its_own_claim_and_the_mount_keeps_reading_another_jobs():
    cfg = parse_config({"store": {"uri": "file:///nonexistent"}})
    held: dict[str, set[str]] = {}
    agent = _Agent(held)
    m = HintsManager(cfg.replicas, ["a0"], {"a0": agent}, Stats(), holder="hostA")
    for name, ttl in (("short", 10.0), ("long", 100.0)):
        m.jobs[name] = Job(name, None, {"ckpt/hot": FileState(1, 64)}, ttl, 1e9)   # type: ignore[arg-type]
        m.jobs[name].files["ckpt/hot"].ready.append("a0")
        held.setdefault("ckpt/hot", set()).add(m.claim(name))
    m.router.replicas["ckpt/hot"] = ["a0"]

    trio.run(m.reclaim, 20.0)               # "short" expired
    assert agent.calls == [("ckpt/hot", "hostA/short")]
    assert held["ckpt/hot"] == {"hostA/long"}                       # the agent keeps the replica
    assert m.router.replicas["ckpt/hot"] == ["a0"]                  # and this mount reads it
    trio.run(m.reclaim, 200.0)
    assert held["ckpt/hot"] == set() and "ckpt/hot" not in m.router.replicas

"""The index of paths by folder (hintfs.common.paths.PathTree, PathDict, PathSet) and the removal
rounds that use it: a round of journal removal records looks at the files at or under the
removed paths, not at every file the follower knows and every replica (bench/scale_xdc.py:
those passes, 20 rounds a second while jobs deleted old steps, were a fifth of the agent's CPU)."""
from __future__ import annotations

import pytest

from hintfs.common.paths import PathDict, PathSet, PathTree

PATHS = ["a/b/c1", "a/b/c2", "a/bc/d", "a/d/e/f", "a/x", "b/y", "top"]


def test_under_finds_a_file_a_folder_and_a_tree_and_nothing_by_a_shared_prefix():
    t = PathTree()
    for p in PATHS:
        t.add(p)
    assert sorted(t.under("a")) == ["a/b/c1", "a/b/c2", "a/bc/d", "a/d/e/f", "a/x"]
    assert sorted(t.under("a/b")) == ["a/b/c1", "a/b/c2"]          # not a/bc/d
    assert t.under("a/b/c1") == ["a/b/c1"] and t.under("top") == ["top"]
    assert t.under("a/b/c") == [] and t.under("zz") == [] and t.under("a/d/e/f/g") == []
    t.add("a/b/c1")                                                  # twice: once
    assert sorted(t.under("a/b")) == ["a/b/c1", "a/b/c2"]


def test_discarding_every_path_leaves_no_folder_behind():
    t = PathTree()
    for p in PATHS:
        t.add(p)
    t.discard("a/b/c1")
    t.discard("nope/x")                                              # not there: nothing
    assert sorted(t.under("a/b")) == ["a/b/c2"]
    for p in PATHS:
        t.discard(p)
    assert t._files == {} and t._subs == {}
    t.add("a/x")
    t.add("a/b/c")
    t.discard("a/b/c")                       # a folder emptied whose parent still holds a file
    assert t._files == {"a": {"a/x"}} and t._subs == {"": {"a"}}


def test_the_dict_and_the_set_keep_their_index_through_every_change_they_allow():
    d = PathDict()
    for i, p in enumerate(PATHS):
        d[p] = i
    del d["a/x"]
    assert d.pop("a/b/c1") == 0 and d.pop("missing", None) is None
    assert sorted(d.under("a")) == ["a/b/c2", "a/bc/d", "a/d/e/f"]
    for mutate in (lambda: d.update(z=1), lambda: d.setdefault("z", 1), d.popitem):
        with pytest.raises(TypeError):
            mutate()
    d.clear()
    assert d.under("a") == []
    s = PathSet()
    for p in PATHS:
        s.add(p)
    s -= {"a/b/c1", "top"}
    s.discard("b/y")
    assert sorted(s.under("a/b")) == ["a/b/c2"] and s.under("top") == [] and "top" not in s
    assert isinstance(s - {"a/x"}, set) and "a/x" in s
    for mutate in (lambda: s.update({"z"}), s.pop, lambda: s.remove("a/x")):
        with pytest.raises(TypeError):
            mutate()


def test_a_removal_round_looks_only_at_the_replicas_and_files_under_it(tmp_path, monkeypatch):
    from hintfs.agent.catalog import Catalog, Replica
    from hintfs.agent.follower import Follower
    from hintfs.common import journal
    calls = {"n": 0}
    newest = journal.Removals.newest

    def counted(self, path):
        calls["n"] += 1
        return newest(self, path)
    monkeypatch.setattr(journal.Removals, "newest", counted)
    cat = Catalog(str(tmp_path / "tier"), 1 << 40, persistent=False)
    with cat.lock:
        for i in range(2000):
            for j in range(3):
                p = f"ckpt/bg/job{i}/step_1/f{j}"
                cat.replicas[p] = Replica(path=p, local=str(tmp_path / "x"), size=1, expires_at=2e9,
                                          source_mtime_ns=1)
    dropped = cat.removed_from_store([("ckpt/bg/job7/step_1", 10**18)])
    assert sorted(dropped) == [f"ckpt/bg/job7/step_1/f{j}" for j in range(3)]
    assert calls["n"] <= 3 and len(cat.replicas) == 5997
    f = Follower.__new__(Follower)                   # the follower's own pass, alone
    f.removals, f.journaled, f.copied = journal.Removals(), PathDict(), PathSet()
    f.queued, f.errors, f.pending_markers, f.folder_files, f.complete = set(), {}, set(), {}, {}
    f.cfg = type("C", (), {"commit_marker": ".metadata"})()
    f.cond = type("Cond", (), {"notify_all": lambda self: None})()
    for i in range(2000):
        p = f"ckpt/bg/job{i}/step_1/f0"
        f.journaled[p] = ((1, 1), None)
        f.copied.add(p)
        f.folder_files[f"ckpt/bg/job{i}/step_1"] = {p}
    calls["n"] = 0
    f._forget([("ckpt/bg/job7", 10**18)])
    assert "ckpt/bg/job7/step_1/f0" not in f.journaled and "ckpt/bg/job7/step_1/f0" not in f.copied
    assert "ckpt/bg/job7/step_1" not in f.folder_files and len(f.journaled) == 1999
    assert calls["n"] <= 3                           # (one lookup per file under it, not 4,000)


def test_has_below_says_whether_a_path_lies_below_a_folder_without_walking_them():
    t = PathTree()
    for p in PATHS:
        t.add(p)
    assert t.has_below("a") and t.has_below("a/b") and t.has_below("a/d") and t.has_below("a/d/e")
    assert t.has_below("")                                   # the root holds "top"
    assert not t.has_below("a/b/c1")                         # a file itself is not below itself
    assert not t.has_below("a/b/c") and not t.has_below("a/bc/d") and not t.has_below("zz")
    t.discard("a/d/e/f")
    assert not t.has_below("a/d") and not t.has_below("a/d/e") and t.has_below("a")
    d = PathDict()
    d["x/y/z"] = 1
    assert d.has_below("x") and d.has_below("x/y") and not d.has_below("x/y/z")
    del d["x/y/z"]
    assert not d.has_below("x")


class _NoScan(PathDict):
    """A catalog that fails any pass over all its replicas."""

    def __iter__(self):
        raise AssertionError("a pass over every replica")

    def items(self):
        raise AssertionError("a pass over every replica")

    def keys(self):
        raise AssertionError("a pass over every replica")


def test_the_tier_tells_a_folder_from_an_absent_name_without_a_pass_over_its_replicas(tmp_path):
    """`TierView.state` of a folder, or of a name the tier does not hold, looked at every replica
    under the arrivals lock: 2.5-6.1 ms a call at 67,622 replica paths (in-process), on an eval
    tier that held 50,352 replicas after three checkpoints of 16,384 files in bench/scale_xdc.py,
    and more with every checkpoint it keeps. Now the catalog's folder index answers. (Whether the
    pass caused that run's slower merges, 3.05, 3.64, 4.03 s, was not measured.)"""
    from hintfs.agent.catalog import Catalog, Replica
    from hintfs.agent.streams import StreamTier
    from hintfs.agent.tier import Arrivals, TierView
    from hintfs.common.clock import FakeClock
    clock = FakeClock()
    cat = Catalog(str(tmp_path / "tier"), 1 << 40, persistent=False, clock=clock)
    tier = TierView(cat, Arrivals(cat), StreamTier(str(tmp_path / "streams"), clock, budget=cat), clock=clock)
    index = _NoScan()
    with cat.lock:
        for i in range(3):
            for j in range(1000):
                p = f"ckpt/main/step_{i}/f{j}"
                index[p] = Replica(path=p, local=str(tmp_path / "x"), size=1, expires_at=2e9, source_mtime_ns=1)
        index["ckpt/mainx/f"] = Replica(path="ckpt/mainx/f", local=str(tmp_path / "x"), size=1,
                                        expires_at=2e9, source_mtime_ns=1)
    cat.replicas = index   # (the test's catalog: every replica put in before any pass is refused)
    assert tier.state("ckpt/main/step_2").state == "dir"
    assert tier.state("ckpt/main/step_2/").state == "dir"
    assert tier.state("ckpt").state == "dir"
    assert tier.state("ckpt/main/step_2/f7").state == "ready"
    assert tier.state("ckpt/main/step_3").state == "absent"
    assert tier.state("ckpt/mai").state == "absent"          # a shared prefix is not a folder
    assert tier.state("ckpt/main/step_2/f7/x").state == "absent"

"""Execution plans: determinism, coverage, resume, the cost model, balancing, registration, and
a DataLoader over a PlanDataset. Pure and file-level; no mount."""
from __future__ import annotations

import collections
import errno
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hintfs import plan as fplan
from hintfs.plan import (PlanRegistration, build_plan, estimate_costs, fit_cost_model, parse_plan_registration,
                         read_listing, read_plan_meta, read_steps, register_plan, row_groups_for_steps,
                         update_step, walk_listing)
from policy import plan as pplan

SAMPLES = [f"data/{i:04d}.jpg" for i in range(100)]


def _build(tmp_path, name="p.parquet", samples=SAMPLES, **kw):
    args = dict(seed=7, world_size=4, batch_per_rank=3, steps=40, steps_per_row_group=5)
    args.update(kw)
    return build_plan(samples, str(tmp_path / name), **args)


# -- determinism and layout ----------------------------------------------------------------------
def test_same_inputs_same_file(tmp_path):
    a = _build(tmp_path, "a.parquet")
    b = _build(tmp_path, "b.parquet")
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    assert pq.read_table(a.path).equals(pq.read_table(b.path))
    c = _build(tmp_path, "c.parquet", seed=8)
    assert pq.read_table(c.path)["sample"].to_pylist() != pq.read_table(a.path)["sample"].to_pylist()


def test_schema_metadata_and_order(tmp_path):
    r = _build(tmp_path)
    t = pq.read_table(r.path)
    assert [(f.name, str(f.type)) for f in t.schema] == [
        ("step", "int64"), ("rank", "int32"), ("slot", "int32"), ("sample", "string"),
        ("aug_seed", "int64"), ("est_cost_ms", "float")]
    meta = read_plan_meta(r.path)
    assert {k: meta[k] for k in ("seed", "world_size", "batch_per_rank", "steps", "mode")} == {
        "seed": 7, "world_size": 4, "batch_per_rank": 3, "steps": 40, "mode": "plain"}
    assert meta["dataset_hash"] == pplan.listing_hash(SAMPLES)
    keys = list(zip(t["step"].to_pylist(), t["rank"].to_pylist(), t["slot"].to_pylist()))
    assert keys == sorted(keys) and len(set(keys)) == len(keys) == 40 * 12
    assert keys[:3] == [(0, 0, 0), (0, 0, 1), (0, 0, 2)]
    assert min(t["aug_seed"].to_pylist()) >= 0


def test_every_sample_once_per_epoch(tmp_path):
    # 100 samples, 12 per step: positions [e*100, (e+1)*100) are epoch e, 3 epochs in 25 steps
    r = _build(tmp_path, steps=25)
    samples = pq.read_table(r.path)["sample"].to_pylist()
    for e in range(3):
        assert sorted(samples[e * 100:(e + 1) * 100]) == sorted(SAMPLES)
    assert samples[:100] != samples[100:200]            # each epoch its own order
    # aug seeds differ between epochs for the same sample
    t = pq.read_table(r.path)
    seeds = collections.defaultdict(set)
    for s, a in zip(t["sample"].to_pylist(), t["aug_seed"].to_pylist()):
        seeds[s].add(a)
    assert all(len(v) == 3 for k, v in seeds.items() if samples[:300].count(k) == 3)


def test_drop_last(tmp_path):
    r = _build(tmp_path, steps=16, drop_last=True)    # 8 whole steps per epoch, 4 samples skipped
    samples = pq.read_table(r.path)["sample"].to_pylist()
    for e in range(2):
        chunk = samples[e * 96:(e + 1) * 96]
        assert len(set(chunk)) == 96
    with pytest.raises(ValueError):
        build_plan(SAMPLES[:5], str(tmp_path / "x.parquet"), seed=1, world_size=4, batch_per_rank=3,
                   steps=2, drop_last=True)


def test_ranks_disjoint_within_step(tmp_path):
    r = _build(tmp_path, samples=SAMPLES[:50], steps=30)
    t = pq.read_table(r.path).to_pylist()
    by_step = collections.defaultdict(lambda: collections.defaultdict(list))
    for row in t:
        by_step[row["step"]][row["rank"]].append(row["sample"])
    for step, ranks in by_step.items():
        assert sorted(ranks) == [0, 1, 2, 3]
        allsamples = [s for v in ranks.values() for s in v]
        assert all(len(v) == 3 for v in ranks.values())
        if (step * 12) // 50 == (step * 12 + 11) // 50:   # a step inside one epoch
            assert len(set(allsamples)) == 12


def test_permutation_is_a_permutation_and_stable():
    p = pplan.epoch_permutation(123, 4, 1000)
    assert sorted(p.tolist()) == list(range(1000))
    assert p.tolist() == pplan.epoch_permutation(123, 4, 1000).tolist()
    assert p.tolist() != pplan.epoch_permutation(123, 5, 1000).tolist()
    # pinned: the schedule must not change with numpy versions
    assert pplan.epoch_permutation(0, 0, 8).tolist() == [4, 0, 7, 5, 1, 2, 3, 6]
    assert pplan.aug_seeds(0, np.array([0]), np.array([0])).tolist() == [1395282523173604091]


# -- resume --------------------------------------------------------------------------------------
def test_resume_reads_only_needed_row_groups(tmp_path):
    r = _build(tmp_path, steps=40, steps_per_row_group=5)
    pf = pq.ParquetFile(r.path)
    assert pf.metadata.num_row_groups == 8
    assert row_groups_for_steps(pf, 23, 24) == [4]
    assert row_groups_for_steps(pf, 23) == [4, 5, 6, 7]
    full = pq.read_table(r.path)
    part = read_steps(r.path, 23)
    mask = np.asarray(full["step"]) >= 23
    assert part.equals(full.filter(pa.array(mask)))
    one = read_steps(r.path, 23, 24, rank=2)
    assert one["step"].to_pylist() == [23] * 3 and one["slot"].to_pylist() == [0, 1, 2]
    expect = [row["sample"] for row in full.to_pylist() if row["step"] == 23 and row["rank"] == 2]
    assert one["sample"].to_pylist() == expect
    assert read_steps(r.path, 40).num_rows == 0


def test_resume_reads_touch_only_those_row_groups(tmp_path, monkeypatch):
    r = _build(tmp_path, steps=40, steps_per_row_group=5)
    seen = []
    orig = pq.ParquetFile.read_row_groups

    def spy(self, groups, *a, **kw):
        seen.append(list(groups))
        return orig(self, groups, *a, **kw)
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", spy)
    read_steps(r.path, 31, 33)
    assert seen == [[6]]


# -- listings ------------------------------------------------------------------------------------
def test_listings(tmp_path):
    lst = tmp_path / "list.txt"
    lst.write_text("# comment\na/1.jpg\n\n./a/2.jpg\n")
    assert read_listing(str(lst)) == ["a/1.jpg", "a/2.jpg"]
    lst.write_text("a/1.jpg\n../etc/passwd\n")
    with pytest.raises(ValueError, match="contains '..'"):
        read_listing(str(lst))
    lst.write_text("a/1.jpg\na//1.jpg\n")
    with pytest.raises(ValueError, match="twice"):
        read_listing(str(lst))
    root = tmp_path / "ds"
    for p in ["b/x.mp4", "a/y.jpg", "a/z.txt", ".hintfs/stats", "c/d/w.JPG"]:
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        (root / p).write_bytes(b"x")
    assert walk_listing(str(root), ["*.jpg", "*.mp4"]) == ["a/y.jpg", "b/x.mp4"]
    assert walk_listing(str(root), ["c/*/*"]) == ["c/d/w.JPG"]


# -- cost model and balancing --------------------------------------------------------------------
def _catalog(n, rng):
    kind = np.where(rng.random(n) < 0.5, "image", "video")
    codec = np.where(kind == "image", "jpeg", np.where(rng.random(n) < 0.5, "h264", "hevc"))
    w = rng.integers(256, 2048, n)
    h = rng.integers(256, 2048, n)
    dur = np.where(kind == "video", rng.pareto(1.2, n) * 5 + 1, 0.0)
    size = (w * h * np.where(kind == "video", dur * 0.1, 0.3)).astype(np.int64)
    return pa.table({"relpath": [f"m/{i}.bin" for i in range(n)], "bytes": size, "width": w, "height": h,
                     "duration_s": dur, "codec": codec.tolist(), "kind": kind.tolist()})


def _true_cost(cat):
    X = pplan.features(cat["bytes"].to_numpy(), cat["width"].to_numpy(), cat["height"].to_numpy(),
                       cat["duration_s"].to_numpy())
    codec = np.array(cat["codec"].to_pylist())
    coef = {"jpeg": [1.0, 2.0, 3.0, 0.0, 0.0], "h264": [5.0, 0.5, 1.0, 2.0, 4.0],
            "hevc": [8.0, 0.2, 2.0, 3.0, 6.0]}
    return np.array([X[i] @ np.array(coef[c]) for i, c in enumerate(codec)])


def test_cost_model_fits_linear_cost(tmp_path):
    rng = np.random.default_rng(1)
    cat = _catalog(300, rng)
    y = _true_cost(cat)
    timed = cat.slice(0, 120).append_column("measured_ms", pa.array(y[:120]))
    pacsv.write_csv(timed, str(tmp_path / "timings.csv"))
    model = fit_cost_model(fplan.read_table(str(tmp_path / "timings.csv")))
    assert set(model.coefs) == {"image/jpeg", "video/h264", "video/hevc"}
    est = estimate_costs(cat["relpath"].to_pylist(), cat, model)
    np.testing.assert_allclose(est, y, rtol=1e-6, atol=1e-6)
    again = pplan.CostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    np.testing.assert_allclose(estimate_costs(cat["relpath"].to_pylist(), cat, again), y, rtol=1e-6)
    # a sample missing from the catalog gets the mean estimate
    est2 = estimate_costs(cat["relpath"].to_pylist()[:3] + ["m/unknown"], cat, model)
    assert est2[3] == pytest.approx(est2[:3].mean())


def test_balancing_lowers_max_mean_fixed_example():
    rng = np.random.default_rng(0)
    W, B, S = 8, 4, 200
    costs = rng.pareto(2.0, (S, W * B)) * 10 + 1      # heavy tail
    rank_of = pplan.balance(costs, W, B)
    rep = pplan.balance_report(costs, W, B, rank_of)
    assert rep["summary"]["after"]["mean"] < rep["summary"]["before"]["mean"] * 0.8
    # no assignment beats the rank holding the heaviest sample plus the B-1 lightest ones
    mean = costs.sum(axis=1) / W
    bound = np.maximum(costs.max(axis=1) + np.sort(costs, axis=1)[:, :B - 1].sum(axis=1), mean) / mean
    assert rep["after"].mean() <= bound.mean() * 1.01
    assert np.all(rep["after"] <= rep["before"] + 1e-12)
    for s in range(S):
        assert np.bincount(rank_of[s], minlength=W).tolist() == [B] * W


@settings(max_examples=60, deadline=None)
@given(W=st.integers(1, 6), B=st.integers(1, 5), S=st.integers(1, 4), seed=st.integers(0, 2**32 - 1),
       alpha=st.floats(0.5, 3.0))
def test_balancing_property(W, B, S, seed, alpha):
    costs = np.random.default_rng(seed).pareto(alpha, (S, W * B)) + 0.1
    rank_of = pplan.balance(costs, W, B)
    rep = pplan.balance_report(costs, W, B, rank_of)
    assert np.all(rep["after"] <= rep["before"] + 1e-9)
    assert np.all(rep["after"] >= 1 - 1e-9)
    for s in range(S):    # every position exactly once, every rank exactly B slots
        assert np.bincount(rank_of[s], minlength=W).tolist() == [B] * W
    lay = pplan.layout(rank_of, B)
    assert all(sorted(row.tolist()) == list(range(W * B)) for row in lay)


def test_cost_aware_plan_keeps_step_contents(tmp_path):
    rng = np.random.default_rng(3)
    costs = rng.pareto(1.0, len(SAMPLES)) * 20 + 1
    plain = _build(tmp_path, "plain.parquet", costs=costs)
    aware = _build(tmp_path, "aware.parquet", costs=costs, cost_aware=True)
    assert read_plan_meta(aware.path)["mode"] == "cost_aware"
    tp, ta = pq.read_table(plain.path).to_pylist(), pq.read_table(aware.path).to_pylist()
    for step in range(40):
        sp = sorted((r["sample"], r["aug_seed"]) for r in tp if r["step"] == step)
        sa = sorted((r["sample"], r["aug_seed"]) for r in ta if r["step"] == step)
        assert sp == sa
    assert aware.ratio_after.mean() < aware.ratio_before.mean()
    assert np.allclose(plain.ratio_before, aware.ratio_before)
    cost_of = dict(zip(SAMPLES, costs))
    assert all(abs(r["est_cost_ms"] - cost_of[r["sample"]]) < 1e-3 * cost_of[r["sample"]] for r in ta)


# -- registration --------------------------------------------------------------------------------
@pytest.mark.parametrize("doc,reason", [
    ({"plan": "p.parquet"}, "step"),
    ({"plan": "p.parquet", "step": -1}, "step"),
    ({"plan": "p.parquet", "step": 1, "extra": 1}, "extra: unknown key"),
    ({"plan": "../p.parquet", "step": 1}, "contains '..'"),
    ({"plan": "/abs/p.parquet", "step": 1}, "relative"),
    ({"plan": ".hintfs/x", "step": 1}, ".hintfs"),
    ({"plan": "", "step": 1}, "plan"),
    ({"plan": "p.parquet", "step": "3"}, "step"),
    ({"plan": "p.parquet", "step": True}, "step"),
    ({"plan": "p.parquet", "step": 1, "lookahead": -2}, "lookahead"),
    ([1, 2], "object"),
])
def test_registration_validation(doc, reason):
    with pytest.raises(ValueError) as err:
        parse_plan_registration(doc)
    assert reason in str(err.value) and "\n" not in str(err.value)


def test_registration_normalizes():
    reg = parse_plan_registration({"plan": "./plans//run.parquet", "step": 3, "lookahead": 2})
    assert reg == PlanRegistration(plan="plans/run.parquet", step=3, lookahead=2)
    # '..' is refused even where it would stay inside: a symlinked folder makes 'a/..' elsewhere.
    with pytest.raises(ValueError, match="contains '..'"):
        parse_plan_registration({"plan": "plans/a/../run.parquet", "step": 3})


def test_register_and_update_write_control_file(tmp_path):
    mount = tmp_path / "mnt"
    (mount / ".hintfs" / "plans").mkdir(parents=True)
    register_plan(str(mount), "job1", str(mount / "plans" / "run.parquet"), 5, lookahead=3)
    assert json.loads((mount / ".hintfs/plans/job1").read_text()) == {"plan": "plans/run.parquet", "step": 5,
                                                                        "lookahead": 3}
    update_step(str(mount), "job1", 6)
    assert json.loads((mount / ".hintfs/plans/job1").read_text())["step"] == 6
    with pytest.raises(ValueError, match="inside the mount"):
        register_plan(str(mount), "job1", str(tmp_path / "elsewhere.parquet"), 0)
    with pytest.raises(ValueError, match="register_plan first"):
        update_step(str(mount), "nojob", 1)
    with pytest.raises(ValueError, match="one path component"):
        register_plan(str(mount), "a/b", "p.parquet", 0)


def test_register_reports_mount_reason(tmp_path, monkeypatch):
    mount = tmp_path / "mnt"
    (mount / ".hintfs" / "plans").mkdir(parents=True)
    (mount / ".hintfs" / "plans" / "job2.error").write_text("plan: no such file plans/x.parquet\n")
    real_open = open

    def fake_open(path, mode="r", *a, **kw):
        if str(path).endswith("plans/job2") and "w" in mode:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, mode, *a, **kw)
    monkeypatch.setattr("builtins.open", fake_open)
    with pytest.raises(ValueError, match="job2: plan: no such file"):
        register_plan(str(mount), "job2", "plans/x.parquet", 0)


# -- CLI -----------------------------------------------------------------------------------------
def test_cli_build_register_show(tmp_path, capsys):
    import argparse
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="verb")
    from hintfs.cli import plan as plan_cli
    plan_cli.add_parser(sub)
    lst = tmp_path / "list.txt"
    lst.write_text("\n".join(SAMPLES))
    rng = np.random.default_rng(5)
    cat = _catalog(len(SAMPLES), rng)
    cat = cat.set_column(0, "relpath", pa.array(SAMPLES))
    cat = cat.append_column("measured_ms", pa.array(_true_cost(cat)))
    pq.write_table(cat, str(tmp_path / "cat.parquet"))
    args = parser.parse_args(["plan", "build", str(lst), str(tmp_path / "p.parquet"), "--seed", "1",
                              "--world-size", "4", "--batch-per-rank", "2", "--steps", "30",
                              "--cost-aware", "--catalog", str(tmp_path / "cat.parquet")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "cost_aware" in out and "before" in out
    assert read_plan_meta(str(tmp_path / "p.parquet"))["mode"] == "cost_aware"
    args = parser.parse_args(["plan", "show", str(tmp_path / "p.parquet"), "--step", "3", "--rank", "1"])
    assert args.func(args) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 3     # a header, then batch_per_rank rows
    (tmp_path / ".hintfs" / "plans").mkdir(parents=True)
    args = parser.parse_args(["plan", "register", str(tmp_path), "j", "p.parquet", "--step", "4"])
    assert args.func(args) == 0
    assert json.loads((tmp_path / ".hintfs/plans/j").read_text()) == {"plan": "p.parquet", "step": 4}
    args = parser.parse_args(["plan", "build", str(lst), str(tmp_path / "q.parquet"), "--seed", "1",
                              "--world-size", "4", "--batch-per-rank", "2", "--steps", "3", "--cost-aware"])
    from hintfs.cli.base import UserError
    with pytest.raises(UserError, match="--catalog"):
        args.func(args)


# -- the torch Dataset ---------------------------------------------------------------------------
def test_dataloader_yields_plan_batches_in_order(tmp_path):
    torch = pytest.importorskip("torch")
    from hintfs.dataset import PlanDataset
    mount = tmp_path / "mnt"
    mount.mkdir()
    r = build_plan(SAMPLES, str(mount / "plan.parquet"), seed=11, world_size=2, batch_per_rank=4,
                   steps=20, steps_per_row_group=3)
    index_of = {s: i for i, s in enumerate(SAMPLES)}
    calls = []

    def loader(path):
        calls.append(path)
        assert path.startswith(str(mount)) and path.endswith(".tensor")
        rel = os.path.relpath(path, mount)[:-len(".tensor")]
        return torch.tensor([index_of[rel]], dtype=torch.int64)

    ds = PlanDataset(str(mount), "plan.parquet", rank=1, start_step=7, loader=loader)
    assert len(ds) == 13 * 4 and ds.steps == list(range(7, 20))
    batches = [b.view(-1).tolist() for b in ds.dataloader(num_workers=0)]
    full = pq.read_table(r.path).to_pylist()
    expect = [[index_of[row["sample"]] for row in full if row["step"] == s and row["rank"] == 1]
              for s in range(7, 20)]
    assert batches == expect
    # with metadata and a job: registration then one step report per batch
    (mount / ".hintfs" / "plans").mkdir(parents=True)
    ds2 = PlanDataset(str(mount), "plan.parquet", rank=0, start_step=18, loader=loader, with_meta=True)
    seen = []
    for batch in ds2.dataloader(job="train", lookahead=2):
        seen.append(json.loads((mount / ".hintfs/plans/train").read_text()))
        assert batch["step"].tolist() == [seen[-1]["step"]] * 4
    assert seen == [{"plan": "plan.parquet", "step": 18, "lookahead": 2},
                    {"plan": "plan.parquet", "step": 19, "lookahead": 2}]
    with pytest.raises(ValueError, match="rank"):
        PlanDataset(str(mount), "plan.parquet", rank=2, loader=loader)

"""The scale model (policy/scale.py, issue 37 item 5): its limits and monotonicity, the fit and the
held-out errors bench/scale_model.py recorded, and `hintfs hints plan` on a small DCP checkpoint,
with its errors."""
from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import replace

import pytest

from policy.scale import (
    Costs, FileLoad, MergeCase, ReadGroup, Workload, agent_loads, best_replicas, costs_from_mapping, dcp_layout,
    expected_max, fit_costs, hot_set_plan, merge_time, predict_load, prescale_time,
)
from tests.conftest import REPO
from tests.helpers.cli import hintfs, one_clean_line

RESULTS = REPO / "bench" / "results" / "scale_model.json"
# bench/restart_storm.py's checkpoint: .metadata, 5 replicated reads in rank 0's file, 4 shard reads
REP = [132649, 1833, 1833, 1833, 132649]
SHARD = [13865, 5673, 17961, 9769]
# no burst, no per-read time, no fixed part: bytes and bandwidth only
BARE = Costs(agent_bandwidth_bytes_s=1e6, agent_burst_s=0.0, agent_read_s=0.0, shared_read_s=0.0,
             storm_overhead_s=0.0, read_latency_s=0.0)


def bench(n: int) -> Workload:
    return dcp_layout(n, 4, 4827, REP, SHARD)


def one_file(readers: int, size: int, reads: int = 1) -> Workload:
    per = [size // reads] * reads
    f = FileLoad("f", size, (ReadGroup.of(readers, per),))
    return Workload(readers, (f,), size, reads)


# -- limits ---------------------------------------------------------------------------------------
def test_one_reader_takes_its_bytes_over_the_agent_bandwidth():
    w = one_file(1, 3_000_000, reads=3)
    for strategy in ("default", "hints", "reactive"):
        assert predict_load(w, BARE, 4, strategy).seconds == pytest.approx(3.0)
    # several files on several agents: one reader still reads them one after another
    w = bench(1)
    assert predict_load(w, BARE, 8, "hints").seconds == pytest.approx(w.rank_bytes / 1e6)
    # a round trip per read adds up along the chain
    c = replace(BARE, read_latency_s=0.01)
    assert predict_load(w, c, 8, "hints").seconds == pytest.approx(w.rank_bytes / 1e6 + 0.01 * w.rank_reads)


def test_many_readers_of_one_replica_share_its_bandwidth():
    w = one_file(100, 1_000_000)
    assert predict_load(w, BARE, 1, "hints").seconds == pytest.approx(100.0)
    # spread evenly over 4 replicas (balanced), a quarter each
    assert predict_load(w, BARE, 4, "hints", replicas={"f": 4}).seconds == pytest.approx(25.0)
    # the burst an idle agent serves at once comes off, never below zero
    assert predict_load(w, replace(BARE, agent_burst_s=5), 1, "hints").seconds == pytest.approx(95.0)
    assert predict_load(one_file(1, 1000), replace(BARE, agent_burst_s=5), 1, "hints").seconds == pytest.approx(1e-3)


def test_bandwidth_twice_the_time_half_when_bandwidth_binds():
    w = bench(256)
    t1 = predict_load(w, BARE, 8, "hints").seconds
    t2 = predict_load(w, replace(BARE, agent_bandwidth_bytes_s=2e6), 8, "hints").seconds
    assert t2 == pytest.approx(t1 / 2)


def test_unlimited_agents_leave_the_read_costs():
    c = replace(BARE, agent_bandwidth_bytes_s=0.0, shared_read_s=0.001, agent_read_s=0.0)
    w = bench(256)
    assert predict_load(w, c, 8, "hints").seconds == pytest.approx(w.total_reads * 0.001)
    c = replace(c, shared_read_s=0.0, agent_read_s=0.01)
    p = predict_load(w, c, 8, "default", placement="index")
    loads = agent_loads(w, p.replicas, 8, False, placement="index")
    assert p.seconds == pytest.approx(max(loads.reads) * 0.01)


# -- monotonicity ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n,agents", [(256, 8), (2048, 128), (20000, 1250)])
def test_more_replicas_of_the_hot_set_never_slower_until_the_agents_are_the_limit(n, agents):
    w = bench(n)
    costs = Costs()
    times = [predict_load(w, costs, agents, "hints", replicas=hot_set_plan(w, agents, r)).seconds
             for r in range(1, agents + 3, max(1, agents // 16))]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(times, times[1:])), times
    # past one replica per agent nothing changes
    at_k = predict_load(w, costs, agents, "hints", replicas=hot_set_plan(w, agents, agents)).seconds
    assert predict_load(w, costs, agents, "hints", replicas=hot_set_plan(w, agents, 4 * agents)).seconds == at_k


def test_more_agents_never_slower_with_hints():
    w = bench(1024)
    times = [predict_load(w, Costs(), k, "hints", placement="index").seconds for k in (4, 8, 16, 32, 64)]
    assert all(b <= a for a, b in zip(times, times[1:])), times


def test_balanced_choice_never_slower_than_random_on_the_same_replicas():
    for n in (64, 256, 2048):
        w = bench(n)
        plan = hot_set_plan(w, 16, 8)
        bal = predict_load(w, Costs(), 16, "hints", replicas=plan).seconds
        rnd = predict_load(w, Costs(), 16, "hints", replicas=plan, balanced=False).seconds
        assert bal <= rnd


def test_random_choice_spread_and_expected_max():
    assert expected_max([1.0, 2.0, 3.0], [0.0, 0.0, 0.0]) == 3.0
    # two equal normals: E[max] = mean + sigma / sqrt(pi)
    assert expected_max([10.0, 10.0], [1.0, 1.0]) == pytest.approx(10 + 1 / math.sqrt(math.pi), rel=1e-3)
    w = bench(64)
    loads = agent_loads(w, {f.path: 3 for f in w.files}, 8, False, placement="index")
    assert max(loads.variance) > 0 and sum(loads.bytes) == pytest.approx(w.total_bytes)
    bal = agent_loads(w, {f.path: 3 for f in w.files}, 8, True, placement="index")
    assert max(bal.variance) == 0 and sum(bal.bytes) == pytest.approx(w.total_bytes)


def test_reactive_without_copies_is_the_default_fluid():
    w = bench(256)
    c = replace(Costs(), storm_overhead_s=0.0, agent_read_s=0.0)
    no_copies = predict_load(w, c, 8, "reactive", qps_threshold=1e12, placement="index")
    loads = agent_loads(w, no_copies.replicas, 8, False, placement="index")
    assert no_copies.seconds == pytest.approx(max(loads.bytes) / c.agent_bandwidth_bytes_s - c.agent_burst_s,
                                              rel=0.03)
    copies = predict_load(w, c, 8, "reactive", placement="index")
    assert copies.seconds < no_copies.seconds and copies.replicas["__0_0.distcp"] > 3


def test_prescale_is_a_tree_of_rounds():
    w = bench(256)
    c = replace(Costs(), replica_copy_bytes_s=1e12, replica_copy_file_s=0.1)
    # 8 replicas: the home agent serves the store's copy, one copy comes from the store, then the
    # 7th..2nd copies in three rounds of the tree (1 -> 2 -> 4 sources): four rounds
    assert prescale_time(w, {".metadata": 1, "__0_0.distcp": 8}, c) == pytest.approx(0.4, rel=1e-4)
    assert prescale_time(w, {"__0_0.distcp": 1}, c) == 0.0


def test_best_replicas_is_the_fewest_within_the_tolerance():
    w = bench(2048)
    best, times = best_replicas(w, Costs(), 128, [3, 8, 32, 128], 0.10)
    assert best in times and times[best] <= min(times.values()) * 1.1
    assert all(times[r] > min(times.values()) * 1.1 for r in times if r < best)


def test_merge_modes():
    case = MergeCase(checkpoint_bytes=1e8, files=10, merge_tensors=50, merge_bytes=1e7, tail_bytes=2e7, remote_bytes=3e7)
    c = Costs()
    remote, copy, stream = (merge_time(case, c, m) for m in ("remote", "copy", "stream"))
    assert stream < copy < remote
    assert merge_time(replace(case, tail_bytes=0.0), c, "stream") < stream
    with pytest.raises(ValueError, match="mode"):
        merge_time(case, c, "tier")


# -- costs ----------------------------------------------------------------------------------------
def test_costs_from_a_mapping_and_its_errors():
    c = costs_from_mapping({"agent_bandwidth_bytes_s": 2e9, "agent_read_slots": 8})
    assert c.agent_bandwidth_bytes_s == 2e9 and c.agent_read_slots == 8 and c.link_rtt_s == Costs().link_rtt_s
    with pytest.raises(ValueError, match="unknown cost key agent_bw"):
        costs_from_mapping({"agent_bw": 1})
    with pytest.raises(ValueError, match="must be >= 0"):
        costs_from_mapping({"link_rtt_s": -1})
    with pytest.raises(ValueError, match="finite number"):
        costs_from_mapping({"link_rtt_s": True})
    with pytest.raises(ValueError, match="whole number"):
        costs_from_mapping({"agent_read_slots": 2.5})


def test_the_fit_finds_known_costs():
    truth = replace(BARE, storm_overhead_s=0.3, shared_read_s=0.0007)
    pts = [((n, b), predict_load(bench(n), replace(truth, agent_bandwidth_bytes_s=b), 8, "hints").seconds)
           for n, b in ((64, 1.5e6), (256, 1.5e6), (256, 0.0), (32, 0.0))]

    def predict(c, p):
        return predict_load(bench(p[0]), replace(c, agent_bandwidth_bytes_s=p[1]), 8, "hints").seconds
    fitted = fit_costs(pts, replace(BARE, storm_overhead_s=0.01, shared_read_s=0.01), ["storm_overhead_s",
                                                                                      "shared_read_s"], predict)
    assert fitted.storm_overhead_s == pytest.approx(0.3, rel=0.02)
    assert fitted.shared_read_s == pytest.approx(0.0007, rel=0.02)


# -- what bench/scale_model.py recorded -----------------------------------------------------------
def _bench_module():
    spec = importlib.util.spec_from_file_location("scale_model_bench", REPO / "bench" / "scale_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_recorded_fit_and_hold_out():
    d = json.loads(RESULTS.read_text())
    assert costs_from_mapping(d["scale_costs"]) == Costs(), "policy.scale.Costs() defaults = the fit's scale_costs"
    rows = d["storm_points"]
    fitted = [r for r in rows if r["role"] == "fitted"]
    held = [r for r in rows if r["role"] == "held out"]
    assert len(fitted) >= 4 and len(held) >= 2 * len(fitted)
    assert d["max_err_vs_measured"] == max(abs(r["err"]) for r in held)
    # within 20% where the agents' bandwidth binds (the regime the scale predictions are in)
    assert all(abs(r["err"]) <= 0.2 for r in held if r["bandwidth_bytes_s"] > 0), held
    for key in ("2048", "10000", "20000"):
        assert set(d["load_time_s"][key]) == {"3", "64", "128"}
    assert d["paper_2048_128_s"]["paper_cut"] == 0.408


def test_recorded_points_come_from_the_model():
    """The latest run's rows, predicted again from the recorded costs, give the recorded model_s."""
    mod = _bench_module()
    d = json.loads(RESULTS.read_text())
    costs = costs_from_mapping(d["costs"])
    pts = mod.storm_points({"latest": json.loads((REPO / "bench" / "results" / "restart_storm.json").read_text())})
    recorded = {(r["case"], r["n"]): r["model_s"] for r in d["storm_points"] if r["run"] == "latest"}
    for p in pts:
        assert mod.predict_storm(costs, p) == pytest.approx(recorded[(p["case"], p["n"])], abs=2e-3)


# -- the CLI --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small DCP checkpoint saved by one process (every tensor in one chunk: read by every rank)."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    out = tmp_path_factory.mktemp("ckpt") / "step_10"
    g = torch.Generator().manual_seed(0)
    sd = {"tok_embeddings.weight": torch.randn(256, 32, generator=g), "norm.weight": torch.randn(32, generator=g),
          "layers.0.w": torch.randn(64, 32, generator=g)}
    with pytest.warns(UserWarning):   # "assuming the intent is to save in a single process"
        dcp.save(sd, checkpoint_id=str(out))
    return out


def plan_json(capsys, *args) -> dict:
    """`hintfs hints plan ... --json` in this process (the command line parsed as the script
    does; torch, which reads the checkpoint, is imported once for all such tests)."""
    from hintfs.cli import build_parser
    from hintfs.cli.hints_plan import cmd_plan
    capsys.readouterr()
    assert cmd_plan(build_parser().parse_args(["hints", "plan", *map(str, args), "--json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_prints_replicas_and_the_predicted_times(checkpoint, capsys):
    r = hintfs("hints", "plan", checkpoint, "--world-size", "256", "--agents", "8", timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "replicas to ask for" in out and ".metadata" in out and "__0_0.distcp" in out
    assert "predicted load time: default" in out and "assumptions:" in out and "storage agents: 8 (--agents)" in out
    doc = plan_json(capsys, checkpoint, "--world-size", "256", "--agents", "8")
    assert doc["readers"] == {".metadata": 256, "__0_0.distcp": 256}
    assert doc["replicas"] == {".metadata": 8, "__0_0.distcp": 8}      # 256 readers / 32 safe, on 8 agents
    assert doc["load_time_s"]["hints"] < doc["load_time_s"]["default"]
    assert doc["max_replicas"] == 8 and doc["agents_assumed"] is False
    assert doc["metadata_bytes"] == (checkpoint / ".metadata").stat().st_size
    assert 0 < doc["metadata_wire_bytes"] <= doc["metadata_bytes"]


def test_the_plan_weighs_the_metadata_as_it_crosses():
    """Agents compress what compresses: a pickle-like `.metadata` weighs a fraction of its size in
    the plan's reads and copies; random bytes weigh what they are."""
    import os
    from hintfs.cli.hints_plan import wire_bytes
    text = b"".join(b"TensorStorageMetadata(layers.%d.w, chunks=[(0, 0), (4096, 128)])\n" % i for i in range(20_000))
    assert wire_bytes(text) < len(text) // 5
    noise = os.urandom(600_000)
    assert wire_bytes(noise) == len(noise)
    assert wire_bytes(b"") == 0


def test_plan_with_a_costs_file_and_a_cap(checkpoint, tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"agent_bandwidth_bytes_s": 1e9, "agent_burst_s": 0}))
    doc = plan_json(capsys, checkpoint, "--world-size", "2048", "--costs", costs, "--max-replicas", "4")
    assert doc["agents"] == 128 and doc["agents_assumed"] is True and doc["max_replicas"] == 4
    assert set(doc["replicas"].values()) == {4} and doc["costs"] == str(costs)


def test_plan_errors(checkpoint, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "is not a DCP checkpoint folder" in one_clean_line(hintfs("hints", "plan", empty, "--world-size", "8"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ".metadata").write_bytes(b"not a pickle")
    from hintfs.cli import build_parser
    from hintfs.cli.base import UserError
    from hintfs.cli.hints_plan import cmd_plan
    with pytest.raises(UserError, match="is not a DCP checkpoint's metadata"):   # (torch reads it: in this process)
        cmd_plan(build_parser().parse_args(["hints", "plan", str(bad), "--world-size", "8"]))
    assert "--world-size must be >= 1" in one_clean_line(hintfs("hints", "plan", checkpoint, "--world-size", "0"))
    assert "needs --world-size" in one_clean_line(hintfs("hints", "plan", checkpoint))
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"agent_bandwidth": 1e9}))
    line = one_clean_line(hintfs("hints", "plan", checkpoint, "--world-size", "8", "--costs", costs))
    assert "unknown cost key agent_bandwidth" in line and "agent_bandwidth_bytes_s" in line
    costs.write_text("[1, 2]")
    assert "expected a JSON object" in one_clean_line(hintfs("hints", "plan", checkpoint, "--world-size", "8",
                                                             "--costs", costs))
    assert "no such directory" in one_clean_line(hintfs("hints", "plan", tmp_path / "nope", "--world-size", "8"))
    # the other actions still want their two words
    r = hintfs("hints", "status")
    assert r.returncode == 2 and "required: mountpoint, job" in r.stderr

"""The daemon end to end on CPU: real socket, real shared memory, simulated training device."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from hintfs.governor.client import GovernorClient, GovernorError
from mountconfig.governor import GiB
from governor_simdevice import SimulatedTrainer
from conftest import wait_until


def test_reserve_fits_without_reclaim(make_daemon):
    d = make_daemon()
    inf = GovernorClient(d.cfg.socket_path, "inference", name="resnet")
    r = inf.request({"op": "reserve", "kind": "weights", "bytes": 2 * GiB})
    assert r["granted"] == 2 * GiB and r["reclaimed"] == 0
    assert d.call(lambda: d.ledger().by_kind()["weights"]) == 2 * GiB
    inf.request({"op": "release", "kind": "weights", "bytes": GiB})
    assert d.call(lambda: d.ledger().inference_bytes()) == GiB
    inf.close()


def test_shrink_through_shared_memory_then_grow_back(make_daemon):
    d = make_daemon(grow_after_free_s=0.1, min_training_fraction=0.1)
    trainer = SimulatedTrainer(d.cfg.socket_path)
    usable = 15 * GiB
    assert trainer.client.initial_quota == usable  # headroom 0, nothing else on the GPU
    # its last step-end report says it holds the whole quota
    trainer.client.report_usage({"weights": GiB, "optimizer_state": 3 * GiB,
                                 "activations": usable - 4 * GiB})
    inf = GovernorClient(d.cfg.socket_path, "inference")
    t0 = time.perf_counter()
    r = inf.request({"op": "reserve", "kind": "kv_cache", "bytes": 6 * GiB})
    wall_ms = (time.perf_counter() - t0) * 1e3
    assert r["reclaimed"] == 6 * GiB
    t = r["timing_ms"]
    assert set(t) >= {"detect", "drain", "release", "ack", "reclaim", "released"}
    assert t["released"] is True and t["aborted"] is False
    # bounded, not timed: the reclaim's latency is measured by bench/gpu_sharing.py
    assert t["reclaim"] < 5000 and wall_ms < 5000
    assert trainer.used <= 9 * GiB
    assert d.call(lambda: d.ledger().training_bytes()) == 9 * GiB
    # memory by kind follows the ack's held bytes, not the stale report
    kinds = d.call(lambda: d.ledger().by_kind())
    assert kinds["kv_cache"] == 6 * GiB and kinds["optimizer_state"] == 3 * GiB
    assert kinds["weights"] + kinds["optimizer_state"] + kinds["activations"] == trainer.used
    # inference leaves: after the quiet period training grows back in steps
    inf.request({"op": "release", "kind": "kv_cache", "bytes": 6 * GiB})
    assert wait_until(lambda: d.call(lambda: d.ledger().training_bytes()) > 12 * GiB, 5)
    assert wait_until(lambda: trainer.used > 12 * GiB, 5)
    trainer.close(); inf.close()


def test_shrink_within_slack_is_acked_without_release(make_daemon):
    # training holds 5 GiB of its 15 GiB quota: a 6 GiB reservation costs it nothing physical
    d = make_daemon(min_training_fraction=0.1)
    trainer = SimulatedTrainer(d.cfg.socket_path, used=5 * GiB, release_s=0.05)
    inf = GovernorClient(d.cfg.socket_path, "inference")
    r = inf.request({"op": "reserve", "kind": "kv_cache", "bytes": 6 * GiB})
    t = r["timing_ms"]
    assert r["reclaimed"] == 6 * GiB and t["released"] is False
    assert t["drain"] == 0 and t["release"] == 0 and t["reclaim"] < 5000
    assert trainer.used == 5 * GiB
    assert d.call(lambda: d.ledger().training_bytes()) == 9 * GiB
    trainer.close(); inf.close()


def test_inference_cannot_take_training_floor(make_daemon):
    d = make_daemon(min_training_fraction=0.5)
    trainer = SimulatedTrainer(d.cfg.socket_path)
    inf = GovernorClient(d.cfg.socket_path, "inference")
    with pytest.raises(GovernorError, match="limit"):
        inf.request({"op": "reserve", "kind": "weights", "bytes": 8 * GiB})
    inf.request({"op": "reserve", "kind": "weights", "bytes": 7 * GiB})
    trainer.close(); inf.close()


def test_deadline_miss_rejects(make_daemon):
    d = make_daemon(reclaim_deadline_ms=30, deadline_miss_action="reject")
    trainer = SimulatedTrainer(d.cfg.socket_path, stuck=True)
    inf = GovernorClient(d.cfg.socket_path, "inference")
    t0 = time.perf_counter()
    with pytest.raises(GovernorError, match="deadline"):
        inf.request({"op": "reserve", "kind": "weights", "bytes": 4 * GiB})
    assert time.perf_counter() - t0 < 5.0      # refused at the deadline, not after a hang
    assert d.call(lambda: d.ledger().inference_bytes()) == 0
    trainer.close(); inf.close()


TRAINER_PROC = textwrap.dedent("""
    import sys, time
    from hintfs.governor.client import GovernorClient
    c = GovernorClient(sys.argv[1], "training", name="stuck")
    print(c.initial_quota, flush=True)
    time.sleep(60)   # never reaches a safe point
""")


def _spawn_trainer(sock):
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", TRAINER_PROC, sock], stdout=subprocess.PIPE,
                         text=True, env=env)
    assert int(p.stdout.readline()) > 0
    return p


def test_deadline_miss_stops_training(make_daemon):
    d = make_daemon(reclaim_deadline_ms=30, deadline_miss_action="stop_training")
    p = _spawn_trainer(d.cfg.socket_path)
    inf = GovernorClient(d.cfg.socket_path, "inference")
    r = inf.request({"op": "reserve", "kind": "weights", "bytes": 10 * GiB})
    assert r["granted"] == 10 * GiB
    assert p.wait(5) != 0  # killed
    assert d.call(lambda: len(d.ledger().training())) == 0
    inf.close()


def test_dead_client_returns_memory(make_daemon):
    d = make_daemon()
    p = _spawn_trainer(d.cfg.socket_path)
    assert d.call(lambda: d.ledger().training_bytes()) == 15 * GiB
    p.kill(); p.wait()
    assert wait_until(lambda: d.call(lambda: d.ledger().training_bytes()) == 0, 5)
    assert d.call(lambda: d.ledger().free_bytes()) == 15 * GiB
    # its slot is reusable
    inf = GovernorClient(d.cfg.socket_path, "inference")
    assert inf.slot_index == 0
    inf.close()


def test_a_refused_request_is_a_reply_and_a_bad_message_drops_its_client(make_daemon):
    d = make_daemon()
    with pytest.raises(GovernorError, match="not governed"):      # refused, well-formed
        GovernorClient(d.cfg.socket_path, "inference", gpu=7)
    inf = GovernorClient(d.cfg.socket_path, "inference", reconnect_timeout_s=0.5)
    with pytest.raises(GovernorError, match="limit"):             # refused: the connection stays
        inf.request({"op": "reserve", "kind": "weights", "bytes": 15 * GiB})
    assert inf.stats()["gpus"][0]["usable_bytes"] == 15 * GiB
    with pytest.raises(GovernorError, match="kind"):              # malformed: answered, dropped
        inf.request({"op": "reserve", "kind": "socks", "bytes": 1})
    assert wait_until(lambda: d.call(lambda: len(d.ledger().clients)) == 0)
    other = GovernorClient(d.cfg.socket_path, "inference")
    with pytest.raises(GovernorError, match="already registered"):
        other.request({"op": "register", "role": "inference", "gpu": 0, "pid": 1})
    assert d.alive()
    inf.close(); other.close()


def test_timing_split_only_from_clients_that_acked_this_command(make_daemon):
    # A reclaim satisfied without this command's ack (e.g. an earlier command's late ack freed
    # the memory) must not report the stale stamps of an older command as its split.
    from hintfs.governor.protocol import W_T_DETECT, W_T_DRAINED, W_T_RELEASED, now_ns
    d = make_daemon()
    trainer = SimulatedTrainer(d.cfg.socket_path, stuck=True)
    st = d.daemon.gpus[0]
    slot = d.daemon.conns[trainer.client.client_id].words
    old = now_ns()
    slot[W_T_DETECT], slot[W_T_DRAINED], slot[W_T_RELEASED] = old, old + 10, old + 20
    t_cmd = now_ns() + 1_000_000
    none = d.call(lambda: d.daemon._timing(st, [], t_cmd, t_cmd, t_cmd + 5_000_000))
    assert "detect" not in none and none["reclaim"] == pytest.approx(5.0)
    cid = trainer.client.client_id
    some = d.call(lambda: d.daemon._timing(st, [cid], old - 1000, old - 1000, old + 1000))
    assert some["detect"] >= 0 and some["released"] is False
    trainer.close()


def test_training_drain_bound_raises_the_reclaim_estimate(make_daemon):
    d = make_daemon(reclaim_time_initial_ms=2.0)
    trainer = GovernorClient(d.cfg.socket_path, "training")
    assert trainer.stats()["gpus"][0]["reclaim_estimate_ms"] == pytest.approx(2.0)
    trainer.request({"op": "usage", "kinds": {"activations": GiB}, "drain_ms": 9.5})
    assert trainer.stats()["gpus"][0]["reclaim_estimate_ms"] == pytest.approx(9.5)
    with pytest.raises(GovernorError, match="drain_ms"):
        trainer.request({"op": "usage", "kinds": {}, "drain_ms": -1})
    trainer.close()
    assert wait_until(lambda: d.call(lambda: d.daemon.reclaim_estimate_s(d.daemon.gpus[0])) == pytest.approx(0.002), 5)

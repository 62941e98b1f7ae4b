"""A governor restart grants nothing twice (issue 41, finding 3): the daemon is a real process
(`python -m hintfs.governor.cli CONFIG`), SIGKILLed while clients hold memory; the next instance holds
back what the previous one's clients may hold until each re-registers or its pid is gone."""
from __future__ import annotations

import inspect
import time
import os
import signal
import subprocess
import sys

import pytest

from conftest import wait_until
from hintfs.governor.client import GovernorClient, GovernorError
from mountconfig.governor import GiB

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


class DaemonProc:
    def __init__(self, cfg_path) -> None:
        self.cfg_path = cfg_path
        self.p = subprocess.Popen([sys.executable, "-m", "hintfs.governor.cli", str(cfg_path)], env=ENV,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def wait_up(self, sock: str) -> None:
        def up():
            assert self.p.poll() is None, self.p.stderr.read()[-3000:]
            import socket
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(2)
                    s.connect(sock)
                    s.sendall(b'{"op":"ping"}\n')
                    return b'"ok"' in s.recv(4096)
            except OSError:
                return False
        assert wait_until(up, 30, 0.05), "governor did not come up"

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, sig)
        self.p.wait(10)

    def stop(self) -> str:
        self.kill(signal.SIGTERM)
        err = self.p.stderr.read()
        self.p.stderr.close()
        return err


# A training process that obeys its commands: releases down to the target, acks, notifies.
TRAINER = """
import sys, time
from hintfs.governor.client import GovernorClient
from hintfs.governor.protocol import ACK_RELEASED, CMD_SHRINK
c = GovernorClient(sys.argv[1], "training", name="held", want_bytes=int(sys.argv[2]))
print(c.initial_quota, flush=True)
while True:
    cmd = c.slot.pending()
    if cmd is not None:
        c.slot.stamp_detect()
        c.slot.ack(cmd.seq, cmd.target, 1, 2, ACK_RELEASED)
        if cmd.cmd == CMD_SHRINK:
            c.notify_ack(cmd.seq)
    time.sleep(0.001)
"""


def _config(tmp_path, **kw) -> tuple:
    sock = tmp_path / "gov.sock"
    extra = "".join(f"{k} = {v!r}\n" if not isinstance(v, str) else f'{k} = "{v}"\n' for k, v in kw.items())
    cfg = tmp_path / "gov.toml"
    cfg.write_text(f'[governor]\nsocket_path = "{sock}"\nshm_name = "hintfs-test-restart-{os.getpid()}"\n'
                   'liveness_interval_s = 0.1\ngrow_after_free_s = 600.0\nreclaim_deadline_ms = 2000.0\n'
                   'min_headroom_bytes = 0\n' + extra +
                   '[[governor.gpus]]\nindex = 0\ntotal_bytes = 17179869184\nreserve_bytes = 1073741824\n')
    return cfg, str(sock)


def _client(sock, role, **kw):
    if "reconnect_timeout_s" not in inspect.signature(GovernorClient).parameters:
        kw.pop("reconnect_timeout_s", None)
    return GovernorClient(sock, role, **kw)


def _trainer(sock, want):
    p = subprocess.Popen([sys.executable, "-c", TRAINER, sock, str(want)], stdout=subprocess.PIPE,
                         text=True, env=ENV)
    assert int(p.stdout.readline()) == want
    return p


def test_memory_a_previous_client_holds_is_not_granted_until_it_re_registers(tmp_path):
    cfg, sock = _config(tmp_path)
    d1 = DaemonProc(cfg)
    d1.wait_up(sock)
    trainer = _trainer(sock, 13 * GiB)
    d2 = None
    try:
        os.kill(trainer.pid, signal.SIGSTOP)      # it cannot re-register meanwhile
        d1.kill()
        d2 = DaemonProc(cfg)
        d2.wait_up(sock)
        inf = _client(sock, "inference", name="new-inf")
        with pytest.raises(GovernorError):        # the trainer's 13 GiB are not free
            inf.request({"op": "reserve", "kind": "kv_cache", "bytes": 13 * GiB})
        inf.request({"op": "reserve", "kind": "kv_cache", "bytes": 2 * GiB})
        os.kill(trainer.pid, signal.SIGCONT)      # it notices the restart and re-registers
        assert wait_until(lambda: any(c["name"] == "held" and c["quota"] == 13 * GiB
                                      for c in inf.stats()["gpus"][0]["clients"]), 10)
        r = inf.request({"op": "reserve", "kind": "kv_cache", "bytes": 6 * GiB})   # a reclaim, now
        assert r["granted"] == 6 * GiB and r["reclaimed"] == 6 * GiB
        s = inf.stats()["gpus"][0]
        assert s["training_bytes"] == 7 * GiB and s["inference_bytes"] == 8 * GiB
        trainer.kill(); trainer.wait()
        assert wait_until(lambda: inf.stats()["gpus"][0]["training_bytes"] == 0, 5)
        inf.close()
    finally:
        if trainer.poll() is None:
            os.kill(trainer.pid, signal.SIGCONT)
            trainer.kill(); trainer.wait()
        d1.kill()
        if d2 is not None:
            d2.stop()


def test_a_previous_clients_memory_returns_when_its_pid_is_gone(tmp_path):
    cfg, sock = _config(tmp_path)
    d1 = DaemonProc(cfg)
    d1.wait_up(sock)
    trainer = _trainer(sock, 13 * GiB)
    os.kill(trainer.pid, signal.SIGSTOP)
    d1.kill()
    d2 = DaemonProc(cfg)
    try:
        d2.wait_up(sock)
        inf = _client(sock, "inference", name="new-inf")
        s = inf.stats()["gpus"][0]
        assert s["free_bytes"] == 2 * GiB, s
        trainer.kill(); trainer.wait()
        assert wait_until(lambda: inf.stats()["gpus"][0]["free_bytes"] == 15 * GiB, 5)
        inf.request({"op": "reserve", "kind": "kv_cache", "bytes": 13 * GiB})
        inf.close()
    finally:
        if trainer.poll() is None:
            trainer.kill(); trainer.wait()
        d2.stop()


def test_an_inference_client_re_registers_with_what_it_holds(tmp_path):
    cfg, sock = _config(tmp_path)
    d1 = DaemonProc(cfg)
    d1.wait_up(sock)
    from hintfs.governor.inference import InferenceClient
    inf = InferenceClient(sock, name="holder")
    inf.reserve(4 * GiB, "weights")
    d1.kill()
    d2 = DaemonProc(cfg)
    try:
        d2.wait_up(sock)
        other = _client(sock, "inference", name="other")
        assert wait_until(lambda: any(c["name"] == "holder" and c["held"] == 4 * GiB
                                      for c in other.stats()["gpus"][0]["clients"]), 10)
        with pytest.raises(GovernorError):
            other.request({"op": "reserve", "kind": "weights", "bytes": 12 * GiB})
        inf.release(4 * GiB, "weights")            # served by the new instance
        other.request({"op": "reserve", "kind": "weights", "bytes": 12 * GiB})
        other.close()
        inf.close()
    finally:
        d2.stop()


def test_a_client_raises_governor_error_when_the_governor_is_gone(tmp_path):
    cfg, sock = _config(tmp_path)
    d1 = DaemonProc(cfg)
    d1.wait_up(sock)
    inf = _client(sock, "inference", name="orphan", reconnect_timeout_s=0.5)
    d1.kill()
    with pytest.raises(GovernorError):
        inf.request({"op": "reserve", "kind": "weights", "bytes": GiB})
    with pytest.raises(GovernorError):
        inf.request({"op": "stats"})
    inf.close()


def test_a_second_instance_of_the_same_config_is_refused_while_one_runs(tmp_path):
    cfg, sock = _config(tmp_path)
    d1 = DaemonProc(cfg)
    try:
        d1.wait_up(sock)
        d2 = DaemonProc(cfg)
        assert d2.p.wait(30) != 0
        assert "in use" in d2.p.stderr.read()
        d2.p.stderr.close()
        GovernorClient(sock, "inference").close()
    finally:
        d1.stop()


def test_an_elastic_trainer_follows_its_commands_through_a_restart(tmp_path):
    """The trainer's slot (the SlotReader ElasticTrainer holds) points at the new instance's
    block once its client registered again; a shrink of the new instance is handled and acked."""
    import threading

    import torch
    from torch import nn

    from hintfs.governor.training import governed_trainer
    from governor_simdevice import SimulatedMemory

    cfg, sock = _config(tmp_path)
    d1 = DaemonProc(cfg)
    d1.wait_up(sock)
    m = nn.Linear(4, 2)
    mem = SimulatedMemory(fixed=6 * GiB, per_sample=0)
    trainer, client = governed_trainer(sock, m, torch.optim.SGD(m.parameters(), lr=0.1), lambda o, y: o.sum(),
                                       device="cpu", probe=mem)
    assert client.initial_quota == 15 * GiB
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            trainer.poll()
            time.sleep(0.0005)
    t = threading.Thread(target=poll, daemon=True)
    t.start()
    d2 = None
    try:
        slot_before = client.slot
        d1.kill()
        d2 = DaemonProc(cfg)
        d2.wait_up(sock)
        assert wait_until(lambda: client.restarts == 1, 10)
        assert client.slot is slot_before and trainer.control is slot_before
        inf = _client(sock, "inference", name="after")
        r = inf.request({"op": "reserve", "kind": "kv_cache", "bytes": 8 * GiB})
        assert r["granted"] == 8 * GiB and r["reclaimed"] == 8 * GiB
        assert trainer.quota == 7 * GiB
        inf.close()
    finally:
        stop.set()
        t.join(5)
        client.close()
        d1.kill()
        if d2 is not None:
            d2.stop()

"""The governor's boundary (issue 41): nothing a client sends stops the daemon, only the users the
config allows take memory, and no client writes another's words or puts fds into another's
process. The attacks run as uid 65534 (governor_attack.py) against a daemon in this process; the
findings they answer are numbered as in the issue."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import wait_until
from hintfs.governor.client import GovernorClient, GovernorError
from hintfs.governor.inference import InferenceClient
from hintfs.governor.protocol import W_ACK, W_SEQ, W_USED
from governor_attack import NobodyProc, needs_nobody, nobody_script
from governor_simdevice import SimulatedTrainer
from mountconfig.governor import GiB
from tests.helpers.security import NOBODY

LOG = "hintfs.governor"


def allowed(make_daemon, **kw):
    """A daemon whose config lets uid 65534 in, so that its messages reach the parser."""
    return make_daemon(world=True, allowed_uids=[NOBODY], **kw)


def root_still_served(d, reserve: bool = True) -> None:
    """The daemon runs, and root's clients are served as before."""
    assert d.alive(), "the daemon stopped"
    c = GovernorClient(d.cfg.socket_path, "inference", name="root-after")
    try:
        if reserve:
            c.request({"op": "reserve", "kind": "weights", "bytes": GiB})
        s = c.stats()["gpus"][0]
        assert s["usable_bytes"] == 15 * GiB and s["by_kind"]["weights"] <= 15 * GiB
    finally:
        c.close()


def lines_about(caplog, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith(LOG) and needle in r.getMessage()]


# --- finding 1: no message stops the daemon ------------------------------------------------

DEEP = '{"op":"ping","x":' + "[" * 5000 + "]" * 5000 + "}"
ATTACKS = {
    "nested_5000_deep": ("", DEEP),
    "integer_of_5000_digits": ("inference", '{"op":"reserve","kind":"weights","bytes":' + "9" * 5000 + "}"),
    "usage_infinity": ("training", '{"op":"usage","kinds":{"weights":Infinity}}'),
    "drain_nan": ("training", '{"op":"usage","kinds":{},"drain_ms":NaN}'),
    "float_bytes": ("inference", '{"op":"reserve","kind":"weights","bytes":1e400}'),
    "not_utf8": ("", '{"op":"ping","x":"\udcff"}'),
    "line_of_1_MiB": ("", '{"op":"ping","x":"' + "a" * (1 << 20) + '"}'),
    "reserve_over_the_card": ("inference", '{"op":"reserve","kind":"weights","bytes":' + str(1 << 62) + "}"),
    "unknown_key": ("inference", '{"op":"reserve","kind":"weights","bytes":1,"evil":1}'),
}


@needs_nobody
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_bad_message_of_an_allowed_user_is_answered_and_dropped(make_daemon, caplog, name):
    caplog.set_level(logging.INFO, logger=LOG)
    d = allowed(make_daemon)
    role, raw = ATTACKS[name]
    r = nobody_script(f"""
        s = conn({d.cfg.socket_path!r})
        if {role!r}:
            reg = register(s, {role!r}, want_bytes=0) if {role!r} == "training" else register(s, {role!r})
            assert reg and reg.get("ok"), reg
        try:
            s.sendall({raw!r}.encode("utf-8", "surrogateescape") + b"\\n")
        except OSError:
            pass
        out({{"reply": recv_line(s), "closed": closed(s)}})
    """)
    assert isinstance(r["reply"], dict) and r["reply"]["ok"] is False, r
    assert r["closed"], "the bad client was not dropped"
    root_still_served(d)
    dropped = lines_about(caplog, f"uid {NOBODY}")
    assert len([m for m in dropped if "dropped" in m]) == 1, dropped


@needs_nobody
def test_two_huge_usage_reports_do_not_break_roots_stats(make_daemon):
    d = allowed(make_daemon)
    r = nobody_script(f"""
        res = []
        for i in range(2):
            s = conn({d.cfg.socket_path!r})
            register(s, "training", want_bytes=0)
            res.append(request(s, ('{{"op":"usage","kinds":{{"weights":' + "9" * 4300 + '}}}}\\n').encode()))
        out({{"replies": res}})
    """)
    assert all(isinstance(x, dict) and x["ok"] is False for x in r["replies"]), r
    root_still_served(d)
    assert d.call(lambda: d.ledger().by_kind()["weights"]) <= 15 * GiB


def test_usage_beyond_the_card_counts_as_the_card_at_most(make_daemon):
    d = make_daemon()
    t = GovernorClient(d.cfg.socket_path, "training", name="liar")
    t.request({"op": "usage", "kinds": {"weights": 100 * GiB, "activations": 100 * GiB}})
    kinds = d.call(lambda: d.ledger().by_kind())
    assert sum(kinds.values()) <= 15 * GiB and kinds["weights"] <= 15 * GiB
    t.close()
    root_still_served(d)


# --- finding 4: who may use it -------------------------------------------------------------

@needs_nobody
def test_a_user_the_config_does_not_allow_is_refused_at_connect(make_daemon, caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    d = make_daemon(world=True, allowed_uids=[4242])      # a socket any user may connect to...
    r = nobody_script(f"""
        res = []
        s = conn({d.cfg.socket_path!r})
        res.append([register(s, "inference"), closed(s)])
        for role, raw in {list(ATTACKS.values())!r}:      # every input of the issue, each on its own
            s = conn({d.cfg.socket_path!r})
            res.append([request(s, raw.encode("utf-8", "surrogateescape") + b"\\n"), closed(s)])
        out({{"results": res}})
    """)
    assert all(reply is None and gone for reply, gone in r["results"]), r   # ...but closes at once
    assert d.call(lambda: d.ledger().clients) == {}
    refused = lines_about(caplog, f"uid {NOBODY}")
    assert len(refused) == 1 and "refused" in refused[0], refused     # one line, not one per try
    root_still_served(d)


@needs_nobody
def test_by_default_only_the_daemons_user_may_connect(make_daemon):
    d = make_daemon(world=True)
    r = nobody_script(f"""
        import errno
        try:
            s = conn({d.cfg.socket_path!r})
            out({{"register": register(s, "inference", want_bytes=0)}})
        except OSError as e:
            out({{"errno": e.errno}})
    """)
    assert r.get("errno") == 13 or r.get("register") is None, r     # EACCES from the kernel
    assert d.call(lambda: d.ledger().clients) == {}
    root_still_served(d)


@needs_nobody
def test_per_uid_bounds_leave_room_for_other_users(make_daemon):
    d = allowed(make_daemon, max_clients=64, max_clients_per_uid=8, max_connections_per_uid=16)
    p = NobodyProc(f"""
        socks, ok = [], 0
        for i in range(64):
            try:
                s = conn({d.cfg.socket_path!r})
                r = register(s, "inference")
                ok += bool(r and r.get("ok"))
                socks.append(s)
            except OSError:
                pass
        out({{"registered": ok}})
        sys.stdin.read()
    """)
    try:
        assert p.line()["registered"] <= 8
        trainer = GovernorClient(d.cfg.socket_path, "training", name="root-trainer")
        assert trainer.initial_quota == 15 * GiB
        trainer.close()
        root_still_served(d)
    finally:
        p.stop()


@needs_nobody
def test_impossible_reserves_and_a_huge_drain_do_not_shrink_trainings_share(make_daemon):
    d = allowed(make_daemon, reclaim_deadline_ms=100)
    p = NobodyProc(f"""
        s = conn({d.cfg.socket_path!r})
        register(s, "inference")
        for i in range(100):
            if request(s, {{"op": "reserve", "kind": "weights", "bytes": 1 << 62}}) is None:
                s = conn({d.cfg.socket_path!r}); register(s, "inference")
        t = conn({d.cfg.socket_path!r})
        register(t, "training", want_bytes=0)
        out({{"drain": request(t, {{"op": "usage", "kinds": {{}}, "drain_ms": 999999}})}})
        sys.stdin.read()
    """)
    try:
        p.line()
        s = d.call(lambda: d.daemon._stats(d.daemon.gpus[0]))
        assert s["reclaim_estimate_ms"] <= 100
        assert s["headroom_bytes"] == 0
        trainer = GovernorClient(d.cfg.socket_path, "training", name="root-trainer")
        assert trainer.initial_quota == 15 * GiB
        trainer.close()
    finally:
        p.stop()


# --- finding 5: pages only from the trainer that owns them, only to its own user's client ----

@needs_nobody
def test_another_users_fds_never_reach_roots_inference_client(make_daemon):
    d = allowed(make_daemon)
    trainer = SimulatedTrainer(d.cfg.socket_path)                      # root's, holds 15 GiB
    p = NobodyProc(f"""
        s = conn({d.cfg.socket_path!r})
        register(s, "training", want_bytes=0)
        page = os.memfd_create("evil")
        os.ftruncate(page, 1 << 20)
        msg = enc({{"op": "pages", "seq": 1, "n": 3, "total": 3, "page_bytes": 1 << 30}})
        try:
            socket.send_fds(s, [msg], [page, page, page])
        except OSError:
            pass
        out({{"sent": True, "closed": closed(s, 1.0)}})
        sys.stdin.read()
    """)
    inf = InferenceClient(d.cfg.socket_path, name="root-inf", accept_pages=True)
    try:
        assert p.line()["closed"], "pages without a shrink were accepted"
        r = inf.reserve(4 * GiB, "kv_cache")
        assert r["granted"] == 4 * GiB
        fds, _ = inf.pop_pages()
        owners = [os.fstat(fd).st_uid for fd in fds]
        for fd in fds:
            os.close(fd)
        assert NOBODY not in owners, owners
    finally:
        p.stop()
        inf.close()
        trainer.close()


# --- finding 6: fds and connections are bounded ---------------------------------------------

def _fds_named(name: str) -> int:
    """fds of memfds called `name` open in this process (the daemon runs in it)."""
    n = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            n += f"memfd:{name}" in os.readlink(f"/proc/self/fd/{f}")
        except OSError:
            pass
    return n


@needs_nobody
def test_fds_on_messages_that_expect_none_are_closed_at_once(make_daemon):
    d = allowed(make_daemon)
    p = NobodyProc(f"""
        s = conn({d.cfg.socket_path!r})
        page = os.memfd_create("junk")
        sent = 0
        try:
            for i in range(8):
                socket.send_fds(s, [enc({{"op": "ping"}})], [page] * 250)
                sent += 250
                recv_line(s)
        except OSError:
            pass
        out({{"sent": sent, "closed": closed(s, 1.0)}})
        sys.stdin.read()
    """)
    try:
        r = p.line()
        assert r["sent"] >= 250 and r["closed"]
        assert wait_until(lambda: _fds_named("junk") == 0, 5), _fds_named("junk")
        root_still_served(d)
    finally:
        p.stop()


@needs_nobody
def test_idle_connections_of_one_user_are_bounded(make_daemon):
    d = allowed(make_daemon, max_connections_per_uid=16)
    p = NobodyProc(f"""
        socks = []
        for i in range(100):
            try:
                socks.append(conn({d.cfg.socket_path!r}))
            except OSError:
                pass
        time.sleep(1.0)
        out({{"open": sum(not closed(s, 0.05) for s in socks)}})
        sys.stdin.read()
    """)
    try:
        assert p.line()["open"] <= 16
        root_still_served(d)
    finally:
        p.stop()


# --- finding 7: no planted file or link is adopted, no client writes another's words ----------

def _old_shm_path(name: str) -> str:
    return f"/dev/shm/{name}-gpu0"


@needs_nobody
def test_a_planted_shm_file_is_never_adopted(make_daemon):
    name = f"hintfs-test-planted-{os.getpid()}"
    path = _old_shm_path(name)
    planted = nobody_script(f"""
        fd = os.open({path!r}, os.O_RDWR | os.O_CREAT, 0o666)
        os.fchmod(fd, 0o666)
        os.ftruncate(fd, 8 * (16 + 64 * 16))
        out({{"ok": True}})
    """)
    assert planted["ok"]
    try:
        d = make_daemon(world=True, shm_name=name, reclaim_deadline_ms=200)
        trainer = SimulatedTrainer(d.cfg.socket_path, stuck=True)     # holds 15 GiB, never acks
        forger = NobodyProc(f"""
            import mmap
            fd = os.open({path!r}, os.O_RDWR)
            m = mmap.mmap(fd, os.fstat(fd).st_size)
            words = memoryview(m).cast("Q")
            out({{"mapped": True}})
            end = time.monotonic() + 20
            while time.monotonic() < end:       # every slot: ACK = SEQ, USED = 0
                for slot in range(64):
                    base = 16 + slot * 16
                    words[base + {W_USED}] = 0
                    words[base + {W_ACK}] = words[base + {W_SEQ}]
                time.sleep(0.001)
        """)
        try:
            forger.line()
            inf = GovernorClient(d.cfg.socket_path, "inference", name="root-inf")
            with pytest.raises(GovernorError, match="deadline"):
                inf.request({"op": "reserve", "kind": "weights", "bytes": 10 * GiB})
            assert d.call(lambda: d.ledger().inference_bytes()) == 0
            inf.close()
        finally:
            forger.stop()
            trainer.close()
        st = os.lstat(path)
        assert st.st_uid == NOBODY      # the daemon never took the planted file over
    finally:
        os.unlink(path)


@needs_nobody
def test_a_planted_symlink_is_never_followed(make_daemon, tmp_path):
    name = f"hintfs-test-link-{os.getpid()}"
    path = _old_shm_path(name)
    precious = tmp_path / "precious"
    precious.write_bytes(b"root's data\n")
    precious.chmod(0o600)
    r = nobody_script(f"""
        os.symlink({str(precious)!r}, {path!r})
        out({{"ok": True}})
    """)
    assert r["ok"]
    try:
        d = make_daemon(world=True, shm_name=name)
        root_still_served(d)
        assert precious.read_bytes() == b"root's data\n"
        assert os.path.islink(path)
    finally:
        os.unlink(path)


def test_a_client_cannot_write_another_clients_words(make_daemon):
    d = make_daemon(reclaim_deadline_ms=200)
    trainer = SimulatedTrainer(d.cfg.socket_path, stuck=True)          # holds 15 GiB, never acks
    inf = GovernorClient(d.cfg.socket_path, "inference", name="forger")
    import threading
    done = threading.Event()

    def forge():
        slots = inf.block.slots                  # every slot this client can map
        while not done.is_set():
            for s in slots:
                s[W_USED] = 0
                s[W_ACK] = s[W_SEQ]
            time.sleep(0.0005)
    t = threading.Thread(target=forge, daemon=True)
    t.start()
    with pytest.raises(GovernorError, match="deadline"):
        inf.request({"op": "reserve", "kind": "weights", "bytes": 10 * GiB})
    assert d.call(lambda: d.ledger().inference_bytes()) == 0
    assert d.call(lambda: d.ledger().training_bytes()) == 15 * GiB
    done.set()
    t.join()
    inf.close(); trainer.close()


# --- finding 8: pids from the kernel only ---------------------------------------------------

TRAINER_PROC = """
import sys, time
from hintfs.governor.client import GovernorClient
c = GovernorClient(sys.argv[1], "training", name="stuck")
print(c.initial_quota, flush=True)
time.sleep(60)
"""


def _spawn(code: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env)


def test_a_pid_the_client_claims_is_never_signalled(make_daemon, monkeypatch):
    import hintfs.governor.daemon as gd
    victim = subprocess.Popen(["sleep", "60"])
    calls = [0]

    def first_gets_no_pid(real):      # SO_PEERCRED says pid 0: a peer in another pid namespace
        def cred(sock):
            calls[0] += 1
            v = real(sock)
            if calls[0] == 1:
                return 0 if v is None or isinstance(v, int) else (0,) + tuple(v[1:])
            return v
        return cred
    for fn in ("_peer_pid", "_peer_cred"):
        if hasattr(gd, fn):
            monkeypatch.setattr(gd, fn, first_gets_no_pid(getattr(gd, fn)))
    try:
        d = make_daemon(reclaim_deadline_ms=30, deadline_miss_action="stop_training")
        import json
        import socket
        s = socket.socket(socket.AF_UNIX)
        s.connect(d.cfg.socket_path)
        s.sendall(json.dumps({"op": "register", "role": "training", "gpu": 0, "pid": victim.pid,
                              "name": "liar"}).encode() + b"\n")
        s.recv(65536)
        inf = GovernorClient(d.cfg.socket_path, "inference", name="root-inf")
        try:
            inf.request({"op": "reserve", "kind": "weights", "bytes": 10 * GiB})
        except GovernorError:
            pass
        time.sleep(0.2)
        assert victim.poll() is None, "the daemon signalled a pid the client named"
        assert d.alive()
        inf.close(); s.close()
    finally:
        victim.kill(); victim.wait()


def test_a_signal_the_daemon_may_not_send_does_not_stop_it(make_daemon, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    d = make_daemon(reclaim_deadline_ms=30, deadline_miss_action="stop_training")
    p = _spawn(TRAINER_PROC, d.cfg.socket_path)
    assert int(p.stdout.readline()) > 0
    real_kill = os.kill

    def eperm_kill(pid, sig):
        if sig == signal.SIGKILL:
            raise PermissionError(1, "Operation not permitted")
        return real_kill(pid, sig)

    def eperm_pidfd(fd, sig, *a):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "kill", eperm_kill)
    monkeypatch.setattr(signal, "pidfd_send_signal", eperm_pidfd)
    try:
        inf = GovernorClient(d.cfg.socket_path, "inference", name="root-inf")
        with pytest.raises(GovernorError):
            inf.request({"op": "reserve", "kind": "weights", "bytes": 10 * GiB})
        assert d.alive()
        assert p.poll() is None
        assert lines_about(caplog, "stuck")
        inf.close()
        root_still_served(d, reserve=False)
    finally:
        monkeypatch.undo()
        p.kill(); p.wait()


# --- finding 9: one governor per GPU set; a socket_path that is no socket is kept -------------

def _second(d, **kw):
    from hintfs.governor.daemon import GovernorDaemon
    cfg = d.cfg.model_copy(update=kw)
    return GovernorDaemon(cfg)


def test_a_second_governor_with_the_same_shm_name_is_refused(make_daemon):
    from hintfs.governor.daemon import DaemonStartError
    d = make_daemon()
    other = _second(d, socket_path=d.cfg.socket_path + ".2")
    with pytest.raises(DaemonStartError, match="in use"):
        other.open()
    other.close()
    root_still_served(d)


def test_a_second_governor_of_the_same_gpu_is_refused(make_daemon):
    from hintfs.governor.daemon import DaemonStartError
    d = make_daemon()
    other = _second(d, socket_path=d.cfg.socket_path + ".2", shm_name=d.cfg.shm_name + "-b")
    with pytest.raises(DaemonStartError, match="in use"):
        other.open()
    other.close()
    root_still_served(d)


def test_a_socket_path_that_is_no_socket_is_an_error_and_kept(tmp_path):
    from hintfs.governor.daemon import DaemonStartError, GovernorDaemon
    from mountconfig.governor import GovernorConfig
    f = tmp_path / "notes.txt"
    f.write_text("keep me\n")
    d = GovernorDaemon(GovernorConfig(socket_path=str(f), shm_name=f"hintfs-test-nosock-{os.getpid()}",
                                      gpus=[{"total_bytes": 16 << 30}]))
    with pytest.raises(DaemonStartError, match="not a socket"):
        d.open()
    d.close()
    assert f.read_text() == "keep me\n"


@needs_nobody
def test_a_non_root_client_works_when_the_config_allows_it(make_daemon):
    d = allowed(make_daemon)
    p = NobodyProc(f"""
        import time
        from hintfs.governor.client import GovernorClient
        from hintfs.governor.protocol import ACK_RELEASED
        c = GovernorClient({d.cfg.socket_path!r}, "training", name="nobody-trainer")
        out({{"quota": c.initial_quota}})
        end = time.monotonic() + 20
        while time.monotonic() < end:
            cmd = c.slot.pending()
            if cmd is not None:
                c.slot.stamp_detect()
                c.slot.ack(cmd.seq, cmd.target, 1, 2, ACK_RELEASED)
                c.notify_ack(cmd.seq)
            time.sleep(0.001)
    """, repo=True)
    try:
        assert p.line()["quota"] == 15 * GiB
        inf = GovernorClient(d.cfg.socket_path, "inference", name="root-inf")
        r = inf.request({"op": "reserve", "kind": "weights", "bytes": 6 * GiB})
        assert r["granted"] == 6 * GiB and r["reclaimed"] == 6 * GiB
        inf.close()
    finally:
        p.stop()


# --- finding 10 ---------------------------------------------------------------------------

def test_a_card_too_large_is_one_config_line_and_leaves_nothing(tmp_path, capsys):
    from hintfs.governor.cli import main as cli_main
    sock = tmp_path / "gov.sock"
    name = f"hintfs-test-huge-{os.getpid()}"
    p = tmp_path / "c.toml"
    p.write_text(f'[governor]\nsocket_path = "{sock}"\nshm_name = "{name}"\n'
                 '[[governor.gpus]]\ntotal_bytes = 99999999999999999999\n')
    assert cli_main(str(p)) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "total_bytes" in err and "Traceback" not in err
    assert not sock.exists() and not os.path.exists(_old_shm_path(name))


def test_late_acks_count_and_a_slow_trainer_is_commanded_once(make_daemon):
    d = make_daemon(reclaim_deadline_ms=50, deadline_miss_action="reject")
    trainer = SimulatedTrainer(d.cfg.socket_path, step_s=0.2)          # a safe point every 200 ms
    seq0 = int(trainer.client.slot.slot[W_SEQ])
    inf = InferenceClient(d.cfg.socket_path, name="patient")
    r = inf.reserve(4 * GiB, "weights", timeout_s=10)
    assert r["granted"] == 4 * GiB
    assert int(trainer.client.slot.slot[W_SEQ]) - seq0 == 1        # one command, acked late
    inf.close(); trainer.close()


def test_the_deadline_warning_names_the_clients(make_daemon, caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    d = make_daemon(reclaim_deadline_ms=30, deadline_miss_action="reject")
    trainer = SimulatedTrainer(d.cfg.socket_path, stuck=True)
    inf = GovernorClient(d.cfg.socket_path, "inference", name="vit-server")
    with pytest.raises(GovernorError, match="deadline"):
        inf.request({"op": "reserve", "kind": "weights", "bytes": 4 * GiB})
    msgs = lines_about(caplog, "missed")
    assert msgs and "vit-server" in msgs[0] and "sim" in msgs[0], msgs
    inf.close(); trainer.close()


@needs_nobody
def test_members_of_the_socket_group_may_connect(make_daemon):
    d = make_daemon(world=True, socket_group=NOBODY)      # uid 65534's primary group
    st = os.stat(d.cfg.socket_path)
    assert st.st_gid == NOBODY and st.st_mode & 0o777 == 0o660
    r = nobody_script(f"""
        s = conn({d.cfg.socket_path!r})
        reg = register(s, "inference")
        out({{"ok": bool(reg and reg.get("ok")), "fds": len(FDS)}})
    """)
    assert r == {"ok": True, "fds": 1}, r      # registered, its block came as an fd

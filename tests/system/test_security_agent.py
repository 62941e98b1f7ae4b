"""Attack tests of issue 11 (the security boundary), run the way an outside tester would: as
another user (uid 65534 via setpriv) against real mounts and a real `hintfs agent`.

Each test fails on the code before the fix (ef76c40): the in-process agent listened on loopback
TCP without a token and joined any client path onto the store root; `hintfs agent` started
without a token; token files were read whatever their mode; the mount daemon re-executed
`python -m hintfs.cli` from the caller's cwd.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from hintfs.agent.client import AgentClient, AgentError
from hintfs.agent.rpc import PlanWindowReply
from tests.conftest import REPO, force_unmount, needs_fuse, wait_for
from tests.helpers.security import (NOBODY, AgentProc, WorldDir, agent_config, can_run_as_nobody,
                                    files_holding, free_port, nobody_connect_unix, nobody_flight_get,
                                    nobody_read_files)

needs_nobody = pytest.mark.skipif(not can_run_as_nobody(), reason="needs root, setpriv and a Python uid 65534 can run")
pytestmark = pytest.mark.timeout(120)

TOKEN = "s3cr3t-agent-token"


def _daemon_tree(pid: int) -> list[psutil.Process]:
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


# -- 1. a default mount's in-process agent ---------------------------------------------------------
@needs_fuse
@needs_nobody
def test_default_mount_agent_has_no_tcp_port_and_a_socket_only_its_user_can_reach(mount_factory):
    m = mount_factory()                    # [store] uri = "file://..." and nothing else
    (m.store / "f.bin").write_bytes(b"store data")
    tcp, unix = [], []
    for proc in _daemon_tree(m.pid):
        for c in proc.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN:
                tcp.append(c.laddr.port)
        for c in proc.net_connections(kind="unix"):
            if c.laddr and c.laddr.endswith("agent.sock"):
                unix.append(c.laddr)
    # Before the fix: a loopback TCP port without a token; uid 65534 read /etc/shadow through it.
    leaks = {port: nobody_flight_get(f"grpc://127.0.0.1:{port}",
                                     {"path": "/etc/shadow", "offset": 0, "length": 4096})
             for port in tcp}
    assert not any("data" in r for r in leaks.values()), f"uid {NOBODY} read /etc/shadow: {leaks}"
    assert tcp == [], f"the mount daemon listens on TCP ports {tcp}"
    assert len(set(unix)) == 1, f"expected one agent unix socket, found {unix}"
    sock = unix[0]
    assert AgentClient(f"grpc+unix://{sock}", timeout_s=10).ping()     # the mount's own user: yes
    assert (os.stat(os.path.dirname(sock)).st_mode & 0o777) == 0o700
    got = nobody_connect_unix(sock)
    assert got == {"errno": errno.EACCES}, f"uid {NOBODY} connecting to {sock}: {got}"
    got = nobody_flight_get(f"grpc+unix://{sock}", {"path": "f.bin", "offset": 0, "length": 100})
    assert "data" not in got, got
    assert (m.mnt / "f.bin").read_bytes() == b"store data"


# -- 2. a real `hintfs agent`: every path form through every RPC --------------------------------------
@pytest.fixture(scope="module")
def real_agent(tmp_path_factory):
    base = tmp_path_factory.mktemp("agent")
    store, outside = base / "store", base / "outside"
    (store / "sub").mkdir(parents=True)
    outside.mkdir()
    secret = b"OUTSIDE-SECRET-" + os.urandom(16).hex().encode()
    (outside / "secret").write_bytes(secret)
    (base / "x").write_bytes(secret)                         # what ../x names
    (store / "dirlink").symlink_to(outside)                   # a symlinked directory leading out
    (store / "rellink").symlink_to("../outside")              # the same, relative
    (store / "filelink").symlink_to(outside / "secret")       # a last component leading out
    (store / "ok.bin").write_bytes(b"inside")
    token = base / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    port = free_port()
    cfg = agent_config(base, store, port=port, data_dir=base / "tier", token_file=token)
    agent = AgentProc(cfg)
    client = AgentClient(f"grpc://127.0.0.1:{port}", token=TOKEN, timeout_s=15)
    try:
        agent.wait_up(client)
        yield {"client": client, "port": port, "secret": secret, "tier": base / "tier", "base": base}
    finally:
        agent.stop()


LEXICAL = ["/etc/shadow", "/", "../x", "sub/../../x", "a\0b", "", "."]
# Lexically fine, leading out through a symlink: EACCES (openat2 RESOLVE_BENEATH); a symlink as the
# last component is not followed at all (O_NOFOLLOW: ELOOP).
ESCAPES = {"dirlink/secret": {errno.EACCES}, "rellink/secret": {errno.EACCES},
           "filelink": {errno.EACCES, errno.ELOOP}}


def _rpcs(c: AgentClient):
    return {
        "read": lambda p: c.read(p, 0, 1 << 20),
        "sample": lambda p: c.sample(p, "image", "{}", 0),
        "samples_ready": lambda p: c.samples_ready([[p, "image", "{}", 0]]),
        "replicate": lambda p: c.replicate(p, 60),
        "drop": lambda p: c.drop(p),
        "tier_stat": lambda p: c.tier_stat(p),
        "has": lambda p: c.has(p, 1, 1),
        "plan_window": lambda p: c.plan_window([[p, 0]], [[p, "image", "{}", 0]]),
    }


# RPCs that only look at the agent's own catalog: for a path that is lexically fine but leads
# out through a symlink they may answer "nothing here" (they never open a file of the store).
# plan_window only queues transforms (each opens its file beneath the root later, and fails):
# what matters is that no sample of such a path is ever ready (checked after the loop).
CATALOG_ONLY = {"samples_ready": lambda got: got == [], "drop": lambda got: got == {"dropped": False},
                "tier_stat": lambda got: got == {"state": "absent"}, "has": lambda got: got is False,
                "plan_window": lambda got: isinstance(got, PlanWindowReply)}


def test_agent_refuses_every_path_form_on_every_rpc(real_agent):
    c, secret = real_agent["client"], real_agent["secret"]
    wrong = []
    for name, call in _rpcs(c).items():
        for path in [*LEXICAL, *ESCAPES]:
            try:
                got = call(path)
            except AgentError as err:
                want = {errno.EINVAL} if path in LEXICAL else ESCAPES[path]
                if err.errno not in want:
                    wrong.append(f"{name}({path!r}): errno {err.errno}, want {want}: {err}")
                continue
            if secret in repr(got).encode() or (isinstance(got, bytes) and secret in got):
                wrong.append(f"{name}({path!r}) RETURNED THE OUTSIDE FILE")
            elif path in LEXICAL or name not in CATALOG_ONLY or not CATALOG_ONLY[name](got):
                wrong.append(f"{name}({path!r}) accepted: {got!r:.200}")
    assert not wrong, "\n".join(wrong)
    # plan_window may have queued a transform of dirlink/secret: once none is queued or running, look.
    def transforms_idle() -> bool:
        samples = c.status().get("samples") or {}
        return not samples.get("running") and not samples.get("backlog")
    assert wait_for(transforms_idle, timeout=30)
    for path in ESCAPES:
        assert c.samples_ready([[path, "image", "{}", 0]]) == []
    assert files_holding(real_agent["tier"], secret) == [], "the outside file was copied into data_dir"
    assert c.read("ok.bin", 0, 100) == b"inside"           # the agent still serves the store


def test_agent_refuses_oversized_numbers_and_callers_without_the_token(real_agent):
    c, port = real_agent["client"], real_agent["port"]
    bad_tickets = [{"path": "ok.bin", "offset": 0, "length": (256 << 20) + 1},
                   {"path": "ok.bin", "offset": -1, "length": 10},
                   {"path": "ok.bin", "offset": 0, "length": float("nan")},
                   {"path": "ok.bin", "offset": 1e308, "length": 10},
                   {"path": "ok.bin", "offset": 0, "length": 10, "extra": 1}]
    for doc in bad_tickets:
        with pytest.raises(AgentError) as exc:
            c._ticket(json.dumps(doc).encode(), "read")       # (hostile JSON: by hand)
        assert exc.value.errno == errno.EINVAL, (doc, exc.value)
    bad_actions = [("replicate", {"path": "ok.bin", "ttl_s": 1e308}),
                   ("replicate", {"path": "ok.bin", "ttl_s": float("nan")}),
                   ("replicate", {"path": "ok.bin", "ttl_s": float("inf")}),
                   ("replicate", {"path": "ok.bin", "ttl_s": -1}),
                   ("replicate", {"path": "ok.bin", "importance": float("nan")}),
                   ("has", {"path": "ok.bin", "size": 1 << 64, "mtime_ns": 0}),
                   ("signal", {"job": "j", "severity": float("nan")}),
                   ("replicate", {"path": "ok.bin", "ttl_s": 10, "surprise": True}),
                   # a claim's holder: bounded, never empty, a string (hintfs/agent/rpc.py MAX_HOLDER)
                   ("replicate", {"path": "ok.bin", "ttl_s": 10, "holder": "h" * 257}),
                   ("replicate", {"path": "ok.bin", "ttl_s": 10, "holder": ""}),
                   ("drop", {"path": "ok.bin", "holder": "h" * 257}),
                   ("drop", {"path": "ok.bin", "holder": ""}),
                   ("drop", {"path": "ok.bin", "holder": 7}),
                   ("drop", {"path": "../ok.bin", "holder": "h"})]
    for kind, body in bad_actions:
        with pytest.raises(AgentError) as exc:
            c._action(kind, json.dumps(body).encode())
        assert exc.value.errno == errno.EINVAL, (kind, body, exc.value)
    assert c.status()["replicas"] == {}                    # none of them made a replica
    # Without the token, or with a wrong one: EACCES, and nothing read (the client runs as 65534
    # where setpriv is available, else as this user).
    for tok in (None, "wrong-" + TOKEN):
        with pytest.raises(AgentError) as exc:
            AgentClient(f"grpc://127.0.0.1:{port}", token=tok, timeout_s=10).read("ok.bin", 0, 10)
        assert exc.value.errno == errno.EACCES
        with pytest.raises(AgentError) as exc:       # nor release anyone's claim on a replica
            AgentClient(f"grpc://127.0.0.1:{port}", token=tok, timeout_s=10).drop("ok.bin", holder="m/j")
        assert exc.value.errno == errno.EACCES
    if can_run_as_nobody():
        got = nobody_flight_get(f"grpc://127.0.0.1:{port}", {"path": "ok.bin", "offset": 0, "length": 10})
        assert "data" not in got and "Unauthenticated" in got["error"], got


# -- 3. `hintfs agent` and token files ---------------------------------------------------------------
def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr[-3000:]}"
    return lines[0]


def test_agent_without_a_token_file_refuses_to_start(tmp_path):
    (tmp_path / "store").mkdir()
    port = free_port()
    cfg = agent_config(tmp_path, tmp_path / "store", port=port, data_dir=tmp_path / "tier")
    code, err = AgentProc(cfg).exited(timeout=20)
    assert code not in (None, 0), "hintfs agent started without a token"
    assert "token_file" in _one_line(err)


def test_agent_with_auth_none_starts_and_warns(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "f").write_bytes(b"open data")
    port = free_port()
    cfg = agent_config(tmp_path, tmp_path / "store", port=port, data_dir=tmp_path / "tier",
                       extra='auth = "none"\n')
    agent = AgentProc(cfg)
    try:
        c = AgentClient(f"grpc://127.0.0.1:{port}", timeout_s=10)
        agent.wait_up(c)
        assert c.read("f", 0, 100) == b"open data"
        log = (tmp_path / "agent.log").read_text()
        assert "WARNING" in log and "WITHOUT authentication" in log, log
    finally:
        agent.stop()


def _bad_token(tmp_path: Path, how: str) -> Path:
    tok = tmp_path / "bad.token"
    tok.write_text(TOKEN + "\n")
    if how == "mode 0644":
        tok.chmod(0o644)
    else:                                   # 0600 but another user's
        tok.chmod(0o600)
        os.chown(tok, NOBODY, NOBODY)
    return tok


BAD_TOKENS = [pytest.param("mode 0644", id="mode0644"),
              pytest.param("owned by 65534", id="other-owner",
                           marks=pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root"))]


@pytest.mark.parametrize("how", BAD_TOKENS)
def test_agent_refuses_a_token_file_others_can_read_or_own(tmp_path, how):
    (tmp_path / "store").mkdir()
    tok = _bad_token(tmp_path, how)
    port = free_port()
    cfg = agent_config(tmp_path, tmp_path / "store", port=port, data_dir=tmp_path / "tier", token_file=tok)
    code, err = AgentProc(cfg).exited(timeout=20)
    assert code not in (None, 0), f"hintfs agent started with a token file of {how}"
    line = _one_line(err)
    assert str(tok) in line and ("chmod 600" in line if how == "mode 0644" else "owned by uid" in line), line


@needs_fuse
@pytest.mark.parametrize("how", BAD_TOKENS)
def test_mount_refuses_an_agents_token_file_others_can_read_or_own(tmp_path, how):
    store, mnt = tmp_path / "store", tmp_path / "mnt"
    store.mkdir()
    mnt.mkdir()
    tok = _bad_token(tmp_path, how)
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'[store]\nuri = "file://{store}"\n[agents]\nlocations = ["grpc://127.0.0.1:{free_port()}"]\n'
                   f'token_file = "{tok}"\n[logging]\nfile = "{tmp_path / "m.log"}"\n')
    try:
        r = subprocess.run([sys.executable, "-m", "hintfs.cli", "mount", str(cfg), str(mnt)],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
        mounted = os.path.ismount(mnt)
    finally:
        force_unmount(mnt)
    assert r.returncode != 0 and not mounted, f"mounted with an [agents] token file of {how}"
    text = r.stderr + (tmp_path / "m.log").read_text() if (tmp_path / "m.log").exists() else r.stderr
    assert str(tok) in text and ("chmod 600" in text if how == "mode 0644" else "owned by uid" in text), text


# -- 4. the daemon does not import from the caller's cwd ---------------------------------------------
def _console_script(tmp_path: Path) -> list[str]:
    """`hintfs` as installed (sys.path[0] is the script's folder, never the cwd); in a checkout
    without its own venv, the same three lines pinned to this checkout."""
    script = REPO / ".venv" / "bin" / "hintfs"
    if script.exists() and Path(sys.executable).parent == script.parent:
        return [str(script)]
    d = tmp_path / "bin"
    d.mkdir()
    (d / "hintfs").write_text(f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
                              "from hintfs.cli import main\nsys.exit(main())\n")
    return [sys.executable, str(d / "hintfs")]


@needs_fuse
def test_mount_daemon_does_not_import_from_the_callers_cwd(tmp_path):
    store, mnt, cwd = tmp_path / "store", tmp_path / "mnt", tmp_path / "cwd"
    for d in (store, mnt, cwd):
        d.mkdir()
    (store / "f").write_bytes(b"ok")
    marker = tmp_path / "IMPORTED"
    (cwd / "typing.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\n"
                                   "raise ImportError('typing.py from the caller cwd was imported')\n")
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'[store]\nuri = "file://{store}"\n[agent]\ndata_dir = "{tmp_path / "rep"}"\n'
                   f'[logging]\nfile = "{tmp_path / "m.log"}"\n')
    hintfs = _console_script(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    try:
        r = subprocess.run(hintfs + ["mount", str(cfg), str(mnt)], cwd=cwd, env=env,
                           capture_output=True, text=True, timeout=60)
        ok = os.path.ismount(mnt) and (mnt / "f").read_bytes() == b"ok"
    finally:
        if os.path.ismount(mnt):
            subprocess.run(hintfs + ["umount", str(mnt)], cwd=cwd, env=env, capture_output=True, timeout=60)
        force_unmount(mnt)
    assert not marker.exists(), "the mount daemon imported typing.py from the caller's working directory"
    assert r.returncode == 0 and ok, r.stderr + ((tmp_path / "m.log").read_text() if (tmp_path / "m.log").exists() else "")


# -- 5. hints through a symlinked directory of the store ---------------------------------------------
@needs_fuse
def test_hint_through_a_symlinked_directory_copies_nothing(mount_factory, tmp_path):
    rep = tmp_path / "rep"
    m = mount_factory(extra=f'\n[agent]\ndata_dir = "{rep}"\n')
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = b"OUTSIDE-SECRET-" + os.urandom(16).hex().encode()
    (outside / "secret").write_bytes(secret)
    (m.store / "dirlink").symlink_to(outside)
    hints = m.mnt / ".hintfs" / "hints"
    try:
        with open(hints / "j", "w") as f:
            f.write(json.dumps({"files": {"dirlink/secret": 2}, "ttl_s": 60, "deadline_s": 5}))
        refused = None
    except OSError as err:            # refused at close: fine as well
        refused = err.errno

    def settled():
        try:
            st = json.loads((hints / "j.status").read_text() or "{}")
        except OSError:
            return True
        files = st.get("files", {})
        return not st or st.get("done") or st.get("ready") or any(v.get("error") for v in files.values())
    wait_for(settled, timeout=8)
    status = (hints / "j.status").read_text() if refused is None else ""
    doc = json.loads(status) if status.strip() else {}
    assert not doc.get("ready"), f"a hint through dirlink -> {outside} became ready: {doc}"
    assert all(v.get("ready", 0) == 0 for v in doc.get("files", {}).values()), doc
    assert files_holding(rep, secret) == [], "the outside file was copied into the replica folder"


# -- replicas keep store files private; a copy's source is never a private agent --------------------
@needs_nobody
def test_a_replica_of_a_private_file_is_not_readable_by_other_users():
    d = WorldDir()                      # data_dir where every user may look, like /var/lib/hintfs
    try:
        store = d.path / "store"
        store.mkdir(mode=0o700)
        store.chmod(0o700)
        private = b"PRIVATE-" + os.urandom(16).hex().encode()
        (store / "private.bin").write_bytes(private)
        (store / "private.bin").chmod(0o600)
        token = d.path / "token"
        token.write_text(TOKEN)
        token.chmod(0o600)
        port = free_port()
        cfg = agent_config(d.path, store, port=port, data_dir=d.path / "tier", token_file=token)
        agent = AgentProc(cfg)
        try:
            c = AgentClient(f"grpc://127.0.0.1:{port}", token=TOKEN, timeout_s=15)
            agent.wait_up(c)
            c.replicate("private.bin", 60)
            copies = files_holding(d.path / "tier", private)
            assert copies, "no replica was made"
            got = nobody_read_files(copies)
        finally:
            agent.stop()
        leaked = [p for p, v in got.items() if private.decode() in v]
        assert not leaked, f"uid {NOBODY} read the replica of a 0600 store file: {leaked}"
    finally:
        d.close()


@needs_fuse
def test_replicate_source_cannot_reach_a_mounts_private_agent(mount_factory, real_agent, tmp_path):
    m = mount_factory(extra=f'\n[agent]\ndata_dir = "{tmp_path / "rep"}"\n')
    private = b"MOUNT-PRIVATE-" + os.urandom(16).hex().encode()
    (m.store / "p.bin").write_bytes(private)
    (m.mnt / ".hintfs" / "hints" / "j").write_text(json.dumps({"files": {"p.bin": 1}, "ttl_s": 60}))
    assert wait_for(lambda: json.loads((m.mnt / ".hintfs" / "hints" / "j.status").read_text() or "{}")
                    .get("ready"), timeout=10)
    sock = next(c.laddr for c in psutil.Process(m.pid).net_connections(kind="unix")
                if c.laddr and c.laddr.endswith("agent.sock"))
    c = real_agent["client"]             # a token holder of the standalone agent (another store)
    # ...who may write that store: a decoy of the same name, size and mtime (the agent checks its
    # own store's version around a copy from a source)
    decoy = real_agent["base"] / "store" / "p.bin"
    decoy.write_bytes(b"\0" * len(private))
    st = (m.store / "p.bin").stat()
    os.utime(decoy, ns=(st.st_atime_ns, st.st_mtime_ns))
    try:
        c.replicate("p.bin", 60, source=f"grpc+unix://{sock}")
        got = c.read("p.bin", 0, 1 << 20, replica_only=True)
    except AgentError:
        got = b""
    finally:
        try:
            c.drop("p.bin")
        except AgentError:
            pass
        decoy.unlink()
    assert private not in got, "the standalone agent copied a mount's private replica for its client"

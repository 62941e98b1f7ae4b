"""Daemons never import from the caller's folder (issue 34, finding 2).

uid 65534 plants `multiprocessing.py`, `trio.py` and `pyarrow.py` (what the daemons' child
interpreters and the daemons themselves import first) in a folder every user may write. Root
then starts `hintfs agent`, `hintfs mount --foreground` and `hintfs governor` through the
installed console script from that folder (and with PYTHONPATH naming it), and makes them start
their children: a `.tensor` transform (the pool's forkserver, resource tracker and worker) and
the stream sender. None of the planted modules may run, and the daemon and every process it
started run isolated (`python -I`) in `/`.

Before the fix the forkserver (`python -c 'from multiprocessing.forkserver import main ...'`,
so `sys.path[0]` was the cwd) imported the planted `multiprocessing.py` as root at the first
transform, and PYTHONPATH reached every daemon."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import force_unmount, needs_fuse, wait_for
from tests.helpers.security import NOBODY, WorldDir, as_nobody, can_run_as_nobody, free_port

needs_nobody = pytest.mark.skipif(not can_run_as_nobody(), reason="needs root, setpriv and a Python uid 65534 can run")
pytestmark = [needs_nobody, pytest.mark.timeout(120)]
pytest.importorskip("av")

PLANTED = ("multiprocessing", "trio", "pyarrow")
PARAMS = {"size": 32}
RULES = f'''
[transform_load]
workers = 1
fallback = false

[[transforms]]
glob = "imgs/*.jpg"
kind = "image"
params = {json.dumps(PARAMS).replace('":', '" =')}
'''


def console_script() -> list[str]:
    script = Path(sys.executable).parent / "hintfs"
    if not script.exists():
        pytest.skip("needs the installed `hintfs` console script beside this interpreter")
    return [str(script)]


@pytest.fixture
def planted():
    """A 0777 folder where uid 65534 planted modules that, when imported, leave PWNED.<name>.<uid>
    there and fail the import."""
    d = WorldDir()
    d.path.chmod(0o777)
    try:
        got = as_nobody(f"""
            import json, os
            folder = {str(d.path)!r}
            for name in {PLANTED!r}:
                with open(os.path.join(folder, name + ".py"), "w") as f:
                    f.write("import os\\n"
                            f"open(os.path.join({{folder!r}}, 'PWNED.{{name}}.%d' % os.getuid()), 'w').close()\\n"
                            "raise ImportError('planted module imported')\\n")
            print(json.dumps({{"planted": sorted(os.listdir(folder))}}))
        """)
        assert got["planted"] == sorted(f"{n}.py" for n in PLANTED)
        assert all((d.path / f"{n}.py").stat().st_uid == NOBODY for n in PLANTED)
        yield d.path
    finally:
        d.close()


def pwned(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("PWNED."))


def env_for(folder: Path, pythonpath: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    if pythonpath:
        env["PYTHONPATH"] = str(folder)
    return env


def not_isolated(pid: int) -> list[str]:
    """The processes of `pid`'s tree that are not an isolated Python in `/`: "pid: why"."""
    out = []
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            cmd, cwd = p.cmdline(), p.cwd()
        except psutil.NoSuchProcess:
            continue
        if cwd != "/":
            out.append(f"{p.pid}: cwd {cwd} ({' '.join(cmd)[:120]})")
        if cmd and "python" in os.path.basename(cmd[0]) and "-I" not in cmd[1:3]:
            out.append(f"{p.pid}: not -I ({' '.join(cmd)[:120]})")
    return out


def stop(p: subprocess.Popen) -> str:
    """Stop a daemon we started (by its pid); its stderr."""
    if p.poll() is None:
        os.kill(p.pid, signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
    return p.stderr.read() if p.stderr else ""


def jpegs(store: Path, n: int = 2) -> None:
    from tests.helpers.media import jpeg_file
    (store / "imgs").mkdir(parents=True)
    for i in range(n):
        jpeg_file(store / "imgs" / f"{i}.jpg", seed=i)


@pytest.mark.parametrize("pythonpath", [False, True], ids=["cwd", "cwd+PYTHONPATH"])
def test_agent_and_its_transform_pool_never_import_from_the_callers_folder(planted, tmp_path, pythonpath):
    from hintfs.agent.client import AgentClient, AgentError
    from hintfs.transforms.container import decode

    store = tmp_path / "store"
    jpegs(store)
    port = free_port()
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[store]\nuri = "file://{store}"\n[agent]\nlocation = "grpc://127.0.0.1:{port}"\n'
                   f'data_dir = "{tmp_path / "rep"}"\nauth = "none"\n{RULES}\n'
                   f'[logging]\nfile = "{tmp_path / "agent.log"}"\n')
    # a relative config path: the daemon resolves it before it leaves the caller's folder
    rel = os.path.relpath(cfg, planted)
    p = subprocess.Popen(console_script() + ["agent", rel], cwd=planted, env=env_for(planted, pythonpath),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    client = AgentClient(f"grpc://127.0.0.1:{port}", timeout_s=30)
    try:
        def up() -> bool:
            if p.poll() is not None:
                return True
            try:
                return bool(client.ping())
            except AgentError:
                return False
        assert wait_for(up, timeout=60, interval=0.1) and p.poll() is None, stop(p)
        try:
            data = client.sample("imgs/0.jpg", "image", json.dumps(PARAMS), 1, allow_raw=False)
            made = decode(data)[0].mode
        except OSError as err:
            made = f"error: {err}"
        tree = not_isolated(p.pid)
        cmdline = psutil.Process(p.pid).cmdline()
    finally:
        err = stop(p)
        client.close()
    assert pwned(planted) == [], f"modules planted by uid {NOBODY} ran: {pwned(planted)}"
    assert made == "tensor", (made, err[-2000:])
    assert tree == [], tree
    assert str(cfg) in cmdline, cmdline          # (what `ps` shows is the path it reads)


@needs_fuse
def test_foreground_mount_its_transform_pool_and_stream_sender_never_import_from_the_callers_folder(
        planted, tmp_path):
    from tests.system.test_stream_mount import stream_toml

    store, mnt = tmp_path / "store", tmp_path / "mnt"
    jpegs(store)
    mnt.mkdir()
    log = tmp_path / "m.log"
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'[store]\nuri = "file://{store}"\n[agent]\ndata_dir = "{tmp_path / "rep"}"\n{RULES}'
                   f'{stream_toml(f"grpc://127.0.0.1:{free_port()}")}'
                   f'[logging]\nfile = "{log}"\n')
    p = subprocess.Popen(console_script() + ["--debug", "mount", str(cfg), os.path.relpath(mnt, planted), "-f"],
                         cwd=planted, env=env_for(planted, False), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        def up() -> bool:
            return p.poll() is not None or (mnt / ".hintfs" / "stats").exists()
        assert wait_for(up, timeout=60, interval=0.1) and p.poll() is None, stop(p)
        try:
            made = len((mnt / "imgs" / "0.jpg.tensor").read_bytes())
        except OSError as err:
            made = f"error: {err}"

        def sender() -> bool:
            return any("fusefs.stream.sender" in " ".join(c.cmdline()) for c in psutil.Process(p.pid).children())
        has_sender = wait_for(sender, timeout=10)
        tree = not_isolated(p.pid)
        cmdline = psutil.Process(p.pid).cmdline()
        # `hintfs umount` knows it for the mount's daemon (hintfs.common.mounts: its command line names
        # the mountpoint) and stops it
        umount = subprocess.run(console_script() + ["umount", str(mnt)], capture_output=True, text=True, timeout=60)
        p.wait(30)
    finally:
        err = stop(p)
        force_unmount(mnt)
    assert pwned(planted) == [], f"modules planted by uid {NOBODY} ran: {pwned(planted)}"
    assert isinstance(made, int) and made > 0, (made, err[-2000:], log.read_text()[-2000:] if log.exists() else "")
    assert has_sender
    assert tree == [], tree
    assert cmdline[-5:] == ["mount", str(cfg), str(mnt), "--foreground", "--debug"], cmdline
    assert umount.returncode == 0 and umount.stderr == "", umount.stderr


@needs_fuse
def test_background_mount_and_umount_never_import_from_the_callers_folder_or_pythonpath(planted, tmp_path):
    """`hintfs mount` and `hintfs umount` run as root too, though they serve nothing: they run
    isolated from their first import on, as the daemon they start does."""
    store, mnt = tmp_path / "store", tmp_path / "mnt"
    jpegs(store)
    mnt.mkdir()
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'[store]\nuri = "file://{store}"\n[agent]\ndata_dir = "{tmp_path / "rep"}"\n{RULES}'
                   f'[logging]\nfile = "{tmp_path / "m.log"}"\n')
    env = env_for(planted, True)
    hintfs = console_script()
    try:
        r = subprocess.run(hintfs + ["mount", os.path.relpath(cfg, planted), os.path.relpath(mnt, planted)],
                           cwd=planted, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        made = len((mnt / "imgs" / "0.jpg.tensor").read_bytes())
        tree = not_isolated(json.loads((mnt / ".hintfs" / "stats").read_text())["pid"])
        r = subprocess.run(hintfs + ["umount", os.path.relpath(mnt, planted)], cwd=planted, env=env,
                           capture_output=True, text=True, timeout=60)
    finally:
        force_unmount(mnt)
    assert pwned(planted) == [], f"modules planted by uid {NOBODY} ran: {pwned(planted)}"
    assert r.returncode == 0, r.stderr
    assert made > 0 and tree == [], tree


def test_governor_never_imports_from_the_callers_folder_or_pythonpath(planted, tmp_path):
    sock = tmp_path / "gov.sock"
    cfg = tmp_path / "gov.toml"
    cfg.write_text(f'[governor]\nsocket_path = "{sock}"\nshm_name = "hintfs-isolated-{os.getpid()}"\n'
                   '[[governor.gpus]]\nindex = 0\ntotal_bytes = 17179869184\nreserve_bytes = 1073741824\n')
    p = subprocess.Popen(console_script() + ["governor", os.path.relpath(cfg, planted)], cwd=planted,
                         env=env_for(planted, True), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: p.poll() is not None or sock.exists(), timeout=60, interval=0.1)
        assert p.poll() is None, stop(p)
        time.sleep(0.2)
        tree = not_isolated(p.pid)
    finally:
        err = stop(p)
    assert pwned(planted) == [], f"modules planted by uid {NOBODY} ran: {pwned(planted)}"
    assert tree == [], (tree, err[-2000:])

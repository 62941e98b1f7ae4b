"""Issue 11, control files: who may write them, what a refused write leaves, and that no control
write can stall the mount. The attacks run as uid 65534 (`setpriv`) against a real mount whose
folders every user can reach (pytest's own tmp folder is private to root)."""
from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import force_unmount, needs_fuse, run_hintfs, wait_for, write_config

pytestmark = needs_fuse
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def as_nobody(script: str, timeout: float = 20) -> subprocess.CompletedProcess:
    """`sh -c script` as uid/gid 65534."""
    return subprocess.run(NOBODY + ["sh", "-c", script], capture_output=True, text=True, timeout=timeout)


def write_as_nobody(path: Path, text: str) -> subprocess.CompletedProcess:
    """Write `text` to `path` as uid 65534 with a writer that reports a failed close (dd does;
    a shell redirection does not)."""
    return subprocess.run(NOBODY + ["dd", f"of={path}", "status=none"], input=text, capture_output=True,
                          text=True, timeout=20)


@pytest.fixture
def shared_mount():
    base = Path(tempfile.mkdtemp(prefix="hintfs-sec-"))
    base.chmod(0o755)
    store, mnt = base / "store", base / "mnt"
    store.mkdir()
    mnt.mkdir()
    store.chmod(0o755)
    outside = base / "outside"
    outside.mkdir(mode=0o700)
    (outside / "secret").write_text("top secret\n")
    (store / "dirlink").symlink_to(outside)
    (store / "public.bin").write_bytes(b"p" * 4096)
    (store / "public.bin").chmod(0o644)
    (store / "private.bin").write_bytes(b"s" * 4096)
    (store / "private.bin").chmod(0o600)
    (store / "privdir").mkdir(mode=0o700)          # a folder only root may search
    (store / "privdir" / "notes.txt").write_bytes(b"n" * 4096)
    (store / "privdir" / "notes.txt").chmod(0o644)
    cfg = write_config(base / "hintfs.toml", f"file://{store}",
                       f'\n[agent]\ndata_dir = "{base / "rep"}"\n', base / "mount.log")
    r = run_hintfs("mount", cfg, mnt)
    assert r.returncode == 0, r.stderr
    try:
        yield store, mnt, base
    finally:
        run_hintfs("umount", mnt)
        force_unmount(mnt)
        shutil.rmtree(base, ignore_errors=True)


def test_control_modes_owner_and_creator(shared_mount):
    _store, mnt, _base = shared_mount
    ctl = mnt / ".hintfs"
    for d in ("hints", "plans", "signals", "reads"):
        st = os.stat(ctl / d)
        assert stat.S_IMODE(st.st_mode) == 0o1777 and st.st_uid == os.getuid()
    assert stat.S_IMODE(os.stat(ctl / "loglevel").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(ctl / "stats").st_mode) == 0o444
    # Another user may not change the log level, nor rewrite a job file root created.
    r = as_nobody(f"""printf '{{"level": "DEBUG"}}' > {ctl}/loglevel""")
    assert r.returncode != 0 and "Permission denied" in r.stderr
    (ctl / "hints" / "rootjob").write_text(json.dumps({"files": {"public.bin": 2}}))
    assert os.stat(ctl / "hints" / "rootjob").st_uid == os.getuid()
    r = as_nobody(f"""printf '{{"files": {{"private.bin": 9}}}}' > {ctl}/hints/rootjob""")
    assert r.returncode != 0 and "Permission denied" in r.stderr
    assert json.loads((ctl / "hints" / "rootjob").read_text())["files"] == {"public.bin": 2}
    # A job file another user creates is theirs.
    r = as_nobody(f"""printf '{{"files": {{"public.bin": 2}}}}' > {ctl}/hints/mine && stat -c %u {ctl}/hints/mine""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "65534"


def test_unprivileged_writer_may_only_name_files_it_can_read(shared_mount):
    _store, mnt, _base = shared_mount
    ctl = mnt / ".hintfs"
    for name, doc, reason in [
            ("a", {"files": {"private.bin": 4}}, "permission denied for uid 65534"),
            ("b", {"files": {"dirlink/secret": 4}}, "permission denied for uid 65534"),
            ("c", {"files": {"../outside/secret": 4}}, "contains '..'"),
            # a readable file in a folder the user may not search (finding 8 of issue 34) ...
            ("d", {"files": {"privdir/notes.txt": 4}}, "permission denied for uid 65534"),
            # ... is refused in the same words as a file that does not exist: no existence oracle
            ("e", {"files": {"privdir/nothing.txt": 4}}, "permission denied for uid 65534")]:
        r = write_as_nobody(ctl / "hints" / name, json.dumps(doc))
        assert r.returncode != 0, name
        assert reason in (ctl / "hints" / f"{name}.error").read_text(), name
        assert (ctl / "hints" / f"{name}.status").read_text().strip() in ("", "{}")
    assert (ctl / "hints" / "d.error").read_text().replace("notes", "nothing") == \
        (ctl / "hints" / "e.error").read_text()
    # Nothing of the outside file, nor of the private folder, reached the agent's replica folder.
    for root, _dirs, files in os.walk(_base / "rep"):
        for f in files:
            data = Path(root, f).read_bytes()
            assert b"top secret" not in data and data != b"n" * 4096
    # Plans and signals follow the same rule.
    r = write_as_nobody(ctl / "plans" / "p", '{"plan": "private.bin", "step": 0}')
    assert r.returncode != 0 and "permission denied" in (ctl / "plans" / "p.error").read_text()
    r = write_as_nobody(ctl / "signals" / "s", '{"path": "dirlink/x", "kind": "loss_spike"}')
    assert r.returncode != 0 and "permission denied" in (ctl / "signals" / "s.error").read_text()
    r = write_as_nobody(ctl / "signals" / "t", '{"path": "privdir", "kind": "loss_spike"}')
    assert r.returncode != 0 and "permission denied" in (ctl / "signals" / "t.error").read_text()
    # Read hints too: another user may not learn, or make a tier fetch, ranges of files it cannot read.
    r = write_as_nobody(ctl / "reads" / "r", '{"ranges": [["private.bin", 0, 10]]}')
    assert r.returncode != 0 and "permission denied" in (ctl / "reads" / "r.error").read_text()
    r = write_as_nobody(ctl / "reads" / "q", '{"ranges": [["dirlink/secret", 0, 10]]}')
    assert r.returncode != 0 and "permission denied" in (ctl / "reads" / "q.error").read_text()
    r = write_as_nobody(ctl / "reads" / "n", '{"ranges": [["privdir/notes.txt", 0, 10]]}')
    assert r.returncode != 0 and "permission denied" in (ctl / "reads" / "n.error").read_text()
    # The plan is checked; so is every sample it names, when it is registered (test_tensor_access.py).


def test_failed_write_applies_nothing_and_each_refusal_replaces_the_reason(shared_mount):
    _store, mnt, _base = shared_mount
    hints = mnt / ".hintfs" / "hints"
    # A valid document followed by 16 MiB of padding: write() fails with EFBIG; nothing applies.
    fd = os.open(hints / "big", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, json.dumps({"files": {"public.bin": 2}}).encode())
        with pytest.raises(OSError) as exc:
            pad = b" " * (1 << 20)
            for _ in range(17):
                os.write(fd, pad)
        assert exc.value.errno == errno.EFBIG
    finally:
        with pytest.raises(OSError) as exc:
            os.close(fd)
        assert exc.value.errno == errno.EINVAL
    assert (hints / "big.status").read_text().strip() in ("", "{}")
    assert "EFBIG" in (hints / "big.error").read_text()
    # Each refusal replaces the previous reason; a success clears it.
    for doc, reason in [("{x", "invalid JSON"), ('{"files": {"a": 1' + "0" * 400 + "}}", "expected_readers"),
                        ("[" * 5000 + "]" * 5000, "nested deeper")]:
        with pytest.raises(OSError) as exc:
            (hints / "j").write_text(doc)
        assert exc.value.errno == errno.EINVAL
        assert reason in (hints / "j.error").read_text()
    (hints / "j").write_text(json.dumps({"files": {"public.bin": 1}}))
    assert (hints / "j.error").read_text() == ""


def test_no_plan_update_can_stall_the_mount(shared_mount):
    import pyarrow as pa
    import pyarrow.parquet as pq
    store, mnt, _base = shared_mount
    n = 2000
    pq.write_table(pa.table({"step": list(range(n)), "rank": [0] * n, "slot": [0] * n,
                             "sample": ["public.bin"] * n, "aug_seed": list(range(n)),
                             "est_cost_ms": [1.0] * n}), store / "plan.parquet")
    ctl = mnt / ".hintfs" / "plans" / "train"
    ctl.write_text(json.dumps({"plan": "plan.parquet", "step": 0}))
    slowest = [0.0]
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            t0 = time.monotonic()
            os.stat(mnt / "public.bin")
            os.listdir(mnt)
            slowest[0] = max(slowest[0], time.monotonic() - t0)
            time.sleep(0.02)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    try:
        for doc in ({"step": 0, "lookahead": 100000000000000}, {"step": 10 ** 30},
                    {"step": 0, "lookahead": 4096}, {"step": 1999, "lookahead": 4096}):
            try:
                ctl.write_text(json.dumps(doc))
            except OSError as err:
                assert err.errno == errno.EINVAL
        with pytest.raises(OSError):
            ctl.write_text(json.dumps({"step": 0, "lookahead": 100000000000000}))
        assert "lookahead" in (mnt / ".hintfs" / "plans" / "train.error").read_text()
        time.sleep(0.5)
    finally:
        stop.set()
        t.join(5)
    # (a stall is a window of 10^14 samples computed in the loop: minutes; 5 s is no latency claim)
    assert slowest[0] < 5.0, f"the mount took {slowest[0]:.2f} s to answer a stat"
    assert wait_for(lambda: json.loads(ctl.read_text())["step"] == 1999, timeout=5)

"""Issue 34, the mount's side of "nothing widened": a `.tensor` grants exactly what its source
grants (finding 1); job files are bounded per user and removable by their owner (finding 7); the
journal's and the control folder's names are reserved (finding 9); a plan's samples are checked
against who registered it (finding 8); an empty control document is refused (finding 12). Every
attack runs as uid 65534 (`setpriv`) against a real mount in folders every user may traverse."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import needs_fuse, wait_for
from tests.helpers.media import jpeg_file
from tests.helpers.mounts import world_mount

pytestmark = needs_fuse
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]

RULES = '''
[[transforms]]
glob = "imgs/*.jpg"
kind = "image"
params = { size = 32, crop = [24, 24], normalize = true }
'''


def as_nobody(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(NOBODY + ["sh", "-c", script], capture_output=True, text=True, timeout=30)


def as_root(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)


def py_as_nobody(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(NOBODY + [sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=30)


@pytest.fixture
def world():
    """A mount over a store whose root is 1777 (any user may create there), in a folder every user
    may traverse, with image transforms; unmounted and removed at the end."""
    def setup(base: Path) -> str:
        store = base / "store"
        store.chmod(0o1777)
        (store / "imgs").mkdir(mode=0o755)
        jpeg_file(store / "imgs" / "open.jpg", seed=1)
        jpeg_file(store / "imgs" / "secret.jpg", seed=2)
        (store / "imgs" / "secret.jpg").chmod(0o600)
        (store / "imgs" / "open.jpg").chmod(0o644)
        (store / "hidden").mkdir(mode=0o700)
        jpeg_file(store / "hidden" / "h.jpg", seed=3)
        (store / "hidden" / "h.jpg").chmod(0o644)
        (store / "data.txt").write_text("data\n")
        (store / "data.txt").chmod(0o644)
        return f'\n[agent]\ndata_dir = "{base / "rep"}"\n' + RULES.replace("imgs/*.jpg", "*/*.jpg")

    with world_mount(setup, prefix="hintfs-sec-") as m:
        yield m


def test_a_tensor_grants_exactly_what_its_source_grants(world):
    m = world
    for name, mode in (("open", 0o444), ("secret", 0o400)):
        st = os.stat(m.mnt / "imgs" / f"{name}.jpg.tensor")
        assert (st.st_uid, st.st_mode & 0o7777) == (0, mode), name
    # root reads both; another user reads the tensor of the file it may read, not the other
    assert len((m.mnt / "imgs" / "secret.jpg.tensor").read_bytes()) > 0
    r = as_nobody(f"cat {m.mnt}/imgs/open.jpg.tensor | wc -c")
    assert r.returncode == 0 and int(r.stdout) > 0, r.stderr
    r = as_nobody(f"cat {m.mnt}/imgs/secret.jpg.tensor")
    assert r.returncode != 0 and "Permission denied" in r.stderr
    # ... nor through a folder it may not search (the kernel stops it at `hidden`)
    r = as_nobody(f"cat {m.mnt}/hidden/h.jpg.tensor")
    assert r.returncode != 0 and "Permission denied" in r.stderr
    # The mode follows the source (no cached 0444): chmod the source, the tensor follows.
    os.chmod(m.store / "imgs" / "open.jpg", 0o600)
    r = as_nobody(f"cat {m.mnt}/imgs/open.jpg.tensor")
    assert r.returncode != 0 and "Permission denied" in r.stderr


def test_job_files_are_bounded_per_user_and_removable_by_their_owner(world):
    hints = world.mnt / ".hintfs" / "hints"
    doc = json.dumps({"files": {"data.txt": 2}})
    # uid 65534 creates job files until its own bound (64): the next is ENOSPC for it alone.
    r = py_as_nobody(f"""
import errno, os
made = 0
for i in range(80):
    try:
        with open({str(hints)!r} + f"/n{{i}}", "w") as f:
            f.write({doc!r})
        made += 1
    except OSError as e:
        print(made, e.errno)
        break
""")
    assert r.stdout.split() == ["64", str(errno.ENOSPC)], (r.stdout, r.stderr)
    assert "has 64 job files" in (world.log.read_text())
    # root (the mount's owner) still registers jobs
    (hints / "rootjob").write_text(doc)
    assert world.stats()["usage"]["job_files_by_uid"]["65534"]["hints"] == 64
    # ... and the replicas its hints made are counted as its own
    assert wait_for(lambda: world.stats()["usage"]["replicas_by_uid"].get("65534", 0) >= 64, 20), \
        world.stats()["usage"]
    # another user may not remove root's job file; the owner removes its own, and may make one again
    r = as_nobody(f"rm -f {hints}/rootjob")
    assert r.returncode != 0
    assert (hints / "rootjob").exists()
    r = as_nobody(f"rm {hints}/n0 {hints}/n1 && printf '%s' '{doc}' > {hints}/again && ls {hints}")
    assert r.returncode == 0, r.stderr
    names = r.stdout.split()
    assert "n0" not in names and "n0.status" not in names and "again" in names
    assert world.stats()["usage"]["job_files_by_uid"]["65534"]["hints"] == 63
    # root may remove anyone's
    os.unlink(hints / "n2")
    assert not (hints / "n2").exists()


def test_journal_and_control_names_are_reserved(world):
    m = world
    (m.store / ".hintfs-journal").mkdir()      # a journal of another mount, in the store
    (m.store / ".hintfs-journal" / "rec").write_text("")
    for who in (as_nobody, as_root):
        for script in (f"mkdir {m.mnt}/.hintfs-journal/x", f"cat {m.mnt}/.hintfs-journal/rec",
                       f"ls {m.mnt}/.hintfs-journal"):
            r = who(script)
            assert r.returncode != 0 and "No such file" in r.stderr, (script, r.stderr)
    os.rename(m.store / ".hintfs-journal", m.store / "journal-was-here")
    for script in (f"mkdir {m.mnt}/.hintfs-journal", f"echo x > {m.mnt}/.hintfs-journal",
                   f"mkdir {m.mnt}/mine && mv {m.mnt}/mine {m.mnt}/.hintfs-journal",
                   f"ln -s data.txt {m.mnt}/.hintfs-journal", f"ln {m.mnt}/data.txt {m.mnt}/.hintfs-journal"):
        for who in (as_nobody, as_root):
            r = who(script)
            # (the kernel itself refuses uid 65534 a hard link to root's file: EPERM, protected_hardlinks)
            assert r.returncode != 0 and ("Permission denied" in r.stderr or
                                          (who is as_nobody and "not permitted" in r.stderr)), (script, r.stderr)
            subprocess.run(["rm", "-rf", f"{m.mnt}/mine"])
    assert not (m.store / ".hintfs-journal").exists()
    assert ".hintfs-journal" not in os.listdir(m.mnt) and ".hintfs" not in os.listdir(m.mnt)


def test_a_plan_transforms_only_samples_its_registrant_may_read(world):
    import pyarrow as pa
    import pyarrow.parquet as pq
    m = world
    samples = ["imgs/open.jpg", "imgs/secret.jpg", "hidden/h.jpg"]
    pq.write_table(pa.table({"step": [0, 0, 0], "rank": [0, 0, 0], "slot": [0, 1, 2], "sample": samples,
                             "aug_seed": [1, 2, 3], "est_cost_ms": [1.0] * 3}), m.store / "plan.parquet")
    os.chmod(m.store / "plan.parquet", 0o644)
    r = subprocess.run(NOBODY + ["dd", f"of={m.mnt}/.hintfs/plans/p", "status=none"],
                       input=json.dumps({"plan": "plan.parquet", "step": 0}), capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    assert wait_for(lambda: m.stats()["counters"].get("plan_samples_refused", 0) == 2, 10), m.stats()["counters"]
    assert "not readable by that user" in m.log.read_text()


def test_an_empty_control_document_is_refused(world):
    hints = world.mnt / ".hintfs" / "hints"
    with pytest.raises(OSError) as exc:
        (hints / "bad").write_text("{x")
    assert exc.value.errno == errno.EINVAL and "invalid JSON" in (hints / "bad.error").read_text()
    with pytest.raises(OSError) as exc:
        open(hints / "bad", "w").close()
    assert exc.value.errno == errno.EINVAL
    assert "empty document" in (hints / "bad.error").read_text()
    assert wait_for(lambda: world.log.read_text().count("empty document") == 1, 10)   # one log line
    # a shell redirect (its first close comes before its dup writes) still applies the document
    subprocess.run(["sh", "-c", f"""echo '{{"files": {{"data.txt": 2}}}}' > {hints}/bad"""], check=True)
    assert (hints / "bad.error").read_text() == ""
    assert world.log.read_text().count("empty document") == 1   # the redirect's first close logs nothing


def test_kept_and_by_name_listings_grant_no_more_than_the_folder(tmp_path):
    """patches/pyfuse3-readdir.patch's two listings, attacked as uid 65534: the kernel keeps the
    listing of a folder declared immutable (FOPEN_CACHE_DIR) once root listed it, and a walking
    thread is given files by name (`fusefs.walks`); neither lists a 0700 folder of root's to
    another user (EACCES, the kernel's permission check before any listing it keeps)."""
    def setup(base: Path) -> str:
        store = base / "store"
        store.chmod(0o755)
        (store / "priv").mkdir(mode=0o700)
        (store / "priv" / "secret").write_text("s")
        for d in range(20):
            (store / "tree" / f"d{d:02d}").mkdir(parents=True, mode=0o755)
            (store / "tree" / f"d{d:02d}" / "f").write_text("x" * d)
        (store / "tree").chmod(0o755)
        (store / "tree" / "d19" / "locked").mkdir(mode=0o700)
        (store / "tree" / "d19" / "locked" / "inner").write_text("i")
        return '\n[cache]\nimmutable_globs = ["priv", "priv/*", "tree", "tree/*"]\n'

    with world_mount(setup, prefix="hintfs-sec-") as m:
        assert os.listdir(m.mnt / "priv") == ["secret"] and os.listdir(m.mnt / "priv") == ["secret"]
        assert os.listdir(m.mnt / "tree" / "d19" / "locked") == ["inner"]      # root: kept by the kernel
        r = py_as_nobody(f"""
import json, os
out = {{}}
for name in ("priv", "tree/d19/locked"):
    try:
        out[name] = os.listdir({str(m.mnt)!r} + "/" + name)
    except OSError as e:
        out[name] = e.errno
out["walk"] = [sorted(os.listdir({str(m.mnt)!r} + f"/tree/d{{d:02d}}")) for d in range(20)]
out["size"] = os.stat({str(m.mnt)!r} + "/tree/d18/f").st_size
print(json.dumps(out))
""")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["priv"] == errno.EACCES and out["tree/d19/locked"] == errno.EACCES, out
        assert out["walk"][:19] == [["f"]] * 19 and out["walk"][19] == ["f", "locked"]
        assert out["size"] == 18
        import pyfuse3
        if hasattr(pyfuse3, "cache_dir_supported"):   # (the patched pyfuse3: the walk was given names)
            assert m.stats()["counters"].get("listings_by_name", 0) >= 3

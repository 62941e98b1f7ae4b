"""No user writes a line into the mount's log (issue 34, finding 12): a job name with a control
character is refused (EINVAL) when its control file is created, and every message the daemon
logs is one line whatever path, name or symlink target a user gave it (hintfs.common.logline).

The attacks run as uid 65534 against a real mount whose store has a folder every user may write.
Before the fix a hint named `j\\n<forged line>` was accepted and its job name, like a refused
symlink's target, was logged raw: the forged text stood on a line of its own."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.conftest import force_unmount, needs_fuse, run_hintfs, write_config
from tests.helpers.security import as_nobody, can_run_as_nobody

pytestmark = [needs_fuse, pytest.mark.skipif(not can_run_as_nobody(), reason="needs root, setpriv and a "
                                             "Python uid 65534 can run")]

FORGED = "2099-01-01 00:00:00,000 ERROR hintfs.forged: INJECTED"
# what each line separator does to a log line: \n and \r to every tool, the others to those that
# split as Python's str.splitlines does
SEPARATORS = ["\n", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\u2029"]


@pytest.fixture
def shared_mount():
    base = Path(tempfile.mkdtemp(prefix="hintfs-log-"))
    base.chmod(0o755)
    store, mnt, log = base / "store", base / "mnt", base / "mount.log"
    store.mkdir(mode=0o755)
    mnt.mkdir()
    (store / "tmp").mkdir()
    (store / "tmp").chmod(0o1777)                # a folder every user may write, as /tmp
    (store / "f.bin").write_bytes(b"x" * 100)
    cfg = write_config(base / "hintfs.toml", f"file://{store}", f'\n[agent]\ndata_dir = "{base / "rep"}"\n', log)
    r = run_hintfs("mount", cfg, mnt)
    assert r.returncode == 0, r.stderr
    try:
        yield mnt, log
    finally:
        run_hintfs("umount", mnt)
        force_unmount(mnt)
        import shutil
        shutil.rmtree(base, ignore_errors=True)


def forged_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if line.startswith(FORGED[:10])]


def test_a_job_name_with_a_line_separator_is_refused_and_logs_no_line(shared_mount):
    mnt, log = shared_mount
    names = [f"j{sep}{FORGED}" for sep in SEPARATORS]
    got = as_nobody(f"""
        import json, os
        out = {{}}
        for name in {names!r}:
            try:
                with open(os.path.join({str(mnt / ".hintfs" / "hints")!r}, name), "w") as f:
                    f.write(json.dumps({{"files": {{"f.bin": 2}}, "ttl_s": 60, "deadline_s": 5}}))
                out[name] = 0
            except OSError as err:
                out[name] = err.errno
        print(json.dumps(out))
    """)
    assert got == {n: 22 for n in names}, got          # EINVAL, each one
    assert forged_lines(log) == [], forged_lines(log)
    assert sorted(p.name for p in (mnt / ".hintfs" / "hints").iterdir() if "INJECTED" in p.name) == []


def test_paths_and_symlink_targets_a_user_gives_are_logged_on_one_line(shared_mount):
    mnt, log = shared_mount
    tmp = mnt / "tmp"
    got = as_nobody(f"""
        import json, os
        out = []
        for sep in {SEPARATORS!r}:
            # refused (it points outside the store): the daemon logs the target
            try:
                os.symlink("../../.." + sep + {FORGED!r}, os.path.join({str(tmp)!r}, "l%d" % ord(sep)))
                out.append(0)
            except OSError as err:
                out.append(err.errno)
            # a name of the user's choosing, written and renamed (logged at debug level)
            p = os.path.join({str(tmp)!r}, "n" + sep + {FORGED!r})
            with open(p, "w") as f:
                f.write("x")
            os.rename(p, p + ".2")
        print(json.dumps(out))
    """)
    assert got and all(e != 0 for e in got), got
    assert "refusing to create symlink" in log.read_text()
    assert forged_lines(log) == [], forged_lines(log)


def test_a_hint_with_a_printable_name_still_works(shared_mount):
    mnt, _log = shared_mount
    path = mnt / ".hintfs" / "hints" / "job one ジョブ"
    path.write_text(json.dumps({"files": {"f.bin": 1}, "ttl_s": 60, "deadline_s": 5}))
    assert path.exists()

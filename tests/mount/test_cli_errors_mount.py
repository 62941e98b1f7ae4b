"""One-line errors of the verbs that talk to a live mount, and how a refused control write shows:
`echo bad > .hintfs/loglevel` exits 0 in a shell (close's EINVAL is ignored), so the README's
examples use `tee` or `hintfs` verbs, which fail; the daemon logs every refusal once."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.helpers.cli import hintfs as run_hintfs
from tests.helpers.cli import one_clean_line
from tests.conftest import needs_fuse, wait_for

pytestmark = needs_fuse


def hintfs(*args):
    return run_hintfs(*args, timeout=60)   # commands that wait on a mount get more time


def refusals(log: Path, name: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if f"refused write to {name}" in line]


def test_unknown_job(mounted):
    for action, extra in (("status", []), ("wait", ["--timeout", "2"])):   # (--timeout is wait's own)
        line = one_clean_line(hintfs("hints", action, mounted.mnt, "nojob", *extra))
        assert "no hint job 'nojob'" in line and "hintfs hints set" in line


def test_refused_hint_is_one_line_and_logged_once(mounted):
    files = mounted.mnt.parent / "files.json"
    files.write_text(json.dumps({"a.bin": "many"}))
    line = one_clean_line(hintfs("hints", "set", mounted.mnt, "job1", "--file", files))
    assert "a.bin" in line and "not applied" in line
    assert wait_for(lambda: len(refusals(mounted.log, ".hintfs/hints/job1")) == 1)
    assert len(refusals(mounted.log, ".hintfs/hints/job1")) == 1


def test_shell_redirect_hides_a_refusal_but_tee_reports_it(mounted):
    loglevel = mounted.mnt / ".hintfs" / "loglevel"
    # The shell does not see close() fail: exit status 0. Only loglevel.error and the log tell.
    r = subprocess.run(["bash", "-c", f"echo bad > {loglevel}"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    assert "invalid JSON" in (mounted.mnt / ".hintfs" / "loglevel.error").read_text()
    assert wait_for(lambda: len(refusals(mounted.log, ".hintfs/loglevel")) == 1)
    # tee checks close(): the README's way to write a control file from a shell.
    r = subprocess.run(["bash", "-c", f"echo '{{\"level\": \"LOUD\"}}' | tee {loglevel}"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "Invalid argument" in r.stderr
    assert wait_for(lambda: len(refusals(mounted.log, ".hintfs/loglevel")) == 2)
    lines = refusals(mounted.log, ".hintfs/loglevel")
    assert len(lines) == 2 and "LOUD" in lines[1] and "loglevel.error" in lines[1]
    # and a good document through tee works, clearing the error
    r = subprocess.run(["bash", "-c", f"echo '{{\"level\": \"INFO\"}}' | tee {loglevel}"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert (mounted.mnt / ".hintfs" / "loglevel.error").read_text() == ""


def test_status_of_a_plain_directory_is_one_line(tmp_path):
    line = one_clean_line(hintfs("status", tmp_path))
    assert "not a hintfs mount" in line

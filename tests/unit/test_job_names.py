"""One rule for job names (hintfs.common.paths.job_name), used by the mount when a control file is
created and by the job-side API (hintfs.client, hintfs.plan) before it touches the mount: one
path component, not hidden, bounded, and printable (no control character: it is logged and
shown in status). tests/mount/test_log_lines.py runs the attack through a mount."""
from __future__ import annotations

import errno

import pytest

from hintfs.common.paths import job_name, printable
from hintfs import client, plan

BAD = ["", ".hidden", "a/b", "a\0b", "x.status", "x.error", "n" * 201,
       "a\nb", "a\rb", "a\tb", "\x1b[31mred", "a\x7fb", "a\x85b", "a\u2028b", "a\u2029b", "a\x1cb",
       "a\u202eb",          # RIGHT-TO-LEFT OVERRIDE: text shown in another order than it is
       "a\udcffb"]          # not UTF-8 (surrogate-escaped bytes from the kernel)
GOOD = ["train-1", "job one", "ジョブ", "a.b", "n" * 200, "résumé_2"]


@pytest.mark.parametrize("name", BAD)
def test_bad_job_names_are_einval(name):
    with pytest.raises(OSError) as exc:
        job_name(name)
    assert exc.value.errno == errno.EINVAL
    assert "\n" not in exc.value.strerror and printable(exc.value.strerror) == exc.value.strerror


@pytest.mark.parametrize("name", GOOD)
def test_good_job_names_pass(name):
    assert job_name(name) == name


@pytest.fixture
def fake_mount(tmp_path):
    for d in ("hints", "signals", "reads", "plans"):
        (tmp_path / ".hintfs" / d).mkdir(parents=True)
    return tmp_path


def made(mount) -> list[str]:
    return sorted(p.name for d in (mount / ".hintfs").iterdir() for p in d.iterdir())


@pytest.mark.parametrize("name", BAD)
def test_the_job_api_refuses_what_the_mount_refuses_before_writing(fake_mount, name):
    calls = [lambda: client.set_replication_hints(str(fake_mount), name, {"f": 2}),
             lambda: client.replica_status(str(fake_mount), name),
             lambda: client.signal_anomaly(str(fake_mount), name, "ckpt"),
             lambda: client.hint_reads(str(fake_mount), name, [("f", 0, 1)]),
             lambda: plan.register_plan(str(fake_mount), name, "plan.parquet")]
    for call in calls:
        with pytest.raises(ValueError, match="job name"):
            call()
    assert made(fake_mount) == []


@pytest.mark.parametrize("name", GOOD)
def test_the_job_api_accepts_what_the_mount_accepts(fake_mount, name):
    client.set_replication_hints(str(fake_mount), name, {"f": 2})
    assert made(fake_mount) == [name]


def test_printable_escapes_every_line_separator_and_control_character():
    text = "a\nb\rc\td\x1b\x7f\x85\u2028\u2029\u202e\udcff é ジ"
    out = printable(text)
    assert out == "a\\nb\\rc\\td\\x1b\\x7f\\x85\\u2028\\u2029\\u202e\\udcff é ジ"
    assert out.isprintable() and len(out.splitlines()) == 1
    assert printable("plain/path name.bin") == "plain/path name.bin"


def test_a_daemon_log_record_is_one_line_whatever_its_arguments(tmp_path):
    import logging

    from hintfs.common.logline import OneLineFormatter, one_line_logs

    handler = logging.FileHandler(tmp_path / "d.log")
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("hintfs.test-one-line")
    logger.handlers[:] = [handler]
    logger.propagate = False
    one_line_logs(logger)
    one_line_logs(logger)                       # (once)
    assert isinstance(handler.formatter, OneLineFormatter)
    assert not isinstance(handler.formatter.inner, OneLineFormatter)
    try:
        logger.warning("refusing %s -> %s: 100%% sure", "tmp/l\nERROR forged", "t\u2028\x1b[2K\rx")
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed on %r", "a\nb")
    finally:
        handler.close()
    lines = (tmp_path / "d.log").read_text().splitlines()
    assert lines[0] == "WARNING hintfs.test-one-line: refusing tmp/l\\nERROR forged -> t\\u2028\\x1b[2K\\rx: 100% sure"
    assert lines[1] == "ERROR hintfs.test-one-line: failed on 'a\\nb'"
    assert lines[2] == "Traceback (most recent call last):" and lines[-1] == "ValueError: boom"

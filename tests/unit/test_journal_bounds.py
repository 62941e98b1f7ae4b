"""Journal records are input (issue 34, finding 9): parsed with bounds, refused when dated past the
store's clock or out of their time folder, pruned; the journal's folders private on the store
(hintfs/common/journal.py). The attacks themselves: tests/system/test_security_journal.py."""
from __future__ import annotations

import base64
import os
import stat

import pytest
import trio

from hintfs.common.journal import (BUCKET_NS, MAX_RECORD_BYTES, MAX_SKEW_NS, TIMED, JournalRefused, bucket_of,
                            decode_name, decode_record, encode_record, journal_problem, prepare_journal, prune,
                            record_key, record_name, refusal)
from fusefs.journal_writer import JournalWriter
from fusefs.stats import Stats
from hintfs.stores.base import Stat
from hintfs.stores.local import LocalStore

NOW = 1_800_000_000 * 10**9


def _file(size: int = 0, mtime_ns: int = NOW) -> Stat:
    return Stat(stat.S_IFREG | 0o600, size, mtime_ns, mtime_ns)


@pytest.mark.parametrize("data, why", [
    (b"[" * 200_000, "bytes, more than"),
    (b"[" * 1000 + b"]" * 1000, "nested"),
    (b'{"path": {"a": 1}, "size": 1, "mtime_ns": 1}', "nested"),
    (b'{"path": "a", "size": true, "mtime_ns": 1}', "size must be"),
    (b'{"path": "a", "size": 1.5, "mtime_ns": 1}', "size must be"),
    (b'{"path": "a", "size": 1, "mtime_ns": 9223372036854775808}', "mtime_ns must be"),
    (b'{"path": "a", "size": 1}', "exactly"),
    (b'{"path": "../etc/passwd", "size": 1, "mtime_ns": 1}', ".."),
    (b'\xff{}', "utf-8"),
    (b'"a"', "exactly"),
])
def test_a_record_outside_the_schema_or_the_bounds_is_a_value_error(data, why):
    with pytest.raises(ValueError, match=why):
        decode_record(data)


def test_a_record_in_the_schema_is_read_and_a_string_may_hold_brackets():
    doc = {"path": "ckpt/[x]{y}\"z", "size": 5, "mtime_ns": 7}
    assert decode_record(encode_record(doc["path"], 5, 7)) == doc
    long = "ckpt/" + "/".join(["\u00e9" * 100] * 15)           # a long path, escaped: within the bound
    assert len(encode_record(long, 1, 2)) <= MAX_RECORD_BYTES
    assert decode_record(encode_record(long, 1, 2))["path"] == long


def test_numbers_in_record_names_are_plain_digits():
    enc = base64.urlsafe_b64encode(b"ckpt/a").decode().rstrip("=")
    for size in ("+1", " 1", "1_0", "\u0661", "99999999999999999999", "-1"):
        assert decode_name(f"{NOW:020d}-h-1-0~{size}~5~{enc}.rec") is None, size
    assert decode_name(f"{NOW:020d}-h-1-0~12~5~{enc}.rec") == {"path": "ckpt/a", "size": 12, "mtime_ns": 5}


def test_a_record_dated_past_the_stores_clock_or_outside_its_folder_is_refused():
    name = record_name("ckpt/a", 1, 2)
    t = int(name[:20])
    assert refusal(name, _file(mtime_ns=t), bucket_of(t)) is None
    assert refusal(name, _file(mtime_ns=t), None) is None               # older mounts: flat
    assert refusal(name, _file(mtime_ns=t - MAX_SKEW_NS + 10**9), bucket_of(t)) is None   # a clock ahead
    assert "past the store's clock" in refusal(name, _file(mtime_ns=t - MAX_SKEW_NS - 10**9), bucket_of(t))
    # a store that gives no time (0): the reader's clock
    assert "past the store's clock" in refusal(name, _file(mtime_ns=0), bucket_of(t), now_ns=t - 2 * MAX_SKEW_NS)
    assert "time folder" in refusal(name, _file(mtime_ns=t), bucket_of(t + BUCKET_NS))
    assert "bytes" in refusal(name, _file(size=MAX_RECORD_BYTES + 1, mtime_ns=t), bucket_of(t))
    assert "regular file" in refusal(name, Stat(stat.S_IFDIR | 0o700, 0, t, t), bucket_of(t))


def test_prune_deletes_records_dated_past_the_stores_clock_and_out_of_place(tmp_path):
    jdir = tmp_path / ".hintfs-journal"
    now = NOW
    far = now + 10**9 * 86400 * 365
    names = {"future": f"{far:020d}-e-1-0-r~0~0~Y2twdA.rec", "near": f"{now + 10**9:020d}-h-1-0~1~2~YQ.rec",
             "misplaced": f"{far + 1:020d}-e-1-1~0~0~Y2twdA.rec"}
    places = {"future": record_key(names["future"]), "near": record_key(names["near"]),
              "misplaced": f"{TIMED}/{bucket_of(now - 2 * BUCKET_NS)}/{names['misplaced']}"}
    for key, rel in places.items():
        p = jdir / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")
        os.utime(p, ns=(now, now))                       # the store's clock says: now
    s = LocalStore(str(tmp_path))
    assert prune(s, ".hintfs-journal", now - 86400 * 10**9, now_ns=now) == 1            # the future slice
    assert not (jdir / places["future"]).exists() and not (jdir / places["future"]).parent.exists()
    assert (jdir / places["near"]).exists() and (jdir / places["misplaced"]).exists()
    assert prune(s, ".hintfs-journal", now - BUCKET_NS, now_ns=now) == 1                # its slice is old
    assert not (jdir / places["misplaced"]).exists() and (jdir / places["near"]).exists()


def test_prepare_journal_makes_it_private_and_keeps_an_operators_group(tmp_path):
    s = LocalStore(str(tmp_path))
    assert prepare_journal(s, "meta/journal") == (0o700, 0o600)
    for rel in ("meta/journal", f"meta/journal/{TIMED}"):
        assert stat.S_IMODE(os.stat(tmp_path / rel).st_mode) == 0o700
    # an older mount's 0755 folders are narrowed
    os.chmod(tmp_path / "meta/journal", 0o755)
    os.chmod(tmp_path / "meta/journal" / TIMED, 0o755)
    assert prepare_journal(s, "meta/journal") == (0o700, 0o600)
    assert stat.S_IMODE(os.stat(tmp_path / "meta/journal" / TIMED).st_mode) == 0o700
    # the operator gives the journal a group: its read bits are kept, the time folder takes the
    # group and the setgid bit (so do the folders and records below it), and records are 0640
    os.chown(tmp_path / "meta/journal", -1, 65534)
    os.chmod(tmp_path / "meta/journal", 0o750)
    assert prepare_journal(s, "meta/journal") == (0o750, 0o640)
    st = os.stat(tmp_path / "meta/journal" / TIMED)
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o2750, 65534)
    assert journal_problem(s, "meta/journal") is None
    writer = JournalWriter(s, "meta/journal", Stats(), trio.CapacityLimiter(4))
    (tmp_path / "a").write_bytes(b"x")

    async def write():
        return await writer.published("a", Stat.from_os(os.stat(tmp_path / "a")))
    rec = tmp_path / "meta/journal" / record_key(trio.run(write))
    assert (stat.S_IMODE(os.stat(rec).st_mode), os.stat(rec).st_gid) == (0o640, 65534)
    assert (stat.S_IMODE(os.stat(rec.parent).st_mode) & 0o777, os.stat(rec.parent).st_gid) == (0o750, 65534)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make another user's folder")
def test_prepare_journal_refuses_another_users_folder_or_one_others_may_write(tmp_path):
    s = LocalStore(str(tmp_path))
    (tmp_path / "j").mkdir()
    os.chown(tmp_path / "j", 65534, 65534)
    with pytest.raises(JournalRefused, match="uid 65534"):
        prepare_journal(s, "j")
    assert "uid 65534" in journal_problem(s, "j")
    (tmp_path / "up").mkdir(mode=0o777)
    os.chmod(tmp_path / "up", 0o777)                   # above the journal, not sticky
    with pytest.raises(JournalRefused, match="writable by other users"):
        prepare_journal(s, "up/journal")
    os.chmod(tmp_path / "up", 0o1777)                  # sticky, like /tmp: nobody replaces ours
    assert prepare_journal(s, "up/journal") == (0o700, 0o600)


def test_the_writer_makes_time_folders_and_records_private(tmp_path):
    writer = JournalWriter(LocalStore(str(tmp_path)), ".hintfs-journal", Stats(), trio.CapacityLimiter(4))
    (tmp_path / "a").write_bytes(b"x")

    async def main():
        st = Stat.from_os(os.stat(tmp_path / "a"))
        return await writer.published("a", st), await writer.published("a", st)
    names = trio.run(main)
    assert all(names)
    for name in names:
        rec = tmp_path / ".hintfs-journal" / record_key(name)
        assert stat.S_IMODE(os.stat(rec).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(rec.parent).st_mode) == 0o700

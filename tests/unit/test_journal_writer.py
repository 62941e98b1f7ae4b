"""The journal writer's records of a folder renamed into place (fusefs/journal_writer.py)."""
from __future__ import annotations

import os

import trio

from hintfs.common.journal import decode_record
from fusefs import journal_writer
from fusefs.journal_writer import JournalWriter
from fusefs.stats import Stats
from hintfs.stores.local import LocalStore


def _journaled(store_root) -> dict[str, dict]:
    """path -> record, of every record in the journal folder."""
    jdir = store_root / ".hintfs-journal"
    out = {}
    for rec in (p for p in jdir.rglob("*") if p.is_file()):
        doc = decode_record(rec.read_bytes())
        out[doc["path"]] = doc
    return out


def _run_folders(writer: JournalWriter, *folders: str, counted: int | None = None) -> None:
    """Queue `folders` as renamed, then let `run` journal them and stop once `counted` (all, by
    default) are counted as journaled or skipped."""
    async def main():
        async with trio.open_nursery() as nursery:
            for folder in folders:
                writer.folder_renamed(folder)
            nursery.start_soon(writer.run)
            for _ in range(1000):                  # 10 s at most (a loaded CI host)
                await trio.sleep(0.01)
                if writer.stats.counters["journal_folders"] + writer.stats.counters["journal_folders_skipped"] \
                        >= (len(folders) if counted is None else counted):
                    break
            nursery.cancel_scope.cancel()
    trio.run(main)


def _writer(root) -> JournalWriter:
    return JournalWriter(LocalStore(str(root)), ".hintfs-journal", Stats(), trio.CapacityLimiter(8))


def test_every_file_under_a_renamed_folder_is_journaled_at_its_store_version(tmp_path):
    ck = tmp_path / "ckpt" / "step_1"
    (ck / "shards").mkdir(parents=True)
    (ck / ".metadata").write_bytes(b"plan")
    (ck / "shards" / "0.distcp").write_bytes(b"x" * 1000)
    (ck / ".hintfs-tmp.0.1.2.h").write_bytes(b"staged")     # a write in progress: not a file yet
    os.symlink("0.distcp", ck / "shards" / "link")
    writer = _writer(tmp_path)
    _run_folders(writer, "ckpt/step_1")
    got = _journaled(tmp_path)
    assert set(got) == {"ckpt/step_1/.metadata", "ckpt/step_1/shards/0.distcp"}
    st = os.stat(ck / "shards" / "0.distcp")
    assert (got["ckpt/step_1/shards/0.distcp"]["size"], got["ckpt/step_1/shards/0.distcp"]["mtime_ns"]) \
        == (st.st_size, st.st_mtime_ns)
    assert writer.stats.counters["journal_folders"] == 1 and writer.stats.counters["journal_records"] == 2


def test_a_folder_past_the_limit_or_gone_is_not_journaled_and_the_next_one_is(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_writer, "FOLDER_FILES_MAX", 3)
    for name, n in (("big", 4), ("small", 3)):
        (tmp_path / name).mkdir()
        for k in range(n):
            (tmp_path / name / f"{k}.bin").write_bytes(b"b")
    writer = _writer(tmp_path)
    _run_folders(writer, "big", "gone", "small", counted=2)
    assert set(_journaled(tmp_path)) == {f"small/{k}.bin" for k in range(3)}
    assert writer.stats.counters["journal_folders_skipped"] == 1     # big; gone is only logged
    assert writer.stats.counters["journal_folders"] == 1


def test_a_full_queue_drops_the_folder_and_counts_it(tmp_path):
    (tmp_path / "f").mkdir()
    writer = _writer(tmp_path)
    for _ in range(journal_writer.FOLDER_QUEUE):
        writer.folder_renamed("f")
    writer.folder_renamed("f")                     # nothing is reading the queue: one too many
    assert writer.stats.counters["journal_folders_skipped"] == 1

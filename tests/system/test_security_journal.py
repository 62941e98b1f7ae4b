"""Issue 34, finding 9: the journal can be forged and leaks names.

The attacks, as the outside probe ran them: uid 65534 makes `.hintfs-journal` in a store whose
root is 1777 and plants records; a record dated far in the future (a zero-byte removal record of
`ckpt`) dropped every replica under `ckpt` at the tier and was never pruned; a record of 200,000
`[` raised RecursionError out of a follower round; records were 0644 in 0755 folders, so any local
user read the names of files in folders they cannot list. The follower here is a real agent's,
driven round by round; the training side a real mount.
"""
from __future__ import annotations

import base64
import logging
import os
import stat
import time
from pathlib import Path

import pytest

from hintfs.agent.client import AgentClient
from hintfs.agent.server import start_in_process
from hintfs.common.journal import BUCKET_NS, TIMED, bucket_of, encode_record, prune, record_key, record_name
from mountconfig import parse_config
from hintfs.stores.local import LocalStore
from tests.conftest import needs_fuse, wait_for
from tests.helpers.security import NOBODY, WorldDir, as_nobody, can_run_as_nobody, nobody_read_files

needs_nobody = pytest.mark.skipif(not can_run_as_nobody(), reason="needs root, setpriv and a Python uid 65534 can run")
pytestmark = pytest.mark.timeout(120)

JDIR = ".hintfs-journal"
YEAR_NS = 365 * 86400 * 10**9


def _agent(data_dir: Path, store: Path):
    cfg = parse_config({"store": {"uri": f"file://{store}"}, "agent": {"data_dir": str(data_dir)},
                        "follow": {"prefixes": ["ckpt"], "poll_interval_s": 3600}})   # rounds driven here
    return start_in_process(LocalStore(str(store)), cfg.agent, peers=cfg.agents, follow=cfg.follow,
                            transform_load=cfg.transform_load)


def _journal(store: Path, path: str, removed: bool = False) -> None:
    """A record of `path` as a training mount writes it."""
    size = mtime_ns = 0
    if not removed:
        st = os.stat(store / path)
        size, mtime_ns = st.st_size, st.st_mtime_ns
    dst = store / JDIR / record_key(record_name(removed=removed))
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(encode_record(path, size, mtime_ns))


def _forged_removal(t_ns: int, path: str = "ckpt") -> str:
    """The name of a zero-byte removal record of `path` dated `t_ns` (the probe's forgery)."""
    enc = base64.urlsafe_b64encode(path.encode()).decode().rstrip("=")
    return f"{t_ns:020d}-evil-1-0-r~0~0~{enc}.rec"


def _copied_checkpoint(tmp_path: Path, store: Path):
    """An agent following `ckpt` that holds replicas of ckpt/job/step_1/{a,b}.distcp (journaled)."""
    ck = store / "ckpt" / "job" / "step_1"
    ck.mkdir(parents=True)
    server, loc = _agent(tmp_path / "tier", store)
    for name in ("a.distcp", "b.distcp"):
        (ck / name).write_bytes(name.encode() * 100)
        _journal(store, f"ckpt/job/step_1/{name}")
    server.agent.follower.step(wait=True)
    c = AgentClient(loc)
    assert set(c.status()["replicas"]) == {"ckpt/job/step_1/a.distcp", "ckpt/job/step_1/b.distcp"}
    # the follower's listings and the stream version check's share one budget (journal.ListingBudget)
    assert server.agent.follower.budget is server.agent.intake.versions.budget
    return server, c


def test_a_record_of_200000_brackets_or_of_the_wrong_shape_is_skipped_and_the_round_goes_on(tmp_path, caplog):
    store = tmp_path / "store"
    ck = store / "ckpt" / "job" / "step_1"
    ck.mkdir(parents=True)
    server, loc = _agent(tmp_path / "tier", store)
    try:
        bad = {b"[" * 200_000: "200,000 [", b"[" * 10_000 + b"]" * 10_000: "nested 10,000 deep (within the size bound)",
               b'{"path": "ckpt/job/step_1/a.distcp", "size": "5", "mtime_ns": 1}': "a size that is a string",
               b'{"path": "ckpt/job/step_1/a.distcp", "size": -5, "mtime_ns": 1}': "a negative size",
               b'{"path": "ckpt/job/step_1/a.distcp", "size": 5, "mtime_ns": 1, "x": 1}': "an unknown key",
               b'["ckpt/job/step_1/a.distcp", 5, 1]': "not an object"}
        names = []
        for data in bad:
            name = record_name()                            # a `.json` name: the content is read
            assert name.endswith(".json")
            dst = store / JDIR / record_key(name)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
            names.append(name)
        (ck / "a.distcp").write_bytes(b"a" * 1000)
        _journal(store, "ckpt/job/step_1/a.distcp")         # a good record in the same round
        with caplog.at_level(logging.WARNING, logger="hintfs.follower"):
            server.agent.follower.step(wait=True)                 # (raised RecursionError before)
        assert AgentClient(loc).read("ckpt/job/step_1/a.distcp", 0, 4, replica_only=True) == b"aaaa"
        for name in names:                                  # one line each, naming the record
            assert len([r for r in caplog.records if name in r.getMessage()]) == 1, name
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hintfs.follower"):
            server.agent.follower.step(wait=True)                 # seen: not read or logged again
        assert not [r for r in caplog.records if any(n in r.getMessage() for n in names)]
    finally:
        server.shutdown()


def test_a_record_dated_far_past_the_store_clock_removes_nothing_and_is_pruned(tmp_path, caplog):
    store = tmp_path / "store"
    server, c = _copied_checkpoint(tmp_path, store)
    f = server.agent.follower
    try:
        now = time.time_ns()
        future = now + YEAR_NS
        # in the slice folder of its date (seen by a follower's first poll, which lists every
        # slice: as after a restart), and in the folder of now (seen by every poll)
        in_its_slice = store / JDIR / record_key(_forged_removal(future))
        in_its_slice.parent.mkdir(parents=True)
        in_its_slice.write_bytes(b"")
        in_now = store / JDIR / TIMED / bucket_of(time.time_ns()) / _forged_removal(future + 1)
        in_now.parent.mkdir(parents=True, exist_ok=True)
        in_now.write_bytes(b"")
        f.swept_at = None                                   # the next poll is a first poll
        with caplog.at_level(logging.WARNING, logger="hintfs.follower"):
            f.step(wait=True)
        assert set(c.status()["replicas"]) == {"ckpt/job/step_1/a.distcp", "ckpt/job/step_1/b.distcp"}
        assert len([r for r in caplog.records if in_its_slice.name in r.getMessage()]) == 1
        assert len([r for r in caplog.records if in_now.name in r.getMessage()]) == 1
        # a new version of a followed file is still copied: no removal of `ckpt` is remembered
        (store / "ckpt/job/step_1/c.distcp").write_bytes(b"c" * 10)
        _journal(store, "ckpt/job/step_1/c.distcp")
        f.step(wait=True)
        assert c.read("ckpt/job/step_1/c.distcp", 0, 2, replica_only=True) == b"cc"
        # A clock a few minutes ahead is within the skew: its records are followed.
        ahead = now + 5 * 60 * 10**9
        (store / "ckpt/job/step_1/d.distcp").write_bytes(b"d" * 10)
        st = os.stat(store / "ckpt/job/step_1/d.distcp")
        enc = base64.urlsafe_b64encode(b"ckpt/job/step_1/d.distcp").decode().rstrip("=")
        rec = store / JDIR / record_key(f"{ahead:020d}-h-1-0~{st.st_size}~{st.st_mtime_ns}~{enc}.rec")
        rec.parent.mkdir(parents=True, exist_ok=True)
        rec.write_bytes(b"")
        f.swept_at = None
        f.step(wait=True)
        assert c.read("ckpt/job/step_1/d.distcp", 0, 2, replica_only=True) == b"dd"
        # The writers' pruning deletes the forged records: the future slice's now, the one in the
        # slice of now once that slice is past the retention (here: a cutoff a slice later)
        s = LocalStore(str(store))
        prune(s, JDIR, now - 86400 * 10**9)
        assert not in_its_slice.exists() and rec.exists()
        prune(s, JDIR, now + 2 * BUCKET_NS)
        assert not in_now.exists()
    finally:
        server.shutdown()


@needs_nobody
def test_another_user_cannot_plant_a_journal_in_a_world_writable_store_root(tmp_path, caplog):
    """uid 65534 makes `.hintfs-journal` in a 1777 store root before any training mount did, and
    writes a removal record of `ckpt` dated now: the follower must not take it from them."""
    world = WorldDir()
    try:
        store = world.path / "store"
        store.mkdir()
        store.chmod(0o1777)
        ck = store / "ckpt" / "job" / "step_1"
        ck.mkdir(parents=True)
        for name in ("a.distcp", "b.distcp"):
            (ck / name).write_bytes(name.encode() * 100)
        server, loc = _agent(tmp_path / "tier", store)
        c = AgentClient(loc)
        try:
            server.agent.follower.step(wait=True)                 # no journal: the listing of ckpt
            assert len(c.status()["replicas"]) == 2
            rel = f"{JDIR}/{record_key(_forged_removal(time.time_ns()))}"
            out = as_nobody(f"""
                import json, os
                os.makedirs(os.path.dirname({str(store / rel)!r}))
                open({str(store / rel)!r}, "wb").close()
                print(json.dumps({{"planted": True}}))
            """)
            assert out == {"planted": True} and os.stat(store / JDIR).st_uid == NOBODY
            server.agent.follower.sweep_s = 0                      # every round lists the journal folder
            with caplog.at_level(logging.WARNING, logger="hintfs.follower"):
                server.agent.follower.step(wait=True)
                server.agent.follower.step(wait=True)
            assert set(c.status()["replicas"]) == {"ckpt/job/step_1/a.distcp", "ckpt/job/step_1/b.distcp"}
            lines = [r.getMessage() for r in caplog.records if f"uid {NOBODY}" in r.getMessage()]
            assert len(lines) == 1, lines                   # said once, not at every round
        finally:
            server.shutdown()
    finally:
        world.close()


def _training_mount(mount_factory, store: Path):
    return mount_factory(name="train", store_uri=f"file://{store}", extra="\n[journal]\nenabled = true\n")


@needs_fuse
@needs_nobody
def test_a_training_mounts_journal_is_private_on_the_store(mount_factory):
    world = WorldDir()
    try:
        store = world.path / "store"
        (store / "ckpt" / "secret").mkdir(parents=True)
        (store / "ckpt" / "secret").chmod(0o700)              # nobody may list this folder
        m = _training_mount(mount_factory, store)
        (m.mnt / "ckpt" / "secret" / "layoffs-2027.distcp").write_bytes(b"x")
        assert wait_for(lambda: m.stats()["counters"].get("journal_records") == 1, timeout=10)
        jdir = store / JDIR
        recs = [p for p in jdir.rglob("*") if p.is_file()]
        assert len(recs) == 1
        folders = [jdir, *(p for p in jdir.rglob("*") if p.is_dir())]
        assert {oct(stat.S_IMODE(os.stat(p).st_mode)) for p in folders} == {"0o700"}
        assert oct(stat.S_IMODE(os.stat(recs[0]).st_mode)) == "0o600"
        assert {os.stat(p).st_uid for p in [*folders, *recs]} == {os.geteuid()}
        got = as_nobody(f"""
            import json, os
            out = {{}}
            for d in ({str(jdir)!r}, {str(jdir / TIMED)!r}, {str(recs[0].parent)!r}):
                try:
                    out[d] = os.listdir(d)
                except OSError as err:
                    out[d] = err.errno
            print(json.dumps(out))
        """)
        assert set(got.values()) == {13}, got                # EACCES: no names from the listings
        assert nobody_read_files([str(recs[0])]) == {str(recs[0]): "errno 13"}
    finally:
        world.close()


@needs_fuse
@needs_nobody
def test_a_training_mount_writes_no_record_into_a_journal_folder_another_user_made(mount_factory):
    world = WorldDir()
    try:
        store = world.path / "store"
        (store / "ckpt").mkdir(parents=True)
        store.chmod(0o1777)
        as_nobody(f"""
            import json, os
            os.mkdir({str(store / JDIR)!r}, 0o777)
            os.chmod({str(store / JDIR)!r}, 0o777)
            print(json.dumps({{}}))
        """)
        m = _training_mount(mount_factory, store)
        (m.mnt / "ckpt" / "a.distcp").write_bytes(b"x")
        (m.mnt / "ckpt" / "b.distcp").write_bytes(b"y")
        assert (m.mnt / "ckpt" / "b.distcp").read_bytes() == b"y"    # published as usual
        assert wait_for(lambda: "uid 65534" in m.log.read_text(), timeout=10)
        assert [p for p in (store / JDIR).rglob("*")] == []        # no name went into their folder
        assert len([ln for ln in m.log.read_text().splitlines() if "uid 65534" in ln]) == 1
    finally:
        world.close()

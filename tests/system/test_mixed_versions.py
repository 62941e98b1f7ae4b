"""A deliberately mismatched version of each wire and on-disk format, through real processes
(docs/versions.md): a mount against an agent process that speaks agent protocol 2 (refusing
version 1, then serving it), a stream sender child that does not serve its mount's wire version, a
governor client of another version, and a follower that meets a journal record of a future
version. Each mismatch is one clear line naming both versions and the side to upgrade, never a
silent misbehaviour; a pair that understands each other works."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid

import pytest

from fusefs.stats import Stats
from fusefs.stream import process
from hintfs import client
from hintfs.agent.client import AgentClient, AgentError
from hintfs.common import journal
from hintfs.governor import messages
from hintfs.governor.client import GovernorClient, GovernorError
from mountconfig.governor import GiB, GovernorConfig, GpuConfig
from mountconfig.schema import StreamConfig
from tests.conftest import needs_fuse, wait_for
from tests.helpers.ports import free_port
from tests.helpers.procs import REPO

# An agent process whose protocol is argv[1], the oldest it serves argv[2] (what a later release
# would be), over the store argv[3], its data under argv[4], at argv[5]; no token (a test's).
AGENT = """
import sys
from hintfs.agent import rpc
rpc.PROTOCOL, rpc.OLDEST = int(sys.argv[1]), int(sys.argv[2])
from hintfs.agent.server import AgentServer
from hintfs.common.logsetup import setup_logging
from hintfs.stores import open_store
from mountconfig.schema import AgentConfig, StoreConfig
setup_logging("INFO", sys.argv[4] + "/agent.log")
store = open_store(StoreConfig(uri="file://" + sys.argv[3]), sys.argv[4] + "/spool")
AgentServer(store, AgentConfig(location=sys.argv[5], data_dir=sys.argv[4] + "/data")).serve()
"""


class FutureAgent:
    def __init__(self, tmp_path, store, protocol: int, oldest: int):
        self.dir = tmp_path / f"agent{protocol}{oldest}"
        self.dir.mkdir()
        self.location = f"grpc://127.0.0.1:{free_port()}"
        self.log = self.dir / "agent.log"
        self.p = subprocess.Popen([sys.executable, "-c", AGENT, str(protocol), str(oldest), str(store),
                                   str(self.dir), self.location], cwd=REPO,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def up() -> bool:
            try:
                AgentClient(self.location, timeout_s=2).ping()
                return True
            except AgentError as err:
                return err.errno == 93     # (it refuses this client: it is up)
        assert wait_for(up, 30), self.log.read_text() if self.log.exists() else "no agent log"

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


@pytest.fixture
def future_agent(tmp_path):
    agents: list[FutureAgent] = []

    def start(store, protocol: int, oldest: int) -> FutureAgent:
        agents.append(FutureAgent(tmp_path, store, protocol, oldest))
        return agents[-1]
    yield start
    for a in agents:
        a.stop()


@needs_fuse
def test_a_mount_against_an_agent_that_no_longer_serves_its_version_gets_one_clear_error(
        mount_factory, tmp_path, future_agent):
    m0 = mount_factory(name="probe")          # (its store is the agent's)
    (m0.store / "ckpt").mkdir()
    (m0.store / "ckpt" / ".metadata").write_bytes(b"m" * 4096)
    agent = future_agent(m0.store, protocol=2, oldest=2)
    m = mount_factory(extra=f'\n[agents]\nlocations = {json.dumps([agent.location])}\n',
                      store_uri=f"file://{m0.store}", name="m")
    client.set_replication_hints(str(m.mnt), "j", {"ckpt/.metadata": 4}, deadline_s=10)
    with pytest.raises(TimeoutError) as exc:
        client.wait_for_replicas(str(m.mnt), "j", timeout_s=10)
    error = exc.value.status["files"]["ckpt/.metadata"]["error"]
    assert ("the client speaks agent protocol 1, this agent 2 (accepts 2..2): upgrade hintfs on the client's "
            "host") in error
    # the agent said it once (not once per call), and the mount still reads the store's bytes
    assert wait_for(lambda: agent.log.read_text().count("refused a call: the client speaks agent protocol 1") == 1, 5)
    assert (m.mnt / "ckpt" / ".metadata").read_bytes() == b"m" * 4096


@needs_fuse
def test_a_job_of_a_later_document_version_gets_one_line_in_dot_error(mounted):
    """A job's image with a newer hintfs writes a hint document of version 2 to an older mount."""
    hint = mounted.mnt / ".hintfs" / "hints" / "later"
    with pytest.raises(OSError) as err:
        with open(hint, "w") as f:
            f.write(json.dumps({"files": {"ckpt/a": 1}, "v": 2}))
    assert err.value.errno == 22
    assert (mounted.mnt / ".hintfs" / "hints" / "later.error").read_text().strip() == (
        "v: a document of version 2 (the job's hintfs), this mount reads versions 1..1: upgrade the mount "
        "(mounts before the jobs' images)")


@needs_fuse
def test_a_mount_against_a_newer_agent_that_serves_its_version_works(mount_factory, future_agent):
    m0 = mount_factory(name="probe")
    (m0.store / "ckpt").mkdir()
    (m0.store / "ckpt" / ".metadata").write_bytes(b"n" * 4096)
    agent = future_agent(m0.store, protocol=2, oldest=1)
    m = mount_factory(extra=f'\n[agents]\nlocations = {json.dumps([agent.location])}\n',
                      store_uri=f"file://{m0.store}", name="m")
    client.set_replication_hints(str(m.mnt), "j", {"ckpt/.metadata": 1}, deadline_s=10)
    client.wait_for_replicas(str(m.mnt), "j", timeout_s=20)
    assert AgentClient(agent.location).has("ckpt/.metadata", 4096, os.stat(m0.store / "ckpt/.metadata").st_mtime_ns)
    assert "refused" not in agent.log.read_text()


def test_a_sender_child_that_does_not_serve_the_mounts_wire_version_turns_streaming_off_once(monkeypatch, caplog):
    """The mount (here: its sink in this process) says wire version 2; the child, a real
    `fusefs.stream.sender` of this code (version 1), refuses in one line: no restart loop."""
    monkeypatch.setattr(process, "WIRE_VERSION", 2)
    sc = StreamConfig(prefixes=["ckpt"], agents=["grpc://127.0.0.1:9"])
    stats = Stats()
    caplog.set_level(logging.ERROR, logger="hintfs.stream")
    sink = process.ProcessSink(sc, None, None, stats)
    try:
        assert wait_for(lambda: sink.failed, 15)
        assert stats.counters["stream_sender_refused"] == 1
        assert stats.counters.get("stream_sender_restarts", 0) == 0
        lines = [r.getMessage() for r in caplog.records if "refused this mount" in r.getMessage()]
        assert lines == ["stream sender refused this mount: the stream sender speaks stream wire version 1 "
                         "(serves 1..1), the mount 2: the mount runs a newer hintfs than the one installed: "
                         "reinstall it; streaming is off for this mount meanwhile"]
    finally:
        sink.close(1.0)


def _governor(tmp_path):
    from tests.governor.conftest import RunningDaemon
    return RunningDaemon(GovernorConfig(socket_path=str(tmp_path / "gov.sock"),
                                        shm_name=f"hintfs-test-{uuid.uuid4().hex[:8]}",
                                        gpus=[GpuConfig(index=0, total_bytes=16 * GiB, reserve_bytes=1 * GiB)],
                                        min_headroom_bytes=0))


def test_a_governor_client_of_another_version_is_refused_in_one_line(tmp_path, monkeypatch):
    d = _governor(tmp_path)
    try:
        ok = GovernorClient(d.cfg.socket_path, "inference", name="v1", watch=False)
        ok.close()
        # the client's version (the daemon, in this process, keeps messages.PROTOCOL and CLIENTS)
        monkeypatch.setattr("hintfs.governor.client.PROTOCOL", 2)
        with pytest.raises(GovernorError) as err:
            GovernorClient(d.cfg.socket_path, "inference", name="v2", watch=False)
        assert ("the client speaks governor protocol 2, this governor 1 (serves 1..1): upgrade the governor "
                "(hintfs governor) first") in str(err.value)
        assert d.alive()
        monkeypatch.setattr("hintfs.governor.client.PROTOCOL", 1)
        monkeypatch.setattr(messages, "DAEMONS", (2, 2))  # a client that needs a newer governor
        with pytest.raises(GovernorError, match="the governor speaks governor protocol 1, this client 1 "
                                                r"\(works with 2..2\): upgrade the governor"):
            GovernorClient(d.cfg.socket_path, "inference", name="v3", watch=False)
        assert d.alive()
    finally:
        d.stop()


def test_a_follower_refuses_a_record_of_a_future_version_and_follows_the_rest(tmp_path, caplog):
    from hintfs.agent.server import AgentServer
    from hintfs.stores import open_store
    from hintfs.stores.local import LocalStore
    from mountconfig.schema import AgentConfig, FollowConfig, StoreConfig
    store_dir = tmp_path / "store"
    (store_dir / "ckpt" / "s1").mkdir(parents=True)
    journal.prepare_journal(LocalStore(str(store_dir)), ".hintfs-journal")
    files = {}
    for name, version in (("now.bin", 1), ("later.bin", 2), ("later2.bin", 2)):
        path = f"ckpt/s1/{name}"
        (store_dir / path).write_bytes(name.encode() * 100)
        st = os.stat(store_dir / path)
        files[path] = st
        rec = journal.record_name(path, st.st_size, st.st_mtime_ns)
        if version == 2:
            rec = rec.replace(".rec", ".v2.rec")
        where = store_dir / ".hintfs-journal" / journal.record_key(rec)
        where.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        where.write_bytes(b"")
        where.chmod(0o600)
    caplog.set_level(logging.WARNING)
    store = open_store(StoreConfig(uri=f"file://{store_dir}"), str(tmp_path / "spool"))
    server = AgentServer(store, AgentConfig(location=f"grpc://127.0.0.1:{free_port()}",
                                            data_dir=str(tmp_path / "data")),
                         follow=FollowConfig(prefixes=["ckpt"], poll_interval_s=0.1))
    try:
        c = AgentClient(f"grpc://127.0.0.1:{server.port}")
        now = files["ckpt/s1/now.bin"]
        assert wait_for(lambda: c.has("ckpt/s1/now.bin", now.st_size, now.st_mtime_ns), 15)
        assert wait_for(lambda: "written in journal version 2; this agent reads journal versions 1..1" in caplog.text, 5)
        later = files["ckpt/s1/later.bin"]
        assert not c.has("ckpt/s1/later.bin", later.st_size, later.st_mtime_ns)
        # one line for the two records of version 2 (a newer mount writes one per file)
        refused = [r for r in caplog.records if "journal version 2" in r.getMessage()]
        assert len(refused) == 1, [r.getMessage() for r in refused]
    finally:
        server.shutdown()

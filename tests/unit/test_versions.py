"""Every wire and on-disk format carries a version (docs/versions.md): per format, what was written
before versions reads as version 1, a version this code reads is read, and one it does not is one
clear refusal naming both versions and the side to upgrade. The mixed pairs through real
processes: tests/system/test_mixed_versions.py."""
from __future__ import annotations

import errno
import json
import os

import pyarrow.flight as fl
import pytest

from fusefs.stream import wire
from hintfs.agent import persist, rpc
from hintfs.agent.client import AgentClient, AgentError
from hintfs.common import journal
from hintfs.governor import messages
from hintfs.governor.messages import ProtocolError
from hintfs.governor.protocol import ControlBlock, H_VERSION, VERSION


# -- the agent protocol ----------------------------------------------------------------------------
def test_header_versions_parse_with_bounds():
    assert rpc.header_version(None) == 1 and rpc.header_version([]) == 1      # a peer from before versions
    assert rpc.header_version(["1"]) == 1 and rpc.header_version([b"7"]) == 7
    for junk in (["0"], ["-1"], ["1.5"], ["x"], ["99999999"], ["١"]):
        assert rpc.header_version(junk) is None


def test_the_agent_serves_its_versions_and_names_both_and_the_side_to_upgrade_otherwise(monkeypatch):
    assert rpc.client_refusal(1) is None
    newer = rpc.client_refusal(2)
    assert "client speaks agent protocol 2, this agent 1" in newer and "upgrade this agent" in newer
    monkeypatch.setattr(rpc, "PROTOCOL", 3)
    monkeypatch.setattr(rpc, "OLDEST", 2)
    older = rpc.client_refusal(1)
    assert "client speaks agent protocol 1, this agent 3 (accepts 2..3)" in older and "client's host" in older
    assert rpc.client_refusal(2) is None and rpc.client_refusal(3) is None
    assert "unreadable" in rpc.client_refusal(None)


class _OldAgent(fl.FlightServerBase):
    """An agent that answers without a version header, or with `version`."""

    def __init__(self, version: str | None):
        class Answer(fl.ServerMiddleware):
            def sending_headers(self):
                return {rpc.VERSION_HEADER: version} if version else {}

        class Factory(fl.ServerMiddlewareFactory):
            def start_call(self, info, headers):
                self.seen = headers.get(rpc.VERSION_HEADER)
                return Answer()

        self.factory = Factory()
        super().__init__("grpc://127.0.0.1:0", middleware={"v": self.factory})

    def do_action(self, context, action):
        yield fl.Result(b'{"ok": true}')


@pytest.mark.parametrize("answers", [None, "1"])
def test_a_client_sends_its_version_and_takes_answers_of_agents_it_understands(answers):
    server = _OldAgent(answers)
    client = AgentClient(f"grpc://127.0.0.1:{server.port}")
    try:
        assert client.ping() is True
        assert server.factory.seen == [str(rpc.PROTOCOL)]
    finally:
        client.close()
        server.shutdown()


@pytest.mark.parametrize("answers", [None, "1"])
def test_a_client_refuses_answers_of_an_agent_older_than_it_reads(monkeypatch, answers):
    monkeypatch.setattr(rpc, "PROTOCOL", 2)
    monkeypatch.setattr(rpc, "OLDEST", 2)
    server = _OldAgent(answers)   # (none: an agent from before versions, version 1)
    client = AgentClient(f"grpc://127.0.0.1:{server.port}")
    try:
        with pytest.raises(AgentError) as err:
            client.ping()
        assert err.value.errno == errno.EPROTONOSUPPORT
        assert "the agent speaks agent protocol 1, this client 2 (accepts 2..2): upgrade the agent" in str(err.value)
    finally:
        client.close()
        server.shutdown()


def test_a_real_agent_refuses_a_newer_client_in_one_line_and_answers_its_version(tmp_path):
    from hintfs.agent.server import start_in_process
    from hintfs.stores import open_store
    from mountconfig.schema import AgentConfig, StoreConfig
    (tmp_path / "s").mkdir()
    store = open_store(StoreConfig(uri=f"file://{tmp_path / 's'}"), str(tmp_path / "spool"))
    server, location = start_in_process(store, AgentConfig(data_dir=str(tmp_path / "d")))
    raw = fl.FlightClient(location)
    try:
        with pytest.raises(fl.FlightError) as err:
            list(raw.do_action(fl.Action("ping", b""), fl.FlightCallOptions(headers=[(b"hintfs-agent-protocol", b"2")])))
        assert rpc.errno_of_flight_error(err.value) == errno.EPROTONOSUPPORT
        assert rpc.error_message(err.value) == rpc.client_refusal(2)
        # a client from before versions (no header) is version 1: served
        assert list(raw.do_action(fl.Action("ping", b"")))[0].body.to_pybytes() == b'{"ok":true}'
        assert AgentClient(location).ping() is True
    finally:
        raw.close()
        server.shutdown()


def test_the_fd_socket_request_carries_its_version_only_above_1(monkeypatch):
    doc = {"path": "a/b", "size": 1, "mtime_ns": 2}
    assert rpc.local_fd_request(doc) == doc       # an agent from before versions still answers it
    assert rpc.parse_local_fd(json.dumps(doc).encode()).path == "a/b"
    assert rpc.parse_local_fd(json.dumps({**doc, "v": 1}).encode()).size == 1
    with pytest.raises(fl.FlightServerError) as err:
        rpc.parse_local_fd(json.dumps({**doc, "v": 2}).encode())
    assert rpc.errno_of_flight_error(err.value) == errno.EPROTONOSUPPORT
    assert "client speaks agent protocol 2" in rpc.error_message(err.value)
    monkeypatch.setattr(rpc, "PROTOCOL", 2)
    assert rpc.local_fd_request(doc) == {**doc, "v": 2}


# -- journal records -------------------------------------------------------------------------------
class _St:
    def __init__(self, size=100, mtime_ns=None, is_file=True):
        self.size, self.is_file, self.is_dir = size, is_file, not is_file
        self.mtime_ns = mtime_ns if mtime_ns is not None else 0


def test_version_1_records_are_written_as_before_and_read_as_version_1():
    name = journal.record_name("ckpt/a", 3, 4)
    assert name.endswith("~3~4~Y2twdC9h.rec") and ".v" not in name
    assert journal.record_version(name) == 1 and journal.decode_name(name) == {"path": "ckpt/a", "size": 3,
                                                                                "mtime_ns": 4}
    assert json.loads(journal.encode_record("ckpt/a", 3, 4)) == {"path": "ckpt/a", "size": 3, "mtime_ns": 4}
    assert journal.decode_record(b'{"path": "a", "size": 1, "mtime_ns": 2}')["size"] == 1
    assert journal.decode_record(b'{"path": "a", "size": 1, "mtime_ns": 2, "v": 1}')["size"] == 1
    assert journal.refusal(name, _St(), None) is None


def test_a_record_of_a_future_version_is_refused_in_one_line_and_never_pruned_for_it(tmp_path):
    name = journal.record_name("ckpt/a", 3, 4).replace(".rec", ".v2.rec")
    assert journal.record_version(name) == 2 and journal.decode_name(name) is None
    why = journal.refusal(name, _St(), None)
    assert why == ("written in journal version 2; this agent reads journal versions 1..1: upgrade the agents "
                   "that follow this journal (readers before the training mounts that write it)")
    assert journal.refusal(name, _St(), None, versions=False) is None
    with pytest.raises(ValueError, match="journal version 2; this agent reads journal versions 1..1"):
        journal.decode_record(b'{"path": "a", "size": 1, "mtime_ns": 2, "v": 2}')
    with pytest.raises(ValueError, match="not a number"):
        journal.decode_record(b'{"path": "a", "size": 1, "mtime_ns": 2, "v": "2"}')
    # a version 1 writer's pruning keeps it (for the readers that read it)
    from hintfs.stores.local import LocalStore
    store = LocalStore(str(tmp_path))
    journal.prepare_journal(store, "j")
    old = journal.record_name("ckpt/b", 1, 1)
    for n in (name, old):
        folder = tmp_path / "j" / journal.record_key(n).rsplit("/", 1)[0]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / n).write_bytes(b"")
    assert journal.prune(store, "j", older_than_ns=0) == 0
    assert {p.name for p in (tmp_path / "j").rglob("*") if p.is_file()} == {name, old}


def test_a_writer_of_version_2_names_and_fills_its_records_so_and_a_reader_of_1_and_2_reads_both(monkeypatch):
    monkeypatch.setattr(journal, "JOURNAL_VERSION", 2)
    monkeypatch.setattr(journal, "JOURNAL_READS", (1, 2))
    rec, js = journal.record_name("ckpt/a", 3, 4, streamed=True), journal.record_name("x" * 300, 1, 1)
    assert rec.endswith(".v2.rec") and js.endswith(".v2.json") and journal.streamed_record(rec)
    assert journal.decode_name(rec) == {"path": "ckpt/a", "size": 3, "mtime_ns": 4}
    assert journal.record_key(js).endswith(js) and journal.refusal(js, _St(), None) is None
    assert json.loads(journal.encode_record("a", 1, 2))["v"] == 2
    assert journal.decode_record(journal.encode_record("a", 1, 2)) == {"path": "a", "size": 1, "mtime_ns": 2}
    old = journal.record_name("ckpt/b", 5, 6).replace(".v2.rec", ".rec")
    assert journal.decode_name(old)["size"] == 5
    assert journal.removed_record(journal.record_name("ckpt/c", removed=True))


# -- the stream sender's wire ----------------------------------------------------------------------
def test_the_sender_child_serves_its_mount_versions_and_names_both_otherwise():
    assert wire.mount_refusal({}) is None and wire.mount_refusal({"wire": 1}) is None   # (none: before versions)
    newer = wire.mount_refusal({"wire": 2})
    assert "stream sender speaks stream wire version 1 (serves 1..1), the mount 2" in newer
    assert "reinstall" in newer and "streaming is off" in newer
    assert "restart the mount" in wire.mount_refusal({"wire": "x"})


# -- the governor ----------------------------------------------------------------------------------
def test_the_governor_refuses_a_register_of_another_version_before_its_other_keys():
    ok = messages.parse(b'{"op":"register","role":"training","gpu":0}')
    assert ok.protocol == 1                               # a client from before versions
    assert messages.parse(b'{"op":"register","role":"training","gpu":0,"protocol":1}').protocol == 1
    with pytest.raises(ProtocolError) as err:             # (its unknown key would hide why otherwise)
        messages.parse(b'{"op":"register","role":"training","gpu":0,"protocol":2,"new_key":1}')
    assert str(err.value) == ("register: the client speaks governor protocol 2, this governor 1 (serves 1..1): "
                              "upgrade the governor (hintfs governor) first: governors before jobs")
    with pytest.raises(ProtocolError, match="protocol must be a version number"):
        messages.parse(b'{"op":"register","role":"training","gpu":0,"protocol":"2"}')


def test_a_client_checks_the_governors_version(monkeypatch):
    assert messages.daemon_refusal(1) is None
    assert "upgrade hintfs in this job" in messages.daemon_refusal(2)
    monkeypatch.setattr(messages, "DAEMONS", (2, 2))
    assert "the governor speaks governor protocol 1, this client 1 (works with 2..2): upgrade the governor" \
        in messages.daemon_refusal(1)


def test_a_control_block_of_another_layout_is_named_so():
    block, fd = ControlBlock.memfd("t")
    try:
        block.words[H_VERSION] = VERSION + 1
        with pytest.raises(ValueError, match=f"layout version {VERSION + 1}, this client maps layout {VERSION}: "
                                             "upgrade hintfs in this job"):
            ControlBlock.from_fd(fd)
        block.words[H_VERSION] = VERSION
        ControlBlock.from_fd(fd).close()
    finally:
        os.close(fd)
        block.close()


# -- what an agent keeps on disk -------------------------------------------------------------------
def test_agent_descriptions_carry_their_version_and_newer_ones_are_not_adopted(tmp_path, caplog):
    persist.write_sidecar(str(tmp_path / "r1"), "a", 1, 2, 3.0, None)
    assert json.loads((tmp_path / "r1.meta").read_text())["v"] == persist.DATA_VERSION == 1
    (tmp_path / "r0.meta").write_text(json.dumps({"path": "old", "size": 1, "mtime_ns": 2, "expires_at": 3}))
    (tmp_path / "r2.meta").write_text(json.dumps({"path": "new", "size": 1, "mtime_ns": 2, "expires_at": 3, "v": 2}))
    got = {doc["path"] for _n, _f, doc in persist.descriptions(str(tmp_path), ".meta")}
    assert got == {"a", "old"}                            # (none: written before versions, version 1)
    assert "1 .meta files in" in caplog.text and "agent data of version 2, this agent reads 1..1" in caplog.text


# -- the control documents a job writes to its mount ------------------------------------------------
def test_control_documents_of_version_1_with_or_without_v_are_read_and_later_ones_refused_in_one_line():
    from hintfs.common import documents
    assert documents.parse_signal({"path": "a", "kind": "clear"}).kind == "clear"
    assert documents.parse_hint({"files": {"a": 2}, "v": 1}, 10).files == {"a": 2}
    with pytest.raises(documents.DocumentError) as err:
        documents.parse_hint({"files": {"a": 2}, "v": 2, "new_key": 1}, 10)
    assert str(err.value) == ("v: a document of version 2 (the job's hintfs), this mount reads versions 1..1: "
                              "upgrade the mount (mounts before the jobs' images)")
    with pytest.raises(documents.DocumentError, match="version must be an integer"):
        documents.parse_signal({"path": "a", "kind": "clear", "v": "1"})


def test_a_plan_of_a_later_format_version_is_refused_in_one_line(tmp_path, monkeypatch):
    from hintfs import plan
    path = str(tmp_path / "p.parquet")
    plan.build_plan([f"s{i}" for i in range(8)], path, seed=1, world_size=2, batch_per_rank=2, steps=2)
    assert plan.read_plan_meta(path)["version"] == 1
    monkeypatch.setattr(plan, "FORMAT_VERSION", 2)
    plan.build_plan([f"s{i}" for i in range(8)], path, seed=1, world_size=2, batch_per_rank=2, steps=2)
    monkeypatch.setattr(plan, "FORMAT_VERSION", 1)
    with pytest.raises(ValueError, match="a hintfs plan of format version 2, this hintfs reads versions 1..1"):
        plan.read_plan_meta(path)


def test_a_tensor_file_of_another_format_version_names_it():
    import numpy as np
    from hintfs.transforms import container
    from hintfs.transforms.container import TransformError
    meta = container.make_meta("image", {}, 3, "data/x.jpg", 10, 1_700_000_000_123)
    md = container._meta_strings(meta, "tensor")
    future = container._encode({"x": np.zeros(2, np.uint8)}, {**md, "hintfs": "2"})
    with pytest.raises(TransformError, match="format version 2, this reader reads version 1: upgrade hintfs"):
        container.decode(future)
    with pytest.raises(TransformError, match="not a hintfs .tensor file"):
        container.decode(container._encode({"x": np.zeros(2, np.uint8)}, {**md, "hintfs": "x"}))


def test_placed_is_the_one_range_check_of_every_format():
    from hintfs.common.formatversion import placed
    assert placed(1, (1, 1)) is None and placed(2, (1, 3)) is None
    assert placed(2, (1, 1)) == "newer" and placed(0, (1, 1)) == "older"
    assert placed(True, (1, 1)) == placed("1", (1, 1)) == placed(None, (1, 1)) == "unreadable"

import pytest
from hypothesis import given, strategies as st

from hintfs.governor.messages import parse
from hintfs.governor.protocol import (
    CMD_SHRINK, H_BUSY, W_ACK, W_SEQ, W_USED, ControlBlock, LineBuffer, ProtocolError, SlotReader,
    SlotWriter, decode, encode,
)


def test_command_ack_round_trip_across_two_mappings(tmp_path):
    daemon_side = ControlBlock(tmp_path / "blk", create=True, max_clients=4, total=100, usable=90)
    client_side = ControlBlock(tmp_path / "blk")  # a second, independent mmap of the file
    w = SlotWriter(daemon_side.slot(2))
    r = SlotReader(client_side.slot(2))
    assert r.pending() is None
    base = int(daemon_side.slot(2)[W_SEQ])          # random: no other block's ack matches
    seq = w.command(CMD_SHRINK, 12345)
    cmd = r.pending()
    assert cmd and cmd.seq == seq == base + 1 and cmd.cmd == CMD_SHRINK and cmd.target == 12345
    assert not w.acked(seq)
    r.stamp_detect()
    r.ack(seq, used=12000, drained_ns=1, released_ns=2)
    assert w.acked(seq) and int(daemon_side.slot(2)[W_USED]) == 12000
    assert r.pending() is None
    # other slots untouched
    assert all(int(daemon_side.slot(i)[W_ACK]) == int(daemon_side.slot(i)[W_SEQ]) for i in range(4))
    seq2 = w.command(CMD_SHRINK, 1)
    assert seq2 == base + 2 and r.pending().seq == base + 2
    client_side.close(); daemon_side.close()


def test_the_daemons_busy_count_is_visible_to_the_trainer(tmp_path):
    a = ControlBlock(tmp_path / "b", create=True, max_clients=1)
    b = ControlBlock(tmp_path / "b")
    assert not b.inference_busy()
    a.words[H_BUSY] = 2
    assert b.inference_busy()
    a.words[H_BUSY] = 0
    assert not b.inference_busy()


def test_a_block_is_a_fresh_file_never_a_link(tmp_path):
    import os
    (tmp_path / "target").write_bytes(b"keep")
    os.symlink(tmp_path / "target", tmp_path / "link")
    for name in ("target", "link"):
        with pytest.raises(OSError):
            ControlBlock(tmp_path / name, create=True, max_clients=1)
    assert (tmp_path / "target").read_bytes() == b"keep"


def test_a_memfd_block_cannot_be_resized_by_its_client():
    import fcntl
    import os
    block, fd = ControlBlock.memfd("t", total=100, usable=90)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        with pytest.raises(OSError):
            os.ftruncate(fd, 0)
        client = ControlBlock.from_fd(fd)
        assert client.max_clients == 1 and client.slots.shape[0] == 1
        client.close()
    finally:
        os.close(fd)
        block.close()


def test_attach_refuses_foreign_file(tmp_path):
    p = tmp_path / "junk"
    p.write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError):
        ControlBlock(p)


@given(st.lists(st.dictionaries(st.text(max_size=5).filter(lambda k: k != "op"), st.integers(-2**63, 2**64), max_size=3), max_size=5),
       st.integers(1, 7))
def test_line_buffer_reassembles_any_chunking(msgs, chunk):
    wire = b"".join(encode({"op": "ping", **m}) for m in msgs)
    buf = LineBuffer()
    out = []
    for i in range(0, len(wire), chunk):
        out.extend(buf.feed(wire[i:i + chunk]))
    assert [decode(l) for l in out] == [{"op": "ping", **m} for m in msgs]


@pytest.mark.parametrize("msg", [
    {"op": "nope"}, {"op": "register", "role": "x", "gpu": 0, "pid": 1},
    {"op": "reserve", "bytes": -1}, {"op": "reserve", "bytes": "1"},
    {"op": "reserve", "bytes": 1, "kind": "shoes"}, {"op": "ack"}, {"op": "usage"},
    {"op": "register", "role": "training", "gpu": True, "pid": 1},
    {"op": "reserve", "bytes": 1 << 51}, {"op": "reserve", "bytes": 1.0}, {"op": "ping", "x": 1},
    {"op": "usage", "kinds": {"weights": 1}, "drain_ms": 2e6},
    {"op": "pages", "seq": 1, "n": 251, "total": 251, "page_bytes": 1},
    {"op": "register", "role": "inference", "gpu": 0, "name": "a\nb"},
    {"op": "busy", "on": 1},
])
def test_validation_rejects(msg):
    import json
    with pytest.raises(ProtocolError):
        parse(json.dumps(msg).encode())


@pytest.mark.parametrize("raw", [
    b'{"op":"ping","x":' + b"[" * 50 + b"]" * 50 + b"}",
    b'{"op":"reserve","bytes":' + b"9" * 21 + b"}",
    b'{"op":"usage","kinds":{"weights":Infinity}}',
    b'{"op":"usage","kinds":{},"drain_ms":NaN}',
    b'{"op":"reserve","bytes":1e400}',
    b'{"op":"ping"}' + b" " * 5000,
    b'\xff{"op":"ping"}',
    b'"ping"',
])
def test_parsing_is_bounded(raw):
    with pytest.raises(ProtocolError):
        parse(raw)


def test_parse_gives_typed_messages():
    m = parse(b'{"op":"reserve","kind":"kv_cache","bytes":1024}')
    assert m.op == "reserve" and m.bytes == 1024 and m.kind.value == "kv_cache"


def test_decode_rejects_non_objects():
    for raw in (b"[]", b"{", b'{"op": 3}'):
        with pytest.raises(ProtocolError):
            decode(raw)

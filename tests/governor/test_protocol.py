import pytest
from hypothesis import given, strategies as st

from governor.protocol import (
    CMD_SHRINK, W_ACK, W_USED, ControlBlock, LineBuffer, ProtocolError, SlotReader,
    SlotWriter, decode, encode, validate_request,
)


def test_command_ack_round_trip_across_two_mappings(tmp_path):
    daemon_side = ControlBlock(tmp_path / "blk", create=True, max_clients=4, total=100, usable=90)
    client_side = ControlBlock(tmp_path / "blk")  # a second, independent mmap of the file
    w = SlotWriter(daemon_side.slot(2))
    r = SlotReader(client_side.slot(2))
    assert r.pending() is None
    seq = w.command(CMD_SHRINK, 12345)
    cmd = r.pending()
    assert cmd and cmd.seq == seq == 1 and cmd.cmd == CMD_SHRINK and cmd.target == 12345
    assert not w.acked(seq)
    r.stamp_detect()
    r.ack(seq, used=12000, drained_ns=1, released_ns=2)
    assert w.acked(seq) and int(daemon_side.slot(2)[W_USED]) == 12000
    assert r.pending() is None
    # other slots untouched
    assert int(daemon_side.slots[:, W_ACK].sum()) == 1
    seq2 = w.command(CMD_SHRINK, 1)
    assert seq2 == 2 and r.pending().seq == 2
    client_side.close(); daemon_side.close()


def test_busy_words_visible_to_trainer(tmp_path):
    a = ControlBlock(tmp_path / "b", create=True, max_clients=8)
    b = ControlBlock(tmp_path / "b")
    assert not b.inference_busy()
    SlotReader(a.slot(5)).set_busy(True)
    assert b.inference_busy()
    SlotReader(a.slot(5)).set_busy(False)
    assert not b.inference_busy()


def test_attach_refuses_foreign_file(tmp_path):
    p = tmp_path / "junk"
    p.write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError):
        ControlBlock(p)


@given(st.lists(st.dictionaries(st.text(max_size=5).filter(lambda k: k != "op"), st.integers(), max_size=3), max_size=5),
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
])
def test_validation_rejects(msg):
    with pytest.raises(ProtocolError):
        validate_request(msg)


def test_decode_rejects_non_objects():
    for raw in (b"[]", b"{", b'{"op": 3}'):
        with pytest.raises(ProtocolError):
            decode(raw)

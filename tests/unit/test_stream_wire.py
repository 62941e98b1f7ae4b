"""The stream sender's messages (fusefs/stream/wire.py): order, a descriptor beside a message,
and each refusal (too long, not JSON, no op) in the one place that reads them."""
from __future__ import annotations

import os
import socket

import pytest

from fusefs.stream.wire import MAX_MESSAGE, WireError, receive, send, socketpair


def test_messages_keep_their_order_and_a_descriptor_travels_beside_one():
    a, b = socketpair()
    r, w = os.pipe()
    try:
        send(a, {"op": "start", "n": 1}, r)
        send(a, {"op": "released", "n": 1})
        doc, fd = receive(b)
        assert doc == {"op": "start", "n": 1} and fd is not None
        os.write(w, b"x")
        assert os.read(fd, 1) == b"x"            # the same pipe, through another descriptor
        os.close(fd)
        assert receive(b) == ({"op": "released", "n": 1}, None)
        a.close()
        assert receive(b) is None                # the other end is gone
    finally:
        for x in (r, w):
            os.close(x)
        b.close()


def test_a_message_too_long_is_not_sent():
    a, b = socketpair()
    with a, b, pytest.raises(WireError):
        send(a, {"op": "start", "path": "x" * MAX_MESSAGE})


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b'{"n": 1}', b'{"op": 3}'])
def test_a_message_that_does_not_parse_is_refused_and_its_descriptor_closed(raw):
    a, b = socketpair()
    r, w = os.pipe()
    with a, b:
        socket.send_fds(a, [raw], [r])
        before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(WireError):
            receive(b)
        assert set(os.listdir("/proc/self/fd")) <= before   # the descriptor that came with it is closed
    os.close(r)
    os.close(w)

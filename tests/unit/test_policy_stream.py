"""policy/stream.py: what a streaming sender sends behind a writer, what a tier holds, and the
publish verdict. The property: whatever the writer does (appends, in-place rewrites of bytes
already sent, truncates) and whatever sends are lost, a tier that says "ready" holds exactly the
published bytes, and "fill" names every chunk that is not."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.stream import (RangeMap, chunk_count, chunk_crc, chunk_span, crcs_of, ranges_to_send,
                           verdict)

CHUNK = 16


def chunks_of(data: bytes, chunk: int = CHUNK) -> list[bytes]:
    return [data[i:i + chunk] for i in range(0, len(data), chunk)]


class Tier:
    """A tier's copy of one stream: its bytes and its RangeMap."""

    def __init__(self):
        self.buf = bytearray()
        self.map = RangeMap(CHUNK)

    def receive(self, off: int, data: bytes, crc: int) -> None:
        assert chunk_crc(data) == crc      # the tier checks each range it receives
        if len(self.buf) < off + len(data):
            self.buf.extend(b"\0" * (off + len(data) - len(self.buf)))
        self.buf[off:off + len(data)] = data
        self.map.add(off, len(data), crc)


def send(file: bytes, idx: list[int], sent: dict[int, int], tier: Tier, lost: set[int]) -> None:
    for i in idx:
        off, n = chunk_span(i, len(file), CHUNK)
        data = file[off:off + n]
        sent[i] = chunk_crc(data)
        if i not in lost:
            tier.receive(off, data, sent[i])


def test_whole_chunks_while_writing_then_the_tail_and_rewrites_at_publish():
    sent: dict[int, int] = {}
    assert ranges_to_send(40, CHUNK, sent) == [0, 1]          # the partial third chunk waits
    file = bytes(range(40))
    tier = Tier()
    send(file, ranges_to_send(40, CHUNK, sent), sent, tier, set())
    final = file[:3] + b"XY" + file[5:] + b"more"            # chunk 0 rewritten in place, appended
    crcs = crcs_of(chunks_of(final))
    todo = ranges_to_send(len(final), CHUNK, sent, crcs)
    assert todo == [0, 2]                                      # the rewrite first, then the tail
    assert verdict(tier.map, len(final), crcs, (len(final), 5)).fetch == (0, 2)
    send(final, todo, sent, tier, set())
    v = verdict(tier.map, len(final), crcs, (len(final), 5))
    assert v.state == "ready" and bytes(tier.buf) == final


def test_lost_ranges_are_fetched_and_a_newer_replica_wins():
    file = bytes(range(50))
    crcs = crcs_of(chunks_of(file))
    tier = Tier()
    send(file, list(range(chunk_count(50, CHUNK))), {}, tier, lost={1})
    v = verdict(tier.map, 50, crcs, (50, 100))
    assert v.state == "fill" and v.fetch == (1,) and v.keep == (0, 2, 3)
    assert verdict(tier.map, 50, crcs, (50, 100), replica_version=(60, 200)).state == "stale"
    assert verdict(RangeMap(CHUNK), 0, [], (0, 1)).state == "ready"   # an empty file


def test_a_truncate_forgets_what_it_cut():
    tier = Tier()
    file = bytes(64)
    send(file, [0, 1, 2, 3], {}, tier, set())
    tier.map.drop_from(20)                       # chunk 1 (16..32) is cut, 2 and 3 are gone
    assert sorted(tier.map.held) == [0]
    assert tier.map.missing(40) == [1, 2]


def test_range_map_round_trips_and_refuses_unaligned_ranges():
    m = RangeMap(CHUNK)
    m.add(0, 16, 7)
    m.add(32, 5, 9)
    again = RangeMap.from_doc(m.to_doc())
    assert again == m and again.bytes_held() == 21
    with pytest.raises(ValueError):
        m.add(3, 4, 0)
    with pytest.raises(ValueError):
        m.add(0, 17, 0)
    with pytest.raises(ValueError):
        ranges_to_send(40, CHUNK, {}, final_crcs=[1])          # not one CRC per chunk


ops = st.lists(st.one_of(
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=40)),
    st.tuples(st.just("rewrite"), st.integers(0, 200), st.binary(min_size=1, max_size=20)),
    st.tuples(st.just("truncate"), st.integers(0, 200)),
    st.tuples(st.just("poll"), st.just(0)),
), max_size=30)


@settings(max_examples=300, deadline=None)
@given(ops, st.sets(st.integers(0, 20), max_size=4), st.integers(1, 2000))
def test_ready_means_the_published_bytes_and_fill_names_every_other_chunk(script, lost, mtime):
    file = bytearray()
    sent: dict[int, int] = {}
    tier = Tier()
    for op in script:
        if op[0] == "append":
            file.extend(op[1])
        elif op[0] == "rewrite" and file:
            off = op[1] % len(file)
            data = op[2][: len(file) - off]
            file[off:off + len(data)] = data      # in place: the daemon is not told (passthrough)
        elif op[0] == "truncate":
            size = min(op[1], len(file))
            del file[size:]
            # a truncate is seen (a new generation at the sender): both sides forget past it
            for i in [i for i in sent if chunk_span(i, size, CHUNK)[1] < CHUNK]:
                del sent[i]
            tier.map.drop_from(size)
            del tier.buf[size:]
        else:
            send(bytes(file), ranges_to_send(len(file), CHUNK, sent), sent, tier, lost)
    final = bytes(file)
    crcs = crcs_of(chunks_of(final))
    send(final, ranges_to_send(len(final), CHUNK, sent, crcs), sent, tier, lost)
    v = verdict(tier.map, len(final), crcs, (len(final), mtime))
    for i in v.keep:                              # what is kept is the published file's
        off, n = chunk_span(i, len(final), CHUNK)
        assert bytes(tier.buf[off:off + n]) == final[off:off + n]
    if v.state == "ready":
        assert bytes(tier.buf[:len(final)]) == final
    else:
        assert set(v.fetch) | set(v.keep) == set(range(chunk_count(len(final), CHUNK)))
        assert set(v.fetch) <= lost | set(tier.map.missing(len(final))) | {
            i for i in tier.map.held if tier.map.held[i][1] != crcs[i]}


# -- eval reads first ----------------------------------------------------------------------------

def test_a_checkpoint_file_keeps_its_job_folder_and_name_across_steps():
    from policy.stream import checkpoint_family
    assert checkpoint_family("ckpt/run-7/step_100/__0_0.distcp") == ("ckpt/run-7", "__0_0.distcp")
    assert checkpoint_family("ckpt/run-7/step_200/__0_0.distcp") == checkpoint_family(
        "ckpt/run-7/step_100/__0_0.distcp")
    assert checkpoint_family("ckpt/run-8/step_100/__0_0.distcp") != checkpoint_family(
        "ckpt/run-7/step_100/__0_0.distcp")
    assert checkpoint_family("f.bin") == ("", "f.bin")


def test_chunks_touching_ranges_are_every_chunk_holding_a_byte_of_them():
    from policy.stream import chunks_touching
    assert chunks_touching([(0, 1)], 100) == [0]
    assert chunks_touching([(99, 2)], 100) == [0, 1]          # crosses a boundary
    assert chunks_touching([(100, 100)], 100) == [1]          # exactly one chunk
    assert chunks_touching([(250, 10), (0, 5), (260, 1)], 100) == [0, 2]
    assert chunks_touching([(5, 0), (-1, 10)], 100) == []     # empty and negative ranges: nothing
    assert chunks_touching([(0, 10_000)], 100, limit=3) == [0, 1, 2]
    with pytest.raises(ValueError):
        chunks_touching([(0, 1)], 0)


def test_send_calls_put_the_named_chunks_first_in_runs_and_hold_the_others_to_a_number_of_calls():
    from policy.stream import send_calls
    todo = [0, 1, 2, 3, 4, 5, 6, 7, 8]
    # no chunk named: runs of consecutive chunks, at most call_bytes each (3 chunks of 10 bytes)
    assert send_calls(todo, [], 10, 30) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    # named chunks go first, as runs of their own; then the others
    assert send_calls(todo, [3, 4, 7], 10, 30) == [[3, 4], [7], [0, 1, 2], [5, 6], [8]]
    # the others held to a number of calls (0: none now); the named ones always go
    assert send_calls(todo, [3, 4, 7], 10, 30, others=1) == [[3, 4], [7], [0, 1, 2]]
    assert send_calls(todo, [3, 4, 7], 10, 30, others=0) == [[3, 4], [7]]
    # a call holds at least one chunk, whatever call_bytes says
    assert send_calls([2, 3], [], 10, 5) == [[2], [3]]
    # gaps break runs
    assert send_calls([0, 2, 3], [], 10, 100) == [[0], [2, 3]]
    # while the file grows (its last whole chunk is 8), a short run of others ending there waits
    # to fill a call; named chunks go however few they are
    assert send_calls(todo, [], 10, 40, growing_end=8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert send_calls(todo, [3], 10, 30, growing_end=8) == [[3], [0, 1, 2], [4, 5, 6]]
    assert send_calls(todo, [8], 10, 40, growing_end=8) == [[8], [0, 1, 2, 3], [4, 5, 6, 7]]
    # a short run that cannot grow (a named or a sent chunk after it) goes
    assert send_calls([0, 1, 5, 6], [2], 10, 40, growing_end=6) == [[0, 1]]
    assert send_calls([0], [], 10, 10, growing_end=0) == [[0]]      # a call of one chunk is full

"""Write-time stream chunks compressed where that pays (`[stream] compress`, issue 37: 16,384-file
checkpoints crossed the link at 1.064x their bytes): the replica is the same bytes, fewer cross,
an incompressible chunk goes as it is, and a hostile chunk (a raw size past the stream's chunk,
one it does not inflate to, a broken zstd stream, a CRC not of the raw bytes) is refused with
nothing written. An agent from before the option gets the chunks plainly."""
from __future__ import annotations

import errno
import json
import os

import pyarrow as pa
import pyarrow.flight as fl
import pytest

from hintfs.agent import rpc
from hintfs.agent.client import AgentClient
from policy.stream import chunk_crc, crcs_of
from tests.conftest import needs_fuse, wait_for
from tests.system.test_stream_mount import CHUNK, Tier, streaming_to_tier

_ZSTD = pa.Codec("zstd", compression_level=1)


def _text(n: int) -> bytes:
    """Bytes that compress (a pickle's or torch.save's framing is mostly such)."""
    out = b"".join(b"tensor %08d storage float32 offset %d\n" % (i, i * 7) for i in range(n // 30 + 1))
    return out[:n]


def _stream_whole(c: AgentClient, sid: str, store, rel: str, compress: bool) -> None:
    data = (store / rel).read_bytes()
    st = os.stat(store / rel)
    parts = [data[o:o + CHUNK] for o in range(0, len(data), CHUNK)]
    c.stream_put(sid, 0, [(i * CHUNK, p, chunk_crc(p)) for i, p in enumerate(parts)],
                 opening={"path": rel, "chunk": CHUNK},
                 publish={"path": rel, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "crcs": crcs_of(parts)},
                 compress=compress)


def test_compressed_chunks_make_the_same_replica_with_fewer_bytes_across(tmp_path):
    store = tmp_path / "store"
    (store / "ckpt").mkdir(parents=True)
    text = _text(3 * CHUNK + 1000)
    noise = os.urandom(2 * CHUNK + 10)
    (store / "ckpt" / "meta.bin").write_bytes(text)
    (store / "ckpt" / "noise.bin").write_bytes(noise)
    tier = Tier(tmp_path, store, follow=False)
    try:
        c = AgentClient(tier.loc, own_connection=True)
        _stream_whole(c, "t", store, "ckpt/meta.bin", compress=True)
        assert c.stream_raw_bytes == len(text) and c.stream_wire_bytes < len(text) / 5
        _stream_whole(c, "n", store, "ckpt/noise.bin", compress=True)
        assert c.stream_raw_bytes == len(text) + len(noise)
        assert c.stream_wire_bytes - len(noise) < len(text) / 5     # (random: sent as it is)
        wait_for(lambda: c.status()["replica_count"] == 2)
        st = c.status()["streams"]
        assert st["packed_chunks"] == 3 and st["bytes_saved"] == c.stream_raw_bytes - c.stream_wire_bytes
        assert c.read("ckpt/meta.bin", 0, len(text) + 1, replica_only=True, compress=False) == text
        assert c.read("ckpt/noise.bin", 0, len(noise) + 1, replica_only=True) == noise
        assert c.status()["copies"] == 0            # streamed, not copied
    finally:
        tier.close()


def _put_rows(c: AgentClient, sid: str, rel: str, rows: list[tuple[int, bytes, int, int | None]]) -> None:
    """A put with hand-made compressed rows (offset, payload, crc, raw_size)."""
    req = {"op": "stream", "stream": sid, "gen": 0, "compress": "zstd",
           "open": {"stream": sid, "gen": 0, "path": rel, "chunk": CHUNK}}
    schema = AgentClient._PACKED_CHUNKS
    writer, reader = c._client.do_put(fl.FlightDescriptor.for_command(json.dumps(req).encode()), schema, c._opts)
    try:
        for off, payload, crc, raw_size in rows:
            writer.write_batch(pa.record_batch([pa.array([off], pa.int64()), pa.array([crc], pa.int64()),
                                                pa.array([payload], pa.large_binary()),
                                                pa.array([raw_size], pa.int64())], schema=schema))
        writer.done_writing()
        reader.read()
    finally:
        writer.close()


@pytest.mark.parametrize("case", ["past_the_chunk", "short_of_its_size", "not_zstd", "crc_of_the_packed"])
def test_a_hostile_compressed_chunk_is_refused_and_nothing_is_written(tmp_path, case):
    store = tmp_path / "store"
    (store / "ckpt").mkdir(parents=True)
    tier = Tier(tmp_path, store, follow=False)
    raw = _text(CHUNK)
    packed = _ZSTD.compress(raw, asbytes=True)
    bomb = _ZSTD.compress(b"\0" * (64 * CHUNK), asbytes=True)       # 4 MiB from ~150 bytes
    row = {"past_the_chunk": (0, bomb, chunk_crc(b"\0" * (64 * CHUNK)), 64 * CHUNK),
           "short_of_its_size": (0, packed, chunk_crc(raw), CHUNK - 1),
           "not_zstd": (0, b"\x28\xb5\x2f\xfd" + os.urandom(200), chunk_crc(raw), CHUNK),
           "crc_of_the_packed": (0, packed, chunk_crc(packed), CHUNK)}[case]
    try:
        c = AgentClient(tier.loc, own_connection=True)
        with pytest.raises(fl.FlightError, match="ESTALE stream h: chunk at 0") as exc:
            _put_rows(c, "h", "ckpt/h.bin", [row])
        why = {"past_the_chunk": "4194304 bytes where at most 65536", "short_of_its_size": "does not inflate",
               "not_zstd": "does not inflate", "crc_of_the_packed": "damaged (CRC)"}[case]
        assert why in str(exc.value)
        st = c.status()
        assert st["budget"]["used"] == 0 and st["replica_count"] == 0 and st["streams"]["packed_chunks"] == 0
        # a good chunk of the same stream is still taken afterwards
        _put_rows(c, "h", "ckpt/h.bin", [(0, packed, chunk_crc(raw), CHUNK)])
        st = c.status()
        assert st["budget"]["used"] == CHUNK and st["streams"]["packed_chunks"] == 1
    finally:
        tier.close()


def test_an_agent_that_refuses_the_key_gets_the_chunks_plainly(tmp_path, monkeypatch):
    store = tmp_path / "store"
    (store / "ckpt").mkdir(parents=True)
    text = _text(2 * CHUNK)
    (store / "ckpt" / "a.bin").write_bytes(text)
    (store / "ckpt" / "b.bin").write_bytes(text[::-1])
    tier = Tier(tmp_path, store, follow=False)
    real = rpc.parse_put
    asked: list[dict] = []

    def older(body):
        doc = json.loads(bytes(body))
        asked.append(doc)
        if "compress" in doc:
            raise rpc.rpc_error(errno.EINVAL, "compress: Extra inputs are not permitted")
        return real(body)

    monkeypatch.setattr(rpc, "parse_put", older)
    try:
        c = AgentClient(tier.loc, own_connection=True)
        _stream_whole(c, "a", store, "ckpt/a.bin", compress=True)
        _stream_whole(c, "b", store, "ckpt/b.bin", compress=True)
        assert ["compress" in d for d in asked] == [True, False, False]
        assert c.stream_wire_bytes == c.stream_raw_bytes == 4 * CHUNK
        wait_for(lambda: c.status()["replica_count"] == 2)
        assert c.read("ckpt/b.bin", 0, 2 * CHUNK, replica_only=True) == text[::-1]
    finally:
        tier.close()


@needs_fuse
def test_a_mount_streams_compressed_by_default(mount_factory, tmp_path):
    with streaming_to_tier(mount_factory, tmp_path, follow=False) as (store, tier, m):
        data = _text(5 * CHUNK + 123)
        (m.mnt / "ckpt").mkdir()
        (m.mnt / "ckpt" / "x.bin").write_bytes(data)
        wait_for(lambda: tier.client.status()["replica_count"] == 1)
        assert tier.client.read("ckpt/x.bin", 0, len(data) + 1, replica_only=True) == data
        st = tier.client.status()
        assert st["copies"] == 0 and st["streams"]["packed_chunks"] >= 5
        assert st["streams"]["bytes_saved"] > len(data) * 0.8

"""Reads of hinted files ask the replicas for the bytes the file has, never past its end
(fusefs/replicaread.py). Before, every block was asked as `block_bytes` (4 MiB): a 20 KB file
with 3 replicas was 3 requests (two of them empty), and each replica was charged 1.3 MiB of
`ReplicaRouter.sent` for it, so a host's choice of replicas for its hot files (by bytes asked)
leaned away from the agents that held its small files (bench/scale_storm.py: the busiest agent
served 1.77x the mean, in a smooth slope)."""
from __future__ import annotations

import functools

import trio

from fusefs.hints import ReplicaRouter
from fusefs.replicaread import ReplicaReads
from fusefs.stats import Stats
from mountconfig.schema import ReplicasConfig


class Agent:
    def __init__(self, data: bytes, log: list):
        self.data, self.log = data, log

    def read(self, path: str, off: int, length: int, replica_only: bool = False, expect=None) -> bytes:
        self.log.append((self, off, length))
        return self.data[off:off + length]


class Unused:
    def read(self, off: int, size: int) -> bytes:
        raise AssertionError("the store's copy is the last fallback")


def _reads(size: int, replicas: int = 3) -> tuple[bytes, list, ReplicaRouter]:
    data = bytes(i % 251 for i in range(size))
    log: list = []
    locs = [f"a{i}" for i in range(replicas)]
    router = ReplicaRouter()
    router.replicas["f"] = locs
    opts = ReplicasConfig(hedge_after_ms=0, block_bytes=4 << 20, stripe_bytes=256 << 10)
    reads = ReplicaReads(router, {loc: Agent(data, log) for loc in locs}, opts, Stats(),
                         io_limiter=trio.CapacityLimiter(4))

    async def main() -> bytes:
        out = b""
        while len(out) < size + 1:                     # as the kernel reads: 128 KiB at a time, then EOF
            got = await reads.read("f", (size, 1), len(out), 128 << 10, fallback=Unused())
            if not got:
                break
            out += got
        return out

    assert trio.run(main) == data
    return data, log, router


def test_a_small_file_is_one_request_of_its_size_and_charged_that():
    _, log, router = _reads(20_000)
    assert [length for _, _, length in log] == [20_000]
    assert sum(router.asked.values()) == 20_000


def test_a_larger_file_is_read_in_pieces_that_end_at_its_end():
    size = (4 << 20) + 300_000                         # one whole block and 300,000 bytes
    _, log, router = _reads(size)
    assert sum(length for _, _, length in log) == size   # nothing asked past the end
    assert all(length > 0 for _, _, length in log)
    assert len(log) == 3 + 2                           # a block in 3 pieces; the tail (< 2 stripes) in 2: 2 blocks ask all 3
    assert sum(router.asked.values()) == size
    assert max(router.asked.values()) - min(router.asked.values()) <= 300_000 + 2   # even over the 3


def test_pieces_of_a_file_of_fewer_blocks_than_replicas_ask_every_replica():
    from fusefs.replicaread import MIN_PIECE_BYTES, pieces_of
    block, stripe = 4 << 20, 256 << 10
    assert pieces_of(32, 3_925_700, 3_925_700, block, stripe) == 32      # one block: one piece per replica
    assert pieces_of(32, 746_288, 746_288, block, stripe) == 746_288 // MIN_PIECE_BYTES   # not under 64 KiB
    assert pieces_of(3, 3_925_700, 3_925_700, block, stripe) == 3
    assert pieces_of(1, 3_925_700, 3_925_700, block, stripe) == 1
    assert pieces_of(32, 20_000, 20_000, block, stripe) == 1              # smaller than a piece: whole
    assert pieces_of(32, block, 64 * block, block, stripe) == 16           # many blocks: stripe_bytes pieces
    assert pieces_of(32, block, 4 * block, block, stripe) == 16            # 4 blocks x 16 pieces >= 32 replicas
    assert pieces_of(32, block, 2 * block, block, 0) == 1                  # stripe_bytes = 0: whole blocks


def test_32_hosts_reading_a_hot_file_from_32_replicas_ask_each_agent_the_same():
    """The storm of bench/scale_storm.py on one file: 32 hosts (routers seeded apart) each read a
    3.9 MB file with 32 replicas; every agent is asked for the same bytes, to a piece's rounding."""
    import random
    size, load = 3_925_700, {}
    for h in range(32):
        data = bytes(size)
        log: list = []
        locs = [f"a{i}" for i in range(32)]
        router = ReplicaRouter(random.Random(h))
        router.replicas["f"] = locs
        reads = ReplicaReads(router, {loc: Agent(data, log) for loc in locs},
                             ReplicasConfig(hedge_after_ms=0, block_bytes=4 << 20, stripe_bytes=256 << 10),
                             Stats(), io_limiter=trio.CapacityLimiter(4))
        trio.run(functools.partial(reads.read, "f", (size, 1), 0, size, fallback=Unused()))
        for loc, n in router.asked.items():
            load[loc] = load.get(loc, 0) + n
    assert len(load) == 32
    assert max(load.values()) / (sum(load.values()) / 32) < 1.01

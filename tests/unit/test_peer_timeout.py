"""A copy from a peer agent waits as long as its bytes in flight take at the floor rate
(hintfs.agent.copier.peer_timeout_s), never less than the fixed minimum."""
from hintfs.agent.copier import CHUNK, PEER_MIN_RATE, PEER_TIMEOUT_S, peer_timeout_s


def test_small_copy_keeps_the_minimum():
    assert peer_timeout_s(64 << 10, CHUNK, 16) == PEER_TIMEOUT_S


def test_a_hot_file_on_a_slow_node_gets_its_transfer_time():
    # bench/scale_storm.py's rank-0 file (3.9 MB) from an agent limited to 0.25 MiB/s, shared
    t = peer_timeout_s(3_925_700, CHUNK, 16)
    assert t == 3_925_700 / PEER_MIN_RATE
    assert t > PEER_TIMEOUT_S


def test_a_large_copy_counts_only_the_reads_in_flight():
    assert peer_timeout_s(100 << 30, CHUNK, 4) == 4 * CHUNK / PEER_MIN_RATE
    assert peer_timeout_s(100 << 30, CHUNK, 0) == CHUNK / PEER_MIN_RATE

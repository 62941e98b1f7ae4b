"""The storage agent over Flight on loopback: ranges, replicas, fan-out, TTL, budget, auth."""
import errno
import os

import pytest

from hintfs.agent.server import AgentServer, start_in_process
from hintfs.agent.client import AgentClient
from hintfs.stores.local import LocalStore
from hintfs.common.clock import SYSTEM_CLOCK, FakeClock
from mountconfig import parse_config


@pytest.fixture
def store(tmp_path):
    root = tmp_path / "store"
    (root / "ckpt").mkdir(parents=True)
    (root / "ckpt" / "a.bin").write_bytes(bytes(range(256)) * 4096)   # 1 MiB
    (root / "ckpt" / ".metadata").write_bytes(b"meta")
    return root


def _parts(cfg) -> dict:
    """The config slices an agent takes besides `[agent]`."""
    return {"peers": cfg.agents, "follow": cfg.follow, "transform_load": cfg.transform_load}


def _agent(tmp_path, store, name="a", clock=SYSTEM_CLOCK, **agent):
    cfg = parse_config({"store": {"uri": f"file://{store}"},
                        "agent": {"data_dir": str(tmp_path / name), "reclaim_interval_s": 0.1, **agent}})
    server, loc = start_in_process(LocalStore(str(store)), cfg.agent, clock=clock, **_parts(cfg))
    return server, loc


def _tcp_agent(tmp_path, store, name, peers=(), clock=SYSTEM_CLOCK, **agent):
    """A storage-node agent on loopback TCP (a copy's source must be a network agent it trusts:
    one of its `[agents] locations`, `peers`)."""
    cfg = parse_config({"store": {"uri": f"file://{store}"}, "agents": {"locations": list(peers)},
                        "agent": {"data_dir": str(tmp_path / name), "reclaim_interval_s": 0.1, **agent}})
    server = AgentServer(LocalStore(str(store)), cfg.agent, location="grpc://127.0.0.1:0", clock=clock, **_parts(cfg))
    return server, f"grpc://127.0.0.1:{server.port}"


def test_ranges_replicas_fanout_and_ttl(tmp_path, store):
    clock = FakeClock()                                            # the first agent's TTLs
    s1, l1 = _tcp_agent(tmp_path, store, "a1", clock=clock)
    s2, l2 = _tcp_agent(tmp_path, store, "a2", peers=[l1])
    c1, c2 = AgentClient(l1), AgentClient(l2)
    try:
        data = (store / "ckpt" / "a.bin").read_bytes()
        assert c1.read("ckpt/a.bin", 1000, 5000) == data[1000:6000]
        with pytest.raises(OSError) as exc:
            c1.read("ckpt/a.bin", 0, 10, replica_only=True)   # no replica yet
        assert c1.replicate("ckpt/a.bin", ttl_s=0.5)["size"] == len(data)
        # Tree fan-out: the second agent copies from the first, not from the store.
        assert c2.replicate("ckpt/a.bin", ttl_s=30, source=l1)["size"] == len(data)
        assert c2.read("ckpt/a.bin", 0, len(data), replica_only=True) == data
        load = c1.status()["load"]
        assert load["bytes_served"] + load["bytes_saved"] >= len(data)
        assert "ckpt/a.bin" in c1.status()["replicas"]
        clock.advance(0.4)
        assert s1.agent.catalog.expire() == []                    # not before its TTL
        clock.advance(0.2)
        s1.agent.catalog.expire()                                 # (what the reclaim loop does)
        assert c1.status()["replicas"] == {}                      # reclaimed at TTL
        assert "ckpt/a.bin" in c2.status()["replicas"]
        with pytest.raises(OSError) as exc:
            c1.read("ckpt/missing", 0, 1)
        assert exc.value.errno == errno.ENOENT
    finally:
        s1.shutdown()
        s2.shutdown()


def test_budget_refuses_replicas_that_do_not_fit(tmp_path, store):
    s, loc = _agent(tmp_path, store, budget_bytes=100_000)
    c = AgentClient(loc)
    try:
        c.replicate("ckpt/.metadata", ttl_s=30)
        with pytest.raises(OSError) as exc:
            c.replicate("ckpt/a.bin", ttl_s=30)
        assert exc.value.errno == errno.ENOSPC
        assert set(c.status()["replicas"]) == {"ckpt/.metadata"}
    finally:
        s.shutdown()


def test_token_required_when_configured(tmp_path, store, caplog):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    s, loc = _agent(tmp_path, store, token_file=str(token))
    try:
        assert AgentClient(loc, token="s3cret").ping()
        for bad in (None, "wrong"):
            with pytest.raises(OSError) as exc:
                AgentClient(loc, token=bad).read("ckpt/.metadata", 0, 4)
            assert exc.value.errno == errno.EACCES
        assert "without a valid token" in caplog.text
    finally:
        s.shutdown()


def test_bandwidth_limit_binds(tmp_path, store):
    clock = FakeClock()
    s, loc = _agent(tmp_path, store, clock=clock, bandwidth_bytes_s=2 << 20)
    c = AgentClient(loc)
    try:
        for i in range(4):                     # (plain: a.bin's byte ramp compresses to nothing)
            c.read("ckpt/a.bin", 0, 1 << 20, compress=False)   # 4 MiB at 2 MiB/s, 1 s burst: 1 s of waits
        assert clock.slept == pytest.approx(1.0)
    finally:
        s.shutdown()


def test_compressed_ranges_are_the_same_bytes_and_the_bucket_counts_what_is_sent(tmp_path, store):
    """A range that compresses (DCP's `.metadata`, a pickle: here text) is sent compressed and
    charged by what crosses the wire; one that does not (random bytes) is sent as it is. The
    mount's own agent (a unix socket on this host) is asked plainly."""
    text = b"".join(b"{'fqn': 'layers.%d.mlp.w', 'offsets': [0, %d], 'sizes': [4096, 128]}\n" % (i, i * 128)
                    for i in range(40_000))
    noise = os.urandom(1 << 20)
    (store / "ckpt" / ".metadata").write_bytes(text)
    (store / "ckpt" / "noise.bin").write_bytes(noise)
    clock = FakeClock()
    s, loc = _tcp_agent(tmp_path, store, "a", clock=clock, bandwidth_bytes_s=1 << 20)
    own, own_loc = _agent(tmp_path, store, "own")
    c = AgentClient(loc)
    try:
        assert AgentClient(own_loc).read("ckpt/.metadata", 0, len(text)) == text
        assert own.agent.reads.status().bytes_saved == 0
        for _ in range(4):                     # 4 x 3.1 MB of text: 4 x 0.15 MB on the wire, within the burst
            assert c.read("ckpt/.metadata", 0, len(text)) == text
        assert clock.slept == 0
        load = c.status()["load"]
        assert load["bytes_saved"] > 3 * len(text)
        assert load["bytes_served"] + load["bytes_saved"] == 4 * len(text)
        assert c.read("ckpt/noise.bin", 0, len(noise)) == noise
        after = c.status()["load"]
        assert after["bytes_saved"] == load["bytes_saved"]          # noise went as it is
        assert after["bytes_served"] == load["bytes_served"] + len(noise)
        assert c.read("ckpt/.metadata", 100, 50, compress=False) == text[100:150]
        assert c.status()["load"]["bytes_saved"] == load["bytes_saved"]
    finally:
        s.shutdown()
        own.shutdown()


def test_the_token_bucket_paces_by_its_clock():
    from hintfs.agent.reads import TokenBucket
    clock = FakeClock()
    bucket = TokenBucket(1000, clock)
    bucket.take(1000)                          # the burst: no wait
    assert clock.slept == 0
    bucket.take(500)                           # 500 bytes more than the tokens: half a second
    assert clock.slept == pytest.approx(0.5)
    clock.advance(10)                          # idle: the tokens refill to one second's worth only
    bucket.take(1500)
    assert clock.slept == pytest.approx(1.0)
    TokenBucket(0, clock).take(1 << 30)        # no limit
    assert clock.slept == pytest.approx(1.0)


def test_calibration_finds_the_knee(tmp_path, store):
    from hintfs.calibrate import calibrate
    # An agent that serves at most 2 reads at once: past 2 readers requests queue behind each other.
    s, loc = _agent(tmp_path, store, max_concurrent_reads=2, bandwidth_bytes_s=64 << 20)
    try:
        result = calibrate(loc, "ckpt/a.bin", 1 << 20, max_readers=16, seconds=0.6, block=256 << 10)
        levels = result["levels"]
        assert levels[0]["readers"] == 1 and all(lv["reads"] > 0 for lv in levels)
        assert 1 <= result["safe_readers_per_replica"] <= 8
        last = levels[-1]   # the level that stopped the search: its tail or its median doubled
        assert (last["p99_ms"] > 1.99 * last["p50_ms"] or last["p50_ms"] > 1.99 * levels[0]["p50_ms"]   # rounded to µs
                or last["readers"] == 16)
    finally:
        s.shutdown()


def test_tls(tmp_path, store):
    pytest.importorskip("cryptography")
    import datetime
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    from hintfs.agent.server import AgentServer
    cfg = parse_config({"store": {"uri": f"file://{store}"},
                        "agent": {"data_dir": str(tmp_path / "tls"), "tls_cert_file": str(tmp_path / "cert.pem"),
                                  "tls_key_file": str(tmp_path / "key.pem")}})
    server = AgentServer(LocalStore(str(store)), cfg.agent, location="grpc+tls://localhost:0", **_parts(cfg))
    try:
        c = AgentClient(f"grpc+tls://localhost:{server.port}", tls_root=(tmp_path / "cert.pem").read_bytes())
        assert c.read("ckpt/.metadata", 0, 4) == b"meta"
        with pytest.raises(OSError):   # a client that does not trust the certificate is refused
            AgentClient(f"grpc+tls://localhost:{server.port}", timeout_s=3).read("ckpt/.metadata", 0, 4)
    finally:
        server.shutdown()


def test_calibrate_command_and_its_older_spelling(tmp_path, store):
    from tests.conftest import run_hintfs
    s, loc = _agent(tmp_path, store, max_concurrent_reads=2, bandwidth_bytes_s=64 << 20)
    try:
        for argv in (["calibrate"], ["hints", "calibrate", "-", "-"]):
            r = run_hintfs(*argv, "--agent", loc, "--path", "ckpt/a.bin", "--max-readers", "2",
                           "--seconds", "0.2", "--block", str(64 << 10))
            assert r.returncode == 0, r.stderr
            assert "safe_readers_per_replica = " in r.stdout and "readers:" in r.stdout
        r = run_hintfs("calibrate", "--agent", loc)
        assert r.returncode != 0 and "needs --agent LOCATION --path RELPATH" in r.stderr
    finally:
        s.shutdown()

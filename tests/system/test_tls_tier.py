"""An eval mount reads checkpoints from its tier agent over TLS (`grpc+tls`), configured from
examples/eval-host/mnt-ckpt.toml and examples/eval-tier/tier.toml with only this machine's paths,
store and port put in: the token of `[agents] token_file`, the CA of `[agents] tls_root_file`.
A mount that does not trust the agent's certificate, or sends another token, is not served by
the tier (its reads go to the store, whole and right); a CA file that is missing or not a
certificate stops `hintfs mount` with one line. Storage agents copy from each other over TLS
(examples/storage-node/storage.toml's `[agents] tls_root_file`)."""
from __future__ import annotations

import os
import tomllib

import pytest

pytest.importorskip("cryptography")
import tomli_w  # noqa: E402

from hintfs.agent.client import AgentClient  # noqa: E402
from hintfs.agent.server import AgentServer  # noqa: E402
from hintfs.stores.local import LocalStore  # noqa: E402
from mountconfig import parse_config  # noqa: E402
from tests.conftest import needs_fuse, wait_for  # noqa: E402
from tests.helpers.certs import make_ca, write_token  # noqa: E402
from tests.helpers.mounts import Mounted, MountError, force_unmount, mount_in_process  # noqa: E402
from tests.deploy.examples import EXAMPLES  # noqa: E402


def _example(name: str) -> dict:
    return tomllib.loads((EXAMPLES / name).read_text())


def _local_store(doc: dict, store) -> dict:
    """The example with this machine's file:// store in place of its S3 one."""
    doc["store"] = {"uri": f"file://{store}"}
    doc.pop("cache", None)     # (a remote store's spool)
    return doc


def _tls_agent(example: str, tmp_path, store, name: str, cert, key, token_file, peers: dict | None = None,
               port: int = 0, **agent):
    """The agent of `example` on localhost with TLS, this machine's paths in place of its own
    (its `[agents]` peers: `peers`, none by default)."""
    doc = _local_store(_example(example), store)
    doc["agents"] = peers or {}
    doc["agent"].update({"token_file": str(token_file), "tls_cert_file": str(cert), "tls_key_file": str(key),
                         "data_dir": str(tmp_path / name), "budget_bytes": 1 << 30, **agent})
    doc["agent"].pop("local_socket", None)
    doc["agent"].pop("location")
    cfg = parse_config(doc, example)
    server = AgentServer(LocalStore(str(store)), cfg.agent, location=f"grpc+tls://localhost:{port}",
                         peers=cfg.agents, follow=cfg.follow, transform_load=cfg.transform_load)
    return server, f"grpc+tls://localhost:{server.port}"


@pytest.fixture
def checkpoint(tmp_path):
    store = tmp_path / "store"
    ck = store / "ckpt" / "run" / "step_10"
    ck.mkdir(parents=True)
    payload = {f"__{i}_0.distcp": os.urandom(200_000 + i) for i in range(3)}
    for name, data in payload.items():
        (ck / name).write_bytes(data)
    (ck / ".metadata").write_bytes(b"metadata")   # the commit marker
    payload[".metadata"] = b"metadata"
    return store, payload


@pytest.fixture
def tier(tmp_path, checkpoint):
    """The eval DC's tier agent of the example, over TLS, holding the checkpoint (its follower
    copied it: the example's `[follow] prefixes`)."""
    store, _ = checkpoint
    ca = make_ca(tmp_path / "tls")
    cert, key = ca.host(tmp_path / "tls", "localhost")
    token = write_token(tmp_path / "tier.token", "tier-secret")
    server, loc = _tls_agent("eval-tier/tier.toml", tmp_path, store, "tier", cert, key, token)
    try:
        server.agent.follower.step(wait=True)
        assert server.agent.follower.status()["complete"] == ["ckpt/run/step_10"]
        yield ca, token, server, loc
    finally:
        server.shutdown()


class _Mounts:
    def __init__(self, tmp_path, store):
        self.tmp_path, self.store, self.mounted = tmp_path, store, []

    def mount(self, name: str, loc: str, token_file, tls_root_file, example: str = "eval-host/mnt-ckpt.toml") -> Mounted:
        """The mount of `example` with this machine's store, token, CA and tier agent `loc`."""
        doc = _local_store(_example(example), self.store)
        doc["agents"] = {"token_file": str(token_file), "tls_root_file": str(tls_root_file)}   # no storage agents
        for route in doc.get("routes", []):
            assert route["local_agent"].startswith("grpc+tls://")
            route["local_agent"] = loc
        if "stream" in doc:
            assert all(a.startswith("grpc+tls://") for a in doc["stream"]["agents"])
            doc["stream"].update({"agents": [loc], "token_file": str(token_file)})
        base = self.tmp_path / name
        (base / "mnt").mkdir(parents=True)
        log = base / "mount.log"
        doc["logging"] = {"file": str(log), "level": "DEBUG"}
        doc["agent"] = {"data_dir": str(base / "replicas")}   # its in-process agent
        doc.pop("metrics", None)   # (the host's port 9464: other tests' mounts may serve it)
        cfg = base / "mnt-ckpt.toml"
        cfg.write_text(tomli_w.dumps(doc))
        mount_in_process(cfg, base / "mnt", log)
        m = Mounted(self.store, base / "mnt", cfg, log)
        self.mounted.append(m)
        return m

    def close(self):
        for m in self.mounted:
            try:
                m.umount()
            finally:
                force_unmount(m.mnt)


@pytest.fixture
def evals(tmp_path, checkpoint):
    e = _Mounts(tmp_path, checkpoint[0])
    yield e
    e.close()


def _read_all(m: Mounted, payload: dict) -> None:
    for name, data in payload.items():
        assert (m.mnt / "ckpt" / "run" / "step_10" / name).read_bytes() == data


@needs_fuse
def test_eval_mount_reads_from_its_tier_agent_over_tls(tier, evals, checkpoint):
    ca, token, server, loc = tier
    _, payload = checkpoint
    load = AgentClient(loc, token="tier-secret", tls_root=ca.pem.read_bytes()).status()["load"]
    served = load["bytes_served"] + load["bytes_saved"]     # (sent, and what compressed ranges saved)
    m = evals.mount("eval", loc, token, ca.pem)
    _read_all(m, payload)
    counters = m.stats()["counters"]
    assert counters.get("route_local", 0) >= len(payload) and counters.get("route_remote", 0) == 0, counters
    assert counters.get("replica_reads", 0) >= len(payload) - 1, counters
    load = AgentClient(loc, token="tier-secret", tls_root=ca.pem.read_bytes()).status()["load"]
    after = load["bytes_served"] + load["bytes_saved"]
    assert after - served >= sum(len(d) for d in payload.values() if len(d) > 100)


@needs_fuse
def test_a_tier_restarted_with_a_new_certificate_serves_the_running_mount(tmp_path, checkpoint, evals):
    """docs/deploy.md's certificate rotation: a new host certificate from the same CA, the agent
    restarted on its port; the mount, untouched, is served by the new instance."""
    store, payload = checkpoint
    ca = make_ca(tmp_path / "tls")
    token = write_token(tmp_path / "tier.token", "tier-secret")
    cert, key = ca.host(tmp_path / "tls" / "old", "localhost")
    server, loc = _tls_agent("eval-tier/tier.toml", tmp_path, store, "tier-old", cert, key, token)
    try:
        server.agent.follower.step(wait=True)
        m = evals.mount("eval", loc, token, ca.pem)
        _read_all(m, payload)
        before = m.stats()["counters"].get("route_local", 0)
        assert before >= len(payload)
    finally:
        server.shutdown()
    # The next checkpoint, served by the agent restarted with its new certificate.
    step = store / "ckpt" / "run" / "step_11"
    step.mkdir()
    (step / "w.distcp").write_bytes(os.urandom(100_000))
    (step / ".metadata").write_bytes(b"metadata 11")
    cert, key = ca.host(tmp_path / "tls" / "new", "localhost")
    server, loc2 = _tls_agent("eval-tier/tier.toml", tmp_path, store, "tier-new", cert, key, token,
                              port=int(loc.rsplit(":", 1)[1]))
    try:
        assert loc2 == loc
        server.agent.follower.step(wait=True)
        assert "ckpt/run/step_11" in server.agent.follower.status()["complete"]

        def served() -> bool:
            data = (m.mnt / "ckpt" / "run" / "step_11" / "w.distcp").read_bytes()
            assert data == (step / "w.distcp").read_bytes()
            return m.stats()["counters"].get("route_local", 0) > before
        assert wait_for(served, 15), m.log.read_text()[-2000:]
    finally:
        server.shutdown()


@needs_fuse
def test_a_mount_that_does_not_trust_the_tier_or_has_another_token_is_not_served(tier, evals, checkpoint,
                                                                                    tmp_path):
    ca, token, server, loc = tier
    _, payload = checkpoint
    other_ca = make_ca(tmp_path / "other", "another CA")
    untrusting = evals.mount("untrusting", loc, token, other_ca.pem)
    _read_all(untrusting, payload)                 # from the store, whole
    counters = untrusting.stats()["counters"]
    assert counters.get("route_local", 0) == 0 and counters.get("replica_reads", 0) == 0, counters
    assert "certificate verify failed" in untrusting.log.read_text()   # the log says why

    # A CA being rotated: ca.pem holds the new CA and the old one, and either signature is trusted.
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(other_ca.pem.read_bytes() + ca.pem.read_bytes())
    rotating = evals.mount("rotating", loc, token, bundle)
    _read_all(rotating, payload)
    assert rotating.stats()["counters"].get("route_local", 0) >= len(payload)

    stranger = evals.mount("stranger", loc, write_token(tmp_path / "wrong.token", "not-the-token"), ca.pem)
    _read_all(stranger, payload)
    counters = stranger.stats()["counters"]
    assert counters.get("route_local", 0) == 0 and counters.get("replica_reads", 0) == 0, counters
    assert "wrong token" in stranger.log.read_text()


@needs_fuse
def test_a_bad_tls_root_file_stops_the_mount_in_one_line(tier, evals, tmp_path):
    ca, token, server, loc = tier
    not_pem = tmp_path / "not-a-cert.pem"
    not_pem.write_text("hello\n")
    for path, why in ((tmp_path / "missing.pem", "No such file or directory"), (not_pem, "holds no PEM certificate")):
        with pytest.raises(MountError) as exc:
            evals.mount(f"bad-{path.stem}", loc, token, path)
        first = str(exc.value).splitlines()[0]
        assert str(path) in first and why in first and "Traceback" not in first, first


@needs_fuse
def test_the_training_mount_streams_to_the_tier_over_tls(tier, evals, checkpoint):
    """examples/training-host/mnt-ckpt.toml's `[stream]`: each file under `ckpt` goes to the tier
    while it is written, over grpc+tls with `[stream] token_file`, trusting `[agents] tls_root_file`
    (the sender child gets both from the mount), and is a replica there at its close."""
    ca, token, server, loc = tier
    train = evals.mount("train", loc, token, ca.pem, example="training-host/mnt-ckpt.toml")
    c = AgentClient(loc, token="tier-secret", tls_root=ca.pem.read_bytes())
    published = c.status()["streams"]["published"]
    data = os.urandom(300_000)
    rel = "ckpt/run/step_20/__0_0.distcp"
    (train.mnt / "ckpt" / "run" / "step_20").mkdir(parents=True)
    (train.mnt / rel).write_bytes(data)
    st = os.stat(train.store / rel)
    assert wait_for(lambda: c.status()["streams"]["published"] > published, 15), train.log.read_text()[-2000:]
    assert wait_for(lambda: c.has(rel, st.st_size, st.st_mtime_ns), 10)
    assert c.read(rel, 0, len(data), replica_only=True) == data


def test_storage_agents_copy_from_each_other_over_tls(tmp_path, checkpoint):
    """Fan-out between the storage nodes of examples/storage-node/storage.toml: the copying agent
    checks its peer's certificate against `[agents] tls_root_file` and sends `[agents] token_file`."""
    store, payload = checkpoint
    ca = make_ca(tmp_path / "tls")
    cert, key = ca.host(tmp_path / "tls", "localhost")
    token = write_token(tmp_path / "agent.token", "storage-secret")
    s1, l1 = _tls_agent("storage-node/storage.toml", tmp_path, store, "s1", cert, key, token)
    servers = [s1]
    try:
        peers = {"locations": [l1], "token_file": str(token), "tls_root_file": str(ca.pem)}
        s2, l2 = _tls_agent("storage-node/storage.toml", tmp_path, store, "s2", cert, key, token, peers=peers)
        servers.append(s2)
        c1 = AgentClient(l1, token="storage-secret", tls_root=ca.pem.read_bytes())
        c2 = AgentClient(l2, token="storage-secret", tls_root=ca.pem.read_bytes())
        path = "ckpt/run/step_10/__0_0.distcp"
        data = payload["__0_0.distcp"]
        assert c1.replicate(path, ttl_s=60)["size"] == len(data)
        before = c1.status()["load"]["bytes_served"]
        assert c2.replicate(path, ttl_s=60, source=l1)["size"] == len(data)   # from its peer, over TLS
        assert c2.read(path, 0, len(data), replica_only=True) == data
        assert c1.status()["load"]["bytes_served"] - before >= len(data)
        # `hintfs calibrate`'s measurement reaches a grpc+tls agent too (its CA given).
        from hintfs.calibrate import calibrate
        result = calibrate(l1, path, len(data), max_readers=2, seconds=0.2, block=64 << 10, token="storage-secret",
                           tls_root=ca.pem.read_bytes())
        assert all(level["reads"] > 0 for level in result["levels"]), result
        # and the command, with the CA's file
        import subprocess
        import sys
        cli = subprocess.run([sys.executable, "-m", "hintfs.cli", "calibrate", "--agent", l1, "--path", path,
                              "--token-file", str(token), "--tls-root-file", str(ca.pem), "--max-readers", "2",
                              "--seconds", "0.2", "--block", str(64 << 10)], capture_output=True, text=True, timeout=120)
        assert cli.returncode == 0 and "safe_readers_per_replica = " in cli.stdout, cli.stderr
    finally:
        for s in servers:
            s.shutdown()

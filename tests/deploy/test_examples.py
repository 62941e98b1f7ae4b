"""examples/: one complete config per role, each loaded by the real loaders (mountconfig), and
the files of different roles agree with each other: the addresses, ports, tokens, TLS roots,
prefixes and sockets one role names are those the other role serves. docs/deploy.md is the guide
they belong to; tests/deploy/test_units.py checks them against the systemd units."""
from __future__ import annotations

import re
import tomllib
from urllib.parse import urlparse

import pytest

from mountconfig import ConfigError, parse_config
from tests.deploy.examples import EXAMPLES, REPO, ROLE_OF_FOLDER, all_examples, example_files, load_example

EX = all_examples()
TRAIN = EX["training-host/mnt-ckpt.toml"]
EVAL = EX["eval-host/mnt-ckpt.toml"]
TIER = EX["eval-tier/tier.toml"]
STORAGE = EX["storage-node/storage.toml"]
GPU = EX["gpu-host/governor.toml"]


def _host_port(location: str) -> tuple[str, int]:
    url = urlparse(location)
    assert url.hostname and url.port, location
    return url.hostname, url.port


def _serves(agent, location: str) -> bool:
    """`location` (what a client dials) reaches `agent`'s `[agent] location` (what it binds):
    the same scheme and port, and the bound host is every interface or that host."""
    bound, dialed = urlparse(agent.cfg.agent.location), urlparse(location)
    return (bound.scheme == dialed.scheme and bound.port == dialed.port
            and bound.hostname in ("0.0.0.0", "::", dialed.hostname))


@pytest.mark.parametrize("path", example_files(), ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_every_example_loads_through_the_real_loaders_and_says_how_to_run_it(path):
    assert str(path.parent.relative_to(EXAMPLES)).replace(".", "") in ROLE_OF_FOLDER, \
        f"{path.name}: a new example folder needs its role in tests/deploy/examples.py"
    ex = load_example(path)   # load_config and load_governor_config: a bad key fails here
    text = path.read_text()
    # The header says how it is installed and started, under the instance name its file gives.
    assert f"systemctl enable --now hintfs-{ex.role}@{ex.instance}" in text, text.splitlines()[:6]
    if path.parent != EXAMPLES:
        assert f"examples/{ex.name} /etc/hintfs/{path.name}" in text
    if ex.role == "governor":
        assert "governor" in tomllib.loads(text) and set(tomllib.loads(text)) == {"governor"}
    else:
        assert "store" in tomllib.loads(text), "a mount or an agent names its store"


def test_the_installed_example_is_still_the_quick_starts():
    """`make install` installs examples/srv-ckpt.toml (the Makefile's EXAMPLE_CONFIG)."""
    assert "EXAMPLE_CONFIG := srv-ckpt.toml" in (REPO / "Makefile").read_text()
    ex = EX["srv-ckpt.toml"]
    assert ex.cfg.store.uri == "file:///srv/data" and ex.mountpoint == "/srv/ckpt"


def test_roles_have_their_sections():
    assert TRAIN.cfg.journal.enabled and TRAIN.cfg.stream.prefixes and TRAIN.cfg.stream.agents
    assert not TRAIN.cfg.routes and not EVAL.cfg.journal.enabled and not EVAL.cfg.stream.prefixes
    assert EVAL.cfg.routes and EVAL.cfg.agents.token_file
    assert TIER.cfg.follow.prefixes and TIER.cfg.agent.token_file and TIER.cfg.agent.local_socket
    assert STORAGE.cfg.agent.token_file and STORAGE.cfg.agents.locations and not STORAGE.cfg.follow.prefixes
    assert len(GPU.governor.gpus) == 8 and all(g.total_bytes is None for g in GPU.governor.gpus)   # NVML


def test_one_store_for_every_role():
    """Training and eval mounts and both agents are views of the same store (the eval DC's
    across the link): a replica is only ever served for the store's own version."""
    stores = {(e.cfg.store.uri, e.cfg.store.endpoint_override) for e in (TRAIN, EVAL, TIER, STORAGE)}
    assert len(stores) == 1, stores


def test_everything_that_crosses_hosts_is_tls():
    """Every agent listens with grpc+tls and a certificate, and every client of one trusts the
    same CA file (`[agents] tls_root_file`, also what `[stream]` uses)."""
    for agent in (TIER, STORAGE):
        a = agent.cfg.agent
        assert a.location.startswith("grpc+tls://") and a.tls_cert_file and a.tls_key_file, agent.name
        assert a.auth == "token" and a.token_file, agent.name
    dialed = [*TRAIN.cfg.agents.locations, *TRAIN.cfg.stream.agents, *(r.local_agent for r in EVAL.cfg.routes),
              *STORAGE.cfg.agents.locations]
    assert dialed and all(loc.startswith("grpc+tls://") for loc in dialed), dialed
    roots = {e.cfg.agents.tls_root_file for e in (TRAIN, EVAL, STORAGE)}
    assert len(roots) == 1 and None not in roots, roots
    # Each agent's certificate and key, and the CA, are separate files, absolute paths.
    files = [TIER.cfg.agent.tls_cert_file, TIER.cfg.agent.tls_key_file, *roots]
    assert all(f and f.startswith("/etc/hintfs/") for f in files) and len(set(files)) == len(files)


def test_the_training_mount_streams_to_the_tier_agent_with_its_token():
    assert all(_serves(TIER, loc) for loc in TRAIN.cfg.stream.agents)
    assert TRAIN.cfg.stream.token_file == TIER.cfg.agent.token_file
    # What it streams is what the tier takes streams into and follows.
    assert set(TRAIN.cfg.stream.prefixes) == set(TIER.cfg.follow.prefixes)
    assert TIER.cfg.agent.stream_prefixes is None   # unset: the [follow] prefixes
    # The journal it writes is the one the tier follows.
    assert TRAIN.cfg.journal.dir == TIER.cfg.follow.journal_dir


def test_the_eval_mount_routes_to_the_tier_agent_with_its_token():
    """What the issue had to guess: the eval mount authenticates to its tier agent with
    `[agents] token_file` (the same file as the agent's `[agent] token_file`)."""
    for route in EVAL.cfg.routes:
        assert _serves(TIER, route.local_agent), route.local_agent
        assert route.prefix in TIER.cfg.follow.prefixes
    assert EVAL.cfg.agents.token_file == TIER.cfg.agent.token_file


def test_the_eval_mount_on_the_tier_host_names_the_agents_socket():
    """The commented `local_socket` line of the eval example, for a mount on the tier host
    itself, loads and names the tier agent's `[agent] local_socket`."""
    text = EVAL.path.read_text()
    line = re.search(r"^# (local_socket = .*?)(?:\s+#.*)?$", text, re.M)
    assert line, "the eval example shows the co-located route's local_socket"
    cfg = parse_config(tomllib.loads(text.replace(line.group(0), line.group(1))), "co-located eval mount")
    assert cfg.routes[0].local_socket == TIER.cfg.agent.local_socket
    assert cfg.routes[0].local_socket_uid == 0   # the agent runs as root under its unit


def test_the_training_mount_and_the_storage_agents_agree():
    """Restart storms: the training mount hints replicas on the storage agents; the agents copy
    from each other (fan-out), so each lists the others as trusted peers, with their token."""
    assert TRAIN.cfg.agents.locations and all(_serves(STORAGE, loc) for loc in TRAIN.cfg.agents.locations)
    assert set(STORAGE.cfg.agents.locations) == set(TRAIN.cfg.agents.locations)
    assert TRAIN.cfg.agents.token_file == STORAGE.cfg.agents.token_file == STORAGE.cfg.agent.token_file
    # The storage agents' token is not the tier's: a training host's hint token cannot feed the tier.
    assert STORAGE.cfg.agent.token_file != TIER.cfg.agent.token_file


def test_ports_and_hosts_are_the_documented_ones():
    """docs/deploy.md's table of hosts and ports names what the examples name."""
    doc = (REPO / "docs" / "deploy.md").read_text()
    for loc in {*TRAIN.cfg.agents.locations, *TRAIN.cfg.stream.agents, *(r.local_agent for r in EVAL.cfg.routes)}:
        host, port = _host_port(loc)
        assert host in doc and str(port) in doc, loc
    for path in (TIER.cfg.agent.local_socket, GPU.governor.socket_path, TIER.cfg.agent.token_file,
                 STORAGE.cfg.agent.token_file, EVAL.cfg.agents.tls_root_file):
        assert path in doc, path
    for ex in EX.values():
        assert ex.name in doc, f"docs/deploy.md does not name examples/{ex.name}"


def test_the_picture_is_its_scripts_output():
    """docs/deploy.svg is what docs/deploy_diagram.py writes (edit the script, then run it), it is
    well-formed SVG, and it names every example and the ports and sockets the examples use."""
    import subprocess
    import sys
    import xml.etree.ElementTree as ET
    r = subprocess.run([sys.executable, str(REPO / "docs" / "deploy_diagram.py"), "--check"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    svg = (REPO / "docs" / "deploy.svg").read_text()
    assert ET.fromstring(svg).tag == "{http://www.w3.org/2000/svg}svg"
    for ex in EX.values():
        if ex.name != "srv-ckpt.toml":   # the single-host quick start is not in the picture
            assert ex.name in svg, ex.name
    for needle in (":8815", TIER.cfg.agent.local_socket, GPU.governor.socket_path.rsplit("/", 1)[1],
                   TIER.cfg.agent.token_file, STORAGE.cfg.agent.token_file, EVAL.cfg.agents.tls_root_file):
        assert needle in svg, needle


def test_an_agent_on_grpc_tls_without_its_certificate_and_key_is_refused_in_one_line():
    """(gRPC itself only says it could not listen, which reads like a busy port.)"""
    doc = tomllib.loads(TIER.path.read_text())
    del doc["agent"]["tls_key_file"]
    with pytest.raises(ConfigError, match=r"^tier: agent: tls_cert_file and tls_key_file go together") as exc:
        parse_config(doc, "tier")
    assert "\n" not in str(exc.value)
    del doc["agent"]["tls_cert_file"]
    with pytest.raises(ConfigError, match=r"location grpc\+tls://0.0.0.0:8815 needs tls_cert_file and tls_key_file"):
        parse_config(doc, "tier")

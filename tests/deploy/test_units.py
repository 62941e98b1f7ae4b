"""The systemd units of systemd/ work with the examples of examples/: each example's daemon can
write what it writes (sockets, state, caches, logs) under its unit's sandbox, the folders it
expects to exist are made by the unit, and the sockets other processes reach are not hidden in
a private /tmp. The unit files are read the way systemd reads them (repeated keys add up)."""
from __future__ import annotations

import os

import pytest

from tests.deploy.examples import REPO, Example, all_examples, shared_sockets, writable_paths

UNITS = REPO / "systemd"
EX = all_examples()


def read_unit(text: str, instance: str) -> dict[str, list[str]]:
    """[Service] settings: key -> values, %i replaced by `instance` (a list-valued key given
    again adds to it, as in systemd; an empty assignment resets it)."""
    out: dict[str, list[str]] = {}
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        if section != "Service" or "=" not in line:
            continue
        key, value = (s.strip() for s in line.split("=", 1))
        value = value.replace("%i", instance)
        if not value:
            out[key] = []
        else:
            out.setdefault(key, []).extend(value.split())
    return out


def _under(path: str, folder: str) -> bool:
    return os.path.normpath(path) == os.path.normpath(folder) or path.startswith(folder.rstrip("/") + "/")


class Sandbox:
    """What a service of this unit may write, and which folders systemd makes for it."""

    PREFIX = {"RuntimeDirectory": "/run", "StateDirectory": "/var/lib", "CacheDirectory": "/var/cache",
              "LogsDirectory": "/var/log"}

    def __init__(self, service: dict[str, list[str]]):
        self.service = service
        self.made = [f"{root}/{d}" for key, root in self.PREFIX.items() for d in service.get(key, [])]
        self.protect = (service.get("ProtectSystem") or ["no"])[-1]
        self.private_tmp = (service.get("PrivateTmp") or ["no"])[-1] in ("yes", "true", "1")
        self.read_only = [p.lstrip("-") for p in service.get("ReadOnlyPaths", []) + service.get("InaccessiblePaths", [])]
        if (service.get("ProtectHome") or ["no"])[-1] in ("yes", "true", "read-only", "tmpfs"):
            self.read_only += ["/home", "/root", "/run/user"]
        self.read_write = [p.lstrip("-") for p in service.get("ReadWritePaths", [])] + self.made

    def writable(self, path: str) -> bool:
        if any(_under(path, d) for d in self.read_write):
            return True
        if any(_under(path, d) for d in self.read_only):
            return False
        if self.protect == "strict":
            return self.private_tmp and (_under(path, "/tmp") or _under(path, "/var/tmp"))
        ro = {"yes": ["/usr", "/boot", "/efi"], "true": ["/usr", "/boot", "/efi"],
              "full": ["/usr", "/boot", "/efi", "/etc"]}.get(self.protect, [])
        return not any(_under(path, d) for d in ro)

    def private(self, path: str) -> bool:
        """Seen by this service only (its private /tmp)."""
        return self.private_tmp and (_under(path, "/tmp") or _under(path, "/var/tmp"))


def sandbox_of(ex: Example, text: str | None = None) -> Sandbox:
    return Sandbox(read_unit(text if text is not None else (UNITS / ex.unit).read_text(), ex.instance))


IDS = sorted(EX)


@pytest.mark.parametrize("name", IDS)
def test_the_unit_lets_the_example_write_what_it_writes(name):
    ex = EX[name]
    box = sandbox_of(ex)
    blocked = {what: p for what, p in writable_paths(ex).items() if not box.writable(p)}
    assert not blocked, f"{ex.unit} (instance {ex.instance}) cannot write {blocked}"


@pytest.mark.parametrize("name", IDS)
def test_the_sockets_others_reach_are_made_by_the_unit_and_not_private(name):
    ex = EX[name]
    box = sandbox_of(ex)
    for what, sock in shared_sockets(ex).items():
        assert not box.private(sock), f"{what} {sock} is in {ex.unit}'s private /tmp: no other process sees it"
        # The daemon binds the socket in a folder it does not make (the agent's fd server; the
        # governor's lock files live beside its socket): the unit makes it, root's, 0755.
        folder = os.path.dirname(sock)
        assert folder in box.made, f"{what} {sock}: {ex.unit} does not make {folder} (RuntimeDirectory=)"
        mode = (box.service.get("RuntimeDirectoryMode") or ["0755"])[-1]
        assert int(mode, 8) & 0o022 == 0, f"{folder} would be writable by others ({mode})"


@pytest.mark.parametrize("name", IDS)
def test_the_unit_runs_the_example_as_installed(name):
    ex = EX[name]
    service = sandbox_of(ex).service
    argv = service["ExecStart"]
    assert argv[:3] == ["/usr/local/bin/hintfs", ex.role, f"/etc/hintfs/{ex.instance}.toml"], argv
    if ex.role == "mount":
        # The mount's unit keeps the host's mount namespace: a sandbox would hide the FUSE mount.
        for key in ("ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "ReadOnlyPaths"):
            assert key not in service, f"{ex.unit} sets {key}"
        assert ex.mountpoint and argv[3] == "%f"


def test_the_check_catches_the_old_agent_unit():
    """The agent unit before issue 38 (only /var/lib/hintfs writable) could neither bind the tier
    example's local_socket under /run/hintfs nor make a remote store's spool folder."""
    old = """[Service]
ExecStart=/usr/local/bin/hintfs agent /etc/hintfs/%i.toml
StateDirectory=hintfs
ProtectSystem=strict
ReadWritePaths=/var/lib/hintfs
PrivateTmp=yes
"""
    tier = EX["eval-tier/tier.toml"]
    box = sandbox_of(tier, old)
    blocked = {what for what, p in writable_paths(tier).items() if not box.writable(p)}
    assert blocked == {"[cache] spool_dir", "[agent] local_socket's folder"}
    assert box.writable(tier.cfg.agent.data_dir)
    home = sandbox_of(tier, "[Service]\nProtectHome=read-only\n")   # no ProtectSystem: all but /home, /root
    assert not home.writable("/root/replicas") and home.writable("/var/lib/x") and home.writable("/srv/x")
    # A socket in /tmp would be writable but private to the service.
    assert box.private("/tmp/tier.sock") and box.writable("/tmp/tier.sock")


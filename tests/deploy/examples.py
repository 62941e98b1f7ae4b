"""The per-role examples of examples/ as the deploy tests see them: which role each file is,
which unit runs it under which instance name, and the paths it needs to write or share."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from mountconfig import MountConfig, load_config
from mountconfig.governor import GovernorConfig, load_governor_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

# examples/<folder>/<instance>.toml -> the role and the unit that runs it (`make install` puts
# examples/srv-ckpt.toml in /etc/hintfs; the others are copied there by the operator).
ROLE_OF_FOLDER = {
    "": "mount",   # examples/srv-ckpt.toml
    "training-host": "mount",
    "eval-host": "mount",
    "storage-node": "agent",
    "eval-tier": "agent",
    "gpu-host": "governor",
}


@dataclass
class Example:
    path: Path
    role: str          # mount | agent | governor
    cfg: MountConfig
    governor: GovernorConfig

    @property
    def name(self) -> str:
        return str(self.path.relative_to(EXAMPLES))

    @property
    def instance(self) -> str:
        """The unit's instance name: the config is /etc/hintfs/%i.toml."""
        return self.path.stem

    @property
    def unit(self) -> str:
        return f"hintfs-{self.role}@.service"

    @property
    def mountpoint(self) -> str | None:
        """A mount unit's instance is the escaped mountpoint (`systemd-escape --path`)."""
        return "/" + self.instance.replace("-", "/") if self.role == "mount" else None


def example_files() -> list[Path]:
    return sorted(EXAMPLES.rglob("*.toml"))


def load_example(path: Path) -> Example:
    folder = str(path.parent.relative_to(EXAMPLES)).replace(".", "")
    role = ROLE_OF_FOLDER[folder]
    # `hintfs governor` reads the [governor] table only; mounts and agents the whole file.
    cfg = MountConfig() if role == "governor" else load_config(path)
    return Example(path, role, cfg, load_governor_config(path))


def all_examples() -> dict[str, Example]:
    return {e.name: e for e in map(load_example, example_files())}


def remote_store(cfg: MountConfig) -> bool:
    return urlparse(cfg.store.uri).scheme != "file"


def writable_paths(ex: Example) -> dict[str, str]:
    """What the example's daemon creates or writes on its host: {what: absolute path}."""
    cfg, out = ex.cfg, {}
    if ex.role == "governor":
        out["[governor] socket_path's folder"] = os.path.dirname(ex.governor.socket_path)
        return out
    if remote_store(cfg):
        out["[cache] spool_dir"] = cfg.cache.spool_dir
    elif ex.role == "mount":
        out["the file:// store (writes)"] = urlparse(cfg.store.uri).path
    if ex.role == "mount" and cfg.cache.dir:
        out["[cache] dir"] = cfg.cache.dir
    if ex.role == "mount" and cfg.metrics.enabled:   # the host's exporter: snapshots and the port's lock
        out["[metrics] dir"] = cfg.metrics.dir or "/run/hintfs/metrics"   # (unset, as root)
    if cfg.logging.file:
        out["[logging] file's folder"] = os.path.dirname(cfg.logging.file)
    if ex.role == "agent" or not cfg.agents.locations:   # an agent, or a mount's in-process agent
        out["[agent] data_dir"] = cfg.agent.data_dir
    if ex.role == "agent" and cfg.agent.local_socket:
        out["[agent] local_socket's folder"] = os.path.dirname(cfg.agent.local_socket)
    return out


def shared_sockets(ex: Example) -> dict[str, str]:
    """Sockets other processes of the host must reach (so never in a private /tmp)."""
    if ex.role == "governor":
        return {"[governor] socket_path": ex.governor.socket_path}
    if ex.role == "agent" and ex.cfg.agent.local_socket:
        return {"[agent] local_socket": ex.cfg.agent.local_socket}
    return {}

"""Typed configuration of the GPU-memory governor (the `[governor]` table of the project TOML).

No torch here: the daemon and the mount config import this module.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hintfs.common.errors import validation_message

GiB = 1 << 30
MiB = 1 << 20
MAX_CARD_BYTES = 1 << 50        # 1 PiB: far above any GPU, far below what a uint64 word holds


class GovernorConfigError(ValueError):
    """A user mistake in the governor configuration; `str()` is one line naming key and problem."""


class GpuConfig(BaseModel):
    """One GPU the governor keeps a ledger for."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(0, ge=0, description="CUDA device index as the clients see it. The card "
                       "whose memory is read for an unset total_bytes is NVML's of this index (PCI "
                       "order, CUDA's with CUDA_DEVICE_ORDER=PCI_BUS_ID), through the daemon's own "
                       "CUDA_VISIBLE_DEVICES if it has one.")
    total_bytes: int | None = Field(
        None,
        gt=0,
        le=MAX_CARD_BYTES,
        description="Bytes the ledger may hand out on this GPU; clients are told this number, not "
        "the driver's. None: the card's memory, read from the driver (NVML) at start; a host "
        "without one must set it. Set it lower to emulate a smaller card.",
    )
    reserve_bytes: int = Field(
        2 * GiB,
        ge=0,
        le=MAX_CARD_BYTES,
        description="Bytes never handed out: CUDA contexts, cuBLAS/cuDNN workspaces, fragmentation.",
    )

    @model_validator(mode="after")
    def _reserve_below_total(self) -> GpuConfig:
        if self.total_bytes is not None and self.reserve_bytes >= self.total_bytes:
            raise ValueError("reserve_bytes must be smaller than total_bytes")
        return self


class GovernorConfig(BaseModel):
    """Everything `hintfs governor CONFIG` needs; every field has a default."""

    model_config = ConfigDict(extra="forbid")

    socket_path: str = Field(
        "/run/hintfs/governor.sock",
        description="Unix stream socket for registration and blocking requests (reserve, release). "
        "Its folder holds the daemon's lock files (one per GPU, recording the running instance) "
        "and must be owned by root or the daemon's user and writable by no one else.",
    )
    shm_name: str = Field(
        "hintfs-governor",
        pattern=r"^[A-Za-z0-9_.-]{1,200}$",
        description="Name of this governor's instance: its lock file in the socket's folder, and "
        "the prefix of the shared-memory blocks (anonymous memfds, one per client, each instance "
        "its own) that hold the quota/command/ack words.",
    )
    max_clients: int = Field(
        64, ge=1, le=4096, description="Clients (registrations) per GPU."
    )
    # --- who may use it --------------------------------------------------------------------
    socket_group: int | str | None = Field(
        None,
        description="Group (gid or name) that owns the socket (mode 0660): its members may "
        "connect. None: only the daemon's user, and the users of allowed_uids/allowed_gids.",
    )
    allowed_uids: list[int] = Field(
        default_factory=list, max_length=4096,
        description="Users (uids) who may connect besides the daemon's own. With any (or any "
        "allowed_gids) the socket is 0666 and the daemon checks every peer (SO_PEERCRED) at "
        "accept; others are closed at once, with one log line.",
    )
    allowed_gids: list[int] = Field(
        default_factory=list, max_length=4096,
        description="Groups whose members (primary or supplementary group of the connecting "
        "process) may connect.",
    )
    max_connections: int = Field(
        1024, ge=1, le=1 << 20, description="Open connections, all users together."
    )
    max_connections_per_uid: int = Field(
        64, ge=1, le=1 << 20, description="Open connections of one user (registered or not)."
    )
    max_clients_per_uid: int = Field(
        16, ge=1, le=4096, description="Registrations of one user, all GPUs together."
    )
    max_reserves_in_flight_per_uid: int = Field(
        8, ge=1, le=4096,
        description="Reservations of one user waiting at once (one per connection at most).",
    )
    gpus: list[GpuConfig] = Field(
        default_factory=lambda: [GpuConfig()],
        min_length=1,
        description="GPUs governed by this daemon, each with its own ledger.",
    )
    # --- reclaim and deadlines -------------------------------------------------------------
    reclaim_deadline_ms: float = Field(
        50.0,
        gt=0,
        description="How long an inference reservation waits for training to acknowledge a "
        "shrink before `deadline_miss_action` applies.",
    )
    deadline_miss_action: Literal["reject", "stop_training"] = Field(
        "reject",
        description="When training misses the reclaim deadline: 'reject' fails the inference "
        "request (the caller may retry or route elsewhere); 'stop_training' kills the training "
        "clients that did not acknowledge, and grants once their memory is back.",
    )
    ack_poll_interval_ms: float = Field(
        0.2,
        gt=0,
        description="How often the daemon looks at ack words while a shrink is pending.",
    )
    # --- policy knobs ----------------------------------------------------------------------
    min_headroom_bytes: int = Field(
        1 * GiB,
        ge=0,
        description="Free memory always kept back from training for inference arrivals.",
    )
    headroom_quantile: float = Field(
        0.99,
        gt=0,
        lt=1,
        description="Headroom covers this quantile of inference demand arriving within one "
        "reclaim time (Poisson arrivals at the observed rate).",
    )
    arrival_window_s: float = Field(
        30.0, gt=0, description="Window over which the inference arrival rate is observed."
    )
    reclaim_time_initial_ms: float = Field(
        20.0,
        gt=0,
        description="Reclaim time assumed before any shrink was measured (then an EWMA).",
    )
    keepalive_min_s: float = Field(
        2.0, ge=0, description="Shortest keep-alive of an idle inference model."
    )
    keepalive_max_s: float = Field(
        300.0, gt=0, description="Longest keep-alive of an idle inference model."
    )
    keepalive_quantile: float = Field(
        0.9,
        gt=0,
        lt=1,
        description="Keep-alive = this quantile of the model's observed idle gaps (clamped).",
    )
    min_training_fraction: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Guaranteed minimum share of the GPU's usable memory that training keeps "
        "(its minimum progress); inference requests beyond it are rejected, not reclaimed.",
    )
    grow_after_free_s: float = Field(
        1.0,
        ge=0,
        description="Memory must have stayed free this long before training is told to grow.",
    )
    grow_step_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Fraction of the spare memory given back to training per grow command.",
    )
    # --- page pool (fast handoff) ------------------------------------------------------------
    page_bytes: int = Field(
        32 * MiB,
        ge=4096,
        le=MAX_CARD_BYTES,
        description="The smallest page a training client may lend in a page handoff (the page "
        "allocator's default; the CUDA granularity is 2 MiB); smaller pages are refused. It sizes "
        "the bound on lent pages and the daemon's open files (docs/governor.md, 'Bounds').",
    )
    # --- liveness / ops --------------------------------------------------------------------
    liveness_interval_s: float = Field(
        1.0, gt=0, description="How often the daemon checks that client pids are alive."
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Serve Prometheus metrics on this port; None disables."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Log level of the daemon."
    )

    @model_validator(mode="after")
    def _consistent(self) -> GovernorConfig:
        if self.keepalive_min_s > self.keepalive_max_s:
            raise ValueError("keepalive_min_s must not exceed keepalive_max_s")
        indexes = [g.index for g in self.gpus]
        if len(set(indexes)) != len(indexes):
            raise ValueError("gpus: each index may appear once")
        if self.max_clients_per_uid > self.max_clients * len(self.gpus):
            raise ValueError("max_clients_per_uid must not exceed max_clients x the number of GPUs")
        return self

    def pages_bound(self, gpu: GpuConfig) -> int:
        """Most lent pages the daemon can hold for one GPU: every page of its usable memory, in
        the smallest page allowed, plus one partial page per shrink command (one per client)."""
        assert gpu.total_bytes is not None, "total_bytes is read from the card at start"
        usable = gpu.total_bytes - gpu.reserve_bytes
        return -(-usable // self.page_bytes) + self.max_clients

    def fd_bound(self) -> int:
        """The daemon's open files at most: a few of its own and per GPU, two per connection (the
        socket and a pidfd of the peer) and two per page in transit (held, and in flight while it
        is sent on), every page of every GPU at once. RLIMIT_NOFILE must be at least this."""
        return 64 + 2 * len(self.gpus) + 2 * self.max_connections + 2 * sum(
            self.pages_bound(g) for g in self.gpus)

    def gpu(self, index: int) -> GpuConfig:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(index)


def load_governor_config(path: str | Path) -> GovernorConfig:
    """Read the `[governor]` table of a TOML file; other tables belong to the mount and are ignored.

    Raises GovernorConfigError with a one-line message for a missing file, bad TOML or bad values.
    A file without a `[governor]` table gives the defaults.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise GovernorConfigError(f"cannot read config {p}: {e.strerror or e}") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise GovernorConfigError(f"{p}: invalid TOML: {e}") from None
    table = doc.get("governor", {})
    if not isinstance(table, dict):
        raise GovernorConfigError(f"{p}: 'governor' must be a table")
    try:
        return GovernorConfig.model_validate(table)
    except ValidationError as e:
        raise GovernorConfigError(f"{p}: {validation_message(e, prefix='governor.', root='governor', model=GovernorConfig)}") from None

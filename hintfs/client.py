"""One-call helpers for training jobs: everything goes through the mount's control files.

The mount never imports torch; these helpers run in the job. `hints_from_dcp` and friends live
in `hintfs.hintsource` and are re-exported here. A job image installs them with the `hintfs-client`
wheel (client/pyproject.toml, docs/client.md): this module imports nothing beyond Python.
"""
from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Mapping

from hintfs.common import paths
from hintfs.common.paths import job_name
from hintfs.hintsource import dcp_read_ranges, hints_from_dcp, hints_from_megatron, hints_from_safetensors

__all__ = ["signal_anomaly", "hint_reads", "hint_dcp_reads", "dcp_read_ranges", "set_replication_hints", "replica_status", "wait_for_replicas", "ReplicasNotReady", "hints_from_dcp",
           "hints_from_megatron", "hints_from_safetensors"]


def job_file(mount: str, folder: str, job: str, suffix: str = "") -> str:
    """`<mount>/.hintfs/<folder>/<job><suffix>`, once `job` passes the mount's own rule for job
    names (hintfs.common.paths.job_name: one printable path component ...); ValueError otherwise, before
    anything is written."""
    try:
        job_name(job)
    except OSError as err:
        raise ValueError(err.strerror) from None
    return os.path.join(mount, ".hintfs", folder, job + suffix)


def _write_control(path: str, doc: dict) -> None:
    try:
        with open(path, "w") as f:
            f.write(json.dumps(doc))
    except OSError as err:
        if err.errno == errno.EINVAL:
            try:
                with open(path + ".error") as f:
                    reason = f.read().strip()
            except OSError:
                reason = "refused"
            raise ValueError(f"{os.path.basename(path)}: {reason}") from None
        raise


def set_replication_hints(mount: str, job: str, files: Mapping[str, int], *, ttl_s: float = 600.0,
                          deadline_s: float = 300.0, safe_readers_per_replica: int | None = None) -> None:
    """Tell the mount which files `job` will read and by how many readers; returns at once.
    Raises ValueError with the mount's reason if the hint is refused (nothing is applied then)."""
    doc = {"files": dict(files), "ttl_s": ttl_s, "deadline_s": deadline_s}
    if safe_readers_per_replica is not None:
        doc["safe_readers_per_replica"] = safe_readers_per_replica
    _write_control(job_file(mount, "hints", job), doc)


def replica_status(mount: str, job: str) -> dict:
    with open(job_file(mount, "hints", job, ".status")) as f:
        text = f.read()
    return json.loads(text) if text.strip() else {}


class ReplicasNotReady(TimeoutError):
    """`wait_for_replicas` gave up: `status` is the last replica status it read."""

    def __init__(self, message: str, status: dict) -> None:
        super().__init__(message)
        self.status = status


def wait_for_replicas(mount: str, job: str, timeout_s: float | None = None, poll_s: float = 0.1) -> dict:
    """Block until every hinted file has its target replicas, or the hint's deadline (or
    `timeout_s`) passes: then ReplicasNotReady (a TimeoutError), carrying the last status."""
    start = time.monotonic()
    while True:
        status = replica_status(mount, job)
        if not status:
            raise KeyError(f"no hint job {job!r} on {mount}")
        if status.get("ready"):
            return status
        late = status.get("deadline_in_s", 1) <= 0
        if late or (timeout_s is not None and time.monotonic() - start > timeout_s) or (
                status.get("done") and not status.get("ready")):
            raise ReplicasNotReady(f"replicas of job {job!r} not ready: " + json.dumps(
                {p: v for p, v in status["files"].items() if v["ready"] < v["target"]})[:2000], status)
        time.sleep(poll_s)


def signal_anomaly(mount: str, job: str, path: str, kind: str = "loss_spike", severity: float = 1.0) -> None:
    """Tell the mount that `job`'s eval of the checkpoints under `path` is anomaly-triggered:
    their copies across the cross-DC link go first. `kind="clear"` ends it."""
    _write_control(job_file(mount, "signals", job), {"path": path, "kind": kind, "severity": severity})


def hint_reads(mount: str, job: str, ranges) -> None:
    """Tell an eval mount the byte ranges `[(path, offset, length)]` (paths relative to the mount)
    the job is about to read: files its local tier is still receiving get them fetched first,
    in parallel (docs/cross_dc.md, "Demand-first reads"). Raises ValueError if refused."""
    _write_control(job_file(mount, "reads", job), {"ranges": [[p, int(o), int(n)] for p, o, n in ranges]})


def hint_dcp_reads(mount: str, job: str, ckpt_dir: str, keys) -> int:
    """`hint_reads` for a DCP load of the tensors `keys` from `ckpt_dir` (a folder under `mount`);
    how many ranges. Call it after the commit marker is there, just before `dcp.load`."""
    rel = paths.inside(os.path.realpath(mount), os.path.realpath(ckpt_dir))
    if rel is None:
        raise ValueError(f"{ckpt_dir} is not under {mount}")
    ranges = [(f"{rel}/{name}", off, n) for name, off, n in dcp_read_ranges(ckpt_dir, keys)]
    if ranges:
        hint_reads(mount, job, ranges)
    return len(ranges)

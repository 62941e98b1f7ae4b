"""What an agent keeps on disk, and what a restarted one finds there.

Each agent instance keeps its replicas in a folder of its own under `[agent] data_dir`,
`<kind>-<pid>-<n>`, locked (flock) while it runs, so two agents (or a mount's in-process agent)
sharing `data_dir` never serve each other's files. A persistent agent (`hintfs agent`, kind
"agent") keeps its folder when it stops, and the next one adopts the folders of stopped or
crashed ones (`adopt_stopped_instances`): the catalog takes the replicas described by a sidecar
(`<replica>.meta`, written after the data: `write_sidecar`), the copier the copies cut short with
their progress (`<part>.progress`: `Progress`, `CutCopy`), the stream tier its streams. A mount's
in-process agent (kind "mount") removes its folder on exit, and those of dead mounts at start.
Replicas are copies of files whose permissions the agent cannot carry over: only the agent's user
may open them (the folder is 0700, the files 0600).
"""
from __future__ import annotations

import fcntl
import itertools
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from collections.abc import Callable, Iterator

from hintfs.common.clock import SYSTEM_CLOCK, Clock
from hintfs.common.procs import pid_alive
from hintfs.common.formatversion import placed

log = logging.getLogger("hintfs.agent")
_instances = itertools.count()

# The version of what an agent keeps on disk: replica sidecars, cut-copy and stream progress
# (docs/versions.md). Each description carries it (`v`; none: version 1, written before versions:
# readers from before took the keys they knew, so the key is written at version 1 too). A restarted
# agent adopts only descriptions of the versions it reads and says how many it left.
DATA_VERSION = 1
DATA_READS = (1, 1)


def stamped(doc: dict) -> dict:
    """A description as written: with this code's DATA_VERSION."""
    return {**doc, "v": DATA_VERSION}


def data_refusal(doc: dict) -> str | None:
    """Why a description (a sidecar, a progress file) is not adopted for its version; None if it is."""
    version = doc.get("v", 1) if isinstance(doc, dict) else 1   # (not a dict: the caller's KeyError)
    where = placed(version, DATA_READS)
    if where is None:
        return None
    lo, hi = DATA_READS
    side = ("written by a newer agent: run that version on this data_dir to keep it" if where == "newer"
            else "upgrade the agent")
    return f"agent data of version {version!r}, this agent reads {lo}..{hi}: {side}"


class InstanceFolder:
    """This instance's folder under `data_dir`, made 0700 and locked for the life of the instance;
    the folders of dead mounts' agents are removed first."""

    def __init__(self, data_dir: str, persistent: bool) -> None:
        os.makedirs(data_dir, exist_ok=True)
        self.data_dir = data_dir
        self.persistent = persistent
        kind = "agent" if persistent else "mount"
        self.path = os.path.join(data_dir, f"{kind}-{os.getpid()}-{next(_instances)}")
        os.makedirs(self.path, mode=0o700)
        os.chmod(self.path, 0o700)
        self._lock_fd: int | None = lock_folder(self.path)
        reap_dead_instances(data_dir, "mount")

    def close(self) -> None:
        """Unlock; a mount's in-process agent removes its folder (a persistent one keeps it for
        the next agent on this data_dir to adopt)."""
        if not self.persistent:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def lock_folder(folder: str) -> int:
    """Hold an exclusive flock on `folder/.lock` for the life of this instance (the kernel drops it
    when the process dies, however it dies)."""
    fd = os.open(os.path.join(folder, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def stopped_instances(data_dir: str, kind: str) -> list[str]:
    """Folders of `kind` whose owner is gone: nobody holds their lock (an owner holds it from
    start to exit, and the kernel drops it when the owner dies). Folders without a lock file (older
    versions) count as gone when their pid is."""
    out = []
    for name in sorted(os.listdir(data_dir)):
        if not name.startswith(kind + "-"):
            continue
        folder = os.path.join(data_dir, name)
        lock = os.path.join(folder, ".lock")
        if os.path.exists(lock):
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue          # its owner runs
            os.close(fd)          # free: the owner stopped (a racing adopter finds it gone)
            out.append(folder)
        else:
            try:
                pid = int(name.split("-")[1])
            except (ValueError, IndexError):
                continue
            if not pid_alive(pid):
                out.append(folder)
    return out


def reap_dead_instances(data_dir: str, kind: str) -> None:
    for folder in stopped_instances(data_dir, kind):
        shutil.rmtree(folder, ignore_errors=True)


def adopt_stopped_instances(data_dir: str, adopt: Callable[[str], None]) -> None:
    """Each folder of a stopped persistent agent is handed to `adopt` (which moves what it can
    use into this instance's folder), then removed with whatever is left in it."""
    for folder in stopped_instances(data_dir, "agent"):
        adopt(folder)
        shutil.rmtree(folder, ignore_errors=True)


def descriptions(folder: str, suffix: str) -> Iterator[tuple[str, str, dict]]:
    """(name, the file it describes, its JSON) for each `*suffix` file of a stopped agent's
    folder: replica sidecars (`.meta`) and cut-copy progress (`.part.progress`). An unreadable
    description is logged and skipped; its file goes with the folder. So is one of a version this
    agent does not read (`data_refusal`): one line per folder and suffix."""
    refused: dict[str, int] = {}
    for name in os.listdir(folder):
        if not name.endswith(suffix):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                doc = json.load(f)
        except (OSError, ValueError) as err:
            log.warning("unreadable %s in %s: %s", name, folder, err)
            continue
        why = data_refusal(doc) if isinstance(doc, dict) else None
        if why:
            refused[why] = refused.get(why, 0) + 1
            continue
        yield name, os.path.join(folder, name[: -len(suffix)]), doc
    for why, n in refused.items():
        log.warning("%d %s files in %s not adopted: %s", n, suffix, folder, why)


def write_sidecar(local: str, path: str, size: int, mtime_ns: int, expires_at: float,
                  record: str | None, holders: dict[str, float] | None = None) -> None:
    """`<replica>.meta`: what the replica is a copy of, written after the data (tmp + rename), so
    a restarted agent trusts only complete, described copies; `holders`: the claims on it."""
    tmp = local + ".meta.tmp"
    with open(tmp, "w") as f:
        json.dump(stamped({"path": path, "size": size, "mtime_ns": mtime_ns, "expires_at": expires_at,
                           "record": record, "holders": holders or {}}), f)
    os.rename(tmp, local + ".meta")


def holders_of(meta: dict) -> dict[str, float]:
    """The claims a sidecar recorded (none in one written before claims existed, or malformed)."""
    raw = meta.get("holders")
    if not isinstance(raw, dict):
        return {}
    return {str(h): float(t) for h, t in raw.items() if isinstance(t, (int, float))}


@dataclass
class CutCopy:
    """A copy that was cut (the link dropped, the agent stopped): the version it was copying, its
    range size, and the ranges on disk in its `.part` file (offset -> length). The next copy of
    the same version resumes from them."""
    version: tuple[int, int]
    chunk: int
    done: dict[int, int]


class Progress:
    """The ranges of a copy that are on disk, in `<part>.progress` (JSON, tmp + rename). What it
    lists was fdatasync'ed first: after a crash, the listed ranges of the `.part` hold real data."""

    EVERY_S = 0.5

    def __init__(self, part: str, path: str, version: tuple[int, int], chunk: int, fd: int,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.file = part + ".progress"
        self.doc = stamped({"path": path, "size": version[0], "mtime_ns": version[1], "chunk": chunk})
        self.fd = fd
        self.clock = clock
        self.last = clock.monotonic()
        self.saving = threading.Lock()

    def due(self) -> bool:
        return self.clock.monotonic() - self.last >= self.EVERY_S

    def save(self, done: dict, force: bool = False) -> None:
        if not self.saving.acquire(blocking=force):
            return   # another range's thread is saving right now
        try:
            self.last = self.clock.monotonic()
            os.fdatasync(self.fd)
            tmp = self.file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({**self.doc, "done": {str(k): v for k, v in done.items()}}, f)
            os.rename(tmp, self.file)
        except OSError as err:
            log.warning("cannot save the progress of %s: %s", self.doc["path"], err)
        finally:
            self.saving.release()

    def remove(self) -> None:
        try:
            os.unlink(self.file)
        except FileNotFoundError:
            pass

    @staticmethod
    def read(doc: dict) -> tuple[str, CutCopy]:
        """(path, the cut copy) a progress file describes (KeyError, ValueError: not one)."""
        path, size, chunk = str(doc["path"]), int(doc["size"]), int(doc["chunk"])
        done = {int(k): int(v) for k, v in doc["done"].items()}
        return path, CutCopy((size, int(doc["mtime_ns"])), chunk, done)


__all__ = ["DATA_VERSION", "data_refusal", "stamped", "InstanceFolder", "adopt_stopped_instances", "descriptions", "write_sidecar", "CutCopy", "Progress",
           "stopped_instances", "reap_dead_instances", "lock_folder"]

"""The interfaces `Filesystem` calls its collaborators through (each one optional).

| interface       | implemented by                    | called                                        |
|-----------------|-----------------------------------|-----------------------------------------------|
| `ReplicaSource` | `fusefs.replicaread.ReplicaReads` | open (has replicas?) and read of hinted files |
| `TensorSource`  | `fusefs.tensorfile.TensorFiles`   | lookup and first open of `x.tensor` paths     |
| `OpenRouting`   | `fusefs.routes.TierRouting`       | open of a store file (eval side, cross-DC)    |
| `PublishJournal`| `fusefs.journal_writer.JournalWriter` | a file published by a commit, unlinked or renamed away; a folder renamed into place |
| `StreamHooks`   | `fusefs.stream.hooks.StreamFront` | staging created, published, released, dropped, renamed |

`fusefs/mount.py` builds them and hands them to the `Filesystem` constructor.
"""
from __future__ import annotations

from typing import Optional, Protocol

from stores.base import Stat


class ReplicaSource(Protocol):
    def has_replicas(self, path: str) -> bool: ...
    async def local_fd(self, path: str, identity: tuple[int, int]) -> int:
        """A new fd of a complete replica of exactly this version held on this host (the mount's
        own agent, or a tier agent's `local_socket`), for FUSE passthrough; -1 when there is none."""
    async def read(self, path: str, identity: tuple[int, int], off: int, size: int) -> bytes: ...


class TensorSource(Protocol):
    def match(self, path: str) -> Optional[tuple]:
        """(source path, transform rule) when `path` is a virtual `x.tensor` file, else None."""
    async def fetch(self, source: str, rule) -> bytes: ...


class OpenRouting(Protocol):
    async def on_open(self, path: str, st: Stat) -> None:
        """A store file is being opened for reading (after `open_reader`, before replicas are
        looked up): route it to a local tier when one holds this version."""


class PublishJournal(Protocol):
    async def published(self, path: str, st: Stat, streamed: bool = False) -> Optional[str]:
        """`path` was just published with attributes `st` (`streamed`: the mount streams it to the
        eval tiers too): the record's name, None when it could not be written (never raises for a
        failed record)."""

    async def removed(self, path: str) -> None:
        """`path`, a file or a folder, left the store (unlinked or renamed away)."""

    def folder_renamed(self, path: str) -> None:
        """(trio loop) The folder `path` was renamed into place: its files are journaled soon."""


class StreamHooks(Protocol):
    """Write-time streaming (training side): each call only records an event, from the trio loop."""
    def wants(self, path: str) -> bool: ...
    def will_stream_renamed(self, key: Optional[int], path: str, size: int) -> bool: ...
    def started(self, key: int, path: str, fd: int) -> None: ...
    def published(self, key: int, path: str, st: Stat, record: Optional[str], final: bool) -> None: ...
    def released(self, key: int) -> None: ...
    def dropped(self, key: int) -> None: ...
    def renamed(self, key: Optional[int], path: str, st: Stat, record: Optional[str]) -> None: ...
    def close(self, timeout_s: float = 10.0) -> None:
        """At unmount, after the trio loop: published files get `timeout_s` to reach the tiers."""


__all__ = ["ReplicaSource", "TensorSource", "OpenRouting", "PublishJournal", "StreamHooks"]

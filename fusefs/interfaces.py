"""The interfaces `Filesystem` calls its collaborators through (each one optional), and `Source`.

| interface       | implemented by                    | called                                        |
|-----------------|-----------------------------------|-----------------------------------------------|
| `ReplicaSource` | `fusefs.replicaread.ReplicaReads` | read of a file from its replicas (hinted, or the local tier's) |
| `TensorSource`  | `fusefs.tensorfile.TensorFiles`   | lookup and first open of `x.tensor` paths     |
| `PublishJournal`| `fusefs.journal_writer.JournalWriter` | a file published by a commit, unlinked or renamed away; a folder renamed into place |
| `StreamHooks`   | `fusefs.stream.hooks.StreamFront` | staging created, published, released, dropped, renamed |
| `KernelNotices` | `fusefs.fuse.KernelNotices`       | a name the kernel must forget (a publish split a hard link, close-to-open) |

Where an open's reads come from is `fusefs.readpath.ReadPath` (over `fusefs.routes.RoutedStore`
and the replica reads). `fusefs/mount.py` builds them all and hands them to the `Filesystem`
constructor.
"""
from __future__ import annotations

import enum
from typing import Protocol
from collections.abc import Sequence

from hintfs.stores.base import Reader, Stat


class Source(enum.Enum):
    """Where the bytes of a file opened for reading come from (decided at open)."""
    STORE = "store"         # the store's reader (on file://, its fd can back a passthrough open)
    REPLICAS = "replicas"   # a hinted file's replicas on the agents (`fusefs.replicaread`)
    TIER = "tier"           # a routed file the local tier holds at this version: its replica
    DEMAND = "demand"       # a routed file the tier is still receiving: each read asks the tier


class ReplicaSource(Protocol):
    async def read(self, path: str, identity: tuple[int, int], off: int, size: int, *, fallback: Reader,
                   locations: Sequence[str] | None = None) -> bytes:
        """Bytes of this version from the replicas at `locations` (None: the hinted ones), else
        through `fallback` (the store's copy of that version)."""


class KernelNotices(Protocol):
    """What the filesystem tells the kernel outside a reply (the FUSE binding's notify calls)."""
    def invalidate_entry(self, parent: int, name: bytes) -> None:
        """Forget the cached name (queued: returns at once)."""

    def invalidate_entry_now(self, parent: int, name: bytes) -> None:
        """Forget the cached name, returning once the kernel has (blocking: a worker thread, and
        only from a request during which the kernel holds no directory lock)."""

    def invalidate_listing(self, folder: int) -> None:
        """Drop the folder's listing the kernel keeps (FOPEN_CACHE_DIR) and its attributes,
        returning once the kernel has (blocking: a worker thread)."""

    def invalidate_attrs(self, inode: int) -> None:
        """Drop the attributes the kernel keeps of `inode` (its pages stay): its next stat asks
        (returns at once; an inode the kernel no longer knows is fine)."""


class ListingEnds(Protocol):
    """Listings the FUSE binding finishes itself (the patched pyfuse3's `dir_ended`,
    patches/pyfuse3-readdir-names.patch): a directory handle's RELEASEDIR is answered there, and
    once its listing was given to its end the kernel's last READDIR (the one that finds nothing)
    too; the handle comes back to the filesystem later, in `released`."""
    def ended(self, fh: int, end: int | None) -> None:
        """Handle `fh`'s listing ends at offset `end` (None: not known yet; only its RELEASEDIR
        is answered there)."""

    def released(self) -> Sequence[int]:
        """The ended handles the kernel released since the last call."""


class TensorSource(Protocol):
    def match(self, path: str) -> tuple | None:
        """(source path, transform rule) when `path` is a virtual `x.tensor` file, else None."""
    async def fetch(self, source: str, rule) -> bytes: ...


class PublishJournal(Protocol):
    async def published(self, path: str, st: Stat, streamed: bool = False) -> str | None:
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
    def will_stream_renamed(self, key: int | None, path: str, size: int) -> bool: ...
    def started(self, key: int, path: str, fd: int) -> None: ...
    def published(self, key: int, path: str, st: Stat, record: str | None, final: bool) -> None: ...
    def released(self, key: int) -> None: ...
    def dropped(self, key: int) -> None: ...
    def renamed(self, key: int | None, path: str, st: Stat, record: str | None) -> None: ...
    def close(self, timeout_s: float = 10.0) -> None:
        """At unmount, after the trio loop: published files get `timeout_s` to reach the tiers."""


__all__ = ["Source", "ReplicaSource", "KernelNotices", "TensorSource", "PublishJournal", "StreamHooks"]

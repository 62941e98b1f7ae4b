"""The read path of an open: where the bytes of a file opened for reading come from.

`Filesystem.open` opens the store's reader (through the mount's view of the store: with routes,
`fusefs.routes.RoutedStore`), makes its close-to-open check, then asks `ReadPath.source`:

| the file                                  | source    | its reads                               |
|-------------------------------------------|-----------|-----------------------------------------|
| routed, the local tier holds this version | `TIER`    | blocks from the tier's replica          |
| routed, the tier is still receiving it    | `DEMAND`  | each read asks the tier (demand-first)  |
| routed otherwise, or neither              | `STORE`   | the store's reader                      |
| hinted, with ready replicas (not routed)  | `REPLICAS`| blocks from the agents' replicas        |

A routed path is the routes' alone: the tier decides, hints do not. With FUSE passthrough on,
`local_fd` gives an fd of a complete replica of exactly the version opened held on this host (the
tier agent's through its `local_socket`, the in-process agent's), which the kernel then reads
itself; the handle kind follows from all this (`fusefs.handles.choose_handle`). Replica reads
fall back to the reader opened here: the store's copy of that version.
"""
from __future__ import annotations


import trio

from fusefs.handles import ReplicaRead
from fusefs.inodes import Inode
from fusefs.interfaces import Source
from fusefs.replicaread import ReplicaReads
from fusefs.routes import RoutedStore, TierReplicaReader
from fusefs.stats import Stats
from hintfs.stores.base import Reader, Stat


def source_of(reader: Reader) -> Source:
    """What a reader the store layers opened reads from (a plain store reader: the store)."""
    return getattr(reader, "source", Source.STORE)


class ReadPath:
    """Routes (the eval side's tier) and replicas (hints), each optional, decide an open's source."""

    def __init__(self, stats: Stats, *, routes: RoutedStore | None = None,
                 replicas: ReplicaReads | None = None):
        self.stats = stats
        self.routes = routes
        self.replicas = replicas

    async def source(self, path: str, reader: Reader, st: Stat) -> tuple[Reader, Source]:
        """The reader the open reads through (a routed file's, settled by the tier) and its source."""
        if self.routes is not None and self.routes.routes_path(path):
            reader = await self.routes.at_open(path, reader, st)
            return reader, source_of(reader)
        if self.replicas is not None and self.replicas.has_replicas(path):
            return reader, Source.REPLICAS
        return reader, source_of(reader)

    def source_unopened(self, path: str) -> Source | None:
        """What `source` gives an open of `path` whose store reader is the store's own (a plain
        store reader), known before the open: None for a routed path (the tier decides at the
        open, `RoutedStore.at_open`). For a mark made before any open (`Filesystem._mark_lazy`)."""
        if self.routes is not None and self.routes.routes_path(path):
            return None
        if self.replicas is not None and self.replicas.has_replicas(path):
            return Source.REPLICAS
        return Source.STORE

    async def local_fd(self, path: str, reader: Reader, source: Source, identity: tuple[int, int]) -> int:
        """A new fd of a complete replica of exactly this version on this host, or -1."""
        if source is Source.TIER and isinstance(reader, TierReplicaReader):
            fd = await trio.to_thread.run_sync(reader.local_fd)
            if fd >= 0:
                self.stats.add("tier_fd_opens")
            return fd
        if source is Source.REPLICAS and self.replicas is not None:
            return self.replicas.local_fd(path, identity)
        return -1

    def replica_handle(self, node: Inode, reader: Reader, source: Source, identity: tuple[int, int]) -> ReplicaRead:
        """A handle reading blocks from the replicas: the tier's (fixed at open) or the hinted ones."""
        assert self.replicas is not None
        locations = (reader.location,) if isinstance(reader, TierReplicaReader) else None
        return ReplicaRead(node, reader, identity, self.replicas, locations)


__all__ = ["ReadPath", "source_of"]

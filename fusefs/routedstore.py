"""The eval side's view of routed prefixes: metadata from the local tier, not across the WAN.

An eval mount's `[[routes]]` send paths under a prefix to a local tier agent. Reads were already
served from the tier when it held the file (operations.Operations._route); this wrapper also
answers `stat` and `open_reader` of routed paths from the tier, so that a lookup, a getattr or an
open of a checkpoint file the tier holds costs one loopback call instead of remote round trips
(100 ms each across datacenters; a DCP load opens a few files but walks several folders).

- ready: the tier holds a verified version (size + mtime of the store's file when it was copied):
  its attributes are served; data reads go to the tier (the lazily opened store reader is only the
  fallback, and refuses a store file that is no longer that version).
- copying: a copy is in flight; `stat` serves the version being copied and `open_reader` waits
  for the copy (the copy crosses the link faster than per-read round trips would), falling back
  to the store if it fails.
- dir: the tier holds files below the path, which is a folder.
- absent, or the tier does not answer: the store, as without routes.

Consistency: routes are meant for write-once data (checkpoints). A routed file the tier holds is
served at the tier's version until the tier learns of a newer one (the follower copies each new
journaled version), so an overwrite in the remote store is seen with the journal's delay, not at
the next open. Everything else (writes, listings, paths outside the routes) goes to the store.
"""
from __future__ import annotations

import errno
import logging
import stat as stat_mod
import time
from typing import Optional

from stores.base import Stat

log = logging.getLogger("hintfs.routes")

_DIR = Stat(stat_mod.S_IFDIR | 0o755, 0, 0, 0, 2)


class _StoreFallbackReader:
    """Reads the store copy only if someone reads through it (replica reads failed over)."""

    def __init__(self, store, path: str, identity: tuple[int, int]):
        self.store, self.path, self.identity = store, path, identity
        self.reader = None

    def read(self, offset: int, size: int) -> bytes:
        if self.reader is None:
            reader, st = self.store.open_reader(self.path)
            if st.identity() != self.identity:
                reader.close()
                raise OSError(errno.ESTALE, f"{self.path} changed in the store since the local tier copied it")
            self.reader = reader
        return self.reader.read(offset, size)

    def read_nowait(self, offset: int, size: int):
        return None

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def route_of(routes, path: str):
    """The first route whose prefix is `path` or a folder above it, or None."""
    return next((r for r in routes if path == r.prefix or path.startswith(r.prefix.rstrip("/") + "/")), None)


class RoutedStore:
    def __init__(self, store, routes, clients: dict, stats):
        self._store = store
        self.routes = list(routes)
        self.clients = clients
        self.stats = stats
        # A stat may be a call to the tier agent: never inline in the trio loop.
        self.inline_metadata = False
        self._warned: dict[str, float] = {}

    def __getattr__(self, name):           # everything not routed is the store's
        return getattr(self._store, name)

    def _tier(self, path: str) -> tuple[Optional[object], dict]:
        route = route_of(self.routes, path)
        if route is None:
            return None, {"state": "absent"}
        client = self.clients[route.local_agent]
        try:
            return client, client.tier_stat(path)
        except OSError as err:
            now = time.monotonic()
            if now - self._warned.get(route.local_agent, -1e9) > 30:   # not once per lookup
                self._warned[route.local_agent] = now
                log.warning("local tier %s unavailable (reading the store): %s", route.local_agent, err)
            self.stats.add("route_tier_down")
            return None, {"state": "absent"}

    @staticmethod
    def _file(doc: dict) -> Stat:
        return Stat(stat_mod.S_IFREG | 0o644, int(doc["size"]), int(doc["mtime_ns"]), int(doc["mtime_ns"]))

    def stat(self, rel: str) -> Stat:
        _client, doc = self._tier(rel)
        state = doc["state"]
        if state in ("ready", "copying"):
            self.stats.add("route_tier_stat")
            return self._file(doc)
        if state == "dir":
            self.stats.add("route_tier_stat")
            return _DIR
        return self._store.stat(rel)

    def open_reader(self, rel: str):
        client, doc = self._tier(rel)
        if doc["state"] == "copying":
            self.stats.add("route_wait_copy")
            try:
                client.replicate(rel, 86400.0, None, "eval", None, 2.0,
                                 expect=(int(doc["size"]), int(doc["mtime_ns"])))
                doc = client.tier_stat(rel)
            except OSError as err:
                log.warning("local tier copy of %s failed, reading the store: %s", rel, err)
        if doc["state"] == "ready":
            st = self._file(doc)
            return _StoreFallbackReader(self._store, rel, st.identity()), st
        return self._store.open_reader(rel)

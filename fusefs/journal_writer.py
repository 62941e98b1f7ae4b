"""The publish journal, writer side: one small record in the store per published file.

Followers in other datacenters list the journal folder instead of walking the store
(`common.journal` has the record format, `agent.follower` the reader, docs/cross_dc.md the
design). The filesystem calls `published` after each commit (`PublishJournal`); a record
that cannot be written is logged, never an error of the close: the file is published and
followers fall back to listing.
"""
from __future__ import annotations

import logging
from typing import Optional

import trio

from common.journal import encode_record, record_key, record_name
from fusefs.stats import Stats
from stores.base import Stat, Store

log = logging.getLogger("hintfs.ops")


class JournalWriter:
    def __init__(self, store: Store, journal_dir: str, stats: Stats, io_limiter: trio.CapacityLimiter):
        self.store = store
        self.dir = journal_dir
        self.stats = stats
        self.io_limiter = io_limiter   # the filesystem's: a record is one more store call

    async def published(self, path: str, st: Stat, streamed: bool = False) -> Optional[str]:
        """Write the record of `path` at version `st`; `streamed`: this mount streams the file to
        the eval tiers too (followers wait for the stream instead of copying). Its name, or None."""
        name = record_name(path, st.size, st.mtime_ns, streamed)
        # (if it fails, the file is still published; followers fall back to listing)
        return name if await self._put(name, path, st.size, st.mtime_ns, "journal_records") else None

    async def removed(self, path: str) -> None:
        """Write the record that `path` is gone from the store (unlinked, or renamed away): eval
        tiers drop what they hold of it. A failure is logged; the tier then keeps serving the old
        bytes until its TTL or `keep_last` drops them, as before removal records existed."""
        await self._put(record_name(path, removed=True), path, 0, 0, "journal_removals")

    async def _put(self, name: str, path: str, size: int, mtime_ns: int, counter: str) -> bool:
        """Write the record `name` of `path`; counted in `counter` when written, logged when not."""
        try:
            await trio.to_thread.run_sync(self.store.put_small, f"{self.dir}/{record_key(name)}",
                                          encode_record(path, size, mtime_ns), limiter=self.io_limiter)
        except OSError as err:
            log.warning("journal record %s for %s failed: %s", name, path, err)
            return False
        self.stats.add(counter)
        return True


__all__ = ["JournalWriter"]

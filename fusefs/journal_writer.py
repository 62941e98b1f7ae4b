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
        try:
            await trio.to_thread.run_sync(self.store.put_small, f"{self.dir}/{record_key(name)}",
                                          encode_record(path, st.size, st.mtime_ns), limiter=self.io_limiter)
            self.stats.add("journal_records")
            return name
        except OSError as err:   # the file is published; followers fall back to listing
            log.warning("journal record for %s failed: %s", path, err)
            return None

    async def removed(self, path: str) -> None:
        """Write the record that `path` is gone from the store (unlinked, or renamed away): eval
        tiers drop what they hold of it. A failure is logged; the tier then keeps serving the old
        bytes until its TTL or `keep_last` drops them, as before removal records existed."""
        name = record_name(path, removed=True)
        try:
            await trio.to_thread.run_sync(self.store.put_small, f"{self.dir}/{record_key(name)}",
                                          encode_record(path, 0, 0), limiter=self.io_limiter)
            self.stats.add("journal_removals")
        except OSError as err:
            log.warning("journal removal record for %s failed: %s", path, err)


__all__ = ["JournalWriter"]

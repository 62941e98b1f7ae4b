"""Predictive checkpoint replication in an eval-side agent.

The agent follows the training side's closed-file journal in the (remote) store, or, without a
journal, the listing of the followed prefixes. Every new file under a followed prefix is copied
at once (large ranged reads, many in flight); a checkpoint's commit marker (`.metadata` for DCP)
is copied last, after every other file of its folder, and then the checkpoint is complete.
The last `keep_last` complete checkpoints of each job folder are kept; older ones are dropped.
Runs on its own thread (the agent is a threaded Flight server).
"""
from __future__ import annotations

import logging
import posixpath
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pyarrow.fs as pafs  # noqa: F401  (listing types come through the store)

from .journal import decode_record

log = logging.getLogger("hintfs.follower")


class Follower:
    def __init__(self, agent, cfg):
        self.agent = agent
        self.cfg = cfg
        self.seen_records: set[str] = set()
        self.seen_files: dict[str, tuple[int, int]] = {}
        self.copied: set[str] = set()
        self.pending_markers: set[str] = set()
        self.complete: dict[str, float] = {}      # checkpoint folder -> when it completed
        self.errors: dict[str, str] = {}
        self._stop = threading.Event()
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="hintfs-follow")
        self.thread = threading.Thread(target=self._run, name="hintfs-follower", daemon=True)

    def start(self) -> "Follower":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _followed(self, path: str) -> bool:
        return any(path == p or path.startswith(p.rstrip("/") + "/") for p in self.cfg.prefixes)

    # -- discovering new files -------------------------------------------------------------------
    def _new_from_journal(self) -> list[str] | None:
        store = self.agent.store
        try:
            entries = list(store.iter_dir(self.cfg.journal_dir))
        except FileNotFoundError:
            return None
        names = [n for n, _st in sorted(entries) if n not in self.seen_records and n.endswith(".json")]
        self.seen_records.update(names)

        def read(name: str):
            try:
                reader, st = store.open_reader(f"{self.cfg.journal_dir}/{name}")
                try:
                    return decode_record(reader.read(0, st.size))
                finally:
                    reader.close()
            except (OSError, ValueError, KeyError) as err:
                log.warning("unreadable journal record %s: %s", name, err)
                return None

        # Records are read concurrently: over a long link each one costs round trips.
        records = list(self.pool.map(read, names)) if len(names) > 1 else [read(n) for n in names]
        return [r["path"] for r in records if r is not None and self._followed(r["path"])]

    def _walk(self, rel: str):
        for name, st in self.agent.store.iter_dir(rel):
            path = f"{rel}/{name}" if rel else name
            if st.is_dir:
                yield from self._walk(path)
            elif st.is_file:
                yield path, st

    def _new_from_listing(self) -> list[str]:
        new = []
        for prefix in self.cfg.prefixes:
            try:
                for path, st in self._walk(prefix.rstrip("/")):
                    if self.seen_files.get(path) != st.identity():
                        self.seen_files[path] = st.identity()
                        new.append(path)
            except FileNotFoundError:
                continue
        return new

    # -- copying ---------------------------------------------------------------------------------
    def _copy(self, path: str) -> bool:
        try:
            # Predictive copies serve scheduled evals; the job is the checkpoint's parent folder,
            # so a signal for that job promotes its copies on the link.
            job = posixpath.dirname(posixpath.dirname(path))
            self.agent.replicate(path, self.cfg.ttl_s, None, parallel=self.cfg.parallel, priority="eval", job=job)
            self.copied.add(path)
            self.errors.pop(path, None)
            return True
        except Exception as err:   # FlightServerError/OSError: retried on the next round
            self.errors[path] = str(err)
            log.warning("predictive copy of %s failed (will retry): %s", path, err)
            return False

    def _finish_markers(self) -> None:
        for marker in sorted(self.pending_markers):
            folder = posixpath.dirname(marker)
            try:
                files = [p for p, _st in self._walk(folder)]
            except FileNotFoundError:
                continue
            self._copy_all([p for p in files if p != marker and p not in self.copied])
            if all(p in self.copied for p in files if p != marker) and self._copy(marker):
                self.pending_markers.discard(marker)
                self.complete[folder] = time.time()
                log.info("checkpoint %s complete in the local tier", folder)
                self._keep_last(posixpath.dirname(folder))

    def _keep_last(self, job: str) -> None:
        done = sorted((t, f) for f, t in self.complete.items() if posixpath.dirname(f) == job)
        for _t, folder in done[: max(0, len(done) - self.cfg.keep_last)]:
            for path in [p for p in self.copied if p.startswith(folder + "/")]:
                self.agent.drop(path)
                self.copied.discard(path)
            del self.complete[folder]
            log.info("checkpoint %s dropped from the local tier (keep_last=%d)", folder, self.cfg.keep_last)

    def _copy_all(self, paths: list[str]) -> None:
        """Copy files concurrently: their chunks meet in the agent's link scheduler (priority
        and weights decide who crosses first) and the round trips of one file overlap others'."""
        paths = [p for p in dict.fromkeys(paths) if p not in self.copied]
        if len(paths) <= 1:
            for p in paths:
                self._copy(p)
            return
        list(self.pool.map(self._copy, paths))

    def step(self) -> None:
        new = self._new_from_journal()
        if new is None:
            new = self._new_from_listing()
        todo = []
        for path in new:
            if posixpath.basename(path) == self.cfg.commit_marker:
                self.pending_markers.add(path)
            elif path not in self.copied:
                todo.append(path)
        # and earlier failures, again
        todo += [p for p in self.errors if p not in self.pending_markers]
        self._copy_all(todo)
        self._finish_markers()

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.poll_interval_s):
            try:
                self.step()
            except Exception:
                log.exception("follower round failed")

    def status(self) -> dict:
        return {"complete": sorted(self.complete), "copied": len(self.copied),
                "pending_markers": sorted(self.pending_markers), "errors": dict(self.errors)}

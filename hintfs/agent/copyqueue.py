"""The follower's queue of files waiting for a copy.

A pick is the oldest file of a job with an anomaly signal, else the oldest file of all: the
order the link scheduler's classes expect. Files are kept per job in arrival order, so a pick
looks at one head per job. A min over every queued file, asking the link gate about each one's
job, took 9.6 s of the follower's lock to drain one checkpoint of 4,096 files
(bench/follower_queue.py).
"""
from __future__ import annotations

import itertools
import posixpath
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator


class CopyQueue:
    """Paths waiting for a copy, by job (`job_of`). Not thread-safe: the follower's lock guards it."""

    def __init__(self, job_of: Callable[[str], str]):
        self._job_of = job_of
        self._jobs: dict[str, OrderedDict[str, int]] = {}
        self._order = itertools.count()
        self._n = 0
        self._folders: Counter[str] = Counter()   # queued files per folder (`folders`)

    def __len__(self) -> int:
        return self._n

    def __contains__(self, path: str) -> bool:
        return path in self._jobs.get(self._job_of(path), ())

    def __iter__(self) -> Iterator[str]:
        for paths in self._jobs.values():
            yield from paths

    def add(self, path: str) -> None:
        """Queue `path` last (no change if it is queued already)."""
        paths = self._jobs.setdefault(self._job_of(path), OrderedDict())
        if path not in paths:
            paths[path] = next(self._order)
            self._n += 1
            self._folders[posixpath.dirname(path)] += 1

    def discard(self, path: str) -> None:
        job = self._job_of(path)
        paths = self._jobs.get(job)
        if paths is not None and paths.pop(path, None) is not None:
            self._n -= 1
            self._left(path)
            if not paths:
                del self._jobs[job]

    def take(self, signalled: Callable[[str], bool]) -> str | None:
        """Remove and return the oldest path of a `signalled` job, else the oldest of all; None
        when empty. One look per job."""
        best: tuple[bool, int] | None = None
        best_job = ""
        for job, paths in self._jobs.items():
            key = (not signalled(job), next(iter(paths.values())))
            if best is None or key < best:
                best, best_job = key, job
        if best is None:
            return None
        paths = self._jobs[best_job]
        path, _order = paths.popitem(last=False)
        self._n -= 1
        self._left(path)
        if not paths:
            del self._jobs[best_job]
        return path

    def _left(self, path: str) -> None:
        folder = posixpath.dirname(path)
        self._folders[folder] -= 1
        if self._folders[folder] <= 0:
            del self._folders[folder]

    def folders(self) -> set[str]:
        """The folders of the queued files (kept as counts: no pass over the queue)."""
        return set(self._folders)


__all__ = ["CopyQueue"]

"""The follower's copy queue (hintfs/agent/copyqueue.py): oldest first, a signalled job's files first."""
from __future__ import annotations

import posixpath

from hintfs.agent.copyqueue import CopyQueue


def _job(path: str) -> str:
    return posixpath.dirname(posixpath.dirname(path))


def test_oldest_first_across_jobs_and_a_signalled_job_first():
    q = CopyQueue(_job)
    for p in ("a/s1/0", "b/s1/0", "a/s1/1", "b/s1/1"):
        q.add(p)
    q.add("a/s1/0")                                   # queued already: keeps its place
    assert len(q) == 4 and "b/s1/1" in q and "c/s1/0" not in q
    assert q.take(lambda job: False) == "a/s1/0"
    assert q.take(lambda job: job == "b") == "b/s1/0"   # the signalled job's oldest
    assert q.take(lambda job: job == "b") == "b/s1/1"
    assert q.take(lambda job: job == "b") == "a/s1/1"   # nothing of b left: the oldest of all
    assert q.take(lambda job: False) is None and len(q) == 0 and not q


def test_a_discarded_path_leaves_and_comes_back_last():
    q = CopyQueue(_job)
    for p in ("a/s/0", "a/s/1", "a/s/2"):
        q.add(p)
    q.discard("a/s/0")
    q.discard("a/s/9")                                # never queued: nothing happens
    q.add("a/s/0")
    assert list(q) == ["a/s/1", "a/s/2", "a/s/0"]
    assert [q.take(lambda job: False) for _ in range(3)] == ["a/s/1", "a/s/2", "a/s/0"]
    assert len(q) == 0 and list(q) == []


def test_the_queue_answers_as_a_min_over_every_path_would():
    """Random adds, discards, takes and signals against the plain min the follower used."""
    import random
    rng = random.Random(7)
    q, plain, order = CopyQueue(_job), {}, 0
    signalled: set[str] = set()
    for _ in range(3000):
        op = rng.random()
        path = f"j{rng.randrange(4)}/s/{rng.randrange(50)}"
        if op < 0.5:
            q.add(path)
            if path not in plain:
                plain[path] = order
                order += 1
        elif op < 0.6:
            q.discard(path)
            plain.pop(path, None)
        elif op < 0.65:
            signalled ^= {f"j{rng.randrange(4)}"}
        else:
            want = min(plain, key=lambda p: (_job(p) not in signalled, plain[p])) if plain else None
            assert q.take(lambda job: job in signalled) == want
            plain.pop(want, None)
        assert len(q) == len(plain)

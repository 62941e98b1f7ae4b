"""An open for writing that arrives while the last release of the file is still publishing.

The kernel sends RELEASE after close(2) has returned, so `open(p, "wb")` right after a close
reaches the daemon while that release waits on its publish. The open must take the staging
either before the release drops it or after, never in between: it once copied the staging the
release was closing and failed with EBADF (CI, tests/mount/test_passthrough.py
test_publish_on_close_stays_atomic_for_store_readers). The steps are ordered here by events,
not by timing: the release waits inside its publish until the open is copying the staging or
waits for it, and the copy waits until the release dropped the staging (bounded waits only).
"""
from __future__ import annotations

import os

import trio

from fusefs.filesystem import Filesystem
from fusefs.handles import PassthroughWrite
from hintfs.stores.local import LocalStore
from tests.helpers.backing import CountingBacking


async def _until(cond, limit_s: float = 2.0) -> None:
    with trio.move_on_after(limit_s):
        while not cond():
            await trio.sleep(0.002)


def test_an_open_for_writing_during_the_last_release_takes_the_staging_before_or_after(tmp_path):
    (tmp_path / "f").write_bytes(b"old old old")
    fs = Filesystem(LocalStore(str(tmp_path)))
    backing = CountingBacking()
    fs.set_passthrough((backing, "on"))
    real_io = fs.io
    copying, dropped = trio.Event(), trio.Event()
    errors: list[BaseException] = []

    async def ordered_io(fn, *args, inline: bool = False):
        if getattr(fn, "__name__", "") == "_still_published":
            node = args[0]
            # the release's publish waits until the open is inside (copying, or on the lock)
            await _until(lambda: copying.is_set() or fs.publish_lock(node).statistics().tasks_waiting)
        if getattr(fn, "__name__", "") == "new_staging" and len(args) >= 3 and args[2] is not None:
            copying.set()                    # a copy of the open staging: after the drop, if any
            await _until(dropped.is_set)
        result = await real_io(fn, *args, inline=inline)
        if getattr(fn, "__name__", "") == "discard":
            dropped.set()
        return result

    fs.io = ordered_io

    async def main():
        attrs = await fs.lookup(1, b"f")
        ino = attrs.st_ino
        node = fs.inodes.by_ino[ino]
        w1 = await fs.open(ino, os.O_WRONLY | os.O_TRUNC)
        assert isinstance(fs.handles[w1.fh], PassthroughWrite)
        staging = node.writer
        os.pwrite(staging.fd, b"first", 0)          # the kernel's write into the backing file
        await fs.flush(w1.fh)                       # close(2): published in place
        os.pwrite(staging.fd, b"FIRST", 0)          # a dup's write after that close
        assert (tmp_path / "f").read_bytes() == b"FIRST"

        async def second_open():
            await _until(lambda: node.pt_refs == 0)     # the release has begun
            try:
                w2 = await fs.open(ino, os.O_WRONLY | os.O_TRUNC)
            except OSError as err:                  # (Refused is an OSError)
                errors.append(err)
                return
            os.pwrite(node.writer.fd, b"second", 0)
            await fs.flush(w2.fh)
            await fs.release(w2.fh)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fs.release, w1.fh)
            nursery.start_soon(second_open)

    trio.run(main)
    assert not errors, errors
    assert (tmp_path / "f").read_bytes() == b"second"
    assert backing.live == set()                    # every backing id released
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]   # no staging file left behind

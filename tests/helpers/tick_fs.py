"""A pyfuse3 filesystem whose handlers never suspend, with a trio task ticking beside the FUSE
loop (test helper for the patched loop's queued reads; `python tests/helpers/tick_fs.py MNT`).

`/f` is a file whose attributes are never cached (each stat is a request, answered in a busy
0.2 ms); reading `/ticks`
answers {"max_gap_s": the longest a 5 ms tick was late, "queued_reads": pyfuse3.queued_reads()}.
"""
import errno
import json
import stat
import sys
import time

import pyfuse3
import trio

TICK_S = 0.005
SPIN_S = 0.0002   # each getattr of /f busy-waits this long (never suspends)
F_INO, TICKS_INO = pyfuse3.ROOT_INODE + 1, pyfuse3.ROOT_INODE + 2


class TickFS(pyfuse3.Operations):
    def __init__(self) -> None:
        super().__init__()
        self.max_gap_s = 0.0

    async def tick(self) -> None:
        while True:
            t0 = time.monotonic()
            await trio.sleep(TICK_S)
            self.max_gap_s = max(self.max_gap_s, time.monotonic() - t0 - TICK_S)

    def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.st_mode = (stat.S_IFDIR | 0o755) if ino == pyfuse3.ROOT_INODE else (stat.S_IFREG | 0o644)
        a.st_nlink = 1
        a.st_size = 0 if ino != TICKS_INO else 4096
        a.attr_timeout = a.entry_timeout = 0
        return a

    async def lookup(self, parent, name, ctx=None):
        ino = {b"f": F_INO, b"ticks": TICKS_INO}.get(name)
        if parent != pyfuse3.ROOT_INODE or ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(ino)

    async def getattr(self, ino, ctx=None):
        if ino == F_INO:      # slower than the callers: with a few of them, requests stay queued
            end = time.perf_counter() + SPIN_S
            while time.perf_counter() < end:
                pass
        return self._attr(ino)

    async def open(self, ino, flags, ctx):
        return pyfuse3.FileInfo(fh=ino, direct_io=True)

    async def read(self, fh, off, size):
        body = json.dumps({"max_gap_s": self.max_gap_s, "queued_reads": pyfuse3.queued_reads()}).encode()
        return body[off:off + size] if fh == TICKS_INO else b""


async def main(fs: TickFS) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fs.tick)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    fs = TickFS()
    pyfuse3.init(fs, sys.argv[1], {"fsname=tickfs"})
    try:
        trio.run(main, fs)
    finally:
        pyfuse3.close()

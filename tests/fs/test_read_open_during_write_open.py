"""A read open that arrives while a write open of the same file is making its staging.

The write open takes its staging in a worker thread (`new_staging`); a read open that ran
meanwhile found no writer yet and registered the store file itself as the inode's passthrough
backing, which the write open then shared: its writes went into the store file in place, and its
publish at close replaced them with the staging (a write lost). A read open in that window
gets no backing now (`Inode.writers_pending`): the daemon reads the store file for it, and the
write open is served from its own staging. Ordered by events, not timing (bounded waits only)."""
from __future__ import annotations

import errno
import os

import pytest
import trio

from fusefs.filesystem import Filesystem
from hintfs.stores.local import LocalStore
from tests.helpers.backing import CountingBacking, FakeFastTable


class FileBacking(CountingBacking):
    """Which file each backing id stands for: (st_dev, st_ino) of the fd it was made from."""

    def __init__(self):
        super().__init__()
        self.files: dict[int, tuple[int, int]] = {}

    def open(self, fd: int) -> int:
        bid = super().open(fd)
        st = os.fstat(fd)
        self.files[bid] = (st.st_dev, st.st_ino)
        return bid


async def _until(cond, limit_s: float = 2.0) -> None:
    with trio.move_on_after(limit_s):
        while not cond():
            await trio.sleep(0.002)


@pytest.mark.parametrize("immutable", [False, True], ids=["plain", "immutable (fast path)"])
def test_a_write_open_never_shares_a_backing_a_read_open_took_while_it_made_its_staging(tmp_path, immutable):
    from mountconfig.schema import CacheConfig
    store = tmp_path / "store"
    store.mkdir()
    (store / "f").write_bytes(b"old old")
    fs = Filesystem(LocalStore(str(store)), cache=CacheConfig(immutable_globs=["*"] if immutable else []))
    backing = FileBacking()
    fs.set_passthrough((backing, "on"), FakeFastTable())
    real_io = fs.io
    making, reader_in = trio.Event(), trio.Event()

    async def ordered_io(fn, *args, inline: bool = False):
        if getattr(fn, "__name__", "") == "new_staging":
            making.set()                     # the write open is making its staging: a read opens now
            await _until(reader_in.is_set)
        return await real_io(fn, *args, inline=inline)

    fs.io = ordered_io
    got: dict = {}

    async def main():
        ino = (await fs.lookup(1, b"f")).st_ino
        node = fs.inodes.by_ino[ino]

        async def writer():
            try:
                got["w"] = await fs.open(ino, os.O_WRONLY | os.O_TRUNC)
            except OSError as err:           # (Refused is an OSError)
                got["w_err"] = err

        async def reader():
            await making.wait()
            got["r"] = await fs.open(ino, os.O_RDONLY)
            reader_in.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            nursery.start_soon(reader)
        store_file = (os.stat(store / "f").st_dev, os.stat(store / "f").st_ino)
        r = got["r"]
        assert not r.backing_id, "a read open during a write open's staging took a passthrough backing"
        # (read after the O_TRUNC open completed: the open writer's staged data, as on a local disk)
        assert await fs.read(r.fh, 0, 100) == (b"" if "w" in got else b"old old")
        if "w_err" in got:
            assert got["w_err"].errno == errno.ETXTBSY, got["w_err"]
        else:
            w = got["w"]
            assert not w.backing_id or backing.files[w.backing_id] != store_file
            if w.backing_id:
                os.pwrite(node.writer.fd, b"new", 0)   # the kernel's write into the backing file
            else:
                await fs.write(w.fh, 0, b"new")
            await fs.release(w.fh)
            assert (store / "f").read_bytes() == b"new"     # published whole: nothing lost
        await fs.release(r.fh)

    trio.run(main)

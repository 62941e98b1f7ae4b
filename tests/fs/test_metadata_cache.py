"""Metadata of big folders (issue 39): listings of immutable folders kept for lookups and
listings (`fusefs.listings`), and the bound on the names the daemon keeps for the kernel
(`[cache] max_entries`, `fusefs.inodes.InodeTable.to_forget`). The filesystem is driven directly
(no mount) over a file:// store; the clock of `Listings` is injected."""
from __future__ import annotations

import os
import stat
import threading
from types import SimpleNamespace

import trio
import trio.testing

from fusefs.attrs import ROOT_INODE
from fusefs.inodes import InodeTable
from fusefs.listings import LIST_AFTER, Listings
from hintfs.common import paths
from hintfs.stores.base import Stat
from tests.fs.test_filesystem_api import CTX, fields, make_fs, write_file

IMMUTABLE = {"cache": {"immutable_globs": ["ck", "ck/*"], "max_entries": 1000}}


def _st(size: int = 1) -> Stat:
    return Stat(0o100644, size, 1, 1)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_listings_expire_and_stay_under_their_bound():
    clock = _Clock()
    ls = Listings(max_entries=10, clock=clock)      # (each user's share: 5)
    ls.put("a", [("x", _st(1)), ("y", _st(2))], ttl=10, uid=1)
    assert ls.get("a", "x").size == 1 and ls.get("a", "z") is None
    ls.put("b", [("x", _st(3)), ("y", _st(4)), ("z", _st(5))], ttl=10, uid=2)
    ls.put("b2", [(n, _st()) for n in "vwxyz"], ttl=10, uid=3)
    assert ls.entries == 10
    ls.put("c", [("x", _st(6))], ttl=10, uid=4)   # past the bound: the least recently used goes
    assert ls.folder("a") is None and ls.entries == 9
    ls.put("huge", [(str(i), _st()) for i in range(6)], ttl=10, uid=5)   # bigger than a share: not kept
    assert ls.folder("huge") is None
    clock.now += 10
    assert ls.folder("b") is None and ls.folder("b2") is None and ls.folder("c") is None and ls.entries == 0
    assert ls.users.held == {}
    ls.put("d/e", [("x", _st())], ttl=10)
    ls.put("d", [("e", _st())], ttl=10)
    ls.drop_under("d/e")                            # removed or renamed: it and its folder go
    assert ls.folder("d") is None and ls.folder("d/e") is None and ls.entries == 0


def test_one_users_listings_give_up_their_own_oldest_never_another_users():
    """Each kept listing counts to the user whose lookups or listing had it made; one user holds at
    most half of `max_entries` names: past it, that user's least recently used folders go first,
    another user's stay; a folder larger than the share is not kept."""
    ls = Listings(max_entries=10)
    assert ls.users.share == 5
    ls.put("f1", [("a", _st()), ("b", _st())], ttl=10, uid=1)
    ls.put("f2", [("a", _st()), ("b", _st())], ttl=10, uid=1)
    ls.put("g", [("a", _st()), ("b", _st()), ("c", _st())], ttl=10, uid=2)
    ls.put("f3", [("a", _st()), ("b", _st())], ttl=10, uid=1)     # 6 > 5: user 1's oldest (f1) goes
    assert ls.folder("f1") is None and ls.folder("g") is not None and ls.users.held == {1: 4, 2: 3}
    ls.folder("f2")                                                # used: f3 is user 1's oldest now
    ls.put("f4", [("a", _st()), ("b", _st())], ttl=10, uid=1)
    assert ls.folder("f3") is None and ls.folder("f2") is not None and ls.folder("g") is not None
    assert ls.given_up_for_share == 2 and ls.users.held == {1: 4, 2: 3} and ls.entries == 7
    assert ls.snapshot() == {"folders": 3, "names": 7, "users": 2, "share": 5, "given_up_for_share": 2}
    ls.put("big", [(str(i), _st()) for i in range(6)], ttl=10, uid=2)
    assert ls.folder("big") is None and ls.users.held[2] == 3
    ls.clear()
    assert ls.users.held == {} and ls.entries == 0


def test_a_folder_being_written_through_the_mount_is_not_listed_for_lookups_until_left_alone():
    """A writer creating file after file drops the folder's listing at each create, and its
    lookups of new names miss: listed again every LIST_AFTER files, each time whole, it cost work
    growing with the square of the folder's size (`make demo`: 235 listings for 400 files)."""
    from fusefs.listings import QUIET_AFTER_CHANGE_S
    clock = _Clock()
    ls = Listings(max_entries=100, clock=clock)
    ls.drop("ck")                                     # a create in it
    assert not any(ls.missed("ck") for _ in range(3 * LIST_AFTER))
    clock.now += QUIET_AFTER_CHANGE_S / 2
    ls.drop("ck")                                     # another: the quiet time starts again
    clock.now += QUIET_AFTER_CHANGE_S * 0.9
    assert not ls.missed("ck")
    clock.now += QUIET_AFTER_CHANGE_S * 0.2           # left alone long enough
    assert [ls.missed("ck") for _ in range(LIST_AFTER)] == [False] * (LIST_AFTER - 1) + [True]
    assert [ls.missed("other") for _ in range(LIST_AFTER)][-1]   # other folders as before


def test_a_folder_is_listed_for_lookups_after_a_few_misses():
    ls = Listings(max_entries=100)
    assert [ls.missed("f") for _ in range(LIST_AFTER)] == [False] * (LIST_AFTER - 1) + [True]
    ls.listing.add("g")
    assert not any(ls.missed("g") for _ in range(2 * LIST_AFTER))   # being listed: never twice


class _CountingStore:
    """The file:// store, counting stat calls (what a HEAD each would be on S3)."""

    def __init__(self, store):
        self._store = store
        self.stats = 0
        self.gate: threading.Event | None = None   # set: listings wait for it (in their thread)

    def iter_dir_in_thread(self, rel):
        if self.gate is not None:
            assert self.gate.wait(30)
        return self._store.iter_dir_in_thread(rel)

    def stat(self, rel):
        self.stats += 1
        return self._store.stat(rel)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _fs(tmp_path, **cfg):
    fs = make_fs(tmp_path, **cfg)
    fs.store = _CountingStore(fs.store)
    return fs, tmp_path / "store"


async def _names(fs, ino: int) -> list[str]:
    fh = await fs.opendir(ino, CTX)
    out: list[str] = []
    await fs.readdir(fh, 0, lambda e: out.append(e.name.decode()) or True)
    await fs.releasedir(fh)
    return sorted(out)


def test_lookups_in_an_immutable_folder_are_answered_from_one_listing(tmp_path):
    fs, root = _fs(tmp_path, **IMMUTABLE)
    (root / "ck").mkdir()
    for i in range(50):
        (root / "ck" / f"f{i:02d}").write_bytes(b"x" * i)

    async def test(fs, _root):
        ck = await fs.lookup(ROOT_INODE, b"ck", CTX)
        before = fs.store.stats
        for i in range(50):
            a = await fs.lookup(ck.st_ino, f"f{i:02d}".encode(), CTX)
            assert a.st_size == i
            await _listed(fs, "ck")
        # the first misses asked the store; then one listing (in the background) answered the rest
        assert fs.store.stats - before == LIST_AFTER
        assert fs.stats.counters["lookup_listings"] == 1
        assert fs.stats.counters["lookup_from_listing"] == 50 - LIST_AFTER
        # a name the listing lacks (written by another host since) still asks the store
        (root / "ck" / "new").write_bytes(b"n")
        assert (await fs.lookup(ck.st_ino, b"new", CTX)).st_size == 1
        assert fs.store.stats - before == LIST_AFTER + 1
    trio.run(test, fs, root)


async def _listed(fs, folder: str) -> None:
    """Wait for a background listing of `folder` (`Filesystem._list_for_lookups`) to end."""
    with trio.fail_after(30):
        while folder in fs.listings.listing:
            await trio.sleep(0.001)


def test_a_listing_begun_before_a_change_through_the_mount_is_not_kept(tmp_path):
    fs, root = _fs(tmp_path, **IMMUTABLE)
    (root / "ck").mkdir()
    for i in range(10):
        (root / "ck" / f"f{i}").write_bytes(b"x")

    async def test(fs, _root):
        ck = await fs.lookup(ROOT_INODE, b"ck", CTX)
        fs.store.gate = threading.Event()
        for i in range(LIST_AFTER):
            await fs.lookup(ck.st_ino, f"f{i}".encode(), CTX)
        assert "ck" in fs.listings.listing          # listing in a worker thread now, held
        await write_file(fs, ck.st_ino, "made", b"m")   # meanwhile: a name made through the mount
        fs.store.gate.set()
        await _listed(fs, "ck")
        assert fs.stats.counters["lookup_listings"] == 1
        assert fs.listings.folder("ck") is None      # not kept: it may lack "made"
        assert "made" in await _names(fs, ck.st_ino)
    trio.run(test, fs, root)


def test_a_folder_bigger_than_the_bound_is_listed_once_and_not_kept(tmp_path):
    fs, root = _fs(tmp_path, cache={"immutable_globs": ["big/*"], "max_entries": 1000})
    (root / "big").mkdir()
    for i in range(1001):
        (root / "big" / f"f{i:04d}").write_bytes(b"")

    async def test(fs, _root):
        big = await fs.lookup(ROOT_INODE, b"big", CTX)
        for i in range(3 * LIST_AFTER):
            await fs.lookup(big.st_ino, f"f{i:04d}".encode(), CTX)
            await _listed(fs, "big")
        assert fs.stats.counters["lookup_listings"] == 1 and fs.listings.folder("big") is None
        assert "lookup_from_listing" not in fs.stats.counters
    trio.run(test, fs, root)


def test_a_folder_not_declared_immutable_is_never_answered_from_a_listing(tmp_path):
    fs, root = _fs(tmp_path, **IMMUTABLE)
    (root / "other").mkdir()
    for i in range(20):
        (root / "other" / f"f{i}").write_bytes(b"y")

    async def test(fs, _root):
        d = await fs.lookup(ROOT_INODE, b"other", CTX)
        assert len(await _names(fs, d.st_ino)) == 20
        before = fs.store.stats
        for i in range(20):
            await fs.lookup(d.st_ino, f"f{i}".encode(), CTX)
        assert fs.store.stats - before == 20 and "lookup_from_listing" not in fs.stats.counters
        (root / "other" / "late").write_bytes(b"z")
        assert "late" in await _names(fs, d.st_ino)      # listed from the store each time
    trio.run(test, fs, root)


def test_an_immutable_folder_is_listed_from_memory_until_this_mount_changes_it(tmp_path):
    fs, root = _fs(tmp_path, **IMMUTABLE)
    (root / "ck").mkdir()
    (root / "ck" / "a").write_bytes(b"a")

    async def test(fs, _root):
        ck = await fs.lookup(ROOT_INODE, b"ck", CTX)
        assert await _names(fs, ck.st_ino) == ["a"]
        # a change behind the mount's back to a folder declared immutable: seen up to
        # immutable_timeout_s later (docs/semantics.md), like its attributes
        (root / "ck" / "b").write_bytes(b"b")
        assert await _names(fs, ck.st_ino) == ["a"]
        before = fs.store.stats
        assert (await fs.lookup(ck.st_ino, b"a", CTX)).st_size == 1   # from the kept listing
        assert fs.store.stats == before
        # a change through this mount is seen at once: create, unlink, rename
        await write_file(fs, ck.st_ino, "c", b"cc")
        assert await _names(fs, ck.st_ino) == ["a", "b", "c"]
        await fs.unlink(ck.st_ino, b"b", CTX)
        assert await _names(fs, ck.st_ino) == ["a", "c"]
        await fs.rename(ck.st_ino, b"c", ck.st_ino, b"d", 0, CTX)
        assert await _names(fs, ck.st_ino) == ["a", "d"]
        assert os.listdir(root / "ck") and sorted(os.listdir(root / "ck")) == ["a", "d"]
    trio.run(test, fs, root)


def test_a_truncate_through_the_mount_drops_the_kept_listing(tmp_path):
    """Model seed 500142 (1fast): a file listed (its folder's listing kept), then truncated by
    path while a writer had it open. The listing kept the size from before; a lookup after the
    kernel forgot the name (a close-to-open renewal) was answered from it, and the kernel kept
    that size for the immutable timeout. A truncate drops the kept listing, with or without a
    writer, as chmod, chown and utimens do."""
    fs, root = _fs(tmp_path, **IMMUTABLE)
    (root / "ck").mkdir()
    (root / "ck" / "a").write_bytes(b"a")
    (root / "ck" / "b").write_bytes(b"b")
    attr = SimpleNamespace(st_size=9000, st_mode=0o644, st_uid=0, st_gid=0, st_atime_ns=0, st_mtime_ns=0)

    async def test(fs, _root):
        ck = await fs.lookup(ROOT_INODE, b"ck", CTX)
        for name in (b"a", b"b"):
            assert await _names(fs, ck.st_ino) == ["a", "b"]
            f = await fs.lookup(ck.st_ino, name, CTX)
            assert f.st_size == 1 and fs.listings.folder("ck") is not None
            writer = await fs.open(f.st_ino, os.O_WRONLY, CTX) if name == b"b" else None
            got = await fs.setattr(f.st_ino, attr, fields(update_size=True), writer.fh if writer else None, CTX)
            assert got.st_size == 9000
            assert fs.listings.folder("ck") is None          # (with a writer open: kept before)
            assert (await fs.lookup(ck.st_ino, name, CTX)).st_size == 9000
            if writer is not None:
                await fs.release(writer.fh)
            assert os.path.getsize(root / "ck" / name.decode()) == 9000
    trio.run(test, fs, root)


class _Kernel:
    def __init__(self):
        self.asked: list[tuple[int, bytes]] = []
        self.listings: list[int] = []
        self.attrs: list[int] = []

    def invalidate_entry(self, parent: int, name: bytes) -> None:
        self.asked.append((parent, name))

    def invalidate_entry_now(self, parent: int, name: bytes) -> None:
        self.asked.append((parent, name))

    def invalidate_listing(self, folder: int) -> None:
        self.listings.append(folder)

    def invalidate_attrs(self, inode: int) -> None:
        self.attrs.append(inode)


def test_past_max_entries_the_kernel_is_asked_to_forget_the_oldest_idle_names(tmp_path):
    fs, root = _fs(tmp_path, cache={"max_entries": 1000})
    kernel = fs.kernel = _Kernel()
    (root / "d").mkdir()
    for i in range(1500):
        (root / "d" / f"f{i:04d}").write_bytes(b"")

    async def test(fs, _root):
        d = await fs.lookup(ROOT_INODE, b"d", CTX)
        names = await _names(fs, d.st_ino)
        assert len(names) == 1500
        # 1,503 known (root, .hintfs, d and the files): down to 90% of the bound asked, the
        # files (d is open: not asked), oldest first
        assert len(kernel.asked) == len(fs.inodes.by_ino) - 900
        assert {parent for parent, _ in kernel.asked} == {d.st_ino}
        known = [i.path for i in fs.inodes.by_ino.values()]
        assert [f"d/{n.decode()}" for _, n in kernel.asked] == [p for p in known if p.startswith("d/")][:603]
        n = len(kernel.asked)
        await fs.readdir(await fs.opendir(d.st_ino, CTX), 10**9, lambda e: True)   # nothing new: not asked again
        assert len(kernel.asked) == n
        # the kernel forgets them: the daemon drops the inodes
        for parent, name in list(kernel.asked):
            if parent == d.st_ino:
                fs.forget([(fs.inodes.by_path_get(f"d/{name.decode()}").ino, 1)])
        assert fs.inodes.over(1000) < 0 and not fs.inodes.asked - set(fs.inodes.by_ino)
    trio.run(test, fs, root)


def test_open_files_and_writers_are_never_asked_to_be_forgotten():
    table = InodeTable()
    d = table.ensure("d")
    d.lookups = 1
    files = [table.ensure(f"d/f{i}") for i in range(4)]
    for f in files:
        f.lookups = 1
    files[0].opens = 1
    files[1].writer = SimpleNamespace(fd=-1)
    picked = [(inode.path, parent.path, name) for inode, parent, name in table.to_forget(10)]
    assert picked == [("d", "", "d"), ("d/f2", "d", "f2"), ("d/f3", "d", "f3")]
    assert table.to_forget(10) == []                 # asked once
    table.forget(files[2].ino, 1)
    assert files[2].ino not in table.asked and table.over(0) == len(table.by_ino) - 2


class _RemoteLike:
    """The file:// store as an object store lists: in one response, in a thread, no d_type listing."""

    inline_metadata = False

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        if name in ("iter_names", "iter_dir_in_thread"):
            raise AttributeError(name)
        return getattr(self._store, name)


def test_a_walking_threads_listing_gives_files_by_name_and_makes_no_inode(tmp_path):
    """`fusefs.walks`: past its first folders a thread's listings give files by name (plus
    False, no inode, no lookup) and folders with attributes; a local store's such listing is not
    kept for lookups (types only), an object store's is (it has the attributes anyway)."""
    from fusefs.walks import Walks
    for remote in (False, True):
        (tmp_path / ("r" if remote else "l")).mkdir()
        fs, root = _fs(tmp_path / ("r" if remote else "l"), **IMMUTABLE)
        if remote:
            fs.store = _RemoteLike(fs.store)
            fs.meta_inline = False
        (root / "ck" / "sub").mkdir(parents=True)
        (root / "ck" / "f").write_bytes(b"abc")
        fs.names_listings, fs.walks = True, Walks(walk_after=0)
        walker = SimpleNamespace(**{**vars(CTX), "pid": 4242})

        async def test(fs, _root):
            ck = await fs.lookup(ROOT_INODE, b"ck", CTX)
            fh = await fs.opendir(ck.st_ino, walker)
            got: dict = {}
            await fs.readdir(fh, 0, lambda e: got.update({e.name: e}) or True)
            await fs.releasedir(fh)
            assert {n: e.plus for n, e in got.items()} == {b"f": False, b"sub": True}
            assert stat.S_ISREG(got[b"f"].attrs.st_mode) and stat.S_ISDIR(got[b"sub"].attrs.st_mode)
            assert fs.inodes.by_path_get("ck/f") is None and fs.inodes.by_path_get("ck/sub") is not None
            assert (fs.listings.folder("ck") is not None) == remote
            assert (await fs.lookup(ck.st_ino, b"f", walker)).st_size == 3   # stat of a name: the real size
            assert fs.walks.back_to_plus == 1
        trio.run(test, fs, root)


def test_a_walks_files_given_in_batches_are_the_entries_given_one_by_one(tmp_path):
    """The batch of name-only entries (`DirHandle.reply_names`, the patched pyfuse3's
    `readdir_names`) gives exactly what `reply_one` gives one at a time: names, inode numbers (an
    inode the daemon knows keeps its number), types and next ids, folders still with their
    attributes; cut where the kernel's buffer is full, a listing resumes at the next id."""
    from fusefs.walks import Walks
    fs, root = _fs(tmp_path, **IMMUTABLE)
    ck = root / "ck"
    ck.mkdir()
    for i in range(40):
        if i % 7 == 3:
            (ck / f"e{i:02d}").mkdir()
        elif i % 11 == 5:
            (ck / f"e{i:02d}").symlink_to("nowhere")
        else:
            (ck / f"e{i:02d}").write_bytes(b"x" * i)
    fs.names_listings, fs.walks = True, Walks(walk_after=0)
    walker = SimpleNamespace(**{**vars(CTX), "pid": 4242})

    async def listing(fs, batch: bool, budget: int) -> list:
        got: list = []
        ck_attrs = await fs.lookup(ROOT_INODE, b"ck", CTX)
        known = await fs.lookup(ck_attrs.st_ino, b"e02", CTX)       # a file the daemon knows
        fh = await fs.opendir(ck_attrs.st_ino, walker)
        start = 0
        while True:
            room = [budget]

            def one(e) -> bool:
                if room[0] == 0:
                    return False
                room[0] -= 1
                got.append((e.name, e.attrs.st_ino, stat.S_IFMT(e.attrs.st_mode) >> 12, e.next_id, e.plus))
                return True

            def names(raw, inos, kinds, first) -> int:
                took = min(room[0], len(raw))
                room[0] -= took
                got.extend((raw[i], inos[i], kinds[i], first + i + 1, False) for i in range(took))
                return took

            before = len(got)
            await fs.readdir(fh, start, one, names if batch else None)
            if len(got) == before:
                break
            start = got[-1][3]
        await fs.releasedir(fh)
        return [(n, ino if n != b"e02" else ("known", ino == known.st_ino), k, nid, plus) for n, ino, k, nid, plus in got]

    async def test(fs, _root):
        one_by_one = await listing(fs, False, 10**6)
        assert len(one_by_one) == 40 and [e[3] for e in one_by_one] == list(range(1, 41))
        assert {e[0]: e[4] for e in one_by_one}[b"e03"] is True                 # a folder: attributes
        assert {e[0]: e[1] for e in one_by_one}[b"e02"] == ("known", True)
        assert {e[0]: e[2] for e in one_by_one}[b"e05"] == stat.S_IFLNK >> 12
        for budget in (10**6, 7, 1):
            assert await listing(fs, True, budget) == one_by_one, budget
    trio.run(test, fs, root)


class _Ends:
    """A FUSE binding that finishes listings itself (`fusefs.interfaces.ListingEnds`)."""
    def __init__(self):
        self.ends: dict[int, int] = {}
        self.gone: list[int] = []

    def ended(self, fh: int, end: int | None) -> None:
        self.ends[fh] = end

    def released(self) -> list[int]:
        out, self.gone = self.gone, []
        return out


def test_a_listing_given_to_its_end_is_finished_and_released_by_the_binding(tmp_path):
    """A handle whose listing was given whole is reported with the offset it ends at (the
    binding then answers the kernel's last READDIR and the RELEASEDIR); one whose listing the
    kernel's buffer cut is not. A handle the binding released goes at the next opendir, and its
    folder's inode with it once the kernel forgets it."""
    fs, root = _fs(tmp_path)
    for i in range(5):
        (root / f"f{i}").write_bytes(b"x")
    (root / "d").mkdir()
    fs.listing_ends = ends = _Ends()

    async def test(fs, _root):
        d = await fs.lookup(ROOT_INODE, b"d", CTX)
        fh = await fs.opendir(ROOT_INODE, CTX)
        room = [3]

        def some(e) -> bool:
            room[0] -= 1
            return room[0] >= 0

        assert ends.ends[fh] is None                    # its release: the binding's from the start
        await fs.readdir(fh, 0, some)
        assert ends.ends[fh] is None                    # cut by the buffer: not ended
        await fs.readdir(fh, 3, lambda e: True)
        assert ends.ends[fh] == 6                       # 5 files and d: it ends at offset 6
        fd = await fs.opendir(d.st_ino, CTX)
        await fs.readdir(fd, 0, lambda e: True)
        assert ends.ends[fd] == 0                       # an empty folder ends at once
        node = fs.inodes.by_ino[d.st_ino]
        opens = node.opens
        ends.gone = [fd, fh]                            # the binding answered their RELEASEDIRs
        await fs.opendir(ROOT_INODE, CTX)
        assert fd not in fs.handles and fh not in fs.handles
        assert node.opens == opens - 1
        assert fs.stats.snapshot()["counters"]["listings_released_by_pyfuse3"] == 2
    trio.run(test, fs, root)


class _FakeNames:
    """pyfuse3's table of names answered at LOOKUP (`fusefs.fastpath.NamesBackend`): `answer`
    plays a LOOKUP pyfuse3 answered, as fuse_lookup counts it."""

    templates = True   # (a checked name may come by its inode number, with a template: `entry`)

    def __init__(self) -> None:
        self.folders: dict[int, dict[bytes, object]] = {}
        self.checks: dict[int, dict[bytes, object]] = {}
        self.templates_given: dict[int, object] = {}
        self.counts: dict[int, int] = {}

    def put(self, parent, entries, deadline_ns, template=None):
        assert template is not None or not any(isinstance(e[1], int) for e in entries)
        assert all(e[2] is not None for e in entries if isinstance(e[1], int))
        self.folders[parent] = {e[0]: e[1] for e in entries}
        self.checks[parent] = {e[0]: e[2] for e in entries}
        self.templates_given[parent] = template

    def drop(self, parent):
        return len(self.folders.pop(parent, {}))

    def take(self, ino):
        return self.counts.pop(ino, 0)

    def stats(self):
        return sum(self.counts.values()), len(self.folders), sum(len(v) for v in self.folders.values())

    def now_ns(self):
        return 0

    def answer(self, parent: int, name: bytes) -> int:
        attrs = self.folders[parent][name]
        ino = attrs if isinstance(attrs, int) else attrs.st_ino
        self.counts[ino] = self.counts.get(ino, 0) + 1
        return ino


def _named_fs(tmp_path, files: int):
    """A filesystem with a fake table of names and `files` files in the immutable folder ck."""
    fs, root = _fs(tmp_path, **IMMUTABLE)
    names = fs.names.backend = _FakeNames()
    (root / "ck").mkdir()
    for i in range(files):
        (root / "ck" / f"f{i:02d}").write_bytes(b"x" * i)
    return fs, root, names


def test_a_name_whose_write_open_is_pending_is_not_registered(tmp_path):
    """A folder named while a write open of one of its files waits (for the publish lock, after
    that open dropped the folder's names): that file is not registered, or pyfuse3 would answer
    its LOOKUPs with the listing's size while the writer grows it (model seed 4500083: `stat` gave
    3 bytes, the open writer had written 70,536)."""
    fs, root, names = _named_fs(tmp_path, 6)

    async def test(fs, _root):
        ck = await fs.lookup(ROOT_INODE, b"ck", CTX)
        f3 = await fs.lookup(ck.st_ino, b"f03", CTX)
        node = fs.inodes[f3.st_ino]
        opened = []

        async def write_open():
            opened.append(await fs.open(f3.st_ino, os.O_WRONLY, CTX))

        async with trio.open_nursery() as nursery:
            async with fs.publish_lock(node):
                nursery.start_soon(write_open)
                await trio.testing.wait_all_tasks_blocked()
                assert node.writers_pending == 1 and node.writer is None
                listing = list(fs.store.iter_dir("ck"))
                fs.listings.put("ck", listing, 3600.0)
                await fs._name_folder("ck", listing, 3600.0, CTX.uid)
                registered = names.folders.get(ck.st_ino, {})
                assert b"f02" in registered and b"f03" not in registered
        await fs.release(opened[0].fh)
    trio.run(test, fs, root)


def test_lookups_answered_in_pyfuse3_are_the_kernels_at_forget_and_when_the_names_go(tmp_path):
    """A registered name's inode is held by the registration; the kernel's FORGET counts the
    lookups pyfuse3 answered (added first), so the inode stays exactly as long as the kernel or the
    registration holds it; when the names go, the lookups answered meanwhile are the kernel's."""
    fs, root, names = _named_fs(tmp_path, 20)
    (root / "ck" / (paths.STAGING_PREFIX + "w")).write_bytes(b"h")   # a write in progress
    (root / "ck" / "sub").mkdir()

    async def test(fs, _root):
        ck = await fs.lookup(ROOT_INODE, b"ck", CTX)
        for i in range(LIST_AFTER):
            await fs.lookup(ck.st_ino, f"f{i:02d}".encode(), CTX)
        await _listed(fs, "ck")
        registered = names.folders[ck.st_ino]
        assert fs.inodes[ck.st_ino].lookups == 2          # the kernel's, and the registration's
        # plain files only: no staging file, no folder; each with the attributes Python answers
        assert set(registered) == {f"f{i:02d}".encode() for i in range(20)}
        for i in (0, 7):
            a = await fs.lookup(ck.st_ino, f"f{i:02d}".encode(), CTX)
            assert registered[f"f{i:02d}".encode()] == a
            fs.forget([(a.st_ino, 1)])                    # (that Python lookup, given back)
        ino = names.answer(ck.st_ino, b"f05")
        names.answer(ck.st_ino, b"f05")
        fs.forget([(ino, 2)])                             # both answered in pyfuse3: held still
        assert fs.inodes.get(ino) is not None and fs.inodes[ino].lookups == 1
        ino9 = names.answer(ck.st_ino, b"f09")
        f9 = fs.inodes[ino9]
        fs.listings.drop("ck")                            # the names go: the kernel still holds f09
        assert not names.folders and not fs.names.folders
        assert fs.inodes.get(ino9) is f9 and f9.lookups == 1 and not f9.fast_named
        assert fs.inodes.get(ino) is None                 # nobody holds f05 any more
        fs.forget([(ino9, 1)])
        assert fs.inodes.get(ino9) is None
        # the folder's inode was held by the registration only while it lasted
        assert fs.inodes[ck.st_ino].lookups == 1
    trio.run(test, fs, root)


def test_a_change_through_the_mount_ends_the_names_answered_in_pyfuse3(tmp_path):
    fs, root, names = _named_fs(tmp_path, 10)

    async def test(fs, _root):
        ck = await fs.lookup(ROOT_INODE, b"ck", CTX)
        for i in range(LIST_AFTER):
            await fs.lookup(ck.st_ino, f"f{i:02d}".encode(), CTX)
        await _listed(fs, "ck")
        assert names.folders
        a = await fs.lookup(ck.st_ino, b"f08", CTX)
        fh = (await fs.open(a.st_ino, os.O_WRONLY, CTX)).fh   # a write open of a name there
        assert not names.folders and not fs.names.folders
        await fs.release(fh)
    trio.run(test, fs, root)


def test_a_registration_made_across_a_change_registers_nothing_and_keeps_no_inode(tmp_path, monkeypatch):
    """The entries are made a chunk at a time, the loop free between: a change in the folder
    meanwhile (here a write open's `_fast_off`) ends the registration, and the inodes made for it
    go."""
    import fusefs.filesystem as filesystem
    monkeypatch.setattr(filesystem, "NAME_CHUNK", 4)
    fs, root, names = _named_fs(tmp_path, 20)

    async def test(fs, _root):
        ck = await fs.lookup(ROOT_INODE, b"ck", CTX)
        listing = list(fs.store.iter_dir("ck"))
        fs.listings.put("ck", listing, 3600.0)
        known = len(fs.inodes.by_ino)
        f03 = await fs.lookup(ck.st_ino, b"f03", CTX)   # (one the kernel holds: it stays)

        made, inode_for = [], fs.inode_for

        def making(path, st):                                # while the entries are made, after
            made.append(path)                                # the first chunk's wait: a write
            if len(made) == 6:                               # open of f03, say
                fs._fast_off(fs.inodes[f03.st_ino])
            return inode_for(path, st)
        fs.inode_for = making
        await fs._name_folder("ck", listing, 3600.0)
        del fs.inode_for
        assert len(made) == 8                                # it stopped at the next wait
        assert not names.folders and not fs.names.folders
        assert len(fs.inodes.by_ino) == known + 1            # only f03, which the kernel holds
        await fs._name_folder("ck", listing, 3600.0)         # undisturbed: every name
        assert len(names.folders[ck.st_ino]) == 20
    trio.run(test, fs, root)


def test_a_local_folder_is_listed_for_lookups_on_the_loop_a_chunk_at_a_time(tmp_path, monkeypatch):
    """On a local store the listing for lookups runs on the event loop (a worker thread's listing
    came too late: each entry's stat gave the GIL up, and the busy loop kept it), LIST_CHUNK entries
    at a time with other tasks running between, and it stops at `most`."""
    import fusefs.filesystem as filesystem
    monkeypatch.setattr(filesystem, "LIST_CHUNK", 4)
    fs, root, _names = _named_fs(tmp_path, 20)
    turns = [0]

    async def test(fs, _root):
        async def other():
            while True:
                turns[0] += 1
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            await trio.sleep(0)
            start = turns[0]
            listing = await fs._list_inline("ck", 1000)
            ran = turns[0] - start
            nursery.cancel_scope.cancel()
        assert sorted(n for n, _ in listing) == [f"f{i:02d}" for i in range(20)]
        assert ran >= 20 // 4 - 1, ran                     # the loop was free between chunks
        assert len(await fs._list_inline("ck", 7)) == 7
    trio.run(test, fs, root)


def _ahead_fs(tmp_path, files: int, folders=("ck",), **mount):
    """`_named_fs` with passthrough and the fast path's table (stand-ins: tests/helpers/backing.py)."""
    from tests.helpers.backing import CountingBacking, FakeFastTable
    cfg = {"cache": {**IMMUTABLE["cache"], "immutable_globs": [g for f in folders for g in (f, f"{f}/*")]},
           "mount": mount}
    fs, root = _fs(tmp_path, **cfg)
    names = fs.names.backend = _FakeNames()
    backing, fast = CountingBacking(), FakeFastTable()
    fs.set_passthrough((backing, "on"), fast)
    for folder in folders:
        (root / folder).mkdir()
        for i in range(files):
            (root / folder / f"f{i:02d}").write_bytes(b"x" * i)
    return fs, root, names, backing, fast


async def _read_through(fs, ck: int, names, *which: int, ctx=CTX) -> None:
    """Open and release each of `which` as a reader would: its LOOKUP answered in pyfuse3 (the fake
    table) once the folder is named, its OPEN and RELEASE in Python."""
    for i in which:
        name = f"f{i:02d}".encode()
        ino = names.answer(ck, name) if ck in names.folders else (await fs.lookup(ck, name, ctx)).st_ino
        h = await fs.open(ino, os.O_RDONLY, ctx)
        await fs.release(h.fh)


async def _named(fs, names, folder: str = "ck") -> int:
    ck = await fs.lookup(ROOT_INODE, folder.encode(), CTX)
    for i in range(LIST_AFTER):
        await fs.lookup(ck.st_ino, f"f{i:02d}".encode(), CTX)
    await _listed(fs, folder)
    assert ck.st_ino in names.folders
    return ck.st_ino


def test_a_reader_going_through_a_named_folder_gets_its_other_files_marked_ahead(tmp_path):
    """After OPEN_AHEAD_AFTER first opens in Python in a folder whose names pyfuse3 answers, the
    folder's other files are marked for the fast path as their own opens would mark them (the
    store file's backing, the attributes), by the same user, and counted apart; no RELEASE is
    counted for them (the model-based test waits for real ones). When the names go, the files the
    kernel never looked up lose their marks and their backing ids."""
    from fusefs.fastpath import OPEN_AHEAD_AFTER
    fs, root, names, backing, fast = _ahead_fs(tmp_path, 20)

    async def test(fs, _root):
        ck = await _named(fs, names)
        await _read_through(fs, ck, names, *range(OPEN_AHEAD_AFTER - 1))
        await trio.testing.wait_all_tasks_blocked()
        assert len(fast.serving) == OPEN_AHEAD_AFTER - 1       # not yet: only its own mark
        await _read_through(fs, ck, names, 10)
        await trio.testing.wait_all_tasks_blocked()
        assert len(fast.serving) == 20 and len(backing.live) == 20
        assert fs.fast.counts["marked_ahead"] == 20 - OPEN_AHEAD_AFTER
        assert set(fs.fast.by_uid) == {CTX.uid}
        for ino, bid in fast.serving.items():                  # each with its own file's backing
            node = fs.inodes[ino]
            assert node.pt_id == bid and node.opens == 1 and node.fast_named
        assert fs.stats.counters["file_releases"] == OPEN_AHEAD_AFTER
        fs.listings.drop("ck")
        # the files the kernel looked up (f00-f03, in Python) or was answered (f10) it still holds:
        # only theirs stay marked, and only their inodes stay known
        kept = {"ck/f00", "ck/f01", "ck/f02", "ck/f03", "ck/f10"}
        assert {fs.inodes[i].path for i in fast.serving} == kept and len(backing.live) == len(kept)
        assert {n.path for n in fs.inodes.by_ino.values() if n.path.startswith("ck/")} == kept
    trio.run(test, fs, root)


def test_files_are_marked_ahead_in_free_places_or_the_users_own_and_never_when_off(tmp_path):
    """Marks made ahead take the free places, then those of the same user's oldest marks, never
    another user's; no more than there were of both when the marking began (they never give up
    each other); `[mount] fast_opens_ahead = 0` makes none."""
    fs, root, names, backing, fast = _ahead_fs(tmp_path, 20, fast_path_inodes=6)
    other = SimpleNamespace(uid=CTX.uid + 1, gid=CTX.gid, pid=CTX.pid, umask=0o022)
    (root / "other").write_bytes(b"y")

    async def test(fs, _root):
        o = await fs.lookup(ROOT_INODE, b"other", other)
        fs.immutable = lambda path: 1                          # (every path, for this one)
        h = await fs.open(o.st_ino, os.O_RDONLY, other)
        await fs.release(h.fh)
        del fs.immutable
        assert o.st_ino in fast.serving
        ck = await _named(fs, names)
        await _read_through(fs, ck, names, 0, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert len(fast.serving) == 6 and o.st_ino in fast.serving     # the other user's kept
        # 3 free places, then the places of f00 and f01 (this user's, the oldest): 5 marked ahead
        assert fs.fast.counts["marked_ahead"] == 5 and fs.fast.counts["given_up_for_room"] == 2
        ahead = {fs.inodes[i].path for i in fast.serving if i != o.st_ino}
        assert len(ahead) == 5 and not ahead & {"ck/f00", "ck/f01"}, ahead
    trio.run(test, fs, root)

    (tmp_path / "off").mkdir()
    fs, root, names, backing, fast = _ahead_fs(tmp_path / "off", 20, fast_opens_ahead=0)

    async def off(fs, _root):
        ck = await _named(fs, names)
        await _read_through(fs, ck, names, 0, 1, 2)
        await trio.testing.wait_all_tasks_blocked()
        assert len(fast.serving) == 3 and fs.fast.counts["marked_ahead"] == 0
    trio.run(off, fs, root)


def test_a_reader_going_through_more_files_than_the_table_holds_gets_each_folder_marked_ahead(tmp_path):
    """A full table (a pass over a dataset larger than `fast_path_inodes`): the next folder's files
    are marked ahead in place of the reader's oldest marks, those of the folder it has gone
    through, so its opens stay in pyfuse3 (a table of free places only marked none of them)."""
    fs, root, names, backing, fast = _ahead_fs(tmp_path, 6, folders=("ck", "ck2"), fast_path_inodes=6)

    async def test(fs, _root):
        ck = await _named(fs, names)
        await _read_through(fs, ck, names, 0, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert {fs.inodes[i].path for i in fast.serving} == {f"ck/f{i:02d}" for i in range(6)}
        ck2 = await _named(fs, names, "ck2")
        await _read_through(fs, ck2, names, 0, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert {fs.inodes[i].path for i in fast.serving} == {f"ck2/f{i:02d}" for i in range(6)}
        assert fs.fast.counts["marked_ahead"] == 8 and fs.fast.counts["given_up_for_room"] == 6
        assert len(backing.live) == 6          # each given-up mark let its backing id go
    trio.run(test, fs, root)


def test_marking_ahead_stops_at_a_change_in_the_folder_and_its_marks_go(tmp_path, monkeypatch):
    """The files are marked AHEAD_CHUNK at a time, the loop free between: a write open in the folder
    meanwhile ends the names, and so the marking; the marks it made go with the names (the kernel
    never looked those files up); a file being written is never marked."""
    import fusefs.filesystem as filesystem
    monkeypatch.setattr(filesystem, "AHEAD_CHUNK", 3)
    fs, root, names, backing, fast = _ahead_fs(tmp_path, 20)

    async def test(fs, _root):
        ck = await _named(fs, names)
        f15 = await fs.lookup(ck, b"f15", CTX)
        await _read_through(fs, ck, names, 0, 1)           # the marking ahead starts
        w = await fs.open(f15.st_ino, os.O_WRONLY, CTX)    # before it ran: names end at once
        await trio.testing.wait_all_tasks_blocked()
        assert not names.folders
        assert {fs.inodes[i].path for i in fast.serving} == {"ck/f00", "ck/f01"}
        assert fs.fast.counts["marked_ahead"] == 0
        await fs.release(w.fh)
    trio.run(test, fs, root)


def test_one_users_walk_gives_up_its_own_oldest_names_never_another_users(tmp_path):
    """The names registered for lookups in pyfuse3 count to the user whose lookups had the folder
    listed, at most half of `[cache] max_entries` each: past it, that user's oldest folder goes
    (its names answered by Python again), and another user's stay. The kept listings have the same
    share per user and give the folder up first (its names go with it); `FastNames.users` holds
    the names alone (tests/unit/test_fastpath_table.py)."""
    fs, root = _fs(tmp_path, cache={"immutable_globs": ["*"], "max_entries": 1000})
    names = fs.names.backend = _FakeNames()
    for d in ("a", "b", "c", "z"):
        (root / d).mkdir()
        for i in range(200):
            (root / d / f"f{i:03d}").write_bytes(b"x")
    walker = SimpleNamespace(uid=CTX.uid + 1, gid=CTX.gid, pid=CTX.pid, umask=0o022)

    async def walk(fs, folder: str, ctx) -> int:
        d = await fs.lookup(ROOT_INODE, folder.encode(), ctx)
        for i in range(LIST_AFTER):
            await fs.lookup(d.st_ino, f"f{i:03d}".encode(), ctx)
        await _listed(fs, folder)
        await trio.testing.wait_all_tasks_blocked()
        return d.st_ino

    async def test(fs, _root):
        z = await walk(fs, "z", CTX)
        a = await walk(fs, "a", walker)
        b = await walk(fs, "b", walker)
        assert set(fs.names.folders) == {"z", "a", "b"} and fs.names.users.share == 500
        c = await walk(fs, "c", walker)                 # the walker's 600th name: its oldest goes
        assert set(fs.names.folders) == {"z", "b", "c"}
        assert set(names.folders) == {z, b, c} and a not in names.folders
        assert fs.listings.given_up_for_share == 1   # (the walker holds b, c and the root's 4 names)
        assert fs.listings.users.held == {walker.uid: 404, CTX.uid: 200}
        assert fs.names.users.held[walker.uid] == 400 and fs.names.users.held[CTX.uid] == 200
        assert (await fs.lookup(a, b"f150", walker)).st_size == 1   # Python answers a's names again
    trio.run(test, fs, root)

"""fusefs.fastpath without a kernel: which opens may be marked (`fast_eligible`, pure), and the
table's bound, its fairness between users and the holds it lets go (`FastPath`)."""
from __future__ import annotations

import pytest

from fusefs.fastpath import FastPath, FetchAhead, ReadFolders, fast_eligible
from fusefs.handles import HandleKind
from fusefs.inodes import Inode
from tests.helpers.backing import FakeFastTable


def _table(limit: int):
    released: list[int] = []
    fp = FastPath(limit, lambda node: released.append(node.ino))
    fp.backend = FakeFastTable()
    return fp, released


@pytest.mark.parametrize("kind", list(HandleKind))
def test_only_a_plain_store_read_of_an_immutable_or_checked_unrouted_linked_path_is_eligible(kind):
    plain = kind is HandleKind.PASSTHROUGH_STORE
    assert fast_eligible(kind, True, False, False, False) is plain
    assert fast_eligible(kind, False, True, False, False) is plain   # each open checked by pyfuse3
    assert fast_eligible(kind, True, True, False, False) is plain
    assert not fast_eligible(kind, False, False, False, False)     # neither immutable nor checked
    assert not fast_eligible(kind, True, True, True, False)        # a route names the path
    assert not fast_eligible(kind, True, True, False, True)        # unlinked


def test_a_checked_mark_is_known_as_checked_until_it_goes():
    fp, released = _table(4)
    fp.mark(Inode(10, "d/10"), 5, None, uid=1, check=(3, b"d/10", 7, 10))
    fp.mark(Inode(11, "d/11"), 5, None, uid=1)
    assert fp.checked == {10} and fp.backend.check == {10: (3, b"d/10", 7, 10), 11: None}
    assert fp.snapshot()["inodes_checked"] == 1
    fp.unmark(fp.marked[10][0])
    assert fp.checked == set() and released == [10]


def test_a_full_table_takes_room_from_the_user_holding_the_most():
    fp, released = _table(4)
    for ino in (10, 11, 12):                  # user 1 fills most of an idle table
        fp.mark(Inode(ino, f"d/{ino}"), 5, None, uid=1)
    fp.mark(Inode(20, "d/20"), 5, None, uid=2)
    assert set(fp.marked) == {10, 11, 12, 20} and released == []
    fp.mark(Inode(21, "d/21"), 5, None, uid=2)  # full: user 1 (3 marks) gives up its oldest
    assert set(fp.marked) == {11, 12, 20, 21} and released == [10]
    fp.mark(Inode(22, "d/22"), 5, None, uid=2)  # 2 against 2: the first of the most (user 1)
    assert released == [10, 11] and fp.counts["given_up_for_room"] == 2
    fp.mark(Inode(13, "d/13"), 5, None, uid=1)  # user 2 holds 3 now: its oldest goes
    assert released == [10, 11, 20] and set(fp.marked) == {12, 13, 21, 22}
    assert fp.backend.serving.keys() == fp.marked.keys()


def test_a_mark_made_ahead_takes_only_a_free_place_or_its_own_users_oldest():
    fp, released = _table(4)
    for ino in (10, 11, 12):                  # user 1 holds the most
        fp.mark(Inode(ino, f"d/{ino}"), 5, None, uid=1)
    fp.mark(Inode(20, "d/20"), 5, None, uid=2)
    assert fp.room() == 0 and fp.room_for(2) == 1 and fp.room_for(1) == 3 and fp.room_for(3) == 0
    fp.mark(Inode(21, "d/21"), 5, None, uid=2, own=True)   # user 2's own oldest, not user 1's
    assert released == [20] and set(fp.marked) == {10, 11, 12, 21}
    fp.mark(Inode(30, "d/30"), 5, None, uid=3, own=True)   # user 3 holds none: no mark
    assert released == [20, 30] and 30 not in fp and set(fp.marked) == {10, 11, 12, 21}


def test_an_unmark_with_fast_opens_still_open_keeps_the_hold_until_they_are_released():
    fp, released = _table(8)
    node = Inode(30, "d/a")
    fp.mark(node, 7, None, uid=0)
    fp.backend.open[30] = 2                  # two opens answered in pyfuse3, still open
    assert fp.unmark(node) == 2 and released == [] and 30 in fp and 30 not in fp.marked
    fp.settle()
    assert released == []
    fp.backend.open[30] = 0                  # their releases came
    fp.settle()
    assert released == [30] and 30 not in fp
    assert fp.unmark(node) == 0 and released == [30]      # nothing left to let go


def test_a_table_of_holds_not_yet_released_marks_nothing_more():
    fp, released = _table(1)
    a = Inode(40, "d/a")
    fp.mark(a, 7, None, uid=0)
    fp.backend.open[40] = 1
    fp.mark(Inode(41, "d/b"), 7, None, uid=0)  # a is given up, but its fast open holds the place
    assert released == [41] and 41 not in fp and 40 in fp.draining


def test_off_and_unavailable_are_said_in_the_stats():
    assert FastPath(0, lambda h: None).snapshot()["state"] == "off"
    assert FastPath(8, lambda h: None).snapshot()["state"].startswith("unavailable")
    fp, _ = _table(8)
    snap = fp.snapshot()
    assert snap["state"] == "on" and snap["limit"] == 8 and snap["inodes"] == 0


def test_the_filesystem_never_marks_a_path_a_route_names(tmp_path):
    """A routed path (the eval side's tier may hold it later) is read from the store now, by
    passthrough, and never marked; an unrouted path beside it is."""
    import os

    import trio

    from fusefs.filesystem import Filesystem
    from fusefs.readpath import ReadPath
    from fusefs.stats import Stats
    from hintfs.stores.local import LocalStore
    from mountconfig.schema import CacheConfig
    from tests.helpers.backing import CountingBacking

    class Routes:                       # routes "ckpt/..." and lets the store answer for now
        def routes_path(self, path: str) -> bool:
            return path.startswith("ckpt/")

        async def at_open(self, path, reader, st):
            return reader

    for folder in ("ckpt", "data"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "f").write_bytes(b"x" * 100)
    stats = Stats()
    fs = Filesystem(LocalStore(str(tmp_path)), cache=CacheConfig(immutable_globs=["*"]), stats=stats,
                    reads=ReadPath(stats, routes=Routes()))   # type: ignore[arg-type]
    fast = FakeFastTable()
    fs.set_passthrough((CountingBacking(), "on"), fast)

    async def main():
        for folder in (b"ckpt", b"data"):
            d = await fs.lookup(1, folder)
            f = await fs.lookup(d.st_ino, b"f")
            h = await fs.open(f.st_ino, os.O_RDONLY)
            assert h.backing_id                       # both read by passthrough from the store
            await fs.release(h.fh)
        marked = [fs.inodes.by_ino[ino].path for ino in fast.serving]
        assert marked == ["data/f"], marked

    trio.run(main)


def test_the_metrics_show_what_the_fast_path_answered():
    from fusefs.metrics import StatsCollector
    from fusefs.stats import Stats

    stats = Stats()
    fp, _ = _table(8)
    fp.backend.stats = lambda: (5, 4, 2, 3)          # type: ignore[method-assign]
    stats.fast_path = fp.snapshot
    got = {(m.name, tuple(sorted(sm.labels.items()))): sm.value
           for m in StatsCollector(stats).collect() for sm in m.samples}
    assert got[("hintfs_fast_path_answers", (("request", "open"),))] == 5
    assert got[("hintfs_fast_path_answers", (("request", "getattr"),))] == 3
    assert got[("hintfs_fast_path_inodes", ())] == 2
    off = Stats()
    assert not any(m.name.startswith("hintfs_fast_path") for m in StatsCollector(off).collect())


def test_hintfs_status_says_what_the_fast_path_answered():
    from hintfs.status import format_status
    from fusefs.stats import Stats

    stats = Stats()
    fp, _ = _table(8)
    stats.fast_path = fp.snapshot
    text = format_status(stats.snapshot())
    assert "fast path: on, opens 0, releases 0, getattrs 0, inodes 0" in text
    stats.fast_path = FastPath(0, lambda node: None).snapshot
    assert "fast path: off" in format_status(stats.snapshot())


def test_the_loops_spin_is_bounded():
    pyfuse3 = pytest.importorskip("pyfuse3")
    if not hasattr(pyfuse3, "loop_spin"):
        pytest.skip("pyfuse3 without the patches (make setup builds it)")
    with pytest.raises(ValueError):
        pyfuse3.loop_spin(1001)
    with pytest.raises(ValueError):
        pyfuse3.loop_spin(-1)
    pyfuse3.loop_spin(0)
    from mountconfig.schema import MountOptions
    assert MountOptions().request_spin_us == 20
    with pytest.raises(ValueError):
        MountOptions(request_spin_us=1001)
    if hasattr(pyfuse3, "listing_spin"):        # (patches/pyfuse3-readdir-names.patch)
        with pytest.raises(ValueError):
            pyfuse3.listing_spin(5001)
        pyfuse3.listing_spin(0)
    assert MountOptions().listing_spin_us == 300
    with pytest.raises(ValueError):
        MountOptions(listing_spin_us=5001)


def test_the_metrics_and_status_show_the_lookups_answered_in_pyfuse3():
    from fusefs.fastpath import FastNames
    from fusefs.metrics import StatsCollector
    from fusefs.stats import Stats
    from hintfs.status import format_status

    class _Table:
        def stats(self):
            return (7, 1, 40)

    stats = Stats()
    names = FastNames(lambda node, n: None)
    names.backend = _Table()                             # type: ignore[assignment]
    stats.fast_lookups = names.snapshot
    got = {(m.name, tuple(sorted(sm.labels.items()))): sm.value
           for m in StatsCollector(stats).collect() for sm in m.samples}
    assert got[("hintfs_fast_lookups", ())] == 7
    assert "fast lookups: on, lookups 7, folders 1, names 40" in format_status(stats.snapshot())
    stats.fast_lookups = FastNames(lambda node, n: None, enabled=False).snapshot
    assert "fast lookups: off" in format_status(stats.snapshot())
    assert not any(m.name.startswith("hintfs_fast_lookups") for m in StatsCollector(stats).collect())


def test_pyfuse3s_table_of_names_refuses_what_is_not_an_entry():
    pyfuse3 = pytest.importorskip("pyfuse3")
    if not hasattr(pyfuse3, "fast_names_put"):
        pytest.skip("pyfuse3 without the patches (make setup builds it)")
    with pytest.raises(TypeError):
        pyfuse3.fast_names_put(5, [("str, not bytes", pyfuse3.EntryAttributes())], 1)
    with pytest.raises(TypeError):
        pyfuse3.fast_names_put(5, [(b"f", object())], 1)
    pyfuse3.fast_names_put(5, [(b"f", pyfuse3.EntryAttributes())], pyfuse3.fast_monotonic_ns() + 10**9)
    assert pyfuse3.fast_names_stats()[1:] == (1, 1)
    assert pyfuse3.fast_lookups_take(123) == 0            # nothing answered (no FUSE session here)
    assert pyfuse3.fast_names_drop(5) == 1 and pyfuse3.fast_names_drop(5) == 0
    pyfuse3.fast_names_put(5, [], 1)                      # no names: nothing kept
    assert pyfuse3.fast_names_stats()[1:] == (0, 0)


def test_a_registration_for_longer_than_pyfuse3s_clock_holds_is_made_for_ten_years():
    """`immutable_timeout_s` has no upper bound in the config; pyfuse3's deadline is a signed
    64-bit count of nanoseconds (1e15 s would overflow it, and the registration fail)."""
    from fusefs.attrs import Attributes
    from fusefs.fastpath import MAX_TTL_S, FastNames
    from fusefs.fuse import names_backend
    from fusefs.inodes import Inode

    backend = names_backend()
    if backend is None:
        pytest.skip("pyfuse3 without the patches (make setup builds it)")
    names = FastNames(lambda node, n: None)
    names.backend = backend
    folder, f = Inode(900001, "ck"), Inode(900002, "ck/f")
    names.register("ck", folder, [(b"f", f, Attributes(st_ino=f.ino, st_mode=0o100644))], 1e15)
    assert f.fast_named and f.lookups == 1 and folder.lookups == 1
    assert backend.stats()[1:] >= (1, 1)
    names.drop("ck")
    assert not f.fast_named and MAX_TTL_S * 1e9 < 2 ** 63


def test_each_user_holds_at_most_its_share_of_the_names_registered():
    """A folder's names are counted to the user whose lookups had it listed. A user past its share
    gives up its own oldest folders first, never another user's; more names than the share alone
    are not registered at all. Each folder given up ends its holds as any drop."""
    from fusefs.attrs import Attributes
    from fusefs.fastpath import FastNames
    from fusefs.inodes import Inode

    class _Table:
        def __init__(self):
            self.kept: dict[int, int] = {}

        def put(self, parent, entries, deadline_ns, template=None):
            self.kept[parent] = len(entries)

        def drop(self, parent):
            return self.kept.pop(parent, 0)

        def take(self, ino):
            return 0

        def now_ns(self):
            return 0

        def stats(self):
            return 0, len(self.kept), sum(self.kept.values())

    let_go: list[int] = []
    names = FastNames(lambda node, n: let_go.append(node.ino), share=10)
    names.backend = table = _Table()                      # type: ignore[assignment]
    ino = iter(range(1000, 2000))

    def folder(path: str, n: int, uid: int) -> bool:
        parent = Inode(next(ino), path)
        named = [(f"f{i}".encode(), f := Inode(next(ino), f"{path}/f{i}"), Attributes(st_ino=f.ino, st_mode=0o100644))
                 for i in range(n)]
        return names.register(path, parent, named, 60.0, uid)

    assert folder("a1", 4, uid=1) and folder("a2", 4, uid=1) and folder("b1", 6, uid=2)
    assert folder("a3", 4, uid=1)                         # 12 > 10: user 1's oldest (a1) goes
    assert set(names.folders) == {"a2", "a3", "b1"} and len(table.kept) == 3
    assert len(let_go) == 4 + 1                           # a1's four names and its folder let go
    assert names.counts["given_up_for_share"] == 1
    assert not folder("b2", 11, uid=2)                    # more than a share alone: not registered
    assert "b1" in names.folders and "b2" not in names.folders
    assert folder("b3", 4, uid=2) and set(names.folders) == {"a2", "a3", "b1", "b3"}   # 6 + 4 = 10: fits
    names.drop("a2")
    names.drop("a3")
    assert set(names.users.by_uid) == {2} and names.snapshot()["users"] == 1


def test_fetch_ahead_starts_once_per_kept_listing_at_the_configured_open():
    """`FetchAhead.opened`: True at the `after`-th first open of a folder while one kept listing is
    current, once; a new listing of the folder counts afresh; none without a listing or with 0."""
    ahead = FetchAhead(2)
    first, second = {"a": 1}, {"a": 1}
    assert [ahead.opened("d", first) for _ in range(4)] == [False, True, False, False]
    assert [ahead.opened("d", second) for _ in range(3)] == [False, True, False]
    assert ahead.opened("e", None) is False and ahead.opened("e", None) is False
    assert [ahead.opened("e", first), ahead.opened("e", first)] == [False, True]   # (folders apart)
    off = FetchAhead(0)
    assert not any(off.opened("d", first) for _ in range(3))


def test_a_folder_is_being_read_after_its_configured_first_opens_and_few_folders_are_kept():
    r = ReadFolders(2)
    r.opened("a")
    assert not r.reading("a")
    r.opened("a")
    assert r.reading("a") and not r.reading("b")
    for i in range(ReadFolders.FOLDERS):
        r.opened(f"other{i}")
    assert not r.reading("a")                 # forgotten: the least recent
    off = ReadFolders(0)
    off.opened("a"), off.opened("a"), off.opened("a")
    assert not off.reading("a")               # `fast_opens_ahead = 0`: never


def test_lazy_marks_take_only_free_places_or_their_users_own_and_end_without_a_release():
    """`mark_lazy` (marks pyfuse3 opens at their first open) takes places as a mark made ahead
    does: free ones, then the same user's oldest marks, never another user's; a mark with no place
    lets its hold go at once. One never opened ends without the passthrough release (no fd, no
    backing id: `release_unopened`); one pyfuse3 opened is handed over (`adopt`) first, and then
    ends as any mark."""
    from tests.helpers.backing import FakeLazyTable
    released: list[int] = []
    unopened: list[int] = []
    adopted: list[tuple[int, int, int]] = []
    fp = FastPath(4, lambda node: released.append(node.ino), lambda node, fd, bid: adopted.append((node.ino, fd, bid)),
                  lambda node: unopened.append(node.ino))
    fp.backend = table = FakeLazyTable()
    assert fp.lazy_on
    fp.mark(Inode(20, "e/20"), 5, None, uid=2)
    fp.mark(Inode(10, "d/10"), 5, None, uid=1)
    check = (3, b"d/x", 7, 1)
    made = fp.mark_lazy([(Inode(ino, f"d/{ino}"), check) for ino in (11, 12, 13, 14)], uid=1)
    assert made == 4 and set(fp.marked) == {20, 12, 13, 14} and fp.lazy == {12, 13, 14}
    assert released == [10] and unopened == [11]           # (user 1's own oldest: 10, then 11)
    assert fp.mark_lazy([(Inode(30, "f/30"), check)], uid=3) == 0 and unopened == [11, 30]   # (no place of its own)
    table.first_open(13, 99, 8)
    fp.take_opened()
    assert adopted == [(13, 99, 8)] and fp.lazy == {12, 14} and fp.counts["lazy_adopted"] == 1
    table.open[13] = 0
    assert fp.unmark(fp.marked[12][0]) == 0 and unopened == [11, 30, 12] and 12 not in table.lazy_marks
    assert fp.unmark(fp.marked[13][0]) == 0 and released == [10, 13]

"""The journal's slices listed from their newest record (hintfs.common.journal.SliceListings),
the S3 listing's parse of a server's document (hintfs.stores.s3get), and the follower's sweeps
of ended slices at doubling ages (issue 37: the whole slice, listed as often as the budget
allowed, was 12% of the bytes written across the WAN)."""
from __future__ import annotations

import errno

import pytest

from hintfs.common.journal import (BUCKET_NS, LAG_NS, LAGGED_EVERY_S, LIST_BYTES_S, ListingBudget, SliceListings,
                                   bucket_of, listing_gap_s)
from hintfs.stores.base import Stat

T0 = 1_700_000_000 * 10**9          # a slice's start
SLICE = bucket_of(T0)


def _name(t_ns: int, i: int) -> str:
    return f"{t_ns:020d}-host-1-{i}~10~5~Y2twdC9h.rec"


class _Store:
    """A folder of names that can be listed from a name (like S3's start-after); records what
    each listing asked for and carried."""

    lists_after = True

    def __init__(self, names=()):
        self.names: set[str] = set(names)
        self.asked: list[str | None] = []      # None: listed whole
        self.carried: list[int] = []

    def _entries(self, after: str):
        out = sorted((n, Stat(0o100600, 10, 5, 5)) for n in self.names if n > after)
        self.carried.append(len(out))
        return iter(out)

    def iter_dir(self, rel):
        assert rel.endswith(SLICE) or not self.names
        self.asked.append(None)
        return self._entries("")

    def iter_dir_after(self, rel, after):
        self.asked.append(after)
        return self._entries(after)


def test_a_slice_is_listed_whole_once_then_from_its_newest_record(monkeypatch):
    store = _Store(_name(T0 + i * 10**6, i) for i in range(100))
    budget = ListingBudget()
    sl = SliceListings(store, "j", budget)
    got = sl.listing(SLICE, 0.0)
    # (the newest record is kept listing by listing: no pass over the slice's names for it)
    monkeypatch.setattr(SliceListings, "_tail", staticmethod(lambda *_a: pytest.fail("a pass over every name")))
    assert set(got) == store.names and store.asked == [None] and store.carried == [100]
    store.names.add(_name(T0 + 200 * 10**6, 200))
    got = sl.listing(SLICE, 0.1)
    assert set(got) == store.names                          # every name, as a whole listing
    assert store.asked[-1] == max(store.names - {_name(T0 + 200 * 10**6, 200)}) and store.carried[-1] == 1
    assert sl.listing(SLICE, 0.2).keys() == store.names and store.carried[-1] == 0
    # the budget is charged by what crossed: an empty tail costs the request alone
    assert budget.wait_s(0.2) == pytest.approx(listing_gap_s([]), abs=1e-9)
    assert sl.counts["whole"] == 1 and sl.counts["tail"] == 2


def test_a_record_named_before_the_newest_is_found_by_the_lagged_listing():
    # A writer whose PUT took longer: its record is named before one already listed. The tail
    # misses it; within LAGGED_EVERY_S a listing from LAG_NS before the newest record finds it.
    store = _Store([_name(T0 + 5 * 10**9, 1)])
    sl = SliceListings(store, "j", ListingBudget())
    sl.listing(SLICE, 0.0)
    late = _name(T0 + 5 * 10**9 - LAG_NS // 2, 2)
    store.names.add(late)
    assert late not in sl.listing(SLICE, 0.1)
    got = sl.listing(SLICE, LAGGED_EVERY_S + 0.01)
    assert late in got and store.asked[-1] == f"{T0 + 5 * 10**9 - LAG_NS:020d}" and sl.counts["lagged"] == 1
    # later than LAG_NS: the whole listing (the follower's sweep) finds it
    older = _name(T0 + 10**9, 3)
    store.names.add(older)
    assert older not in sl.listing(SLICE, 2 * LAGGED_EVERY_S + 0.1)
    assert older in sl.listing(SLICE, 2 * LAGGED_EVERY_S + 0.2, whole=True)


def test_a_name_of_another_time_does_not_move_the_start_and_removed_names_go_at_a_whole_listing():
    ahead = _name(T0 + 50 * BUCKET_NS, 9)          # dated far ahead (refused by readers)
    store = _Store([_name(T0 + 10**9, 1), ahead, "notes.txt"])
    sl = SliceListings(store, "j", ListingBudget())
    sl.listing(SLICE, 0.0)
    new = _name(T0 + 2 * 10**9, 2)
    store.names.add(new)
    assert new in sl.listing(SLICE, 0.1) and store.asked[-1] == _name(T0 + 10**9, 1)
    store.names.discard(_name(T0 + 10**9, 1))      # pruned
    assert _name(T0 + 10**9, 1) in sl.listing(SLICE, 0.2)
    assert _name(T0 + 10**9, 1) not in sl.listing(SLICE, 0.3, whole=True)


def test_a_store_that_cannot_list_from_a_name_is_listed_whole_and_charged_whole():
    store = _Store(_name(T0 + i, i) for i in range(50))
    store.lists_after = False
    budget = ListingBudget()
    sl = SliceListings(store, "j", budget)
    for k in range(3):
        assert sl.listing(SLICE, float(k)).keys() == store.names
    assert store.asked == [None, None, None]
    assert budget.wait_s(2.0) == pytest.approx(listing_gap_s(sorted(store.names)))
    assert listing_gap_s([]) == 1000 / LIST_BYTES_S


def test_only_the_newest_slices_are_kept():
    from hintfs.common.journal import KEPT_SLICES
    stores = _Store()
    sl = SliceListings(stores, "j", ListingBudget())
    buckets = [bucket_of(T0 + k * BUCKET_NS) for k in range(KEPT_SLICES + 3)]
    for b in reversed(buckets):                    # newest first, as a first poll does not
        sl.listing(b, 0.0)
    assert sorted(sl._slices) == buckets[3:]       # an older slice, listed once, is not kept
    sl.listing(bucket_of(T0 + 100 * BUCKET_NS), 0.0)
    assert len(sl._slices) == KEPT_SLICES and buckets[3] not in sl._slices


def test_a_missing_slice_is_empty():
    class Missing(_Store):
        def iter_dir(self, rel):
            raise FileNotFoundError(errno.ENOENT, rel)
    assert SliceListings(Missing(), "j", ListingBudget()).listing(SLICE, 0.0) == {}


# -- the server's document -------------------------------------------------------------------------

_HEAD = '<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'


def _doc(*items: str, enc: str = "url", truncated: str = "false", token: str = "") -> bytes:
    body = "".join(items)
    more = f"<NextContinuationToken>{token}</NextContinuationToken>" if token else ""
    return (f"{_HEAD}<EncodingType>{enc}</EncodingType><IsTruncated>{truncated}</IsTruncated>{more}{body}"
            "</ListBucketResult>").encode()


def _obj(key: str, size: int = 3, when: str = "2026-12-05T21:30:01.250Z") -> str:
    return f"<Contents><Key>{key}</Key><LastModified>{when}</LastModified><Size>{size}</Size></Contents>"


def test_a_listing_page_is_parsed_within_its_folder_and_refused_otherwise():
    from hintfs.stores.s3get import _listing_page
    page = _listing_page(_doc(_obj("j/s/a+b%2Bc.rec", 7), "<CommonPrefixes><Prefix>j/s/sub/</Prefix></CommonPrefixes>",
                              truncated="true", token="tok"), "j/s/")
    assert page is not None
    entries, token = page
    assert token == "tok"
    assert entries[0][:2] == ("a b+c.rec", 7) and entries[0][2] % 10**9 == 250_000_000 and entries[1] == ("sub", 0, 0, True)
    for bad in (_doc(_obj("j/other/x")),                  # outside the folder
                _doc(_obj("j/s/a/b")),                    # deeper than it
                _doc(_obj("j/s/x"), enc=""),              # keys not URL-encoded
                _doc(_obj("j/s/x", size=-1)),
                _doc(_obj("j/s/x", when="yesterday")),
                _doc(_obj("j/s/x", when="2026-12-05T21:30:01")),   # no zone
                _doc(truncated="true"),                   # truncated without a token
                b"<Error><Code>AccessDenied</Code></Error>", b"not xml"):
        assert _listing_page(bad, "j/s/") is None, bad
    bomb = (b'<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">'
            b'<!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;"><!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;">'
            b'<!ENTITY e "&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;"><!ENTITY f "&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;">'
            b'<!ENTITY g "&f;&f;&f;&f;&f;&f;&f;&f;&f;&f;"><!ENTITY h "&g;&g;&g;&g;&g;&g;&g;&g;&g;&g;">]>'
            b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><EncodingType>url</EncodingType>'
            b'<Contents><Key>j/s/&h;</Key><LastModified>2026-12-05T21:30:01Z</LastModified><Size>1</Size></Contents>'
            b'</ListBucketResult>')
    assert _listing_page(bomb, "j/s/") is None        # expat refuses the expansion (no 1 GB string)


# -- the follower's sweeps -----------------------------------------------------------------------

def test_a_sweep_lists_an_ended_slice_again_only_once_its_age_has_doubled():
    from hintfs.agent.follower import Follower
    f = Follower.__new__(Follower)
    f.swept_ages = {}
    end = T0 + BUCKET_NS
    assert f._sweep_due(SLICE, end - 1)                        # not ended: always
    f.swept_ages[SLICE] = -1
    assert f._sweep_due(SLICE, end + 30 * 10**9)               # listed before its end: once after
    f.swept_ages[SLICE] = 30 * 10**9
    assert not f._sweep_due(SLICE, end + 59 * 10**9)
    assert f._sweep_due(SLICE, end + 60 * 10**9)


def test_a_writer_whose_clock_runs_behind_moves_the_lagged_listings_start_back():
    # Its records are named 4 s before the store dates them: a lag of LAG_NS (2 s) leaves them to
    # the sweeps (30 s). The first one a listing sees moves the lag back as far as the store's
    # dates show (and a second more, up to the slice): its later records are seen within
    # LAGGED_EVERY_S.
    class Dated(_Store):
        def __init__(self):
            super().__init__()
            self.dates: dict[str, int] = {}

        def _entries(self, after):
            out = sorted((n, Stat(0o100600, 10, self.dates[n], self.dates[n])) for n in self.names if n > after)
            self.carried.append(len(out))
            return iter(out)

    store = Dated()
    sl = SliceListings(store, "j", ListingBudget())

    def put(t_ns: int, i: int, behind_ns: int = 0) -> str:
        name = _name(t_ns - behind_ns, i)
        store.names.add(name)
        store.dates[name] = t_ns
        return name

    put(T0 + 5 * 10**9, 1)
    sl.listing(SLICE, 0.0)
    assert sl.lag_ns() == LAG_NS
    first = put(T0 + 6 * 10**9, 2, behind_ns=4 * 10**9)   # the slow clock's first record
    assert first not in sl.listing(SLICE, LAGGED_EVERY_S + 0.1)   # 3 s before the newest: missed
    assert first in sl.listing(SLICE, LAGGED_EVERY_S + 0.2, whole=True)   # the sweep's
    assert sl.lag_ns() == 5 * 10**9                     # 4 s late, and a second more
    put(T0 + 6 * 10**9 + 1, 3)                          # the newest now: named at its time
    late = put(T0 + 7 * 10**9, 4, behind_ns=4 * 10**9)
    assert late not in sl.listing(SLICE, LAGGED_EVERY_S + 0.3)   # the tail: not it
    got = sl.listing(SLICE, 2 * LAGGED_EVERY_S + 0.3)   # lagged, 5 s back: it
    assert late in got and store.asked[-1] == f"{T0 + 6 * 10**9 + 1 - 5 * 10**9:020d}"

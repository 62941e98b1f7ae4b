"""`fusefs.walks`: which callers' listings give files by name only."""
from __future__ import annotations

from fusefs.walks import Walks


def test_a_thread_walking_many_folders_gets_names_until_it_looks_up_what_it_listed():
    w = Walks(walk_after=3, max_callers=8, plain_folders=4)
    assert [w.opened(100, folder) for folder in range(10, 15)] == [False, False, False, True, True]
    assert w.by_name == 2
    w.looked_up(100, 99)                 # a file in a folder it was not given by name: no change
    assert w.opened(100, 15) is True
    w.looked_up(100, 14)                 # a file it was given by name: it stats what it lists
    assert w.back_to_plus == 1
    assert [w.opened(100, folder) for folder in range(16, 20)] == [False] * 4   # attributes again
    assert w.opened(200, 1) is False     # another thread counts its own folders


def test_callers_and_their_folders_are_bounded():
    w = Walks(walk_after=0, max_callers=2, plain_folders=2)
    assert w.opened(1, 10) and w.opened(1, 11) and w.opened(1, 12)
    w.looked_up(1, 10)                   # folder 10 was forgotten (two remembered): no flip
    assert w.back_to_plus == 0 and w.opened(1, 13)
    w.opened(2, 10), w.opened(3, 10)     # three threads: the least recently seen (1) is forgotten
    w.looked_up(1, 13)
    assert w.back_to_plus == 0
    assert w.opened(0, 10) is False      # no caller (the daemon itself): always attributes

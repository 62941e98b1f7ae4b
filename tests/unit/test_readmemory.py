"""hintfs/agent/readmemory.py: what eval jobs read of one checkpoint's file predicts the next one's,
bounded, and a newer checkpoint's reads replace an older one's."""
from __future__ import annotations

from hintfs.agent.readmemory import ReadMemory
from policy.stream import merged_ranges


def test_ranges_are_merged_where_they_overlap_or_touch():
    assert merged_ranges([(10, 5), (0, 10), (30, 1), (12, 10)]) == [(0, 22), (30, 1)]
    assert merged_ranges([(0, 0), (-5, 3), (4, 2)]) == [(4, 2)]   # empty and negative ranges dropped


def test_the_next_checkpoints_file_of_the_same_name_is_predicted_by_the_last_ones_reads():
    m = ReadMemory()
    assert m.predict("ckpt/run/step_2/__0_0.distcp") == []
    m.remember("ckpt/run/step_1/__0_0.distcp", [(100, 50)])
    m.remember("ckpt/run/step_1/__0_0.distcp", [(150, 10), (0, 4)])       # the same file: adds up
    assert m.predict("ckpt/run/step_2/__0_0.distcp") == [(0, 4), (100, 60)]
    assert m.predict("ckpt/run/step_2/__1_0.distcp") == []               # another rank's file
    assert m.predict("ckpt/other/step_2/__0_0.distcp") == []             # another job
    m.remember("ckpt/run/step_2/__0_0.distcp", [(7, 1)])                  # a newer checkpoint's reads
    assert m.predict("ckpt/run/step_3/__0_0.distcp") == [(7, 1)]          # replace the older ones


def test_memory_is_bounded_in_files_and_ranges():
    m = ReadMemory(max_files=2, max_ranges=3, max_total=5)
    m.remember("ckpt/a/s/f", [(0, 1)])
    m.remember("ckpt/b/s/f", [(0, 1)])
    m.remember("ckpt/c/s/f", [(0, 1)])
    assert len(m) == 2 and m.predict("ckpt/a/t/f") == []                 # least recently used went
    m.remember("ckpt/c/s/f", [(10 * i, 1) for i in range(10)])
    assert len(m.predict("ckpt/c/t/f")) == 3                             # at most 3 ranges a file
    m.remember("ckpt/d/s/f", [(10 * i, 1) for i in range(3)])            # 3 + 3 > 5 in all:
    assert m.predict("ckpt/b/t/f") == [] and len(m.predict("ckpt/d/t/f")) == 3   # b went, then c
    assert m.predict("ckpt/c/t/f") == [] and len(m) == 1


def test_a_hinted_file_keeps_only_its_hints():
    """Demand reads of a file that was hinted are mostly the kernel's readahead past the last
    tensor: not remembered. Hints replace demand reads remembered before them."""
    m = ReadMemory()
    m.remember("ckpt/run/step_1/f", [(0, 10)])                      # a demand read first
    m.remember("ckpt/run/step_1/f", [(100, 5)], hinted=True)         # then the hint: it replaces
    m.remember("ckpt/run/step_1/f", [(1000, 4096)])                  # readahead: not kept
    m.remember("ckpt/run/step_1/f", [(200, 5)], hinted=True)         # hints add up
    assert m.predict("ckpt/run/step_2/f") == [(100, 5), (200, 5)]
    m.remember("ckpt/run/step_2/f", [(7, 1)])                        # a newer checkpoint, unhinted
    assert m.predict("ckpt/run/step_3/f") == [(7, 1)]

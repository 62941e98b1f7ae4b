"""The page allocator (hintfs/governor/csrc/pagealloc.c) on its host-memory backend: the same C code
torch calls on the GPU, with memfd pages instead of CUDA ones."""
from __future__ import annotations

import ctypes
import mmap
import os
import random
import subprocess
import sys

import pytest

from hintfs.governor.pagealloc import PageAllocError, PageAllocator

MiB = 1 << 20
PAGE = 2 * MiB


def host(va=256 * MiB):
    return PageAllocator.host(page_bytes=PAGE, va_bytes=va)


def rounded(n):
    return (n + 511) // 512 * 512


def fill(ptr, n, byte):
    ctypes.memset(ptr, byte, n)


def check(ptr, n, byte):
    data = ctypes.string_at(ptr, n)
    assert data == bytes([byte]) * n


def test_random_allocations_never_overlap_and_the_books_balance():
    a = host()
    rng = random.Random(7)
    live = {}   # ptr -> (size, marker)
    released_midway = 0
    for i in range(1500):
        if live and rng.random() < 0.45:
            ptr = rng.choice(list(live))
            size, marker = live.pop(ptr)
            check(ptr, size, marker)   # nobody wrote into this block while it was ours
            a.free(ptr, size, stream=0)
        else:
            # mostly small blocks, some larger than a page (they span several pages)
            size = rng.choice([rng.randint(1, 4096), rng.randint(4096, 900_000),
                               rng.randint(MiB, 5 * MiB)])
            ptr = a.malloc(size)
            assert ptr and ptr % 512 == 0
            marker = i % 251 + 1
            fill(ptr, size, marker)
            live[ptr] = (size, marker)
        if i % 300 == 150:
            released_midway += a.release(0)    # the empty pages between live blocks
        if i % 100 == 0:
            s = a.stats()
            assert s["allocated"] == sum(rounded(n) for n, _ in live.values())
            assert s["mapped"] >= s["allocated"] and s["mapped"] % PAGE == 0
    assert released_midway > 0
    for ptr, (size, marker) in live.items():
        check(ptr, size, marker)
        a.free(ptr, size)
    s = a.stats()
    assert s["allocated"] == 0 and s["allocs"] == s["frees"]
    assert a.release(0) == s["mapped"]
    s = a.stats()
    assert s["mapped"] == 0 and s["empty_pages"] == 0 and s["unmaps"] == s["maps"]


def test_release_frees_only_empty_pages_down_to_the_target_and_keeps_live_data():
    a = host()
    blocks = [a.malloc(PAGE) for _ in range(8)]         # one page each
    for k, p in enumerate(blocks):
        fill(p, PAGE, k + 1)
    for p in blocks[::2]:
        a.free(p, PAGE)                                 # 4 pages now empty
    assert a.stats()["mapped"] == 8 * PAGE
    assert a.release(6 * PAGE) == 2 * PAGE              # only what the target needs
    assert a.stats()["mapped"] == 6 * PAGE
    assert a.release(0) == 2 * PAGE                     # the live pages cannot go
    assert a.stats()["mapped"] == 4 * PAGE
    for k, p in enumerate(blocks):
        if k % 2:
            check(p, PAGE, k + 1)
    # released space is reused: new blocks map fresh pages again
    q = a.malloc(3 * PAGE)
    fill(q, 3 * PAGE, 99)
    check(q, 3 * PAGE, 99)
    assert a.stats()["mapped"] == 7 * PAGE


def test_a_page_with_one_small_live_block_stays_mapped():
    a = host()
    small = [a.malloc(1000) for _ in range(50)]
    keep = small[17]
    for p in small:
        if p != keep:
            a.free(p, 1000)
    assert a.release(0) == 0                            # the page holds `keep`
    a.free(keep, 1000)
    assert a.release(0) == PAGE


def test_a_block_freed_on_one_stream_is_not_reused_on_another_until_a_release():
    a = host()
    p = a.malloc(4096, stream=1)
    a.free(p, 4096, stream=1)
    assert a.malloc(4096, stream=1) == p                # same stream: reused at once
    a.free(p, 4096, stream=1)
    q = a.malloc(4096, stream=2)
    assert q != p                                       # its kernels may still be queued on 1
    a.free(q, 4096, stream=2)
    a.release(10 * PAGE)                                # synchronises: streams are forgotten
    assert a.malloc(4096, stream=2) in (p, q)


def test_running_out_of_address_space_returns_null_with_a_message(capfd):
    a = host(va=8 * PAGE)
    p = a.malloc(6 * PAGE)
    assert p
    assert a.malloc(4 * PAGE) == 0
    assert a.stats()["ooms"] == 1
    assert "out of device memory" in capfd.readouterr().err
    a.free(p, 6 * PAGE)
    assert a.malloc(4 * PAGE)


def test_when_nothing_is_left_to_map_empty_pages_of_the_other_pool_are_given_back():
    a = host(va=8 * PAGE)
    big = a.malloc(8 * PAGE)            # every page, in the large pool
    a.free(big, 8 * PAGE)               # empty but still mapped
    small = a.malloc(1000)              # the small pool needs a page of its own
    assert small
    s = a.stats()
    assert s["unmaps"] == 8 and s["mapped"] == PAGE and s["ooms"] == 0


def test_lent_pages_carry_the_old_owner_data_until_the_new_owner_zeroes_them():
    a = host()
    p = a.malloc(2 * PAGE)
    fill(p, 2 * PAGE, 0xAB)
    a.free(p, 2 * PAGE)
    fds = a.lend(0, max_pages=8)
    assert len(fds) == 2 and a.stats()["mapped"] == 0 and a.stats()["pages_lent"] == 2
    # the borrower maps the page in another process (the fd crosses like SCM_RIGHTS would)
    code = ("import mmap, os, sys; fd = int(sys.argv[1]); m = mmap.mmap(fd, %d);"
            "before = m[:16]; m[:] = bytes(%d); print(before.hex(), m[:].count(0))" % (PAGE, PAGE))
    r = subprocess.run([sys.executable, "-c", code, str(fds[0])], pass_fds=[fds[0]],
                       capture_output=True, text=True, check=True)
    before, zeros = r.stdout.split()
    assert before == "ab" * 16        # why zeroing on an owner change is mandatory
    assert int(zeros) == PAGE
    with mmap.mmap(fds[0], PAGE) as m:  # the memory is the borrower's, and zeroed
        assert m[:].count(0) == PAGE
    for fd in fds:
        os.close(fd)


def test_bad_parameters_are_refused_with_a_clear_error():
    with pytest.raises(PageAllocError, match="multiple of 2 MiB"):
        PageAllocator.host(page_bytes=3 * MiB)


def test_the_lock_free_counters_match_the_statistics():
    a = host()
    p = a.malloc(3 * PAGE + 5)
    s = a.stats()
    assert a.mapped() == s["mapped"] == 4 * PAGE
    assert a.peak_allocated() == s["peak_allocated"] == rounded(3 * PAGE + 5)
    a.free(p, 3 * PAGE + 5)
    a.reset_peak()
    assert a.peak_allocated() == 0


def test_pages_exported_at_creation_are_lent_without_a_new_export_and_closed_on_release():
    def open_fds():
        return len(os.listdir("/proc/self/fd"))

    a = PageAllocator.host(page_bytes=PAGE, va_bytes=256 * MiB, export_fds=True)
    base = open_fds()
    p = a.malloc(4 * PAGE)
    assert open_fds() == base + 2 * 4                  # the memfd and its exported fd, per page
    fill(p, 4 * PAGE, 0x5A)
    a.free(p, 4 * PAGE)
    fds = a.lend(2 * PAGE, max_pages=8)                # the exported fds change hands as they are
    assert len(fds) == 2 and open_fds() == base + 2 * 2 + 2
    with mmap.mmap(fds[0], PAGE) as m:
        assert m[:2] == b"\x5a\x5a"
    for fd in fds:
        os.close(fd)
    assert a.release(0) == 2 * PAGE                    # released pages close their fds too
    assert open_fds() == base


def test_install_without_a_cuda_driver_fails_with_a_clear_error():
    import ctypes.util

    import torch

    from hintfs.governor import pagealloc
    if torch.cuda.is_available() or ctypes.util.find_library("cuda"):
        pytest.skip("a CUDA driver is present: install() would succeed")
    with pytest.raises(PageAllocError, match="libcuda"):
        pagealloc.install(0)
    assert pagealloc.installed() is None


def _pages_mapped_at(ptr, n):
    """Which of the n pages from ptr are readable (mapped) here: /proc/self/maps knows."""
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            spans.append((lo, hi, line.split()[1]))
    return [any(lo <= ptr + i * PAGE < hi and perms.startswith("r") for lo, hi, perms in spans)
            for i in range(n)]


@pytest.mark.parametrize("batch", ["1", "0"])
def test_release_unmaps_a_run_of_pages_in_one_call(batch, monkeypatch):
    monkeypatch.setenv("HINTFS_PAGEALLOC_BATCH_UNMAP", batch)
    a = host()
    ptrs = [a.malloc(PAGE) for _ in range(6)]    # six whole pages, adjacent
    keep = ptrs[0]
    for p in ptrs[1:]:
        a.free(p, PAGE)
    calls = a.stats()["unmap_calls"]
    assert a.release(PAGE) == 5 * PAGE
    s = a.stats()
    assert s["unmaps"] == 5 and s["mapped"] == PAGE
    assert s["unmap_calls"] - calls == (1 if batch == "1" else 5)
    assert _pages_mapped_at(keep, 6) == [True] + [False] * 5   # really gone, the kept one not
    fill(keep, PAGE, 7)
    check(keep, PAGE, 7)
    # lending unmaps in runs too, and the lent memory stays readable through its fd
    more = [a.malloc(PAGE) for _ in range(3)]
    for p in more:
        fill(p, PAGE, 9)
        a.free(p, PAGE)
    fds = a.lend(PAGE, 3)
    assert len(fds) == 3
    for fd in fds:
        with mmap.mmap(fd, PAGE) as m:
            assert m[:4] == b"\x09" * 4
        os.close(fd)


def test_deferred_lend_hands_pages_over_first_and_unmaps_them_after():
    a = host()
    keep = a.malloc(PAGE)
    lent = [a.malloc(PAGE) for _ in range(3)]
    for p in lent:
        fill(p, PAGE, 5)
        a.free(p, PAGE)
    fds = a.lend(PAGE, 3, defer_unmap=True)
    assert len(fds) == 3 and a.stats()["mapped"] == PAGE     # out of the books at once
    assert _pages_mapped_at(keep, 4) == [True] * 4            # our mappings are still there
    # new allocations do not land on pages waiting to be unmapped
    fresh = a.malloc(PAGE)
    assert fresh not in lent
    assert a.finish_lend() == 3
    assert _pages_mapped_at(keep, 4) == [True, False, False, False]
    for fd in fds:                                            # the receiver still has the data
        with mmap.mmap(fd, PAGE) as m:
            assert m[:4] == b"\x05" * 4
        os.close(fd)
    assert a.finish_lend() == 0
    fill(fresh, PAGE, 1)
    check(fresh, PAGE, 1)


def test_release_idle_takes_only_pages_freed_before_a_completed_mark():
    """Early release (issue 16): without a device sync, only pages whose last free came before
    the mark of an event known to be complete may go; they leave the books at once, worker
    threads unmap them, and release() waits for those unmaps."""
    a = host()
    keep = a.malloc(PAGE)
    old = [a.malloc(PAGE) for _ in range(3)]
    new = [a.malloc(PAGE) for _ in range(3)]
    for p in old:
        a.free(p, PAGE)
    m = a.mark()                       # an event recorded here has completed (say)
    for p in new:
        a.free(p, PAGE)                # freed after it: queued kernels may still use these
    assert a.release_idle(0, m) == 3 * PAGE
    assert a.stats()["mapped"] == 4 * PAGE and a.stats()["idle_released"] == 3 * PAGE
    assert a.release_idle(0, m) == 0   # the later frees are not covered by m
    m2 = a.mark()
    assert a.release_idle(3 * PAGE, m2) == PAGE   # down to the target only, highest first
    assert a.release(3 * PAGE) == 0    # waits for the workers; nothing more asked for
    assert _pages_mapped_at(keep, 7) == [True, False, False, False, True, True, False]
    assert a.release(0) == 2 * PAGE    # a full release: the device is synchronised
    assert _pages_mapped_at(keep, 7) == [True] + [False] * 6
    fill(keep, PAGE, 3)
    check(keep, PAGE, 3)
    # released addresses are reused once unmapped
    again = a.malloc(2 * PAGE)
    fill(again, 2 * PAGE, 4)
    check(again, 2 * PAGE, 4)


def test_a_page_freed_on_another_stream_is_not_idle_until_a_full_release():
    a = host()
    a.set_mark_stream(0)
    p = a.malloc(PAGE, stream=0)
    q = a.malloc(PAGE, stream=5)
    a.free(p, PAGE, stream=0)
    a.free(q, PAGE, stream=5)          # a stream the marks do not cover
    m = a.mark()
    assert a.release_idle(0, m) == PAGE
    assert a.release(0) == PAGE        # a full release syncs: that one goes too
    assert a.stats()["mapped"] == 0


@pytest.mark.parametrize("threads", [1, 4])
def test_a_release_through_worker_threads_unmaps_every_page_it_counts(threads):
    a = host()
    a.set_unmap_threads(threads)
    keep = a.malloc(PAGE)
    blocks = [a.malloc(PAGE) for _ in range(20)]
    for p in blocks:
        a.free(p, PAGE)
    assert a.release(5 * PAGE) == 16 * PAGE
    s = a.stats()
    assert s["mapped"] == 5 * PAGE and s["unmaps"] == 16
    assert _pages_mapped_at(keep, 21) == [True] * 5 + [False] * 16
    fill(keep, PAGE, 8)
    check(keep, PAGE, 8)

"""`[cache] max_entries` with a kernel (issue 39): past the bound the daemon asks the kernel to
forget the oldest idle names, the kernel forgets them, and every name still answers right (a
lookup again). A folder declared immutable is listed once for lookups by path."""
from __future__ import annotations

import os

from tests.conftest import needs_fuse
from tests.helpers.procs import wait_for

pytestmark = needs_fuse

N = 3000


def test_names_past_max_entries_are_forgotten_and_found_again(mount_factory):
    m = mount_factory('\n[cache]\nmax_entries = 1000\n')
    (m.store / "d").mkdir()
    for i in range(N):
        (m.store / "d" / f"f{i:04d}").write_bytes(b"x" * (i % 7))
    assert len(os.listdir(m.mnt / "d")) == N
    for i in range(N):
        assert os.lstat(m.mnt / "d" / f"f{i:04d}").st_size == i % 7
    counters = m.stats()["counters"]
    assert counters.get("entries_trimmed", 0) >= N - 1000, counters
    assert m.stats()["ops"]["lookup"]["count"] > 0   # stats of forgotten names were lookups again


def test_stat_by_path_in_an_immutable_folder_lists_it_once(mount_factory):
    m = mount_factory('\n[cache]\nimmutable_globs = ["ck/*"]\n')
    (m.store / "ck").mkdir()
    for i in range(200):
        (m.store / "ck" / f"f{i:03d}").write_bytes(b"y" * i)
    for i in range(10):
        assert os.stat(m.mnt / "ck" / f"f{i:03d}").st_size == i
    # the listing runs in the background (the lookups meanwhile ask the store): wait for it, then
    # every later name comes from it, however slow the machine
    assert wait_for(lambda: m.stats()["counters"].get("lookup_listings") == 1, timeout=60), m.stats()["counters"]
    for i in range(10, 200):
        assert os.stat(m.mnt / "ck" / f"f{i:03d}").st_size == i
    stats = m.stats()
    counters = stats["counters"]
    assert counters.get("lookup_listings") == 1, counters
    # each later name from the listing: in Python, or inside pyfuse3 (fast lookups, the default)
    in_c = stats["fast_lookups"].get("lookups", 0)
    assert counters.get("lookup_from_listing", 0) + in_c >= 190, (counters, stats["fast_lookups"])


def test_stat_by_path_on_s3_lists_an_immutable_folder_once(tmp_path, mount_factory):
    from tests.helpers.s3 import s3_server, s3fs, store_extra
    for server in s3_server(tmp_path / "s3"):
        fs = s3fs(server)
        fs.create_dir("meta")
        for i in range(40):
            with fs.open_output_stream(f"meta/ck/f{i:02d}") as f:
                f.write(b"z" * i)
        m = mount_factory(extra=f'\n[cache]\nspool_dir = "{tmp_path / "spool"}"\nimmutable_globs = ["ck/*"]\n',
                          store_uri="s3://meta", store_extra=store_extra(server))
        for i in range(5):
            assert os.stat(m.mnt / "ck" / f"f{i:02d}").st_size == i
        assert wait_for(lambda: m.stats()["counters"].get("lookup_listings") == 1, timeout=60), m.stats()
        for i in range(5, 40):
            assert os.stat(m.mnt / "ck" / f"f{i:02d}").st_size == i
        stats = m.stats()
        counters = stats["counters"]
        assert counters.get("lookup_listings") == 1, counters   # one LIST, not a HEAD per name
        in_c = stats["fast_lookups"].get("lookups", 0)           # (answered inside pyfuse3)
        assert counters.get("lookup_from_listing", 0) + in_c >= 35, (counters, stats["fast_lookups"])
        m.umount()

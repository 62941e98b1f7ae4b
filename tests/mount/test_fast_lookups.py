"""Lookups answered inside pyfuse3 (fusefs/fastpath.py FastNames, patches/pyfuse3-fastlookup.patch):
the names of a folder of immutable paths listed for the lookups to come are answered without
Python, as Python's lookup from that listing would answer them, and never once anything in the
folder changed through this mount or the listing's time is up. The kernel's lookups answered there
are the daemon's to count: an inode the kernel still holds is never dropped (its next request
would be ESTALE; the counting at FORGET is tests/fs/test_metadata_cache.py's, where no global
drop_caches disturbs the other mounts' tests)."""
from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from fusefs.listings import LIST_AFTER
from tests.conftest import needs_fuse
from tests.helpers.mounts import world_mount
from tests.helpers.security import as_nobody, can_run_as_nobody
from tests.helpers.procs import wait_for

pytestmark = needs_fuse

N = 200


def _mount(mount_factory, extra: str = ""):
    m = mount_factory(f'\n[cache]\nimmutable_globs = ["ck/*"]\n{extra}')
    if m.stats()["fast_lookups"].get("state") != "on":
        pytest.skip("fast lookups unavailable (needs the patched pyfuse3)")
    (m.store / "ck").mkdir()
    for i in range(N):
        (m.store / "ck" / f"f{i:03d}").write_bytes(b"y" * i)
    return m


def _no_estale(m) -> None:
    """No request named an inode the daemon had let go (the kernel retries an open once after
    ESTALE, so reads alone would not show it)."""
    assert "ESTALE" not in m.stats()["errors"], m.stats()["errors"]


def _listed(m) -> None:
    """Stat names by path until the folder is listed for lookups and its names registered."""
    for i in range(10):
        assert os.stat(m.mnt / "ck" / f"f{i:03d}").st_size == i
    assert wait_for(lambda: m.stats()["fast_lookups"]["names"] >= N - 10, timeout=60), m.stats()["fast_lookups"]


def test_names_of_a_folder_listed_for_lookups_are_answered_in_pyfuse3(mount_factory):
    m = _mount(mount_factory)
    _listed(m)
    before = m.stats()
    for i in range(10, N):
        st = os.stat(m.mnt / "ck" / f"f{i:03d}")
        assert (st.st_size, st.st_mode & 0o777) == (i, os.stat(m.store / "ck" / f"f{i:03d}").st_mode & 0o777)
    after = m.stats()
    assert after["fast_lookups"]["lookups"] - before["fast_lookups"]["lookups"] == N - 10, (
        after["fast_lookups"], after["ops"]["lookup"], after["counters"], before["ops"]["lookup"])
    # none reached Python (which answers them from the same listing otherwise)
    assert after["counters"].get("lookup_from_listing", 0) == before["counters"].get("lookup_from_listing", 0)
    # what they read is the files' own bytes (the inodes answered are the daemon's)
    for i in range(10, N, 37):
        assert (m.mnt / "ck" / f"f{i:03d}").read_bytes() == b"y" * i


def test_a_change_through_the_mount_ends_the_folders_answers(mount_factory):
    m = _mount(mount_factory)
    _listed(m)
    for i in range(10, 20):   # answered in pyfuse3: the kernel holds these inodes
        os.stat(m.mnt / "ck" / f"f{i:03d}")
    os.unlink(m.mnt / "ck" / "f150")          # (its LOOKUP answered there, its UNLINK in Python)
    assert m.stats()["fast_lookups"]["folders"] == 0
    with pytest.raises(FileNotFoundError):
        os.stat(m.mnt / "ck" / "f150")
    assert not (m.store / "ck" / "f150").exists()
    # a name never looked up is asked of Python now: a file written there by this mount is seen
    with open(m.mnt / "ck" / "f151", "wb") as f:
        f.write(b"new")
    assert os.stat(m.mnt / "ck" / "f151").st_size == 3
    # the inodes pyfuse3 answered stay known: opening them is no ESTALE
    for i in range(10, 20):
        assert (m.mnt / "ck" / f"f{i:03d}").read_bytes() == b"y" * i
    _no_estale(m)


def test_names_are_not_answered_past_the_listings_time(mount_factory):
    m = _mount(mount_factory, "immutable_timeout_s = 2\n")
    for i in range(10):
        assert os.stat(m.mnt / "ck" / f"f{i:03d}").st_size == i
    assert wait_for(lambda: m.stats()["fast_lookups"]["folders_named"] == 1, timeout=60), m.stats()["fast_lookups"]
    served = m.stats()["fast_lookups"]["lookups"]
    time.sleep(2.5)   # registered before it was seen: its 2 s are up (pyfuse3's CLOCK_MONOTONIC)
    # never looked up: the kernel asks, pyfuse3 passes them on (fewer than LIST_AFTER of them: the
    # folder is not listed again for lookups meanwhile)
    for i in range(100, 100 + LIST_AFTER - 1):
        assert os.stat(m.mnt / "ck" / f"f{i:03d}").st_size == i
    assert m.stats()["fast_lookups"]["lookups"] == served


def test_off_in_the_config(mount_factory):
    m = mount_factory('\n[cache]\nimmutable_globs = ["ck/*"]\n\n[mount]\nfast_lookups = false\n')
    assert m.stats()["fast_lookups"]["state"] == "off"
    (m.store / "ck").mkdir()
    for i in range(50):
        (m.store / "ck" / f"f{i:03d}").write_bytes(b"y" * i)
    for i in range(50):
        assert os.stat(m.mnt / "ck" / f"f{i:03d}").st_size == i


@pytest.mark.skipif(not can_run_as_nobody(), reason="needs root and setpriv")
def test_names_answered_in_pyfuse3_open_no_folder_a_user_may_not_search():
    """The attack: root's stats register a closed folder's names; another user then asks for
    them. The kernel checks search permission on the folder (`default_permissions`) before any
    LOOKUP is sent, whoever would answer it: EACCES, as without fast lookups; and in an open
    folder, a file's own mode still refuses its read."""
    def setup(base: Path) -> str:
        for folder, mode in (("shut", 0o700), ("open", 0o755)):
            (base / "store" / folder).mkdir()
            (base / "store" / folder).chmod(mode)
            for i in range(40):
                f = base / "store" / folder / f"f{i:02d}"
                f.write_bytes(b"s" * i)
                f.chmod(0o600 if i % 2 else 0o644)
        return '\n[cache]\nimmutable_globs = ["shut/*", "open/*"]\n'

    with world_mount(setup, prefix="hintfs-fastlookup-") as m:
        if m.stats()["fast_lookups"].get("state") != "on":
            pytest.skip("fast lookups unavailable (needs the patched pyfuse3)")
        for folder in ("shut", "open"):
            for i in range(10):
                os.stat(m.mnt / folder / f"f{i:02d}")
        assert wait_for(lambda: m.stats()["fast_lookups"]["folders"] == 2, timeout=60), m.stats()["fast_lookups"]
        got = as_nobody(f"""
            import json, os
            out = {{}}
            for p in {[str(m.mnt / f / f"f{i:02d}") for f in ("shut", "open") for i in (20, 21)]!r}:
                try:
                    st = os.stat(p)
                    out[p] = st.st_size
                    with open(p, "rb") as f:
                        out[p] = len(f.read())
                except OSError as err:
                    out[p] = "errno %d" % err.errno
            print(json.dumps(out))
        """)
        shut, opened = m.mnt / "shut", m.mnt / "open"
        assert got[str(shut / "f20")] == got[str(shut / "f21")] == f"errno {errno.EACCES}", got
        assert got[str(opened / "f20")] == 20, got                      # 0644: stat and read
        assert got[str(opened / "f21")] == f"errno {errno.EACCES}", got  # 0600: stat yes, read no


def test_files_of_a_folder_a_reader_goes_through_are_opened_in_pyfuse3_after_two(mount_factory):
    """Opens ahead (`[mount] fast_opens_ahead`, Filesystem._open_ahead): once a reader opened two
    files of a folder whose names pyfuse3 answers, its other files are marked, and their first
    opens and releases are answered in pyfuse3 with the files' own bytes. A change in the folder
    ends it: the marks of files never opened go, the opened ones still read."""
    m = _mount(mount_factory)
    if m.stats()["fast_path"].get("state") != "on":
        pytest.skip("the fast path is unavailable (needs passthrough and the patched pyfuse3)")
    _listed(m)
    for i in (10, 11):
        assert (m.mnt / "ck" / f"f{i:03d}").read_bytes() == b"y" * i
    assert wait_for(lambda: m.stats()["fast_path"]["marked_ahead"] >= N - 2 - 10, timeout=60), m.stats()["fast_path"]
    before = m.stats()
    for i in range(12, N):
        assert (m.mnt / "ck" / f"f{i:03d}").read_bytes() == b"y" * i
    after = m.stats()
    assert after["fast_path"]["opens"] - before["fast_path"]["opens"] == N - 12, after["fast_path"]
    assert after["counters"].get("file_releases") == before["counters"].get("file_releases")   # none in Python
    marked = after["fast_path"]["inodes"]
    os.unlink(m.mnt / "ck" / "f005")            # the folder changes through the mount
    assert m.stats()["fast_lookups"]["folders"] == 0
    # the files read keep their marks (the kernel holds them); none read was marked ahead
    assert wait_for(lambda: m.stats()["fast_path"]["inodes"] <= marked, timeout=10)
    for i in range(12, N, 23):
        assert (m.mnt / "ck" / f"f{i:03d}").read_bytes() == b"y" * i
    _no_estale(m)


@pytest.mark.skipif(not can_run_as_nobody(), reason="needs root and setpriv")
def test_files_opened_ahead_open_nothing_a_user_may_not_read():
    """The attack: root reads two files of a folder, so its other files are marked for opens in
    pyfuse3, a 0600 file of root's among them; another user then opens them. The kernel checks the
    file's mode (`default_permissions`) before any OPEN is sent, whoever would answer it: EACCES
    for the 0600 file, its bytes for the 0644 one."""
    def setup(base: Path) -> str:
        (base / "store" / "open").mkdir()
        (base / "store" / "open").chmod(0o755)
        for i in range(40):
            f = base / "store" / "open" / f"f{i:02d}"
            f.write_bytes(b"s" * i)
            f.chmod(0o600 if i % 2 else 0o644)
        return '\n[cache]\nimmutable_globs = ["open/*"]\n'

    with world_mount(setup, prefix="hintfs-openahead-") as m:
        if m.stats()["fast_path"].get("state") != "on" or m.stats()["fast_lookups"].get("state") != "on":
            pytest.skip("the fast path is unavailable (needs passthrough and the patched pyfuse3)")
        for i in range(10):
            os.stat(m.mnt / "open" / f"f{i:02d}")
        assert wait_for(lambda: m.stats()["fast_lookups"]["folders"] == 1, timeout=60), m.stats()["fast_lookups"]
        for i in (10, 11):
            (m.mnt / "open" / f"f{i:02d}").read_bytes()
        assert wait_for(lambda: m.stats()["fast_path"]["marked_ahead"] >= 20, timeout=60), m.stats()["fast_path"]
        opens = m.stats()["fast_path"]["opens"]
        got = as_nobody(f"""
            import json
            out = {{}}
            for p in {[str(m.mnt / "open" / f"f{i:02d}") for i in (20, 21, 31)]!r}:
                try:
                    with open(p, "rb") as f:
                        out[p] = len(f.read())
                except OSError as err:
                    out[p] = "errno %d" % err.errno
            print(json.dumps(out))
        """)
        d = m.mnt / "open"
        assert got[str(d / "f20")] == 20, got                                   # 0644: read
        assert got[str(d / "f21")] == got[str(d / "f31")] == f"errno {errno.EACCES}", got   # 0600: no
        assert m.stats()["fast_path"]["opens"] == opens + 1                     # f20's, in pyfuse3


@pytest.mark.skipif(not can_run_as_nobody(), reason="needs root and setpriv")
def test_another_users_walk_pushes_out_only_its_own_kept_listings():
    """The attack: another user stats its way through more large folders than its share of the
    kept listings (half of `[cache] max_entries`). Its own oldest folder is given up; root's kept
    listing and the names registered from it stay."""
    def setup(base: Path) -> str:
        for d in ("mine", "d0", "d1", "d2"):
            (base / "store" / d).mkdir()
            (base / "store" / d).chmod(0o755)
            for i in range(200):
                (base / "store" / d / f"f{i:03d}").write_bytes(b"w")
        return '\n[cache]\nimmutable_globs = ["mine/*", "d*/*"]\nmax_entries = 1000\n'

    with world_mount(setup, prefix="hintfs-listshare-") as m:
        if m.stats()["fast_lookups"].get("state") != "on":
            pytest.skip("fast lookups unavailable (needs the patched pyfuse3)")
        for i in range(10):
            os.stat(m.mnt / "mine" / f"f{i:03d}")
        assert wait_for(lambda: m.stats()["fast_lookups"]["folders"] == 1, timeout=60), m.stats()["fast_lookups"]
        for n, d in enumerate(("d0", "d1", "d2"), start=2):
            as_nobody(f"""
                import os
                for i in range(10):
                    os.stat({str(m.mnt / d)!r} + "/f%03d" % i)
                print("{{}}")
            """)
            assert wait_for(lambda: m.stats()["fast_lookups"]["folders_named"] == n, timeout=60), m.stats()
        assert m.stats()["fast_lookups"]["folders"] == 3, m.stats()["fast_lookups"]
        kept = m.stats()["kept_listings"]
        assert kept["share"] == 500 and kept["users"] == 2 and kept["given_up_for_share"] == 1, kept
        assert kept["folders"] == 3 and kept["names"] == 600, kept    # mine, d1, d2: d0 (the walker's oldest) gone
        assert m.stats()["fast_lookups"]["users"] == 2

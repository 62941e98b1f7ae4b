"""Owners on a file:// store through a real mount behave as on the backing filesystem (issue 12)."""
from __future__ import annotations

import os
import subprocess

from tests.conftest import needs_fuse

pytestmark = needs_fuse


def test_chown_on_a_file_store(mount_factory):
    m = mount_factory()
    (m.mnt / "own").write_text("x\n")
    subprocess.run(["chown", "65534:65534", str(m.mnt / "own")], check=True)
    st = os.stat(m.store / "own")
    assert (st.st_uid, st.st_gid) == (65534, 65534)
    assert (os.stat(m.mnt / "own").st_uid, os.stat(m.mnt / "own").st_gid) == (65534, 65534)

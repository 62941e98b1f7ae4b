"""POSIX behaviour of a file:// store through a real mount (issue 12; docs/semantics.md, Namespace).

One mount for the module (each test works in its own folder); ownership is checked as another
user with `setpriv --reuid=65534 --regid=65534 --clear-groups`.
"""
from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from tests.conftest import Mounted, force_unmount, needs_fuse, run_hintfs, write_config

pytestmark = needs_fuse

NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


@pytest.fixture(scope="module")
def mnt():
    # not under pytest's 0700 temp root: the other user must reach the mount
    base = Path(tempfile.mkdtemp(prefix="hintfs-posix-"))
    store, mp = base / "store", base / "mnt"
    store.mkdir()
    mp.mkdir()
    os.chmod(base, 0o755)
    cfg = write_config(base / "hintfs.toml", f"file://{store}", log=base / "mount.log")
    r = run_hintfs("mount", cfg, mp)
    assert r.returncode == 0, r.stderr
    m = Mounted(store, mp, cfg, base / "mount.log")
    yield m
    try:
        m.umount()
    finally:
        force_unmount(mp)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def d(mnt, request) -> tuple[Path, Path]:
    """A fresh 1777 folder for this test: (through the mount, in the store)."""
    name = request.node.name.replace("[", "_").replace("]", "")
    here = mnt.mnt / name
    here.mkdir()
    os.chmod(here, 0o1777)
    return here, mnt.store / name


def as_nobody(*argv: str, umask: str = "022") -> subprocess.CompletedProcess:
    return subprocess.run(AS_NOBODY + ["sh", "-c", f'umask {umask}; exec "$@"', "sh", *argv],
                          capture_output=True, text=True, timeout=30)


MAKE = {
    "regular": ["touch"],
    "dir": ["mkdir"],
    "symlink": ["ln", "-s", "target"],
    "fifo": ["mkfifo"],
}


@pytest.mark.parametrize("kind", sorted(MAKE))
def test_new_nodes_belong_to_the_caller(d, kind):
    here, store = d
    r = as_nobody(*MAKE[kind], str(here / "n"))
    assert r.returncode == 0, r.stderr
    for p in (here / "n", store / "n"):
        st = os.lstat(p)
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY), p


@pytest.mark.parametrize("kind", sorted(MAKE))
def test_setgid_parent_gives_its_group(d, kind):
    here, store = d
    os.chown(here, 0, 4242)
    os.chmod(here, 0o2777)
    r = as_nobody(*MAKE[kind], str(here / "n"))
    assert r.returncode == 0, r.stderr
    st = os.lstat(here / "n")
    assert (st.st_uid, st.st_gid) == (NOBODY, 4242)
    if kind == "dir":   # new folders in a set-group-ID folder are set-group-ID themselves
        assert st.st_mode & stat.S_ISGID and os.lstat(store / "n").st_mode & stat.S_ISGID


@pytest.mark.parametrize("kind", ["regular", "dir", "fifo"])
@pytest.mark.parametrize("umask", ["000", "027"])
def test_mode_is_what_was_asked_under_the_callers_umask(d, kind, umask):
    here, _ = d
    argv = {"regular": ["python3", "-c", f"import os; os.close(os.open('{here / 'n'}', os.O_CREAT | os.O_WRONLY, 0o777))"],
            "dir": ["mkdir", "-m", "0777"], "fifo": ["mkfifo", "-m", "0777"]}[kind]
    if kind != "regular":
        argv = argv + [str(here / "n")]
    r = as_nobody(*argv, umask=umask)
    assert r.returncode == 0, r.stderr
    if kind != "regular":   # mkdir -m / mkfifo -m chmod explicitly; ask without -m as well
        r = as_nobody(argv[0], str(here / "m"), umask=umask)
        assert r.returncode == 0, r.stderr
        assert stat.S_IMODE(os.lstat(here / "m").st_mode) == (0o777 if kind == "dir" else 0o666) & ~int(umask, 8)
    else:
        assert stat.S_IMODE(os.lstat(here / "n").st_mode) == 0o777 & ~int(umask, 8)


def test_writing_keeps_the_owner_and_mode_of_the_file(d):
    here, store = d
    r = as_nobody("sh", "-c", f"echo one > {here / 'f'}; chmod 0604 {here / 'f'}; echo two >> {here / 'f'}")
    assert r.returncode == 0, r.stderr
    st = os.stat(store / "f")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, NOBODY, 0o604)
    assert (store / "f").read_text() == "one\ntwo\n"
    r = as_nobody("sh", "-c", f": > {here / 'f'}")   # O_TRUNC
    assert r.returncode == 0, r.stderr
    assert os.stat(store / "f").st_uid == NOBODY and os.stat(store / "f").st_size == 0


@pytest.mark.parametrize("flags", [os.O_RDONLY, os.O_RDWR])
def test_unlinked_open_file_works_through_its_fd_until_close(d, flags):
    here, _ = d
    (here / "f").write_bytes(b"hello")
    fd = os.open(here / "f", flags)
    try:
        os.unlink(here / "f")
        assert not (here / "f").exists()
        st = os.fstat(fd)
        assert st.st_nlink == 0 and st.st_size == 5
        assert os.pread(fd, 5, 0) == b"hello"
        os.fchmod(fd, 0o600)
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
        os.utime(fd, ns=(1_000_000_000, 2_000_000_000))
        assert os.fstat(fd).st_mtime_ns == 2_000_000_000
        if flags == os.O_RDWR:
            assert os.pwrite(fd, b"HELLO!", 0) == 6
            assert os.pread(fd, 10, 0) == b"HELLO!"
            os.ftruncate(fd, 2)
            assert os.fstat(fd).st_size == 2
    finally:
        os.close(fd)
    assert not (here / "f").exists()   # nothing published under the old name


def test_paths_longer_than_path_max_below_the_root(d):
    """16 levels of 255-byte names (4,096+ bytes below the store root), worked on relative to
    the cwd as a process does."""
    here, _ = d
    name = "x" * 255
    code = f"""
import os
os.chdir({str(here)!r})
for i in range(16):
    os.mkdir({name!r}); os.chdir({name!r})
with open("f", "w") as f: f.write("deep")
os.rename("f", "g"); os.symlink("g", "l"); os.mkdir("sub"); os.chmod("g", 0o600)
assert open("l").read() == "deep" and sorted(os.listdir(".")) == ["g", "l", "sub"]
print("ok")
"""
    r = subprocess.run(["python3", "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "ok", r.stderr


def test_atime_is_kept_and_utimensat_sets_only_what_is_asked(d):
    here, store = d
    f = here / "f"
    f.write_bytes(b"x")
    os.utime(f, ns=(1_000_000_000, 2_000_000_000))
    st = os.stat(f)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_000, 2_000_000_000)   # atime is not mtime
    subprocess.run(["touch", "-m", "-d", "@3", str(f)], check=True)             # UTIME_OMIT for atime
    assert (os.stat(f).st_atime_ns, os.stat(f).st_mtime_ns) == (1_000_000_000, 3_000_000_000)
    subprocess.run(["touch", "-a", "-d", "@4", str(f)], check=True)             # UTIME_OMIT for mtime
    assert (os.stat(f).st_atime_ns, os.stat(f).st_mtime_ns) == (4_000_000_000, 3_000_000_000)
    subprocess.run(["touch", "-m", str(f)], check=True)                          # UTIME_NOW for mtime
    st = os.stat(f)
    assert st.st_atime_ns == 4_000_000_000 and st.st_mtime_ns > 3_000_000_000
    assert os.stat(store / "f").st_atime_ns == 4_000_000_000


def test_fifo_through_the_mount_passes_data(d):
    here, store = d
    os.mkfifo(here / "p", 0o644)
    assert stat.S_ISFIFO(os.lstat(here / "p").st_mode) and stat.S_ISFIFO(os.lstat(store / "p").st_mode)
    got = []
    reader = threading.Thread(target=lambda: got.append((here / "p").read_bytes()))
    reader.start()      # blocks in open until the writer comes: the kernel's pipe, not the daemon
    (here / "p").write_bytes(b"through the pipe")
    reader.join(10)
    assert got == [b"through the pipe"]
    os.unlink(here / "p")


def test_sockets_and_device_nodes(d):
    here, store = d
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(here / "sock"))
        assert stat.S_ISSOCK(os.lstat(here / "sock").st_mode) and stat.S_ISSOCK(os.lstat(store / "sock").st_mode)
    finally:
        s.close()
    os.mknod(here / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    st = os.lstat(here / "null")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    assert os.lstat(store / "null").st_rdev == os.makedev(1, 3)
    r = as_nobody("mknod", str(here / "null2"), "c", "1", "3")   # CAP_MKNOD, checked by the kernel
    assert r.returncode != 0 and not (store / "null2").exists()


def test_hard_links_are_one_inode(d):
    here, store = d
    (here / "a").write_bytes(b"one")
    os.link(here / "a", here / "b")
    sa, sb = os.stat(here / "a"), os.stat(here / "b")
    assert sa.st_ino == sb.st_ino and sa.st_nlink == sb.st_nlink == 2
    assert os.stat(store / "a").st_ino == os.stat(store / "b").st_ino
    os.rename(here / "b", here / "c")
    assert os.stat(here / "c").st_ino == sa.st_ino and (here / "c").read_bytes() == b"one"
    os.unlink(here / "a")
    assert os.stat(here / "c").st_nlink == 1 and (here / "c").read_bytes() == b"one"
    # a hard link made in the store directly is the same inode through the mount too
    os.link(store / "c", store / "e")
    assert os.stat(here / "e").st_ino == os.stat(here / "c").st_ino
    # publishing a write replaces the name written through; the other name keeps the old file
    (here / "c").write_bytes(b"two")
    assert (here / "c").read_bytes() == b"two" and (here / "e").read_bytes() == b"one"


def test_link_to_a_file_still_open_for_writing_links_what_was_written(d):
    here, _ = d
    with open(here / "w", "wb") as f:
        f.write(b"so far")
        f.flush()
        os.link(here / "w", here / "w2")
        assert (here / "w2").read_bytes() == b"so far"


def test_the_mount_itself_is_never_served_through_itself(mnt, d):
    here, store = d
    (store / "loop").mkdir()
    subprocess.run(["mount", "--bind", str(mnt.mnt), str(store / "loop")], check=True)
    try:
        r = subprocess.run(["stat", str(here / "loop")], capture_output=True, text=True, timeout=20)
        assert r.returncode != 0 and "symbolic links" in r.stderr   # ELOOP, at once
        assert "loop" not in os.listdir(here)
        with pytest.raises(OSError) as exc:
            os.stat(here / "loop" / "anything")
        assert exc.value.errno == errno.ELOOP
        assert (here / "..").exists()   # the daemon kept serving
    finally:
        subprocess.run(["umount", str(store / "loop")], check=True)

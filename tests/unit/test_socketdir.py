"""The in-process agent's socket folder: private, removed at stop, and reaped after a kill."""
import fcntl
import os
import signal
import stat
import subprocess
import sys

from hintfs.agent import socketdir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_made_folder_is_private_locked_and_removed_at_stop(tmp_path):
    d = socketdir.make(str(tmp_path))
    assert os.path.basename(d.path).startswith(f"hintfs-agent-{os.getpid()}-")
    assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o700
    other = os.open(d.path, os.O_RDONLY | os.O_DIRECTORY)
    try:                       # held: a second open file description cannot take it
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            raise AssertionError("the folder was not locked")
        except BlockingIOError:
            pass
    finally:
        os.close(other)
    assert socketdir.reap_dead(str(tmp_path)) == 0 and os.path.isdir(d.path)
    d.remove()
    assert not os.path.exists(d.path)


def test_the_folder_of_a_killed_mount_is_reaped_by_the_next_one(tmp_path):
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from hintfs.agent import socketdir; "
            "d = socketdir.make(sys.argv[2]); open(d.socket, 'w').close(); print(d.path, flush=True); "
            "time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, REPO, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        path = p.stdout.readline().strip()
        assert os.path.exists(os.path.join(path, "agent.sock"))
        assert socketdir.reap_dead(str(tmp_path)) == 0, "a live mount's folder was reaped"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
    assert os.path.isdir(path)           # a kill leaves it behind ...
    fresh = socketdir.make(str(tmp_path))
    try:
        assert not os.path.exists(path)  # ... and the next mount removes it
        assert os.path.isdir(fresh.path)
    finally:
        fresh.remove()


def test_reaping_leaves_locked_foreign_linked_and_unnamed_folders_alone(tmp_path):
    dead = _dead_pid()
    locked = tmp_path / f"hintfs-agent-{dead}-locked"        # a live mount in another pid namespace
    foreign = tmp_path / f"hintfs-agent-{dead}-foreign"      # another user's
    target = tmp_path / "elsewhere"
    link = tmp_path / f"hintfs-agent-{dead}-link"            # a symlink planted in /tmp
    old = tmp_path / "hintfs-agent-abcdefgh"                 # no pid in its name (an older version's)
    gone = tmp_path / f"hintfs-agent-{dead}-gone"
    for d in (locked, foreign, target, old, gone):
        d.mkdir(mode=0o700)
        (d / "agent.sock").write_bytes(b"")
    os.chown(foreign, 65534, 65534)
    link.symlink_to(target)
    held = os.open(locked, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        assert socketdir.reap_dead(str(tmp_path)) == 1
    finally:
        os.close(held)
    assert not gone.exists()
    for d in (locked, foreign, target, old):
        assert (d / "agent.sock").exists(), d
    assert link.is_symlink()

"""The stream sender process (`[stream] sender = "process"`, docs/cross_dc.md "The sender
process"), through real mounts and a real tier agent: the sends run in a child of the mount at
`sender_nice` (in a session and autogroup of its own), on `sender_cpus`; a child killed mid-stream is started again and the file still reaches the tier
whole; the child ends with the mount, whether it is unmounted or killed; a child that keeps
dying turns streaming off (the eval side then copies after close)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from hintfs.common.procs import child_pids, pid_alive
from fusefs.stats import Stats
from fusefs.stream import process, sender
from fusefs.stream.hooks import StreamFront
from mountconfig.schema import StreamConfig
from tests.conftest import needs_fuse, wait_for
from tests.system.test_stream_mount import CHUNK, streaming_to_tier

PATH = "ckpt/run/step_1/__0_0.distcp"


def sender_of(pid: int) -> list[int]:
    """The mount's stream sender processes (its children running fusefs.stream.sender)."""
    out = []
    for kid in child_pids(pid):
        try:
            if b"fusefs.stream.sender" in Path(f"/proc/{kid}/cmdline").read_bytes():
                out.append(kid)
        except OSError:
            pass
    return out


def nice_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


@needs_fuse
def test_the_sends_run_in_a_child_at_sender_nice_on_sender_cpus_which_ends_with_the_unmount(mount_factory, tmp_path):
    mine = os.sched_getaffinity(0)             # what the mount inherits
    cpu = max(mine)                            # (on a host of one CPU, the child's is the same)
    with streaming_to_tier(mount_factory, tmp_path, stream={"sender_nice": 13, "sender_cpus": [cpu]}) as (
            store, tier, train):
        (kid,) = sender_of(train.pid)
        assert wait_for(lambda: nice_of(kid) == 13, 10)   # (its first acts once it has its setup)
        assert wait_for(lambda: os.sched_getaffinity(kid) == {cpu}, 10)
        assert nice_of(train.pid) == 0            # the mount itself keeps the job's priority
        # a session of its own, whose autogroup has the niceness (tests/unit/test_stream_sender_nice.py)
        assert wait_for(lambda: os.getsid(kid) == kid, 10) and os.getsid(train.pid) != kid
        if os.path.exists(f"/proc/{kid}/autogroup"):
            assert wait_for(lambda: Path(f"/proc/{kid}/autogroup").read_text().split()[-1:] == ["13"], 10)
            # (an empty file: the mount is in the boot-time default group, which has no niceness)
            assert (Path(f"/proc/{train.pid}/autogroup").read_text().split() or ["0"])[-1] == "0"
        assert os.sched_getaffinity(train.pid) == mine     # and its CPUs
        (train.mnt / "ckpt/run/step_1").mkdir(parents=True)
        data = os.urandom(5 * CHUNK + 3)
        (train.mnt / PATH).write_bytes(data)
        st = os.stat(store / PATH)
        assert wait_for(lambda: tier.client.has(PATH, st.st_size, st.st_mtime_ns), 10)
        assert tier.client.read(PATH, 0, len(data) + 1, replica_only=True) == data
        # the child's counters reach the mount's stats (just after the tier's answer)
        assert wait_for(lambda: train.stats()["counters"].get("stream_bytes_sent") == len(data), 10)
        assert train.stats()["counters"]["streams_published"] == 1
        train.umount()
        assert wait_for(lambda: not pid_alive(kid), 10)


@needs_fuse
def test_a_sender_killed_mid_stream_is_started_again_and_the_file_arrives_whole(mount_factory, tmp_path):
    with streaming_to_tier(mount_factory, tmp_path) as (store, tier, train):
        (kid,) = sender_of(train.pid)
        (train.mnt / "ckpt/run/step_1").mkdir(parents=True)
        data = os.urandom(12 * CHUNK + 5)
        with open(train.mnt / PATH, "wb") as f:
            f.write(data[: 6 * CHUNK])
            f.flush()
            assert wait_for(lambda: tier.client.status()["streams"]["bytes_held"] >= 6 * CHUNK, 10)
            os.kill(kid, signal.SIGKILL)
            t0 = time.monotonic()
            f.write(data[6 * CHUNK:])             # the writer goes on: nothing waits for the sender
        assert time.monotonic() - t0 < 2.0
        assert wait_for(lambda: train.stats()["counters"].get("stream_sender_restarts") == 1, 10)
        # (the count comes before the new child is started: wait for it)
        assert wait_for(lambda: len(sender_of(train.pid)) == 1, 10), sender_of(train.pid)
        (new,) = sender_of(train.pid)
        assert new != kid
        st = os.stat(store / PATH)
        assert wait_for(lambda: tier.client.has(PATH, st.st_size, st.st_mtime_ns), 15)
        assert tier.client.read(PATH, 0, len(data) + 1, replica_only=True) == data
        assert tier.client.status()["copies"] == 0   # the new child sent it: no copy after close


@needs_fuse
def test_the_sender_ends_when_the_mount_is_killed(mount_factory, tmp_path):
    with streaming_to_tier(mount_factory, tmp_path) as (store, tier, train):
        (kid,) = sender_of(train.pid)
        os.kill(train.pid, signal.SIGKILL)
        assert wait_for(lambda: not pid_alive(kid), 10)


def test_a_sender_that_keeps_dying_turns_streaming_off(monkeypatch):
    """No mount needed: the hooks over the child's sink, its child killed twice with RESTARTS = 1."""
    monkeypatch.setattr(process, "RESTARTS", 1)
    sc = StreamConfig(prefixes=["ckpt"], agents=["grpc://127.0.0.1:9"])
    stats = Stats()
    hooks = StreamFront(sc, lambda finished: process.ProcessSink(sc, None, None, stats, finished))
    proc = hooks.sink
    assert isinstance(proc, process.ProcessSink)
    try:
        assert hooks.wants("ckpt/run/x")
        for deaths in (1, 2):
            pid = proc.proc.pid
            os.kill(pid, signal.SIGKILL)
            assert wait_for(lambda: proc.proc.pid != pid or proc.failed, 15)
        assert wait_for(lambda: proc.failed, 15)
        assert stats.counters["stream_sender_restarts"] == 2
        assert not hooks.wants("ckpt/run/x")      # the journal now tells the eval side to copy
        r, w = os.pipe()
        try:
            hooks.started(1, "ckpt/run/x", r)     # a hook after that is a no-op
            assert hooks.live == {} and proc.live == {}
        finally:
            os.close(r)
            os.close(w)
    finally:
        hooks.close(1.0)
    assert not pid_alive(proc.proc.pid)


def test_cpus_the_kernel_refuses_leave_the_sender_where_it_was_with_a_warning(monkeypatch, caplog):
    def refuse(pid, cpus):
        raise OSError(22, "Invalid argument")

    before = os.sched_getaffinity(0)
    monkeypatch.setattr(sender.os, "sched_setaffinity", refuse)
    assert sender.pin_to([0]) is False
    assert os.sched_getaffinity(0) == before
    assert "cannot run on CPUs [0]" in caplog.text

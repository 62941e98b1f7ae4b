"""Write-time streaming through real mounts and a real tier agent (issue 15, docs/cross_dc.md):
a training mount with `[stream]` sends each checkpoint file to the eval tier while it is written;
the tier makes it a replica at publish (no copy after close); eval reads through `[[routes]]`
return the published bytes, and unpublished bytes are never served."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import pytest

from hintfs.agent.client import AgentClient
from hintfs.agent.server import AgentServer
from hintfs.common.clock import SYSTEM_CLOCK, Clock
from mountconfig import parse_config
from hintfs.stores.local import LocalStore
from tests.conftest import needs_fuse, wait_for

pytestmark = needs_fuse

CHUNK = 64 << 10


class Tier:
    """An eval tier agent on a loopback TCP port (streams need a network agent), following `ckpt`."""

    def __init__(self, tmp_path, store, follow: bool = True, follow_options: dict | None = None,
                 clock: Clock = SYSTEM_CLOCK, **agent):
        cfg = {"store": {"uri": f"file://{store}"},
               "agent": {"data_dir": str(tmp_path / "tier"), "auth": "none", "stream_prefixes": ["ckpt"], **agent}}
        if follow:
            cfg["follow"] = {"prefixes": ["ckpt"], "poll_interval_s": 0.05, **(follow_options or {})}
        parsed = parse_config(cfg)
        self.server = AgentServer(LocalStore(str(store)), parsed.agent, peers=parsed.agents, follow=parsed.follow,
                                  transform_load=parsed.transform_load, location="grpc://127.0.0.1:0", clock=clock)
        self.loc = f"grpc://127.0.0.1:{self.server.port}"
        # Listening from here on: Flight starts the gRPC server in its constructor. `serve()` is not
        # called: it only waits, and as it returns Arrow wakes its signal thread, which shuts down
        # the server the process-wide `running_instance_` names: the last one to enter `serve()`.
        # Under load the serve thread of an earlier test's tier ended after the next test's tier
        # had entered `serve()`, and shut that one down: "Connection refused" on its first calls
        # (two Flight servers, the first shut down while the second starts serving: the second
        # stopped listening in 54 of 300 tries; in none without `serve()` or with its end awaited).
        # A connection of its own: gRPC shares connections per address within a process, and a
        # port reused from an earlier test's tier could hand this client that address's state.
        self.client = AgentClient(self.loc, own_connection=True)

    def close(self):
        self.server.shutdown()


@contextlib.contextmanager
def streaming_to_tier(mount_factory, tmp_path, stream: dict | None = None, **tier_options) -> Iterator[tuple]:
    """(store, tier, training mount): a tier agent over the training store (`Tier` options), and
    a training mount streaming `ckpt` to it (more `[stream]` keys in `stream`); the tier is shut
    down at the end."""
    store = tmp_path / "train" / "store"
    store.mkdir(parents=True)
    tier = Tier(tmp_path, store, **tier_options)
    try:
        yield store, tier, mount_factory(name="train", extra=stream_toml(tier.loc, **(stream or {})))
    finally:
        tier.close()


def stream_toml(loc: str, journal: bool = True, **extra) -> str:
    lines = ['prefixes = ["ckpt"]', f'agents = ["{loc}"]', f"chunk_bytes = {CHUNK}", "poll_interval_s = 0.01"]
    lines += [f"{k} = {v}" for k, v in extra.items()]
    return ("\n[journal]\nenabled = true\n" if journal else "") + "\n[stream]\n" + "\n".join(lines) + "\n"


def send_whole(client, sid: str, store, rel: str, record: str | None = None) -> None:
    """The stream of a file written before: its open, all its chunks and its publish (at the
    store's version of `store`/`rel`, with journal `record`) in one call."""
    from policy.stream import crcs_of
    data = (store / rel).read_bytes()
    st = os.stat(store / rel)
    offsets = range(0, len(data), CHUNK)
    crcs = crcs_of([data[o:o + CHUNK] for o in offsets])
    client.stream_put(sid, 0, [(o, data[o:o + CHUNK], crc) for o, crc in zip(offsets, crcs)],
                      opening={"path": rel, "chunk": CHUNK},
                      publish={"path": rel, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "crcs": crcs,
                               "record": record})


@contextlib.contextmanager
def tier_over(tmp_path, *folders: str) -> Iterator[tuple]:
    """(store, tier): a store with these folders under `ckpt`, and a tier agent over it that
    follows nothing (the tests call `replicate` as its follower would); shut down at the end."""
    store = tmp_path / "store"
    for folder in folders:
        (store / "ckpt" / folder).mkdir(parents=True)
    tier = Tier(tmp_path, store, follow=False)
    try:
        yield store, tier
    finally:
        tier.close()


@pytest.mark.parametrize("sender", ["process", "threads"])
def test_a_file_streamed_while_written_is_a_replica_at_close_without_a_copy(mount_factory, tmp_path, sender):
    """Both places the sends may run (`[stream] sender`): a child process or the mount's threads."""
    with streaming_to_tier(mount_factory, tmp_path, stream={"sender": f'"{sender}"'}) as (store, tier, train):
        ck = train.mnt / "ckpt" / "run" / "step_1"
        ck.mkdir(parents=True)
        data = os.urandom(10 * CHUNK + 777)
        with open(ck / "__0_0.distcp", "wb") as f:
            f.write(data[: 6 * CHUNK])
            f.flush()
            # whole chunks leave while the file is open, and are not a replica yet
            assert wait_for(lambda: tier.server.agent.streams.state_of("ckpt/run/step_1/__0_0.distcp") is not None
                            and tier.server.agent.streams.streams and any(
                                s.ranges.bytes_held() >= 6 * CHUNK for s in tier.server.agent.streams.streams.values()),
                            timeout=10)
            assert tier.client.tier_stat("ckpt/run/step_1/__0_0.distcp")["state"] == "streaming"
            with pytest.raises(OSError):
                tier.client.read("ckpt/run/step_1/__0_0.distcp", 0, 10, replica_only=True)
            f.write(data[6 * CHUNK:])
        (ck / ".metadata").write_bytes(b"marker")
        st = os.stat(store / "ckpt/run/step_1/__0_0.distcp")
        assert wait_for(lambda: tier.client.has("ckpt/run/step_1/__0_0.distcp", st.st_size, st.st_mtime_ns), 10)
        assert tier.client.read("ckpt/run/step_1/__0_0.distcp", 0, len(data) + 10, replica_only=True) == data
        assert wait_for(lambda: tier.client.status()["follow"]["complete"] == ["ckpt/run/step_1"], 10)
        status = tier.client.status()
        assert status["streams"]["published"] == 2
        assert status["copies"] == 0        # the follower found both files there: no copy after close
        # (the sender reports its counters just after the tier's answers)
        assert wait_for(lambda: train.stats()["counters"].get("streams_published") == 2, 10)
        counters = train.stats()["counters"]
        # every byte crossed once: the streams sent the file and the marker, the follower nothing
        assert counters["stream_bytes_sent"] == len(data) + len(b"marker")

        ev = mount_factory(name="eval", store_uri=f"file://{store}",
                           extra=f'\n[[routes]]\nprefix = "ckpt"\nlocal_agent = "{tier.loc}"\n')
        assert (ev.mnt / "ckpt/run/step_1/__0_0.distcp").read_bytes() == data
        assert ev.stats()["counters"].get("route_local", 0) >= 1


def test_a_tier_takes_streams_only_under_its_stream_prefixes(tmp_path):
    import errno
    store = tmp_path / "store"
    store.mkdir()
    tier = Tier(tmp_path, store, follow=False)
    try:
        with pytest.raises(OSError) as err:
            tier.client.stream_open("s1", 0, "other/f.bin", CHUNK)
        assert err.value.errno == errno.EACCES
        tier.client.stream_open("s2", 0, "ckpt/f.bin", CHUNK)
        with pytest.raises(OSError) as err:      # nor published under another name
            tier.client.stream_publish("s2", 0, "etc/f.bin", 0, 1, [])
        assert err.value.errno == errno.EACCES
        with pytest.raises(OSError) as err:      # nor inside the do_put that opens it
            tier.client.stream_put("s3", 0, [], opening={"path": "x/y", "chunk": CHUNK})
        assert err.value.errno == errno.EACCES
        assert tier.client.status()["replicas"] == {}
    finally:
        tier.close()


def test_an_eval_mount_serves_tier_replicas_by_passthrough_through_the_agents_fd_socket(mount_factory, tmp_path):
    store = tmp_path / "store"
    (store / "ckpt/run/step_1").mkdir(parents=True)
    data = os.urandom(3 * CHUNK + 5)
    (store / "ckpt/run/step_1/w.distcp").write_bytes(data)
    sock = tmp_path / "run" / "tier.sock"
    tier = Tier(tmp_path, store, follow=False, local_socket=str(sock))
    try:
        tier.client.replicate("ckpt/run/step_1/w.distcp", 600)
        assert (os.stat(sock).st_mode & 0o777) == 0o600
        ev = mount_factory(name="eval", store_uri=f"file://{store}",
                           extra=f'\n[mount]\npassthrough = "auto"\n[[routes]]\nprefix = "ckpt"\n'
                                 f'local_agent = "{tier.loc}"\nlocal_socket = "{sock}"\n')
        if ev.stats()["passthrough"]["state"] != "on":
            pytest.skip(f"FUSE passthrough not available here: {ev.stats()['passthrough']['state']}")
        assert (ev.mnt / "ckpt/run/step_1/w.distcp").read_bytes() == data
        c = ev.stats()["counters"]
        assert c.get("tier_fd_opens") == 1 and c.get("passthrough_replica_opens") == 1
        assert c.get("replica_reads", 0) == 0        # the kernel read the tier's file itself
    finally:
        tier.close()


def test_the_fd_socket_refuses_other_users_and_other_versions(tmp_path):
    import subprocess
    import sys
    from hintfs.agent.fdserver import receive_replica_fd
    store = tmp_path / "store"
    (store / "ckpt").mkdir(parents=True)
    (store / "ckpt/w.bin").write_bytes(b"w" * 1000)
    sock = tmp_path / "tier.sock"
    tier = Tier(tmp_path, store, follow=False, local_socket=str(sock))
    try:
        tier.client.replicate("ckpt/w.bin", 600)
        st = os.stat(store / "ckpt/w.bin")
        fd = receive_replica_fd(str(sock), "ckpt/w.bin", st.st_size, st.st_mtime_ns)
        assert fd >= 0
        try:
            assert os.pread(fd, 4, 0) == b"wwww"
            with pytest.raises(OSError):
                os.pwrite(fd, b"x", 0)                 # read-only: the replica cannot be changed
        finally:
            os.close(fd)
        assert receive_replica_fd(str(sock), "ckpt/w.bin", st.st_size, st.st_mtime_ns + 1) == -1
        assert receive_replica_fd(str(sock), "../etc/passwd", 1, 1) == -1
        # another user: the 0600 socket refuses the connection (and SO_PEERCRED would too)
        os.chmod(tmp_path, 0o755)
        probe = ("import sys; from hintfs.agent.fdserver import receive_replica_fd; "
                 f"print(receive_replica_fd({str(sock)!r}, 'ckpt/w.bin', {st.st_size}, {st.st_mtime_ns}))")
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", probe],
                           capture_output=True, text=True, timeout=60, cwd=os.getcwd(),
                           env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "-1"
    finally:
        tier.close()


def test_a_commit_marker_renamed_into_place_reaches_the_tier_by_stream_and_completes(mount_factory, tmp_path):
    """DCP writes `.metadata.tmp` and renames it to `.metadata`: the rename is journaled (the
    follower learns of the marker) and the small file is streamed under its new name."""
    with streaming_to_tier(mount_factory, tmp_path) as (store, tier, train):
        ck = train.mnt / "ckpt" / "run" / "step_2"
        ck.mkdir(parents=True)
        data = os.urandom(5 * CHUNK + 1)
        with open(ck / "__0_0.distcp", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())                 # as DCP does (sync_files): published at fsync
        (ck / ".metadata.tmp").write_bytes(b"the plan")
        os.rename(ck / ".metadata.tmp", ck / ".metadata")
        assert wait_for(lambda: tier.client.status()["follow"]["complete"] == ["ckpt/run/step_2"], 15)
        st = os.stat(store / "ckpt/run/step_2/.metadata")
        assert tier.client.has("ckpt/run/step_2/.metadata", st.st_size, st.st_mtime_ns)
        assert tier.client.read("ckpt/run/step_2/.metadata", 0, 100, replica_only=True) == b"the plan"
        assert tier.client.read("ckpt/run/step_2/__0_0.distcp", 0, len(data) + 1, replica_only=True) == data
        assert train.stats()["counters"]["streams_renamed"] == 1
        # the data file, .metadata.tmp and .metadata were published by stream. The follower
        # waits for the streams of a streamed folder (test below), but the data file here is
        # journaled twice for one version (fsync, then the close of a passthrough write) and, on
        # a loaded host, a copy for one record may still race the stream: at most one copy. (A
        # replica made for the later record used to be copied again for the earlier one: 2 copies
        # in CI; test_an_older_record_of_the_same_writer_and_version_needs_no_copy.)
        assert wait_for(lambda: tier.client.status()["streams"]["published"] == 3, 10)
        assert tier.client.status()["copies"] <= 1


def test_keep_last_drops_a_streamed_checkpoint_as_it_drops_a_copied_one(mount_factory, tmp_path):
    """A job writing checkpoint after checkpoint by stream keeps `[follow] keep_last` of them at the
    tier: the streams' replicas of an older one go when a newer one completes."""
    def checkpoint(train, step: int) -> bytes:
        ck = train.mnt / "ckpt" / "run" / f"step_{step}"
        ck.mkdir(parents=True)
        data = os.urandom(3 * CHUNK + step)
        with open(ck / "__0_0.distcp", "wb") as f:
            f.write(data)
        (ck / ".metadata.tmp").write_bytes(b"plan %d" % step)
        os.rename(ck / ".metadata.tmp", ck / ".metadata")
        return data

    with streaming_to_tier(mount_factory, tmp_path, follow_options={"keep_last": 1}) as (store, tier, train):
        checkpoint(train, 1)
        assert wait_for(lambda: tier.client.status()["follow"]["complete"] == ["ckpt/run/step_1"], 15)
        old = {"ckpt/run/step_1/__0_0.distcp", "ckpt/run/step_1/.metadata"}
        assert old <= set(tier.client.status()["replicas"])
        data = checkpoint(train, 2)
        assert wait_for(lambda: tier.client.status()["follow"]["complete"] == ["ckpt/run/step_2"], 15)
        replicas = set(tier.client.status()["replicas"])
        assert not replicas & old
        assert {"ckpt/run/step_2/__0_0.distcp", "ckpt/run/step_2/.metadata"} <= replicas
        assert tier.client.read("ckpt/run/step_2/__0_0.distcp", 0, len(data) + 1, replica_only=True) == data
        for path in old:
            with pytest.raises(OSError):
                tier.client.read(path, 0, 10, replica_only=True)
        assert tier.client.status()["streams"]["published"] >= 4      # both checkpoints came by stream


def test_a_file_unlinked_or_renamed_away_after_its_publish_is_no_longer_served_by_the_tier(mount_factory, tmp_path):
    """The tier holds only what the store has: DCP's `.metadata.tmp` (streamed at its close,
    renamed to `.metadata`) and a data file deleted later leave the tier by their removal records,
    and an eval mount then finds neither; the marker under its new name is still served."""
    from tests.system.test_stream_faults import _eval_mount
    with streaming_to_tier(mount_factory, tmp_path) as (store, tier, train):
        ck = train.mnt / "ckpt" / "run" / "step_1"
        ck.mkdir(parents=True)
        (ck / "a.distcp").write_bytes(b"A" * (3 * CHUNK))
        (ck / ".metadata.tmp").write_bytes(b"plan")
        os.rename(ck / ".metadata.tmp", ck / ".metadata")
        assert wait_for(lambda: tier.client.status()["follow"]["complete"] == ["ckpt/run/step_1"], 15)
        os.unlink(ck / "a.distcp")
        assert train.stats()["counters"]["journal_removals"] == 2
        assert wait_for(lambda: set(tier.client.status()["replicas"]) == {"ckpt/run/step_1/.metadata"}, 10)
        ev = _eval_mount(mount_factory, store, tier.loc)
        for gone in (".metadata.tmp", "a.distcp"):
            rel = f"ckpt/run/step_1/{gone}"
            try:
                got = (ev.mnt / rel).read_bytes()
            except FileNotFoundError:
                continue
            # where it came from: what the tier says, and the eval mount's route counters
            # (route_demand_*: read through the tier on demand; route_local: the tier's replica)
            routes = {k: v for k, v in ev.stats()["counters"].items() if k.startswith("route_")}
            pytest.fail(f"{gone} was read ({len(got)} bytes) after its removal; the tier says "
                        f"{tier.client.tier_stat(rel)}; eval routes {routes}")
        assert (ev.mnt / "ckpt/run/step_1/.metadata").read_bytes() == b"plan"
        assert ev.stats()["counters"].get("route_tier_stat", 0) >= 1     # the marker came from the tier


def test_a_version_removed_while_its_copy_waits_for_a_stream_is_neither_announced_nor_read(tmp_path):
    """The way the test above failed under load: DCP's `.metadata.tmp` is journaled at its close
    and renamed away at once, and the follower's copy of it may be waiting for its stream (the
    folder is being streamed) when the removal record arrives. The tier went on answering
    "copying" at that version while the copy waited, and a demand read served it from the store
    reader opened for it before the rename: an eval mount read a file the store no longer had.
    A version older than a removal record of its path is neither announced nor read."""
    import errno
    from hintfs.common.clock import FakeClock
    from hintfs.common.journal import record_name, record_time_ns
    store = tmp_path / "store"
    (store / "ckpt/s1").mkdir(parents=True)
    tier = Tier(tmp_path, store, follow=False, clock=FakeClock())   # (the copy waits until stopped)
    try:
        c = tier.client
        (store / "ckpt/s1/a.bin").write_bytes(b"x" * 100)
        send_whole(c, "a", store, "ckpt/s1/a.bin")              # the folder is being streamed
        rel = "ckpt/s1/.metadata.tmp"
        (store / rel).write_bytes(b"plan")
        st = os.stat(store / rel)
        version = (st.st_size, st.st_mtime_ns)
        copier = tier.server.agent.copier
        answer: dict = {}

        def copy() -> None:
            try:
                answer["reply"] = copier.replicate(rel, 600, None, expect=version,
                                                   record=record_name(rel, *version, streamed=True))
            except OSError as err:
                answer["error"] = err

        t = threading.Thread(target=copy)
        t.start()
        assert wait_for(lambda: c.tier_stat(rel)["state"] == "copying", 10)    # waiting for its stream
        assert c.read(rel, 0, 100, replica_only=True, expect=version, demand=True) == b"plan"
        os.rename(store / rel, store / "ckpt/s1/.metadata")
        # the follower's round with the rename's removal record
        tier.server.agent.catalog.removed_from_store([(rel, record_time_ns(record_name(rel, removed=True)))])
        assert c.tier_stat(rel)["state"] == "absent"
        with pytest.raises(OSError) as err:
            c.read(rel, 0, 100, replica_only=True, expect=version, demand=True)
        assert err.value.errno == errno.ENOENT
        copier.stop()                                            # its wait ends: nothing to copy
        t.join(10)
        assert isinstance(answer.get("error"), FileNotFoundError), answer
        assert rel not in c.status()["replicas"]
    finally:
        tier.close()


def test_a_checkpoint_folder_renamed_into_place_completes_at_the_tier_under_its_new_name(mount_factory, tmp_path):
    """A job that saves into a temporary folder and renames it (Orbax; some trainers' atomic
    save): the files under the new name are journaled, so the follower copies them and the
    checkpoint completes under that name; what was streamed under the old name leaves the tier
    by the folder's removal record. Before, the renamed checkpoint never reached the tier."""
    with streaming_to_tier(mount_factory, tmp_path) as (store, tier, train):
        tmp = train.mnt / "ckpt" / "run" / "step_3.tmp"
        tmp.mkdir(parents=True)
        data = os.urandom(3 * CHUNK + 5)
        (tmp / "__0_0.distcp").write_bytes(data)
        (tmp / ".metadata").write_bytes(b"plan")
        assert wait_for(lambda: tier.client.status()["follow"]["complete"] == ["ckpt/run/step_3.tmp"], 15)
        os.rename(tmp, train.mnt / "ckpt" / "run" / "step_3")
        assert wait_for(lambda: tier.client.status()["follow"]["complete"] == ["ckpt/run/step_3"], 15)
        new = {"ckpt/run/step_3/__0_0.distcp", "ckpt/run/step_3/.metadata"}
        assert wait_for(lambda: set(tier.client.status()["replicas"]) == new, 10)
        assert tier.client.read("ckpt/run/step_3/__0_0.distcp", 0, len(data) + 1, replica_only=True) == data
        assert tier.client.read("ckpt/run/step_3/.metadata", 0, 100, replica_only=True) == b"plan"
        counters = train.stats()["counters"]
        assert counters["journal_folders"] == 1 and counters["journal_removals"] == 1


def test_a_record_that_says_streamed_makes_the_copy_wait_for_the_first_stream_of_a_folder(tmp_path):
    """The record of a folder's first file can overtake its stream's first call (a loaded host):
    a record flagged `streamed` by the writing mount makes the follower wait for that stream
    (bounded) instead of copying the file a second time; an unflagged one is copied at once."""
    from hintfs.common.journal import record_name, streamed_record
    with tier_over(tmp_path, "s1") as (store, tier):
        data = os.urandom(3 * CHUNK)
        (store / "ckpt/s1/__0_0.distcp").write_bytes(data)
        st = os.stat(store / "ckpt/s1/__0_0.distcp")
        record = record_name("ckpt/s1/__0_0.distcp", st.st_size, st.st_mtime_ns, streamed=True)
        assert streamed_record(record) and not streamed_record(record_name("ckpt/s1/x", 1, 2))
        answer: dict = {}
        t = threading.Thread(target=lambda: answer.update(tier.server.agent.copier.replicate(
            "ckpt/s1/__0_0.distcp", 600, None, expect=(st.st_size, st.st_mtime_ns), record=record).model_dump()))
        t.start()
        time.sleep(0.5)          # the stream's first call comes late
        assert t.is_alive() and tier.client.status()["copies"] == 0
        send_whole(tier.client, "a", store, "ckpt/s1/__0_0.distcp")
        t.join(10)
        assert answer.get("already") is True and tier.client.status()["copies"] == 0
        assert tier.client.read("ckpt/s1/__0_0.distcp", 0, len(data) + 1, replica_only=True) == data


def test_a_fetch_without_a_version_waits_while_a_finished_stream_becomes_the_replica(tmp_path):
    """An eval mount's fetch on open (`replicate` without a version: the journal record not seen
    yet) waits while a published stream fills. The put that brings the last chunk finishes the
    stream: it leaves the streams' table before its part is the replica (`_adopt_stream`). A
    fetch that looked in between found neither and copied the file from the store a second time
    (the bench: a data file crossed the link twice in about 4.5% of its reps). It now waits for
    the hand-over, and the stream's part is the one replica."""
    from policy.stream import chunk_crc, crcs_of
    with tier_over(tmp_path, "s1") as (store, tier):
        rel = "ckpt/s1/__0_0.distcp"
        data = os.urandom(3 * CHUNK)
        (store / rel).write_bytes(data)
        st = os.stat(store / rel)
        parts = [data[o:o + CHUNK] for o in range(0, len(data), CHUNK)]
        c = tier.client
        c.stream_open("s", 0, rel, CHUNK)
        c.stream_put("s", 0, [(0, parts[0], chunk_crc(parts[0])), (CHUNK, parts[1], chunk_crc(parts[1]))])
        assert c.stream_publish("s", 0, rel, st.st_size, st.st_mtime_ns, crcs_of(parts))["state"] == "fill"
        answer: dict = {}
        fetch = threading.Thread(target=lambda: answer.update(tier.server.agent.copier.replicate(rel, 600, None).model_dump()))
        fetch.start()
        time.sleep(0.1)
        assert fetch.is_alive()                  # waiting for the stream
        adopt = tier.server.agent.intake._adopt_stream

        def slow_adopt(*args, **kw):             # the window, widened: finished, not yet the replica
            time.sleep(0.3)
            return adopt(*args, **kw)

        tier.server.agent.intake._adopt_stream = slow_adopt
        assert c.stream_put("s", 0, [(2 * CHUNK, parts[2], chunk_crc(parts[2]))]).get("state") == "ready"
        fetch.join(10)
        assert answer.get("already") is True, answer
        assert c.status()["copies"] == 0
        assert c.read(rel, 0, len(data) + 1, replica_only=True) == data


def test_a_copy_waits_for_the_stream_of_a_file_whose_folder_is_streamed(tmp_path):
    """The follower may see a small file's journal record before its stream opens (the stream
    opens with its publish): when other files of the folder came by stream, the copy waits
    for that stream instead of sending the bytes twice; elsewhere it starts at once."""
    with tier_over(tmp_path, "s1", "plain") as (store, tier):
        c = tier.client
        (store / "ckpt/s1/a.bin").write_bytes(b"x" * 100)
        send_whole(c, "a", store, "ckpt/s1/a.bin")
        marker = b"the plan"
        (store / "ckpt/s1/.metadata").write_bytes(marker)
        ms = os.stat(store / "ckpt/s1/.metadata")
        answer: dict = {}
        t = threading.Thread(target=lambda: answer.update(c.replicate(
            "ckpt/s1/.metadata", 600, None, expect=(ms.st_size, ms.st_mtime_ns))))
        t.start()
        time.sleep(0.3)          # the record was seen; the marker's stream comes now
        send_whole(c, "m", store, "ckpt/s1/.metadata")
        t.join(10)
        assert answer.get("already") is True and c.status()["copies"] == 0
        # a folder nothing was streamed to: copied at once
        (store / "ckpt/plain/.metadata").write_bytes(marker)
        ps = os.stat(store / "ckpt/plain/.metadata")
        t0 = time.monotonic()
        assert c.replicate("ckpt/plain/.metadata", 600, None, expect=(ps.st_size, ps.st_mtime_ns))["already"] is False
        assert time.monotonic() - t0 < 0.5 and c.status()["copies"] == 1


class _SlowStatStore(LocalStore):
    """A store whose stat takes a WAN round trip or more (the eval side's view of S3)."""

    def __init__(self, root: str, delay_s: float):
        super().__init__(root)
        self.delay_s = delay_s

    def stat(self, rel):
        time.sleep(self.delay_s)
        return super().stat(rel)


def test_a_file_expected_at_the_tier_is_found_there_before_the_store_answers(tmp_path):
    """A commit marker closed on the training side reaches the tier in one WAN trip; the store
    stat takes a round trip or more. While the marker's folder is being streamed in, the tier
    says "absent, expected", waits for it on request, and an eval mount's stat takes the first
    answer: the tier's when the file arrives first, the store's otherwise (a file that does not
    exist stays ENOENT). Folders nothing is streamed into answer at once, as before."""
    from fusefs.routes import RoutedStore
    from fusefs.stats import Stats
    with tier_over(tmp_path, "s1", "plain") as (store, tier):
        c = tier.client
        (store / "ckpt/s1/a.bin").write_bytes(b"x" * 100)
        send_whole(c, "a", store, "ckpt/s1/a.bin")
        assert c.tier_stat("ckpt/s1/.metadata") == {"state": "absent", "expected": True}
        assert c.tier_stat("ckpt/plain/.metadata") == {"state": "absent"}
        t0 = time.monotonic()
        assert c.tier_stat("ckpt/plain/.metadata", appear_s=2.0) == {"state": "absent"}
        assert time.monotonic() - t0 < 0.5                      # nothing streamed there: no wait
        t0 = time.monotonic()
        assert c.tier_stat("ckpt/s1/none", appear_s=0.3)["state"] == "absent"
        assert 0.25 < time.monotonic() - t0 < 2.0               # bounded by appear_s

        marker = b"the plan"
        (store / "ckpt/s1/.metadata").write_bytes(marker)
        ms = os.stat(store / "ckpt/s1/.metadata")
        stats = Stats()
        route = parse_config({"routes": [{"prefix": "ckpt", "local_agent": tier.loc}]}).routes[0]
        view = RoutedStore(_SlowStatStore(str(store), 1.5), [route], {tier.loc: AgentClient(tier.loc)}, stats)

        def publish_marker() -> None:
            time.sleep(0.2)      # one WAN trip after the commit
            send_whole(c, "m", store, "ckpt/s1/.metadata")

        threading.Thread(target=publish_marker, daemon=True).start()
        t0 = time.monotonic()
        got = view.stat("ckpt/s1/.metadata")
        assert time.monotonic() - t0 < 1.2                      # the tier's answer, not the store's
        assert (got.size, got.mtime_ns) == (ms.st_size, ms.st_mtime_ns)
        assert stats.counters["route_stat_race_tier"] == 1

        # nothing arrives: the store's answer, ENOENT included, as without the race
        t0 = time.monotonic()
        with pytest.raises(FileNotFoundError):
            view.stat("ckpt/s1/never")
        assert 1.4 < time.monotonic() - t0 < 3.0
        (store / "ckpt/s1/only_in_store").write_bytes(b"s")
        assert view.stat("ckpt/s1/only_in_store").size == 1
        assert stats.counters["route_stat_race_store"] == 2


def test_an_older_record_of_the_same_writer_and_version_needs_no_copy(tmp_path):
    """DCP publishes a file at fsync and again at its close: two journal records of one version.
    A replica made for the later one holds what a copy for the earlier one would fetch now, so
    the follower does not copy again; a later record than the replica's is copied as before
    (it may be a rewrite within the mtime's precision), and so is one of another writer."""
    from hintfs.common.journal import later_by_same_writer, record_name
    with tier_over(tmp_path, "s1") as (store, tier):
        (store / "ckpt/s1/w.bin").write_bytes(os.urandom(3 * CHUNK))
        st = os.stat(store / "ckpt/s1/w.bin")
        version = (st.st_size, st.st_mtime_ns)
        r0, r1, r2 = (record_name("ckpt/s1/w.bin", *version, streamed=True) for _ in range(3))
        assert later_by_same_writer(r1, r0) and not later_by_same_writer(r0, r1)
        parts = r0.split("-")
        parts[2] = str(int(parts[2]) + 1)           # the same record name from another pid
        other = "-".join(parts)
        assert not later_by_same_writer(r1, other) and not later_by_same_writer(r1, "junk")
        send_whole(tier.client, "w", store, "ckpt/s1/w.bin", record=r1)
        assert tier.server.agent.copier.replicate("ckpt/s1/w.bin", 600, None, expect=version, record=r0)["already"] is True
        assert tier.client.status()["copies"] == 0
        assert tier.server.agent.copier.replicate("ckpt/s1/w.bin", 600, None, expect=version, record=r2)["already"] is False
        assert tier.client.status()["copies"] == 1


def test_the_chunks_an_eval_read_of_the_last_checkpoint_are_named_first_for_the_next(mount_factory, tmp_path):
    """The tier remembers the read hints of step 1's file (held whole there, so only remembered)
    and, when the training mount starts streaming step 2's file of the same name, names the
    chunks holding those ranges; the sender sends them first. Another job's file gets none."""
    from hintfs.client import hint_reads
    with streaming_to_tier(mount_factory, tmp_path, stream={"first_by_reads": "true"}) as (store, tier, train):
        data = os.urandom(12 * CHUNK)
        (train.mnt / "ckpt" / "run" / "step_1").mkdir(parents=True)
        (train.mnt / "ckpt" / "run" / "step_1" / "__0_0.distcp").write_bytes(data)
        rel1 = "ckpt/run/step_1/__0_0.distcp"
        assert wait_for(lambda: tier.client.tier_stat(rel1)["state"] == "ready", 10)
        ev = mount_factory(name="eval", store_uri=f"file://{store}",
                           extra=f'\n[[routes]]\nprefix = "ckpt"\nlocal_agent = "{tier.loc}"\n')
        hint_reads(str(ev.mnt), "merge", [(rel1, 9 * CHUNK + 10, 100)])
        assert wait_for(lambda: tier.client.status()["streams"]["files_read_remembered"] == 1, 10)
        # (the kernel reads 256 KiB past a hinted range: chunks 9 to 11 of 64 KiB)
        held, first = tier.client.stream_open("probe", 0, "ckpt/run/step_9/__0_0.distcp", CHUNK)
        assert held == {} and first == [9, 10, 11]
        assert tier.client.stream_open("probe2", 0, "ckpt/other/step_9/__0_0.distcp", CHUNK)[1] == []
        tier.client.stream_abort("probe")
        tier.client.stream_abort("probe2")

        (train.mnt / "ckpt" / "run" / "step_2").mkdir()
        rel2 = "ckpt/run/step_2/__0_0.distcp"
        with open(train.mnt / "ckpt" / "run" / "step_2" / "__0_0.distcp", "wb") as f:
            f.write(data[:CHUNK])               # the stream opens with its first whole chunk
            f.flush()
            assert wait_for(lambda: tier.server.agent.streams.state_of(rel2) is not None, 10)
            f.write(data[CHUNK:])
        assert wait_for(lambda: tier.client.tier_stat(rel2)["state"] == "ready", 10)
        assert tier.client.read(rel2, 0, len(data) + 1, replica_only=True) == data
        assert wait_for(lambda: train.stats()["counters"].get("stream_chunks_first") == 3, 10)


def test_a_shell_redirect_reaches_the_tier_whole(mount_factory, tmp_path):
    """The publish rule on the stream to a tier (issue 34, finding 3): bash closes the first
    descriptor of `>` before any byte is written (a FLUSH) and writes through the dup; the tier's
    replica is the whole file, never the empty file of that first close."""
    import subprocess
    with streaming_to_tier(mount_factory, tmp_path) as (store, tier, train):
        ck = train.mnt / "ckpt" / "run" / "step_2"
        ck.mkdir(parents=True)
        subprocess.run(["bash", "-c", f"head -c 300000 /dev/urandom > {ck}/shard.bin; echo hello > {ck}/.metadata"],
                       check=True, timeout=60)
        data = (store / "ckpt/run/step_2/shard.bin").read_bytes()
        assert len(data) == 300000 and (store / "ckpt/run/step_2/.metadata").read_bytes() == b"hello\n"
        for rel, want in (("ckpt/run/step_2/shard.bin", data), ("ckpt/run/step_2/.metadata", b"hello\n")):
            st = os.stat(store / rel)
            assert wait_for(lambda: tier.client.has(rel, st.st_size, st.st_mtime_ns), 10), tier.client.tier_stat(rel)
            assert tier.client.read(rel, 0, len(want) + 10, replica_only=True) == want

"""Write-time streaming under faults, through real processes (issue 15; docs/cross_dc.md, "Faults"):
the training mount SIGKILLed mid-stream, the tier agent SIGKILLed mid-stream, the link cut for
2 s mid-file, a file rewritten while streaming, a file unlinked before close. After each, eval
reads (an eval mount routing `ckpt` to the tier) return the store's published bytes or wait;
never torn or unpublished data, and the writer never waits for the link."""
from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path

import pytest

from hintfs.agent.client import AgentClient
from tests.conftest import needs_fuse, wait_for
from tests.helpers.agent_process import AgentProcess
from tests.system.test_stream_mount import CHUNK, Tier, stream_toml, streaming_to_tier

pytestmark = needs_fuse

PATH = "ckpt/run/step_1/__0_0.distcp"


def _held(client: AgentClient) -> int:
    return client.status()["streams"]["bytes_held"]


def _progress_chunks(tier: Path) -> int:
    """Chunks the tier's stream progress files list (`hintfs.agent.streams`: what a restarted
    agent adopts and the sender is not asked for again)."""
    n = 0
    for p in tier.rglob("stream-*.part.progress"):
        try:
            n += len(json.loads(p.read_text())["held"])
        except (OSError, ValueError, KeyError):   # (being replaced: read it at the next try)
            pass
    return n


def _eval_mount(mount_factory, store, loc: str, name: str = "eval", token_file=None):
    extra = f'\n[[routes]]\nprefix = "ckpt"\nlocal_agent = "{loc}"\nstream_wait_s = 1\n'
    if token_file:
        extra = f'\n[agents]\ntoken_file = "{token_file}"\n' + extra
    return mount_factory(name=name, store_uri=f"file://{store}", extra=extra)


def test_a_training_mount_killed_mid_stream_leaves_nothing_servable(mount_factory, tmp_path):
    with streaming_to_tier(mount_factory, tmp_path, follow=False, stream_idle_s=1.5, reclaim_interval_s=0.2) as (store, tier, train):
        (train.mnt / "ckpt/run/step_1").mkdir(parents=True)
        f = open(train.mnt / PATH, "wb")
        f.write(os.urandom(8 * CHUNK))
        f.flush()
        assert wait_for(lambda: _held(tier.client) >= 8 * CHUNK, 10)
        os.kill(train.pid, signal.SIGKILL)
        try:
            f.close()
        except OSError:
            pass                                   # the mount is gone under the writer
        assert tier.client.tier_stat(PATH)["state"] == "streaming"   # held, never served
        with pytest.raises(OSError):
            tier.client.read(PATH, 0, 10, replica_only=True)
        # nobody calls: the tier drops the stream after stream_idle_s
        assert wait_for(lambda: tier.client.tier_stat(PATH)["state"] == "absent", 10)
        streams = tier.client.status()["streams"]
        assert {k: streams[k] for k in ("open", "published", "bytes_held", "first_chunks", "files_read_remembered")} \
            == {"open": 0, "published": 0, "bytes_held": 0, "first_chunks": 0, "files_read_remembered": 0}
        assert streams["bytes_counted"] == 0      # its bytes left the budget with it
        assert all(u["open"] == 0 and u["bytes"] == 0 for u in streams["by_sender"].values()), streams
        assert not [p for p in (tmp_path / "tier").rglob("stream-*")]
        ev = _eval_mount(mount_factory, store, tier.loc)
        with pytest.raises(FileNotFoundError):     # the store never got the file
            (ev.mnt / PATH).read_bytes()


def test_a_tier_agent_killed_mid_stream_is_adopted_and_only_the_rest_is_sent(mount_factory, tmp_path):
    store = tmp_path / "train" / "store"
    store.mkdir(parents=True)
    agent = AgentProcess(tmp_path, store, agent_extra='reclaim_interval_s = 0.2\nstream_prefixes = ["ckpt"]\n')
    client = agent.start()
    try:
        train = mount_factory(name="train", extra=stream_toml(agent.location) + f'token_file = "{agent.token_file}"\n')
        (train.mnt / "ckpt/run/step_1").mkdir(parents=True)
        data = os.urandom(24 * CHUNK + 99)
        with open(train.mnt / PATH, "wb") as f:
            f.write(data[: 12 * CHUNK])
            f.flush()
            assert wait_for(lambda: _held(client) >= 12 * CHUNK, 10)
            # a progress file lists them (every progress_every_s, 0.5 s): what a restart adopts
            # (a fixed 1 s sleep here was too short once under a loaded make test)
            assert wait_for(lambda: _progress_chunks(tmp_path / "tier") >= 12, 30)
            agent.kill()
            t0 = time.monotonic()
            f.write(data[12 * CHUNK:])             # the writer goes on; nothing waits for the tier
        assert time.monotonic() - t0 < 2.0
        assert (store / PATH).read_bytes() == data  # published in the store meanwhile
        client = agent.start()                     # same port, same data_dir: adopts the stream
        st = os.stat(store / PATH)
        assert wait_for(lambda: client.has(PATH, st.st_size, st.st_mtime_ns), 30), agent.log.read_text()[-2000:]
        assert client.read(PATH, 0, len(data) + 1, replica_only=True) == data
        assert "adopted 1 write-time streams" in agent.log.read_text()
        assert client.status()["copies"] == 0      # the stream made the replica, not a copy
        # (the sender reports its counters just after the tier's answer)
        assert wait_for(lambda: "stream_bytes_sent" in train.stats()["counters"], 10)
        sent = train.stats()["counters"]["stream_bytes_sent"]
        assert sent <= len(data) + 8 * CHUNK, sent  # the adopted chunks were not sent again
        ev = _eval_mount(mount_factory, store, agent.location, token_file=agent.token_file)
        assert (ev.mnt / PATH).read_bytes() == data
    finally:
        agent.stop()


def test_a_link_cut_for_two_seconds_mid_file_resumes_and_the_writer_never_waits(mount_factory, tmp_path):
    from tests.helpers.wan import Relay
    store = tmp_path / "train" / "store"
    store.mkdir(parents=True)
    tier = Tier(tmp_path, store, follow=False)
    relay = Relay(("127.0.0.1", tier.server.port), 0.005, 8e6)   # 8 MB/s: the file takes ~1 s
    port = relay.start()
    try:
        train = mount_factory(name="train", extra=stream_toml(f"grpc://127.0.0.1:{port}"))
        ev = _eval_mount(mount_factory, store, tier.loc)
        (train.mnt / "ckpt/run/step_1").mkdir(parents=True)
        data = os.urandom(128 * CHUNK + 5)
        with open(train.mnt / PATH, "wb") as f:
            f.write(data[: 64 * CHUNK])
            f.flush()
            assert wait_for(lambda: _held(tier.client) >= 8 * CHUNK, 10)
            relay.stop()                           # the link is cut ...
            t0 = time.monotonic()
            f.write(data[64 * CHUNK:])
        assert time.monotonic() - t0 < 1.0         # the writer did not wait for the link
        # during the cut: the store has the file; the eval side reads it whole, old or new, never torn
        assert (ev.mnt / PATH).read_bytes() == data
        time.sleep(max(0.0, 2.0 - (time.monotonic() - t0)))
        relay = Relay(("127.0.0.1", tier.server.port), 0.005, 8e6, listen_port=port)   # ... and back
        relay.start()
        st = os.stat(store / PATH)
        assert wait_for(lambda: tier.client.has(PATH, st.st_size, st.st_mtime_ns), 30)
        assert tier.client.read(PATH, 0, len(data) + 1, replica_only=True) == data
        assert tier.client.status()["streams"]["published"] == 1
        assert (ev.mnt / PATH).read_bytes() == data
    finally:
        relay.stop()
        tier.close()


def test_a_file_rewritten_while_streaming_is_served_whole_old_or_new(mount_factory, tmp_path):
    with streaming_to_tier(mount_factory, tmp_path, follow=False) as (store, tier, train):
        (train.mnt / "ckpt/run/step_1").mkdir(parents=True)
        # (a) a chunk already sent is rewritten in place before close: the final CRCs catch it
        v1 = bytearray(os.urandom(10 * CHUNK))
        fd = os.open(train.mnt / PATH, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, v1)
        assert wait_for(lambda: _held(tier.client) >= 10 * CHUNK, 10)
        patch = os.urandom(100)
        os.pwrite(fd, patch, CHUNK + 10)
        v1[CHUNK + 10:CHUNK + 110] = patch
        os.close(fd)
        st = os.stat(store / PATH)
        assert wait_for(lambda: tier.client.has(PATH, st.st_size, st.st_mtime_ns), 10)
        assert tier.client.read(PATH, 0, len(v1) + 1, replica_only=True) == bytes(v1)
        # (b) opened again with O_TRUNC and rewritten: a new generation; until its publish the tier
        # serves the previous version whole, then the new one
        ev = _eval_mount(mount_factory, store, tier.loc)
        v2 = os.urandom(7 * CHUNK + 3)
        with open(train.mnt / PATH, "wb") as f:
            f.write(v2[: 5 * CHUNK])
            f.flush()
            time.sleep(0.3)
            assert tier.client.tier_stat(PATH)["size"] == len(v1)          # still v1, whole
            assert tier.client.read(PATH, 0, len(v1) + 1, replica_only=True) == bytes(v1)
            f.write(v2[5 * CHUNK:])
        st = os.stat(store / PATH)
        assert wait_for(lambda: tier.client.has(PATH, st.st_size, st.st_mtime_ns), 10)
        assert tier.client.read(PATH, 0, len(v2) + 1, replica_only=True) == v2
        assert (ev.mnt / PATH).read_bytes() == v2
        assert tier.client.status()["streams"]["open"] == 0


def test_a_file_unlinked_before_close_is_dropped_at_the_tier(mount_factory, tmp_path):
    with streaming_to_tier(mount_factory, tmp_path, follow=False) as (store, tier, train):
        (train.mnt / "ckpt/run/step_1").mkdir(parents=True)
        with open(train.mnt / PATH, "wb") as f:
            f.write(os.urandom(6 * CHUNK))
            f.flush()
            assert wait_for(lambda: _held(tier.client) >= 6 * CHUNK, 10)
            os.unlink(train.mnt / PATH)
            f.write(os.urandom(CHUNK))
        assert wait_for(lambda: tier.client.status()["streams"]["open"] == 0, 10)
        assert tier.client.tier_stat(PATH)["state"] == "absent"
        assert tier.client.status()["streams"]["published"] == 0
        assert not (store / PATH).exists()
        with pytest.raises(OSError) as err:
            tier.client.read(PATH, 0, 10, replica_only=True)
        assert err.value.errno in (errno.ENOENT, errno.EIO, errno.ESTALE)
        assert train.stats()["counters"].get("streams_published", 0) == 0

"""hintfs/agent/streams.py in a process that is SIGKILLed while chunks arrive (a building block of
write-time streaming, not wired into the agent yet): a new tier adopts the stream; every chunk the
killed one acknowledged is listed as held with its bytes on disk, so the sender re-sends only the
rest, and the publish is verified against the whole file."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from hintfs.agent.streams import StreamTier
from policy.stream import chunk_crc, crcs_of
from tests.conftest import REPO

CHUNK = 64 << 10

CHILD = textwrap.dedent("""
    import sys, time
    from hintfs.agent.streams import StreamTier
    from policy.stream import chunk_crc
    folder, src, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tier = StreamTier(folder, time.monotonic, persistent=True, progress_every_s=0)
    tier.open("s1", 2, "ckpt/job/step_1/__0_0.distcp", chunk, job="ckpt/job")
    data = open(src, "rb").read()
    for off in range(0, len(data), chunk):
        piece = data[off:off + chunk]
        tier.put("s1", 2, off, piece, chunk_crc(piece))
        print(off, flush=True)            # acknowledged: the sender may forget this chunk
        time.sleep(0.01)
    time.sleep(60)
""")


def test_a_tier_killed_mid_stream_is_adopted_with_every_acknowledged_chunk(tmp_path):
    data = os.urandom(40 * CHUNK + 777)
    src = tmp_path / "src"
    src.write_bytes(data)
    old = tmp_path / "old"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(old), str(src), str(CHUNK)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    acked = []
    try:
        deadline = time.monotonic() + 60
        while len(acked) < 12 and time.monotonic() < deadline:
            acked.append(int(child.stdout.readline()))
        os.kill(child.pid, signal.SIGKILL)    # mid-stream: the next chunks were on their way
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close()
    assert len(acked) == 12
    new = StreamTier(str(tmp_path / "new"), time.monotonic, persistent=True)
    try:
        assert new.adopt(str(old)) == 1
        held = new.open("s1", 2, "ckpt/job/step_1/__0_0.distcp", CHUNK)
        assert {off // CHUNK for off in acked} <= set(held)
        assert new.streaming("ckpt/job/step_1/__0_0.distcp")
        for i in range(0, len(data), CHUNK):      # the sender: only what the tier does not hold
            if i // CHUNK not in held:
                new.put("s1", 2, i, data[i:i + CHUNK], chunk_crc(data[i:i + CHUNK]))
        chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]
        v, part = new.publish("s1", 2, "ckpt/job/step_1/__0_0.distcp", len(data), 1, crcs_of(chunks))
        assert v.state == "ready", v
        with open(part, "rb") as f:
            assert f.read() == data
    finally:
        new.close()

"""bench/send_floor.py, the floor sender of `cross_dc_eval.py --floor-sender`: every byte of every
file crosses, its CRC pass runs, and the pace holds."""
import json
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.ports import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "send_floor.py"


def test_the_floor_sender_sends_every_byte_at_its_pace(tmp_path):
    files = []
    for i, size in enumerate((3 << 20, 5, 0)):    # chunks and a tail, a tiny file, an empty one
        f = tmp_path / f"f{i}"
        f.write_bytes(bytes([i + 1]) * size)
        files.append(str(f))
    port = free_port()
    sink = subprocess.Popen([sys.executable, str(SCRIPT), "sink", str(port), "1"], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        rate = 20 << 20      # bytes/s: the 3 MiB file's chunks leave at 0, 50 and 100 ms
        send = subprocess.Popen([sys.executable, str(SCRIPT), "send", str(port), "0", str(rate), *files],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert send.stdout.readline().strip() == "ready"
        t0 = time.time()
        out, _ = send.communicate("go\n", timeout=30)
        res = json.loads(out)
        assert res["done"] - t0 >= 0.09       # not faster than the rate
        assert send.returncode == 0
        assert res["bytes"] == (3 << 20) + 5
        assert sink.wait(timeout=10) == 0     # it read the one connection to its end
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()


def test_bad_arguments_are_refused_with_the_usage():
    r = subprocess.run([sys.executable, str(SCRIPT), "send", "1"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "send PORT NICE RATE FILE" in r.stderr

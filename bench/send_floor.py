"""The least a write-time sender can cost the writer's CPU: a diagnostic for bench/cross_dc_eval.py
(`--floor-sender`), not a data path of hintfs.

`send` sends files over one TCP connection the cheapest way a correct streamer could: each 1 MiB
chunk's CRC-32C computed on the page cache through `mmap` (no copy into the process), then the
chunk handed to the kernel with `sendfile` (no copy through user space either). No framing, no
protocol, no second pass at the publish. It runs as the stream sender does (`[stream]
sender_nice`: a session and autogroup of its own at that niceness), on the CPUs it inherits, and
waits for a line on stdin before it starts, so that its start-up is not charged to the write.
Through the bench's emulated link (the relay) TCP paces it; straight to the sink it paces itself
at RATE, so that the emulated link's own CPU is left out.
It prints one JSON line: its CPU seconds, the bytes sent, and when it finished.

`sink` accepts COUNT connections on loopback, one after the other, and reads each to the end
(the eval DC's side).

    python bench/send_floor.py sink PORT COUNT
    python bench/send_floor.py send PORT NICE RATE FILE...   (RATE in bytes/s, 0: as fast as TCP goes)
"""
from __future__ import annotations

import json
import mmap
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fusefs.stream.sender import nice_against_the_job  # noqa: E402  (the repo, just put on the path)
from policy.stream import chunk_crc  # noqa: E402

CHUNK = 1 << 20


def send(port: int, nice: int, files: list[str], rate_bytes_s: float = 0.0) -> dict:
    nice_against_the_job(nice)
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.settimeout(None)                      # blocking: sendfile waits for the link's window
    print("ready", flush=True)
    sys.stdin.readline()                       # "go": the write starts
    cpu0 = time.process_time()
    t0 = time.monotonic()
    sent = 0
    for name in files:
        with open(name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                continue
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
                view = memoryview(m)
                try:
                    for off in range(0, size, CHUNK):
                        n = min(CHUNK, size - off)
                        chunk_crc(view[off:off + n])
                        if rate_bytes_s:   # paced as the link would: no faster than its rate
                            ahead = (sent + off) / rate_bytes_s - (time.monotonic() - t0)
                            if ahead > 0:
                                time.sleep(ahead)
                        done = 0
                        while done < n:
                            done += os.sendfile(sock.fileno(), f.fileno(), off + done, n - done)
                finally:
                    view.release()
            sent += size
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)                               # the sink's close: every byte crossed
    sock.close()
    return {"cpu_s": round(time.process_time() - cpu0, 4), "bytes": sent, "done": time.time()}


def sink(port: int, count: int) -> None:
    buf = bytearray(1 << 20)
    with socket.create_server(("127.0.0.1", port)) as srv:
        print("ready", flush=True)
        for _ in range(count):
            conn, _ = srv.accept()
            with conn:
                while conn.recv_into(buf):
                    pass


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "sink":
        sink(int(argv[1]), int(argv[2]))
        return 0
    if len(argv) >= 5 and argv[0] == "send":
        print(json.dumps(send(int(argv[1]), int(argv[2]), argv[4:], float(argv[3]))), flush=True)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

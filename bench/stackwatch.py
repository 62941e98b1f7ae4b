"""Loader for bench/stackwatch.c (a diagnostic of bench/gpu_sharing.py --diag): samples every
thread of this process while a governor command waits unseen, or an abort waits to be handled.

    w = StackWatch(slot, thresh_ms=2.5, period_ms=1.0)   # slot: the trainer's governor slot
    w.raised(); ...; w.handled()                        # the trainer's abort, raised / handled
    w.stop(); w.dump(path)                              # one JSON line per thread sample
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

SRC = Path(__file__).with_name("stackwatch.c")


def _build() -> Path:
    src = SRC.read_bytes()
    out = Path(tempfile.gettempdir()) / f"stackwatch-{hashlib.sha256(src).hexdigest()[:12]}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-g", "-shared", "-fPIC", "-o", str(tmp),
                        str(SRC), "-ldl", "-lpthread"], check=True)
        os.rename(tmp, out)
    return out


class StackWatch:
    def __init__(self, slot: np.ndarray, w_cmd_t: int, w_detect: int, thresh_ms: float = 2.5,
                 period_ms: float = 1.0, max_rounds: int = 40, capacity: int = 40000) -> None:
        self.lib = ctypes.CDLL(str(_build()))
        self.slot = slot
        # abort raised at, handled at (monotonic ns); the threads whose user stacks are always
        # taken (the trainer's main and backward threads; others only when running)
        self.words = np.zeros(4, dtype=np.uint64)
        base = slot.ctypes.data
        p = ctypes.c_void_p
        self.lib.sw_start.argtypes = [p, p, p, p, p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int,
                                      ctypes.c_int]
        self.lib.sw_dump.argtypes = [ctypes.c_char_p]
        a = self.words.ctypes.data
        rc = self.lib.sw_start(base + 8 * w_cmd_t, base + 8 * w_detect, a, a + 8, a + 16,
                               int(thresh_ms * 1e6), int(period_ms * 1e6), max_rounds, capacity)
        if rc != 0:
            raise OSError(f"stackwatch start failed: {rc}")

    def raised(self, t_ns: int) -> None:
        self.words[0] = t_ns

    def handled(self, t_ns: int) -> None:
        self.words[1] = t_ns

    def thread(self, i: int, tid: int) -> None:
        """Always take thread `tid`'s user stack (i: 0 or 1)."""
        self.words[2 + i] = tid

    def stop(self) -> int:
        return int(self.lib.sw_stop())

    def dump(self, path: str | Path) -> int:
        return int(self.lib.sw_dump(str(path).encode()))


def symbolize(paths: list[str]) -> dict[str, str]:
    """'lib+0xoff' -> 'function (file:line)' for frames dladdr could not name (static functions),
    by addr2line where the libraries are; run on the machine that made the samples."""
    import json
    import shutil
    want: dict[str, set[str]] = {}
    for p in paths:
        for line in Path(p).read_text().splitlines():
            for f in json.loads(line)["frames"]:
                if " " in f or "+0x" not in f:
                    continue
                lib, off = f.rsplit("+", 1)
                want.setdefault(lib, set()).add(off)
    out: dict[str, str] = {}
    if not shutil.which("addr2line"):
        return out
    for lib, offs in want.items():
        offs = sorted(offs)
        if not Path(lib).exists():
            continue
        r = subprocess.run(["addr2line", "-f", "-C", "-e", lib, *offs], capture_output=True, text=True)
        lines = r.stdout.splitlines()
        for i, off in enumerate(offs):
            if 2 * i + 1 < len(lines):
                out[f"{lib}+{off}"] = f"{lines[2 * i]} ({lines[2 * i + 1]})"
    return out


if __name__ == "__main__":
    import json
    import sys
    if sys.argv[1:2] == ["symbolize"]:
        print(json.dumps(symbolize(sys.argv[2:]), indent=0))

"""Holding a mount's staging files open (bench/cross_dc_eval.py's `--hold-staging` diagnostic), so
their pages outlive the mount's unlink of them."""
from __future__ import annotations

import os
import threading


class StagingHolder:
    """--hold-staging (a diagnostic): hold every staging file a training mount opens during the
    write until the commit, as a stream sender holds its descriptor on each file until it has
    sent and published it. The copy-after-close mount then frees no staging pages during the
    write either, which isolates what the held pages cost the next file's writes. A thread polls
    the mount's descriptors every 5 ms and opens each new staging file by /proc/PID/fd/N."""

    def __init__(self, pid: int | None):
        self.pid = pid
        self.held: dict[int, int] = {}      # inode -> our descriptor
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        if pid is not None:
            self.thread.start()

    def _poll(self) -> None:
        fd_dir = f"/proc/{self.pid}/fd"
        while not self.stop.wait(0.005):
            try:
                names = os.listdir(fd_dir)
            except OSError:
                return
            for n in names:
                try:
                    if "/.hintfs-tmp." not in os.readlink(f"{fd_dir}/{n}"):   # hintfs.common.paths.STAGING_PREFIX
                        continue
                    fd = os.open(f"{fd_dir}/{n}", os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue
                ino = os.fstat(fd).st_ino
                if ino in self.held:
                    os.close(fd)
                else:
                    self.held[ino] = fd

    def release(self) -> int:
        """Stop, close every held file; how many were held."""
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(5)
        for fd in self.held.values():
            os.close(fd)
        return len(self.held)

"""The stream sender process (`[stream] sender = "process"`, docs/cross_dc.md "The sender
process"): a child of the mount that runs `fusefs.streamtap.StreamTap` (the pump, the streamers,
their Flight connections) away from the mount's CPU priority and Python lock.

Started by `fusefs.streamproc.StreamProcess` as `python -I -m fusefs.streamchild FD`: its setup
document (the `[stream]` table, the tier token, TLS roots, logging) comes on stdin; the mount's
hooks come on the SEQPACKET socket FD (`fusefs.streamwire`), in the order the mount called them,
a staging file's descriptor beside a `start`. It answers with counters (`stat`) and the streams
it is done with (`finished`, with the generation it last started, so that the mount never
forgets a file started again meanwhile).

When the mount goes (its end of the socket closes: unmounted, or killed) the process exits at
once, as the mount's own send threads would; a clean unmount sends `close` first, which gives
published files `timeout_s` to reach the tiers.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import socket
import sys
from typing import Any, Optional

from common.logsetup import setup_logging
from common.procs import become_isolated_daemon
from fusefs.streamtap import StreamTap, build_streamers
from fusefs.streamwire import WireError, next_message, send
from mountconfig.schema import StreamConfig
from stores.base import Stat

log = logging.getLogger("hintfs.streamchild")


class ForwardedStats:
    """`Stats.add` for the tap: each counter goes to the mount's own `Stats`."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def add(self, counter: str, n: int = 1) -> None:
        try:
            send(self.sock, {"op": "stat", "name": counter, "n": n})
        except OSError:
            pass                  # the mount is gone: the main loop exits on its end's close


def _stat(doc: dict) -> Stat:
    """The version the mount published (only size and mtime matter to a stream)."""
    return Stat(mode=0o100644, size=int(doc["size"]), mtime_ns=int(doc["mtime_ns"]), ctime_ns=int(doc["mtime_ns"]))


def _record(doc: dict) -> Optional[str]:
    record = doc.get("record")
    return record if isinstance(record, str) else None


class Child:
    def __init__(self, sock: socket.socket, sc: StreamConfig, token: Optional[str], tls_root: Optional[bytes]):
        self.sock = sock
        self.seqs: dict[int, int] = {}      # stream number -> the last `start` applied (under tap.cond)
        self.tap = StreamTap(sc, build_streamers(sc, token, tls_root), ForwardedStats(sock),
                             on_finished=self._finished)

    def _finished(self, key: Any) -> None:
        """(the tap calls it under its `cond`)"""
        if isinstance(key, int):            # (a renamed file's copy is the child's own)
            try:
                send(self.sock, {"op": "finished", "n": key, "seq": self.seqs.pop(key, 0)})
            except OSError:
                pass

    def apply(self, doc: dict, fd: Optional[int]) -> None:
        op, tap = doc["op"], self.tap
        if op == "start":
            if fd is None:
                raise WireError(22, "start without a staging file")
            n = int(doc["n"])
            with tap.cond:      # (an RLock) so that a stream finishing now reports the older start
                self.seqs[n] = int(doc["seq"])
                tap.started(n, str(doc["path"]), fd)
        elif op == "published":
            tap.published(int(doc["n"]), str(doc["path"]), _stat(doc), _record(doc), bool(doc["final"]))
        elif op == "released":
            tap.released(int(doc["n"]))
        elif op == "dropped":
            tap.dropped(int(doc["n"]))
        elif op == "renamed":
            tap.renamed(int(doc["n"]), str(doc["path"]), _stat(doc), _record(doc))
        elif op == "restream":
            if fd is None:
                raise WireError(22, "restream without the file's copy")
            tap.add_published(str(doc["path"]), fd, int(doc["size"]), int(doc["mtime_ns"]), _record(doc))
        else:
            raise WireError(22, f"unknown op {op!r}")

    def serve(self) -> float:
        """Apply the mount's messages until `close` (its timeout) or the mount is gone (-1)."""
        while True:
            msg = next_message(self.sock)
            if msg is None:
                return -1.0
            doc, fd = msg
            try:
                if doc["op"] == "close":
                    return float(doc.get("timeout_s", 10.0))
                self.apply(doc, fd)
            except (KeyError, TypeError, ValueError, OSError) as err:
                log.error("stream sender: message %s refused: %s", doc.get("op"), err)
            finally:
                if fd is not None:
                    os.close(fd)    # the tap keeps its own dups


def pin_to(cpus: list[int]) -> bool:
    """Run this process on `cpus` (`[stream] sender_cpus`); a set the kernel refuses (none of
    them in this cgroup's) leaves it on the mount's CPUs, with a warning."""
    try:
        os.sched_setaffinity(0, cpus)
        return True
    except OSError as err:
        log.warning("stream sender: cannot run on CPUs %s (%s); it runs on the mount's %s",
                    cpus, err, sorted(os.sched_getaffinity(0)))
        return False


def cpu_cgroup(proc_cgroup: str) -> Optional[str]:
    """The cgroup of the CPU controller ("/" at the root) in a `/proc/PID/cgroup` text, None if
    it names none: cgroup v1's cpu hierarchy if mounted, else v2's unified one."""
    unified = None
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
        if controllers == "":
            unified = path
    return unified


def nice_against_the_job(nice: int) -> bool:
    """Make the sender's niceness count against the job's processes, not only the mount's
    threads; True if it now does (docs/cross_dc.md "The sender process").

    Niceness only orders the threads of one scheduling group. With autogroup (the kernel's
    default outside cpu cgroups) each session is a group and busy groups share a CPU equally:
    the mount leads a session of its own, so a nice-10 sender in it took half of a CPU the job
    wanted. The sender therefore leads a session of its own, and that session's group gets the
    niceness (`/proc/self/autogroup`; raising it needs no privilege). In a cpu cgroup (a systemd
    service) autogroups do not apply: the cgroup shares CPU with the job's by weight."""
    if nice <= 0:
        return False    # nice 0: the sender shares the mount's group, as the mount's threads would
    try:
        os.setsid()     # (refused only to a group leader; the mount's child is none)
    except OSError as err:
        log.warning("stream sender: no session of its own (%s): sender_nice orders it against the "
                    "mount's threads only", err)
        return False
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError as err:   # a kernel without autogroup: niceness compares with every process
        log.debug("stream sender: no autogroup (%s)", err)
        return True
    try:
        with open("/proc/self/cgroup") as f:
            group = cpu_cgroup(f.read())
    except (OSError, ValueError):
        group = None
    if group not in (None, "/"):
        log.info("stream sender: in cgroup %s, where autogroups may not apply: sender_nice may order the "
                 "sends against the mount's threads only; sender_cpus or the cgroup's CPU weight keep "
                 "them off the job's CPUs", group)
        return False
    return True


def main(argv: list[str]) -> int:
    # Started isolated (`python -I`) by the mount, which runs in /; a child started otherwise
    # is made so before it reads anything (common.procs): the socket fd and stdin stay.
    become_isolated_daemon("fusefs.streamchild", argv[1:])
    sock = socket.socket(fileno=int(argv[1]))
    setup = json.loads(sys.stdin.buffer.read())
    setup_logging(setup.get("log_level", "INFO"), setup.get("log_file"))
    sc = StreamConfig.model_validate(setup["stream"])
    os.setpriority(os.PRIO_PROCESS, 0, sc.sender_nice)   # before any thread: they all inherit it
    nice_against_the_job(sc.sender_nice)
    if sc.sender_cpus:
        pin_to(sc.sender_cpus)                              # the same: every thread after this
    tls_root = base64.b64decode(setup["tls_root"]) if setup.get("tls_root") else None
    child = Child(sock, sc, setup.get("token"), tls_root)
    timeout_s = child.serve()
    if timeout_s < 0:
        # The mount is gone without a word (killed): stop now, as its own threads would have.
        # The tiers drop the unpublished streams when they go idle; the follower copies the rest.
        os._exit(0)
    child.tap.close(timeout_s)
    try:
        send(sock, {"op": "closed"})
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

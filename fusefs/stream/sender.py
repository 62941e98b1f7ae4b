"""The stream sender child (`[stream] sender = "process"`, docs/cross_dc.md "The sender
process"): a child of the mount that runs a `fusefs.stream.threads.ThreadSink` (the pump, the
streamers, their Flight connections) away from the mount's CPU priority and Python lock.

Started by `fusefs.stream.process.ProcessSink` as `python -I -m fusefs.stream.sender FD` in `/`:
its setup document (the `[stream]` table, the tier token, TLS roots, logging) comes on stdin; the
hooks' commands come on the SEQPACKET socket FD (`fusefs.stream.wire`), in the order the mount
gave them, a staging file's descriptor beside a `start` (a renamed file's copy beside a
`restream`). It answers with counters (`stat`) and the streams it is done with (`finished`, with
the start it last applied, so that the mount never forgets a file started again meanwhile).

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

from hintfs.common.logsetup import setup_logging
from hintfs.common.procs import become_isolated_daemon
from fusefs.stream.flight import build_streamers
from fusefs.stream.hooks import Version
from fusefs.stream.threads import ThreadSink
from fusefs.stream.wire import WIRE_VERSION, WireError, mount_refusal, next_message, send
from mountconfig.schema import StreamConfig

log = logging.getLogger("hintfs.streamchild")


class ForwardedStats:
    """`Stats.add` for the sink: each counter goes to the mount's own `Stats`."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def add(self, counter: str, n: int = 1) -> None:
        try:
            send(self.sock, {"op": "stat", "name": counter, "n": n})
        except OSError:
            pass                  # the mount is gone: the main loop exits on its end's close


def _version(doc: dict) -> Version:
    """The version the mount published (only size and mtime matter to a stream), and its record."""
    record = doc.get("record")
    return Version(int(doc["size"]), int(doc["mtime_ns"]), record if isinstance(record, str) else None)


class Child:
    def __init__(self, sock: socket.socket, sc: StreamConfig, token: str | None, tls_root: bytes | None):
        self.sock = sock
        self.sink = ThreadSink(sc, build_streamers(sc, token, tls_root), ForwardedStats(sock),
                               on_finished=self._finished)

    def _finished(self, key: int, seq: int) -> None:
        """(the sink calls it under its `cond`)"""
        try:
            send(self.sock, {"op": "finished", "n": key, "seq": seq})
        except OSError:
            pass

    def apply(self, doc: dict, fd: int | None) -> None:
        op, sink = doc["op"], self.sink
        if op == "start":
            if fd is None:
                raise WireError(22, "start without a staging file")
            sink.start(int(doc["n"]), int(doc["seq"]), str(doc["path"]), fd)
        elif op == "moved":
            sink.moved(int(doc["n"]), str(doc["path"]))
        elif op == "publish":
            sink.publish(int(doc["n"]), str(doc["path"]), _version(doc))
        elif op == "drop":
            sink.drop(int(doc["n"]))
        elif op == "restream":
            if fd is None:
                raise WireError(22, "restream without the file's copy")
            sink.add_published(str(doc["path"]), fd, _version(doc))
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
                    os.close(fd)    # the sink keeps its own dups


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


def cpu_cgroup(proc_cgroup: str) -> str | None:
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
    # is made so before it reads anything (hintfs.common.procs): the socket fd and stdin stay.
    become_isolated_daemon("fusefs.stream.sender", argv[1:])
    sock = socket.socket(fileno=int(argv[1]))
    setup = json.loads(sys.stdin.buffer.read())
    setup_logging(setup.get("log_level", "INFO"), setup.get("log_file"))
    why = mount_refusal(setup)
    if why:                  # a mount of another version (docs/versions.md): one line, then gone
        log.error("%s", why)
        send(sock, {"op": "refused", "why": why, "wire": WIRE_VERSION})
        return 3
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
    child.sink.close(timeout_s)
    try:
        send(sock, {"op": "closed"})
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

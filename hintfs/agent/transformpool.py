"""The transform workers of the agent's samples (hintfs/agent/samples.py): processes (forkserver), each
fed one task at a time, killed and replaced past a task's time limit or when they die, each under
an address-space cap for its sample (docs/transforms.md)."""
from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future
from collections.abc import Callable

from hintfs.transforms.errors import TransformError, TransformTimeout, WorkerDied

log = logging.getLogger("hintfs.samples")

AS_SLACK = 256 << 20        # address space a worker may use above its baseline + 3x max_decoded_bytes
KILL_GRACE_S = 1.0          # the pool kills a worker this long after the sample's time_limit_s


@contextlib.contextmanager
def _address_space_cap(extra: int):
    """Cap this process's address space at its current size + ``extra`` bytes (Linux), so a
    decode that slips past the header checks fails with MemoryError instead of growing."""
    try:
        import resource
        with open("/proc/self/statm") as f:
            vms = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        old = resource.getrlimit(resource.RLIMIT_AS)
        cap = vms + extra
        if old[1] != resource.RLIM_INFINITY:
            cap = min(cap, old[1])
        resource.setrlimit(resource.RLIMIT_AS, (cap, old[1]))
    except (OSError, ValueError, ImportError):
        yield
        return
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


def transform_to_container(kind: str, raw: bytes, params_json: str, aug_seed: int, meta: dict) -> bytes:
    """Runs in a worker process: decode + transform + encode the `.tensor` bytes, with the
    address space capped for the sample's `max_decoded_bytes`. With `meta["check_only"]`: only
    whether the source decodes (`transforms.check_decodes`, before a raw container goes out);
    returns b"" or raises as the transform would. With `meta["work_only"]` (a video): its decode
    work from its index, demuxed and not decoded, as JSON `[codec, frames to decode x megapixels]`
    (`SampleService._index_new`: the agent never demuxes media in its own process)."""
    from hintfs import transforms
    import hintfs.transforms.image  # noqa: F401  (loads av and FFmpeg's libraries before the cap)
    import hintfs.transforms.video  # noqa: F401
    from hintfs.transforms.container import encode_tensor, make_meta
    from hintfs.transforms.params import parse_params
    p = parse_params(kind, params_json)
    try:
        with _address_space_cap(3 * p.max_decoded_bytes + AS_SLACK):
            if meta.get("check_only"):
                transforms.check_decodes(kind, raw, p)
                return b""
            if meta.get("work_only"):
                from hintfs.transforms.params import VideoParams
                from hintfs.transforms.video import build_index, frames_to_decode, select_frames
                if not isinstance(p, VideoParams):
                    raise TransformError(f"no index for a {kind} sample")
                index = build_index(raw, p)
                n = frames_to_decode(index, select_frames(index, p, aug_seed))
                return json.dumps([index.codec, n * max(1, index.width * index.height) / 1e6]).encode()
            arrays = transforms.apply(kind, raw, p, aug_seed)
            return encode_tensor(arrays, make_meta(kind, p, aug_seed, meta["source"], meta["source_size"],
                                                   meta["source_mtime_ns"]))
    except MemoryError:
        raise TransformError(f"out of memory: the sample needs more than its address-space cap "
                             f"(3 x max_decoded_bytes={p.max_decoded_bytes} + {AS_SLACK >> 20} MiB)") from None


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the kernel kills this worker when its parent (the forkserver, which
    exits with the agent) goes away."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_main(conn, fn: Callable) -> None:
    """A transform worker: one task at a time from ``conn``; exits when the agent's end closes."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a terminal's Ctrl-C is the agent's to handle
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        cpu0 = time.process_time()
        try:
            out = fn(*args)
        except Exception as err:    # sent back to the agent, which decides
            try:
                conn.send(("err", err))
            except Exception:
                conn.send(("err", RuntimeError(f"{type(err).__name__}: {err}")))
            continue
        conn.send(("ok", len(out), time.process_time() - cpu0))   # the CPU time the task took
        conn.send_bytes(out)


_DIED = object()


class TransformPool:
    """`workers` processes (forkserver), each fed one task at a time by its own thread.

    Unlike concurrent.futures' pool it can stop one running task: a task past its time limit
    gets its worker SIGKILLed and a new worker started, and a worker that dies (crash, OOM
    killer, an operator's kill) is replaced; the other workers' tasks are not touched.

    A task's future carries, once done, `cpu_s` (the worker's CPU time for it) and `wall_s` (from
    the hand-off to the answer): the agent learns costs and the core's capacity from them; also
    `fresh` (the worker was started for this task: its wall time includes the worker's start-up)
    and, with `probe` (a callable returning a running total, e.g. other processes' CPU seconds),
    `probe_s`: how much that total grew from the hand-off to the answer."""

    def __init__(self, workers: int, fn: Callable = transform_to_container, grace_s: float = KILL_GRACE_S,
                 probe: Callable[[], float] | None = None):
        # forkserver, not fork: the agent process runs gRPC and trio threads, which a fork
        # would copy mid-flight (locks held by other threads stay locked in the child).
        self.ctx = multiprocessing.get_context("forkserver")
        self.fn = fn
        self.grace_s = grace_s
        self.probe = probe
        self.cond = threading.Condition()
        self.queue: deque = deque()
        self.closed = False
        self.slots: list = [None] * workers         # (process, connection) or None
        self.counts = {"worker_starts": 0, "worker_deaths": 0, "killed_over_time": 0}
        self.threads = [threading.Thread(target=self._loop, args=(i,), name=f"hintfs-transform-{i}", daemon=True)
                        for i in range(workers)]
        for t in self.threads:
            t.start()

    def submit(self, args: tuple, time_limit_s: float, label: str = "") -> Future:
        fut: Future = Future()
        with self.cond:
            if self.closed:
                raise RuntimeError("transform pool is closed")
            self.queue.append((fut, args, float(time_limit_s), label))
            self.cond.notify()
        return fut

    def pids(self) -> list[int]:
        with self.cond:
            return [slot[0].pid for slot in self.slots if slot is not None]

    # -- the dispatcher threads ---------------------------------------------------------------
    def _loop(self, i: int) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                fut, args, limit, label = self.queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                outcome = self._run(i, args, limit)
                if outcome is _DIED and not self.closed:
                    log.warning("transform worker died while making %s; retrying on a new worker", label)
                    outcome = self._run(i, args, limit)
                if outcome is _DIED:
                    outcome = ("err", WorkerDied("the transform worker died twice while making this sample "
                                                 "(crash or killed for memory)"))
            except Exception as err:   # starting a worker failed, a pickling error ...
                outcome = ("err", err)
            if outcome[0] == "ok":
                fut.cpu_s, fut.wall_s, fut.fresh, fut.probe_s = outcome[2], outcome[3], outcome[4], outcome[5]
                fut.set_result(outcome[1])
            else:
                fut.set_exception(outcome[1])

    def _slot(self, i: int):
        slot = self.slots[i]
        if slot is None or not slot[0].is_alive():
            if slot is not None:
                self._drop(i)
                self.counts["worker_deaths"] += 1
            parent, child = self.ctx.Pipe()
            proc = self.ctx.Process(target=_worker_main, args=(child, self.fn), name=f"hintfs-transform-{i}",
                                    daemon=True)
            proc.start()
            child.close()
            with self.cond:
                self.slots[i] = slot = (proc, parent)
            self.counts["worker_starts"] += 1
        return slot

    def _drop(self, i: int, kill: bool = False) -> None:
        with self.cond:
            slot, self.slots[i] = self.slots[i], None
        if slot is None:
            return
        proc, conn = slot
        if kill:
            with contextlib.suppress(OSError, ValueError):
                proc.kill()
        conn.close()
        proc.join(5)
        with contextlib.suppress(ValueError):
            proc.close()

    def _probe(self) -> float:
        if self.probe is None:
            return 0.0
        try:
            return float(self.probe())
        except Exception as err:    # a probe is for measurement only
            log.debug("transform pool probe failed: %s", err)
            return 0.0

    def _run(self, i: int, args: tuple, limit: float):
        fresh = self.slots[i] is None or not self.slots[i][0].is_alive()
        proc, conn = self._slot(i)
        try:
            p0 = self._probe()
            t0 = time.monotonic()
            conn.send(args)
            if not conn.poll(limit + self.grace_s):
                self._drop(i, kill=True)
                self.counts["killed_over_time"] += 1
                return ("err", TransformTimeout(f"transform ran over time_limit_s={limit:g}; "
                                                f"its worker was killed and replaced"))
            head = conn.recv()
            if head[0] == "ok":
                data = conn.recv_bytes()
                wall = time.monotonic() - t0
                return ("ok", data, float(head[2]) if len(head) > 2 else 0.0, wall, fresh,
                        max(0.0, self._probe() - p0))
            return head
        except (EOFError, OSError):
            self._drop(i, kill=True)
            self.counts["worker_deaths"] += 1
            return _DIED

    def shutdown(self) -> None:
        with self.cond:
            self.closed = True
            pending, self.queue = list(self.queue), deque()
            self.cond.notify_all()
        for fut, *_ in pending:
            fut.cancel()
        for i in range(len(self.slots)):
            self._drop(i, kill=True)


__all__ = ["TransformPool", "transform_to_container", "AS_SLACK", "KILL_GRACE_S"]

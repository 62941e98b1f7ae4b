"""The model-based test of docs/semantics.md: random operations by several processes on one or two
mounts of one store, each checked against the reference model (`tests/model/fsmodel.py`).

- **Generation** is seeded and online: each step draws an operation from what the model holds
  (open descriptions, names), so one seed is one sequence. An operation names the descriptions it
  uses by the *label* of the open that made them, so a sequence with steps removed still replays.
- **Execution**: the harness sends each step to one worker process (`tests/model/worker.py`, its
  own descriptors), waits for its answer, asks the model, and compares: return values, errno,
  bytes read, sizes, listings, and now and then the whole store read directly (what a reader of
  the store sees: the model's published state, never a staging file, a prefix or a mix).
- **Shrinking**: a failing sequence is cut down (delta debugging: drop chunks, then single steps)
  to a minimal one that still diverges; `save_regression` writes it to
  `tests/model/regressions/` where `test_model.py` replays it forever after.
- **Crashes** (`crash_every`): a `crash` step, SIGKILL of a mount daemon at a random step, then
  what the model says must survive is checked (everything closed or fsynced is in the store
  whole; what was open may be lost; nothing torn), the dead mount is unmounted with `hintfs
  umount` and mounted again, and the run goes on. What a dead daemon leaves is checked too: on
  `file://` its staging files are never listed and the next mount removes them; on an object
  store (S3) no spool file has a name, no staging object is in the bucket, and the host cache
  holds nothing torn (`check_no_object_staging_left`). A crash is a step: sequences with crashes
  replay and shrink like any other (the rig must give `daemon_pid` and `remount`).

Steps are interleaved at operation boundaries (one at a time), so a seed replays exactly; the
free-running concurrent stress is `stress()`, which runs the workers at once without a model
and checks only what holds under any interleaving.
"""
from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.model.fsmodel import Model

WORKER = Path(__file__).with_name("worker.py")
REGRESSIONS = Path(__file__).with_name("regressions")
STAGING_PREFIX = ".hintfs-tmp."

DIRS = ["d0", "d1", "d0/e"]
FILES = ["f0", "f1", "d0/f0", "d0/f1", "d1/f0", "d0/e/f0"]
OPEN_FLAGS = [
    ("r", os.O_RDONLY), ("w", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), ("rw", os.O_RDWR),
    ("rwc", os.O_RDWR | os.O_CREAT), ("a", os.O_WRONLY | os.O_APPEND | os.O_CREAT),
    ("x", os.O_RDWR | os.O_CREAT | os.O_EXCL), ("wn", os.O_WRONLY),
]
FLAGS = dict(OPEN_FLAGS)


class Worker:
    """One process with its own descriptors, running one call per request."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-I", str(WORKER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd="/", text=True, bufsize=1)

    def call(self, op: str, *args) -> tuple:
        from tests.model.worker import _dec, _enc
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, "args": _enc(list(args))}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.pid} died during {op}")
        answer = json.loads(line)
        if "bug" in answer:
            raise RuntimeError(f"harness bug in {op}{args}: {answer['bug']}")
        if "err" in answer:
            return ("err", answer["err"])
        return ("ok", _dec(answer["ok"]))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@dataclass
class Step:
    """One operation: `op`, the worker, the mount, and its arguments (labels name descriptions)."""
    op: str
    worker: int = 0
    mount: int = 0
    args: tuple = ()
    label: int = -1         # opens: the label later steps use

    def to_json(self) -> list:
        from tests.model.worker import _enc
        return [self.op, self.worker, self.mount, _enc(list(self.args)), self.label]

    @classmethod
    def from_json(cls, v: list) -> Step:
        from tests.model.worker import _dec
        op, worker, mount, args, label = v
        return cls(op, worker, mount, tuple(_dec(args)), label)

    def __str__(self) -> str:
        return f"{self.op}(w{self.worker}, m{self.mount}, {', '.join(map(_arg, self.args))})" + \
            (f" -> #{self.label}" if self.label >= 0 else "")


def _arg(v) -> str:
    if isinstance(v, bytes) and len(v) > 8:
        return f"{v[:1]!r}*{len(v)}" if v == v[:1] * len(v) else f"<{len(v)} bytes>"
    return repr(v)


class DivergenceError(AssertionError):
    def __init__(self, index: int, step: Step, got, want, note: str = ""):
        self.index, self.step, self.got, self.want = index, step, got, want
        super().__init__(f"step {index} {step}: the system gave {_short(got)}, the model {_short(want)}"
                         + (f" ({note})" if note else ""))


def _tree_diff(got: list, want: list) -> list[str]:
    """What differs between two store trees, one line per path: kinds, sizes, first byte that differs."""
    g, w = {p: (k, v) for p, k, v in got}, {p: (k, v) for p, k, v in want}
    out = []
    for p in sorted(set(g) | set(w)):
        if g.get(p) == w.get(p):
            continue
        if p not in g or p not in w:
            out.append(f"{p}: {'only in the store' if p in g else 'missing from the store'}")
            continue
        (gk, gv), (wk, wv) = g[p], w[p]
        if gk != wk or not isinstance(gv, bytes):
            out.append(f"{p}: store {gk} {gv!r}, model {wk} {wv!r}")
            continue
        first = next((i for i, (a, b) in enumerate(zip(gv, wv)) if a != b), min(len(gv), len(wv)))
        out.append(f"{p}: store {len(gv)} bytes, model {len(wv)}, first difference at {first} "
                   f"({gv[first:first + 4]!r} vs {wv[first:first + 4]!r})")
    return out


def _short(v) -> str:
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], bytes):
        return f"({v[0]!r}, {_arg(v[1])})"
    text = repr(v)
    return text if len(text) < 300 else text[:300] + "..."


@dataclass
class Rig:
    """The mounts and the store one run works in (made by the test's fixture or the bench)."""
    store: Path
    mounts: list[Path]
    passthrough: bool
    remount: object | None = None     # callable(i) -> None: restart mount i after a crash
    daemon_pid: object | None = None  # callable(i) -> int
    # An object store (S3): the store is read with `read_tree(folder)` -> [(path, kind, data)] and
    # folders are made with `make_folder(folder)`; None for file:// (read directly).
    read_tree: object | None = None
    make_folder: object | None = None
    # An object store's leftovers after a crash: `list_keys(folder)` -> every key and folder under
    # it as the bucket lists them; `object_version(rel)` -> ((size, mtime_ns, etag), bytes) of the
    # store's object at `rel`, or None; each mount's `[cache] spool_dir` and `[cache] dir`.
    list_keys: object | None = None
    object_version: object | None = None
    spools: list[Path] = field(default_factory=list)
    host_caches: list[Path] = field(default_factory=list)


@dataclass
class Run:
    """One sequence in a fresh folder of the store, against a fresh model."""
    rig: Rig
    folder: str
    workers: int = 3
    steps: list[Step] = field(default_factory=list)
    check_store_every: int = 25
    # Share of opens made read-only (O_RDONLY) on top of the flags' own draw; 0 keeps every
    # seed's sequence as it always was. The fast path's test reopens files for reading more.
    read_bias: float = 0.0

    def __post_init__(self) -> None:
        self.model = Model(len(self.rig.mounts), self.rig.passthrough, local_store=self.rig.read_tree is None)
        self.procs = [Worker() for _ in range(self.workers)]
        # label -> (model handle, worker index, [fds])
        self.open: dict[int, tuple[int, int, list[int]]] = {}
        self._mount_of: dict[int, int] = {}     # model handle -> its mount
        self.ops = 0
        # The kernel sends RELEASE after close() returns: the harness waits for it after each last
        # close, so the next step sees the writer gone, as the model does (a seed replays exactly).
        self.released = [self._settled_releases(i) for i in range(len(self.rig.mounts))]
        self.crashes = 0

    def close(self) -> None:
        for w in self.procs:
            w.close()

    def _stats(self, mount: int) -> dict:
        with open(self.rig.mounts[mount] / ".hintfs" / "stats", "rb") as f:
            return json.loads(f.read())

    def _renewed(self, mount: int) -> int:
        """Opens that gave a name a new inode on `mount` (`Filesystem._renew`)."""
        return self._stats(mount)["counters"].get("opens_renewed", 0)

    def _releases(self, mount: int) -> int:
        doc = self._stats(mount)
        # (releases of opens the fast path answered never reach Python: counted there)
        return doc["counters"].get("file_releases", 0) + doc.get("fast_path", {}).get("releases", 0)

    def _settled_releases(self, mount: int) -> int:
        """The release count once no release is in flight (an earlier run's workers are gone)."""
        last = self._releases(mount)
        for _ in range(100):
            time.sleep(0.02)
            now = self._releases(mount)
            if now == last:
                return now
            last = now
        return last

    def _await_release(self, mount: int) -> None:
        if os.environ.get("HINTFS_MODEL_RELEASE_SLEEP"):
            # (a daemon older than the `file_releases` counter: give its RELEASE time instead)
            time.sleep(float(os.environ["HINTFS_MODEL_RELEASE_SLEEP"]))
            return
        self.released[mount] += 1
        deadline = time.monotonic() + 10
        while self._releases(mount) < self.released[mount]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"mount {mount} did not answer a RELEASE within 10 s")
            time.sleep(0.0005)

    def path(self, mount: int, rel: str) -> str:
        base = self.rig.mounts[mount] / self.folder
        return str(base / rel) if rel else str(base)

    # -- one step ----------------------------------------------------------------------------------
    def apply(self, i: int, step: Step) -> bool:
        """Run `step` on the system and the model; DivergenceError if they differ. False when
        the step does not apply (a description it names is not open)."""
        model, w = self.model, self.procs[step.worker]
        op, a = step.op, step.args
        if op == "crash":
            self.crash(i, step.mount)
            return True
        self.ops += 1
        if op == "open":
            rel, fl = a
            # (an object store: readers open on an object the mount may not tell from the one at
            # the name now; whether it did is its `opens_renewed` counter's to say)
            unsure = self.rig.read_tree is not None and model.renew_unsure(step.mount, rel)
            before = self._renewed(step.mount) if unsure else 0
            got = w.call("open", self.path(step.mount, rel), FLAGS[fl])
            renewed = self._renewed(step.mount) > before if unsure else None
            # (S3 with a host cache: whether a reader is served by passthrough is timing's, so a
            # writer's ETXTBSY is the system's to say; file:// is exact)
            timing = self.rig.read_tree is not None and self.rig.passthrough and got != ("err", errno.ETXTBSY)
            want = model.open(step.mount, rel, FLAGS[fl], served_by_daemon=timing, renewed=renewed)
            self._same(i, step, got[0], want[0], got, want)
            if got[0] == "err":
                self._same(i, step, got, want)
            else:
                self.open[step.label] = (want[1], step.worker, [got[1]])
                self._mount_of[want[1]] = step.mount
            return True
        if op in ("close", "dup", "write", "pwrite", "pread", "read", "ftruncate", "fsync", "fstat_size",
                  "mmap_write"):
            entry = self.open.get(a[0])
            if entry is None:
                return False
            h, wi, fds = entry
            w = self.procs[wi]
            fd = fds[-1]
            rest = a[1:]
            got = w.call(op, fd, *rest)
            want = getattr(model, op)(h, *rest)
            if op == "close":
                fds.pop()
                if not fds:
                    del self.open[a[0]]
                    if got[0] == "ok" or got[1] != errno.EBADF:
                        self._await_release(model.ofds[h].mount if h in model.ofds else self._mount_of[h])
            elif op == "dup" and got[0] == "ok":
                fds.append(got[1])
                got = ("ok", h)
            if want[0] == "any":       # unspecified (object stores: fsmodel.Model._object_gone)
                if op == "read" and got[0] == "ok":
                    model.advance(h, len(got[1]))
                return True
            self._same(i, step, got, want)
            return True
        if op == "rename" or op == "symlink_op":
            src, dst = a
            got = w.call("rename", self.path(step.mount, src), self.path(step.mount, dst))
            want = model.rename(step.mount, src, dst)
        elif op == "symlink":
            target, rel = a
            got = w.call("symlink", target, self.path(step.mount, rel))
            want = model.symlink(step.mount, target, rel)
        elif op == "stat":
            got = w.call("stat", self.path(step.mount, a[0]))
            want = model.stat(step.mount, a[0])
            if got[0] == "ok" and want[0] == "ok":
                mode, size, _nlink = got[1]
                import stat as st
                kind = "dir" if st.S_ISDIR(mode) else "symlink" if st.S_ISLNK(mode) else "file"
                wkind, wsize, wmode = want[1]
                got = ("ok", (kind, size if kind != "dir" else None,
                              st.S_IMODE(mode) if kind == "file" else None))
                want = ("ok", (wkind, wsize, wmode))
        elif op == "truncate":
            got = w.call("truncate", self.path(step.mount, a[0]), a[1])
            want = model.truncate(step.mount, a[0], a[1])
        elif op == "chmod":
            got = w.call("chmod", self.path(step.mount, a[0]), a[1])
            want = model.chmod(step.mount, a[0], a[1])
        elif op == "utime":
            got = w.call("utime", self.path(step.mount, a[0]), [1_700_000_000_000_000_000, 1_700_000_000_000_000_000])
            want = model.utime(step.mount, a[0])
        elif op in ("mkdir", "rmdir", "unlink", "readdir", "readlink"):
            got = w.call(op, self.path(step.mount, a[0]))
            want = getattr(model, op)(step.mount, a[0])
        elif op == "check_store":
            self.check_store(i, step)
            return True
        else:
            raise ValueError(f"unknown step {op}")
        if got == ("ok", None) or (got[0] == "ok" and op in ("mkdir", "rmdir", "unlink", "rename", "symlink",
                                                             "truncate", "chmod", "utime")):
            got = ("ok", None)
        self._same(i, step, got, want)
        return True

    def _same(self, i: int, step: Step, got, want, shown_got=None, shown_want=None) -> None:
        if got != want:
            raise DivergenceError(i, step, shown_got if shown_got is not None else got,
                                  shown_want if shown_want is not None else want)

    def check_store(self, i: int, step: Step) -> None:
        """The store read directly equals the model's published state (no staging file shown)."""
        if self.rig.read_tree is not None:
            got = sorted(self.rig.read_tree(self.folder))   # type: ignore[operator]
            want = sorted(self.model.tree())
            if got != want:
                raise DivergenceError(i, step, _tree_diff(got, want), "the model's store", "the store read directly")
            return
        root = self.rig.store / self.folder
        got = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            rel = os.path.relpath(dirpath, root)
            for name in sorted(dirnames + filenames):
                if name.startswith(STAGING_PREFIX):
                    continue
                p = os.path.join(dirpath, name)
                r = name if rel == "." else f"{rel}/{name}"
                if os.path.islink(p):
                    got.append((r, "symlink", os.readlink(p)))
                elif os.path.isdir(p):
                    got.append((r, "dir", None))
                else:
                    with open(p, "rb") as f:
                        got.append((r, "file", f.read()))
        got.sort()
        want = sorted(self.model.tree())
        if got != want:
            raise DivergenceError(i, step, _tree_diff(got, want), "the model's store", "the store read directly")

    # -- generation --------------------------------------------------------------------------------
    def generate(self, rng: random.Random, n: int, crash_every: int = 0) -> None:
        """Generate and run `n` steps (recorded in `self.steps`); with `crash_every`, a SIGKILL of a
        random mount's daemon after about that many steps (uniformly at random)."""
        for _ in range(n):
            if crash_every and rng.random() < 1.0 / crash_every:
                step = Step("crash", 0, rng.randrange(len(self.rig.mounts)))
            else:
                step = self.draw(rng, len(self.steps))
            self.steps.append(step)
            self.apply(len(self.steps) - 1, step)

    def draw(self, rng: random.Random, index: int) -> Step:
        mounts = len(self.rig.mounts)
        worker = rng.randrange(self.workers)
        mount = rng.randrange(mounts)
        labels = sorted(self.open)
        r = rng.random()
        if labels and r < 0.5:
            label = rng.choice(labels)
            op = rng.choices(["close", "dup", "write", "pwrite", "pread", "read", "ftruncate", "fsync",
                              "fstat_size", "mmap_write"], [18, 3, 16, 14, 12, 3, 3, 4, 3, 2])[0]
            data = bytes([rng.randrange(256)]) * rng.choice([1, 3, 100, 5000, 70000])
            off = rng.choice([0, 1, 7, 4096, 65536, 100000])
            args: tuple = {"close": (label,), "dup": (label,), "write": (label, data),
                           "pwrite": (label, data, off), "pread": (label, rng.choice([1, 100, 200000]), off),
                           "read": (label, rng.choice([10, 70000])), "ftruncate": (label, rng.choice([0, 5, 70000])),
                           "fsync": (label,), "fstat_size": (label,),
                           "mmap_write": (label, rng.choice([0, 3]), data[:rng.choice([1, 4])])}[op]
            return Step(op, 0, 0, args)
        op = rng.choices(["open", "stat", "readdir", "mkdir", "rmdir", "unlink", "rename", "symlink", "chmod",
                          "truncate", "utime", "readlink", "check_store"],
                         [30, 6, 4, 4, 2, 5, 7, 1, 2, 2, 1, 1, 2])[0]
        if op == "open":
            fl = rng.choice(OPEN_FLAGS)[0]
            if self.read_bias and rng.random() < self.read_bias:
                fl = "r"
            return Step("open", worker, mount, (rng.choice(FILES), fl), label=index)
        if op in ("stat", "unlink", "truncate", "chmod", "utime", "readlink"):
            rel = rng.choice(FILES + (DIRS if op == "stat" else []) + ["s0"])
            args = {"truncate": (rel, rng.choice([0, 3, 9000])), "chmod": (rel, rng.choice([0o600, 0o640, 0o644]))}.get(op, (rel,))
            return Step(op, worker, mount, args)
        if op == "readdir":
            return Step(op, worker, mount, (rng.choice([""] + DIRS),))
        if op in ("mkdir", "rmdir"):
            return Step(op, worker, mount, (rng.choice(DIRS),))
        if op == "symlink":
            return Step(op, worker, mount, (rng.choice(["f0", "f1", "s0"]), rng.choice(["s0", "f1"])))
        if op == "rename":
            if rng.random() < 0.8:
                src, dst = rng.choice(FILES), rng.choice(FILES)
            else:
                src, dst = rng.choice(DIRS), rng.choice(DIRS + ["d2"])
                if self._others_write_under(mount, src):
                    src = dst = rng.choice(FILES)   # out of the model's scope: see _others_write_under
            return Step(op, worker, mount, (src, dst))
        return Step("check_store", worker, mount, ())

    def _others_write_under(self, mount: int, folder: str) -> bool:
        """Another mount has a file under `folder` open for writing: a folder renamed under another
        mount's writer is out of the model's scope (that writer's close publishes to the old name
        or fails with EIO: docs/semantics.md, "The model-based test")."""
        for m, ws in enumerate(self.model.writers):
            if m != mount and any(p.startswith(folder + "/") for p in ws):
                return True
        return False

    # -- crashes -----------------------------------------------------------------------------------
    def crash(self, i: int, mount: int) -> None:
        """SIGKILL mount `mount`'s daemon now (step `i`, a `crash` step: a sequence with crashes
        replays and shrinks like any other); then what the model says survives must be in the
        store (everything closed or fsynced, whole), `hintfs umount` of the dead mount and a new
        mount of it, which must leave no staging file of the dead daemon once it has looked."""
        assert self.rig.daemon_pid is not None and self.rig.remount is not None
        pid = self.rig.daemon_pid(mount)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.01)
        # Close what is open on the other mounts (their publishes happen), then the workers go:
        # their descriptors of the dead mount die with them. (Part of the crash step: a
        # divergence there is the crash step's.)
        for label in sorted(self.open):
            h = self.open[label][0]
            if self._mount_of.get(h) != mount:
                while label in self.open:
                    self.apply(i, Step("close", 0, 0, (label,)))
        for w in self.procs:
            w.close()
        for h in self.model.crash(mount):
            self._mount_of.pop(h, None)
        self.open.clear()
        self.rig.remount(mount)
        self.procs = [Worker() for _ in range(self.workers)]
        self.released[mount] = self._settled_releases(mount)
        self.crashes += 1
        self.check_store(i, Step("check_store", 0, mount, ("after a crash",)))
        self.check_no_staging_left(i, mount)

    def check_no_staging_left(self, i: int, mount: int) -> None:
        """The dead daemon's staging files are never shown, and the next mount removes them when
        it lists their folder once they are `STALE_STAGING_AGE_S` old (their mtime is set back
        here instead of waiting a minute). Object stores: `check_no_object_staging_left`."""
        if self.rig.read_tree is not None:
            self.check_no_object_staging_left(i, mount)
            return
        def dead_stagings() -> list[str]:
            return [os.path.join(d, n) for d, _s, ns in os.walk(self.rig.store / self.folder)
                    for n in ns if n.startswith(STAGING_PREFIX) and _staging_pid(n) not in self._live_pids()]
        past = time.time() - 3600
        for p in dead_stagings():
            os.utime(p, (past, past), follow_symlinks=False)
        for dirpath, _dirs, names in os.walk(self.rig.store / self.folder):
            rel = os.path.relpath(dirpath, self.rig.store)
            shown = os.listdir(self.rig.mounts[mount] / rel)       # the mount looks at the folder
            if any(n.startswith(STAGING_PREFIX) for n in shown):
                raise DivergenceError(i, Step("readdir", 0, mount, (rel,)), shown, "no staging file listed")
        leftover = dead_stagings()
        if leftover:
            raise DivergenceError(i, Step("check_store", 0, mount, ("staging after a crash",)), leftover[:4],
                                  "no staging file of a dead daemon", "after the next mount looked")

    def check_no_object_staging_left(self, i: int, mount: int) -> None:
        """On an object store a staging file is a spool file without a name (unlinked at its
        creation: nothing to clean after a crash) and an upload goes to its key (a multipart upload
        is invisible until completed). So: no spool folder holds a named file; no staging name is
        in the bucket or listed through any mount; and the host cache of the mount that died,
        as its next daemon found it, holds nothing a reader could mistake: no temporary fetch of
        the dead daemon, and every complete file is named by its path's hash, carries its path and
        version, has that version's size, and, where the store still has that version, its bytes
        (a torn copy of the current version would be served by passthrough)."""
        where = Step("check_store", 0, mount, ("staging after a crash",))
        named = [str(p) for spool in self.rig.spools if spool.exists() for p in spool.iterdir()]
        if named:
            raise DivergenceError(i, where, named[:4], "no named spool file", "spool files have no name")
        keys = self.rig.list_keys(self.folder)    # type: ignore[operator]
        staged = [k for k in keys if k.rsplit("/", 1)[-1].startswith(STAGING_PREFIX)]
        if staged:
            raise DivergenceError(i, where, staged[:4], "no staging object", "the bucket listed")
        for m, mnt in enumerate(self.rig.mounts):
            for dirpath, _dirs, names in os.walk(mnt / self.folder):
                if any(n.startswith(STAGING_PREFIX) for n in names):
                    rel = os.path.relpath(dirpath, mnt)
                    raise DivergenceError(i, Step("readdir", 0, m, (rel,)), names, "no staging file listed")
        if self.rig.host_caches:
            bad = self._torn_cache_entries(self.rig.host_caches[mount])
            if bad:
                raise DivergenceError(i, where, bad[:4], "nothing a reader could mistake",
                                      "the host cache after a crash")

    def _torn_cache_entries(self, top: Path) -> list[str]:
        """What in a host cache folder (hintfs/stores/hostcache.py) a restarted daemon could serve
        wrongly: a leftover temporary fetch of a dead daemon (the next daemon removes them when it
        starts), or a complete file that is not exactly the version its extended attribute names."""
        out = []
        live = self._live_pids()
        for dirpath, _dirs, names in os.walk(top):
            for name in names:
                problem = _cache_entry_problem(Path(dirpath) / name, live, self.rig.object_version)
                if problem:
                    out.append(f"{name[:16]}: {problem}")
        return out

    def _live_pids(self) -> set[int]:
        assert self.rig.daemon_pid is not None
        return {self.rig.daemon_pid(m) for m in range(len(self.rig.mounts))}

    # -- replay ------------------------------------------------------------------------------------
    def replay(self, steps: list[Step]) -> None:
        for i, step in enumerate(steps):
            if self.apply(i, step):
                self.steps.append(step)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


def _cache_entry_problem(path: Path, live_pids: set[int], object_version) -> str | None:
    """Why a file of a host cache folder could mislead a reader, or None. Its names: `.lock`;
    `<sha256 of the path>` (complete: xattr `user.hintfs.hostcache` {"path", "version"}, what
    `HostCachedStore._restore` indexes and `open_local` serves once the store's version matches);
    `<sha256>.<pid>.<n>.tmp` (a fetch in flight: a live daemon's only)."""
    import hashlib
    from hintfs.stores.hostcache import XATTR
    name = path.name
    if name == ".lock":
        return None
    if name.endswith(".tmp"):
        parts = name.split(".")
        pid = int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else -1
        return None if pid in live_pids else "a temporary fetch of a dead daemon"
    if len(name) != 64 or any(c not in "0123456789abcdef" for c in name):
        return "an unknown name"
    try:
        meta = json.loads(os.getxattr(path, XATTR))
        rel, version = meta["path"], tuple(meta["version"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"no readable {XATTR} ({e})"   # (_restore removes it: never served)
    if hashlib.sha256(rel.encode("utf-8", "surrogateescape")).hexdigest() != name:
        return f"named for another path than {rel!r}"
    data = path.read_bytes()
    if len(version) != 3 or version[0] != len(data):
        return f"{len(data)} bytes, its version says {version}"
    now = object_version(rel)
    if now is not None and tuple(now[0]) == (int(version[0]), int(version[1]), str(version[2])) \
            and now[1] != data:
        first = next((j for j, (a, b) in enumerate(zip(data, now[1])) if a != b), 0)
        return f"{rel}: not the bytes of the version it names (first difference at {first})"
    return None


def _staging_pid(name: str) -> int:
    try:
        return int(name[len(STAGING_PREFIX):].split(".")[0])
    except ValueError:
        return -1


def fresh_folder(rig: Rig, tag: str) -> str:
    folder = f"{tag}-{os.getpid()}-{time.monotonic_ns()}"
    if rig.make_folder is not None:
        rig.make_folder(folder)   # type: ignore[operator]
    else:
        os.makedirs(rig.store / folder)
    return folder


def run_seed(rig: Rig, seed: int, steps: int, workers: int = 3, crash_every: int = 0,
             read_bias: float = 0.0) -> Run:
    """Generate and run one seed's sequence; DivergenceError (with `.run`) if it diverges."""
    run = Run(rig, fresh_folder(rig, f"s{seed}"), workers, read_bias=read_bias)
    try:
        run.generate(random.Random(seed), steps, crash_every)
        run.check_store(len(run.steps), Step("check_store"))
        _close_all(run)
        run.check_store(len(run.steps), Step("check_store"))
    except DivergenceError as err:
        err.run = run   # type: ignore[attr-defined]
        raise
    finally:
        run.close()
    return run


def _close_all(run: Run) -> None:
    """Close every descriptor still open, as the model says (publishes follow)."""
    for label in sorted(run.open):
        while label in run.open:
            step = Step("close", 0, 0, (label,))
            run.steps.append(step)
            run.apply(len(run.steps) - 1, step)


def replays(rig: Rig, steps: list[Step], workers: int = 3) -> DivergenceError | None:
    """Run `steps` in a fresh folder; the divergence it shows, or None."""
    run = Run(rig, fresh_folder(rig, "replay"), workers)
    try:
        for i, step in enumerate(steps):
            run.apply(i, step)
        run.check_store(len(steps), Step("check_store"))
        _close_all(run)
        run.check_store(len(steps), Step("check_store"))
    except DivergenceError as err:
        return err
    finally:
        run.close()
    return None


def shrink(rig: Rig, steps: list[Step], budget_s: float = 300.0) -> list[Step]:
    """A shorter sequence that still diverges (delta debugging: drop chunks, then single steps;
    checks stop after `budget_s`)."""
    deadline = time.monotonic() + budget_s
    err = replays(rig, steps)
    assert err is not None, "the sequence does not diverge"
    steps = steps[:err.index + 1]
    kind = err.step.op      # keep the divergence of the same kind of step (not another one found on the way)
    chunk = max(1, len(steps) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        i, changed = 0, False
        while i < len(steps) and time.monotonic() < deadline:
            trial = steps[:i] + steps[i + chunk:]
            e = replays(rig, trial) if trial else None
            if e is not None and e.step.op == kind:
                steps = trial[:e.index + 1]
                changed = True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return steps


def save_regression(steps: list[Step], name: str, note: str, mounts: int, passthrough: bool,
                    store: str = "file", fast_path: bool = False, reads: bool = False) -> Path:
    """`store`: "file", "s3", "s3-hostcache" (then `passthrough` is the host cache's) or
    "s3-hostcache-blocks" (`model_rig_s3(blocks=True)`, bench/model_test.py's s3hcb configurations),
    each with "-listed" after it for `model_rig_s3(listed=True)` (the s3l and s3hcl configurations);
    `fast_path`: file:// with every path immutable (`model_rig(fast_path=True)`); `reads`: file://
    with a folder's names registered and its files marked after one open (`model_rig(reads=True)`,
    the 1ptr and 2ptr configurations)."""
    REGRESSIONS.mkdir(exist_ok=True)
    path = REGRESSIONS / f"{name}.json"
    doc = {"note": note, "mounts": mounts, "passthrough": passthrough, "store": store}
    if fast_path:
        doc["fast_path"] = True
    if reads:
        doc["reads"] = True
    path.write_text(json.dumps({**doc, "steps": [s.to_json() for s in steps]}, indent=1) + "\n")
    return path


def load_regression(path: Path) -> tuple[dict, list[Step]]:
    doc = json.loads(path.read_text())
    return doc, [Step.from_json(v) for v in doc["steps"]]


__all__ = ["Rig", "Run", "Step", "DivergenceError", "run_seed", "replays", "shrink", "save_regression",
           "load_regression", "errno", "signal"]

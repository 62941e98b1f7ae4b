"""Attack tests of issue 34's agent-side findings 5 and 6, against a real `hintfs agent` (a tier
taking write-time streams), by a token holder running as another user (uid 65534 via setpriv):

- `replicate` with a `source` the tier was never told to trust (a Flight server of that user that
  answers every read with other bytes);
- write-time streams: more streams than the agent has descriptors for, unpublished bytes past
  the tier's budget, a publish with 2^20 CRCs (several at once), a publish of a version the store
  does not have (an mtime in 2100), and a stream at a `stream_prefixes` prefix itself.

The agent listens on `grpc://localhost:PORT`, which is 127.0.0.1 and ::1: the attacker connects
over IPv4, an honest sender over IPv6, so that they are two peers on one loopback host.
"""
from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hintfs.agent.client import AgentClient, AgentError
from policy.stream import crcs_of
from tests.conftest import REPO, wait_for
from tests.helpers.security import NOBODY, SETPRIV, WorldDir, as_nobody, can_run_as_nobody, free_port

needs_nobody = pytest.mark.skipif(not can_run_as_nobody(), reason="needs root, setpriv and a Python uid 65534 can run")
pytestmark = [pytest.mark.timeout(180), needs_nobody]

TOKEN = "stream-tier-token-" + os.urandom(8).hex()
CHUNK = 64 << 10
FDS = 512          # the agent's open-file limit (soft and hard) in these tests


class Tier:
    """A real `hintfs agent` over `store` taking streams under `ckpt`, with a low open-file limit
    and a small budget; stopped by its pid."""

    def __init__(self, base: Path, store: Path, extra: str = "") -> None:
        self.base = base
        self.port = free_port()
        token = base / "token"
        token.write_text(TOKEN)
        token.chmod(0o600)
        self.log = base / "agent.log"
        cfg = base / "agent.toml"
        cfg.write_text(f'[store]\nuri = "file://{store}"\n[agent]\nlocation = "grpc://localhost:{self.port}"\n'
                       f'data_dir = "{base / "tier"}"\ntoken_file = "{token}"\nbudget_bytes = {4 << 20}\n'
                       f'stream_prefixes = ["ckpt"]\nreclaim_interval_s = 0.2\n{extra}'
                       f'[logging]\nfile = "{self.log}"\n')

        def limits() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (FDS, FDS))

        self.p = subprocess.Popen([sys.executable, "-m", "hintfs.cli", "agent", str(cfg)], cwd=REPO,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=limits)
        self.v4 = AgentClient(f"grpc://127.0.0.1:{self.port}", token=TOKEN, timeout_s=20)
        self.v6 = AgentClient(f"grpc://[::1]:{self.port}", token=TOKEN, timeout_s=20, own_connection=True)

        def up() -> bool:
            if self.p.poll() is not None:
                return True
            try:
                return self.v4.ping()
            except AgentError:
                return False
        assert wait_for(up, timeout=30, interval=0.1), "agent did not come up"
        assert self.p.poll() is None, f"agent exited: {self.p.communicate()[1][-2000:]}"

    def log_lines(self, needle: str) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if needle in line]

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.p.pid}/fd"))

    def peak_rss(self) -> int:
        for line in Path(f"/proc/{self.p.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
        raise AssertionError("no VmHWM")

    def stop(self) -> None:
        for c in (self.v4, self.v6):
            c.close()
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.p.pid, signal.SIGKILL)
                self.p.wait(10)
        if self.p.stderr is not None:
            self.p.stderr.close()


@pytest.fixture
def world():
    d = WorldDir()
    try:
        store = d.path / "store"
        (store / "ckpt" / "run" / "step_1").mkdir(parents=True)
        yield d.path, store
    finally:
        d.close()


def _script(tier: Tier, body: str) -> str:
    head = textwrap.dedent(f"""
        import json
        import pyarrow as pa, pyarrow.flight as fl
        from crc32c import crc32c
        LOC, TOKEN = {f"grpc://127.0.0.1:{tier.port}"!r}, {TOKEN!r}
        c = fl.FlightClient(LOC)
        opts = fl.FlightCallOptions(headers=[(b"authorization", b"Bearer " + TOKEN.encode())], timeout=60)

        def errno_of(err):
            try:
                return json.loads(err.extra_info)["errno"]
            except Exception:
                return -1

        def act(kind, doc):
            try:
                got = list(c.do_action(fl.Action(kind, json.dumps(doc).encode()), opts))
                return json.loads(got[0].body.to_pybytes()), None
            except fl.FlightError as err:
                return None, errno_of(err)

        SCHEMA = pa.schema([("offset", pa.int64()), ("crc", pa.int64()), ("data", pa.large_binary())])

        def put(desc, rows):
            try:
                w, r = c.do_put(fl.FlightDescriptor.for_command(json.dumps(desc).encode()), SCHEMA, opts)
                for off, crc, data in rows:
                    w.write_batch(pa.record_batch([pa.array([off], pa.int64()), pa.array([crc], pa.int64()),
                                                   pa.array([data], pa.large_binary())], schema=SCHEMA))
                w.done_writing()
                buf = r.read()
                w.close()
                return json.loads(buf.to_pybytes()), None
            except fl.FlightError as err:
                return None, errno_of(err)

        out = {{}}
    """)
    return head + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"


def _honest_stream(client: AgentClient, sid: str, store: Path, rel: str) -> dict:
    """An honest training mount's stream of a file the store has: its open, chunks and publish
    at the store's own version, in one call."""
    data = (store / rel).read_bytes()
    st = os.stat(store / rel)
    offsets = range(0, len(data), CHUNK)
    crcs = crcs_of([data[o:o + CHUNK] for o in offsets])
    return client.stream_put(sid, 0, [(o, data[o:o + CHUNK], crc) for o, crc in zip(offsets, crcs)],
                             opening={"path": rel, "chunk": CHUNK},
                             publish={"path": rel, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "crcs": crcs})


# -- finding 5: replicate's source ---------------------------------------------------------------
POISON_SERVER = """
import json, sys
import pyarrow as pa, pyarrow.flight as fl

class Poison(fl.FlightServerBase):
    def do_get(self, context, ticket):
        doc = json.loads(ticket.ticket)
        data = b"P" * int(doc.get("length", 0))
        return fl.RecordBatchStream(pa.table({"data": pa.array([data], type=pa.large_binary())}))

    def do_action(self, context, action):
        yield fl.Result(b'{"ok": true}')

s = Poison("grpc://127.0.0.1:0")
print(s.port, flush=True)
s.serve()
"""


def test_replicate_takes_no_source_the_tier_was_not_told_to_trust(world):
    """Before the fix: with no `[agents] locations`, a token holder's `replicate` with a `source`
    on another user's Flight server copied that server's bytes, and the tier served them as the
    store file's replica."""
    base, store = world
    honest = b"honest checkpoint bytes " * 1000
    (store / "ckpt" / "run" / "step_1" / "w.bin").write_bytes(honest)
    script = base / "poison.py"
    script.write_text(POISON_SERVER)
    script.chmod(0o644)
    evil = subprocess.Popen([SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                             sys.executable, "-I", str(script)], stdout=subprocess.PIPE, text=True, cwd="/",
                            env={"PATH": "/usr/bin:/bin"})
    tier = None
    try:
        port = int(evil.stdout.readline())
        tier = Tier(base, store)
        got = as_nobody(_script(tier, f"""
            out["replicate"] = act("replicate", {{"path": "ckpt/run/step_1/w.bin", "ttl_s": 600,
                                                 "source": "grpc://127.0.0.1:{port}"}})
            ans, err = act("status", {{}})
            out["replicas"] = sorted(ans["replicas"]) if ans else None
        """))
        assert got["replicate"][0] is None and got["replicate"][1] in (errno.EACCES, errno.EINVAL), got
        assert got["replicas"] == [], f"the tier kept a copy from an untrusted source: {got}"
        with pytest.raises(AgentError):
            tier.v4.read("ckpt/run/step_1/w.bin", 0, 10, replica_only=True)
        assert len(tier.log_lines("source")) == 1, tier.log.read_text()[-3000:]
        # the tier still copies from its store
        assert tier.v4.replicate("ckpt/run/step_1/w.bin", 600)["size"] == len(honest)
        assert tier.v4.read("ckpt/run/step_1/w.bin", 0, len(honest), replica_only=True) == honest
    finally:
        if tier is not None:
            tier.stop()
        evil.kill()
        evil.wait(10)
        if evil.stdout is not None:
            evil.stdout.close()


# -- finding 6: write-time streams ------------------------------------------------------------------
def test_a_token_holder_cannot_exhaust_the_tiers_descriptors_with_streams(world):
    """Before the fix: every `stream_open` kept a descriptor and nothing bounded them; a token
    holder took all of the agent's descriptors, and every other call that needed one failed."""
    base, store = world
    (store / "ckpt" / "run" / "step_1" / "a.bin").write_bytes(os.urandom(3 * CHUNK + 5))
    (store / "other.bin").write_bytes(b"x" * 100)
    tier = Tier(base, store)
    try:
        before = tier.fds()
        got = as_nobody(_script(tier, f"""
            errs = {{}}
            for i in range({FDS + 64}):
                ans, err = act("stream_open", {{"stream": f"evil-{{i}}", "gen": 0, "path": f"ckpt/x/{{i}}",
                                               "chunk": 65536}})
                errs[str(err)] = errs.get(str(err), 0) + 1
            out["errors"] = errs
        """), timeout=120)
        assert str(errno.EAGAIN) in got["errors"], got
        # descriptors stayed bounded: at most a quarter of the limit went to streams
        assert tier.fds() <= before + FDS // 4 + 8, (before, tier.fds())
        # other principals keep working: a read, a copy, and an honest sender on another peer
        assert tier.v6.read("other.bin", 0, 100) == b"x" * 100
        assert tier.v6.replicate("other.bin", 600)["size"] == 100
        ans = _honest_stream(tier.v6, "honest-1", store, "ckpt/run/step_1/a.bin")
        assert ans.get("state") == "ready", ans
        st = os.stat(store / "ckpt/run/step_1/a.bin")
        assert wait_for(lambda: tier.v6.has("ckpt/run/step_1/a.bin", st.st_size, st.st_mtime_ns), 10)
        refusals = tier.log_lines("refused")
        assert 1 <= len(refusals) <= 4, refusals[:10]        # one line, not one per call
        senders = tier.v6.status()["streams"]["by_sender"]
        assert any(v["refused"] > 0 and v["open"] > 0 for v in senders.values()), senders
    finally:
        tier.stop()


def test_unpublished_stream_bytes_are_inside_the_tiers_budget(world):
    """Before the fix: chunks of streams never published were not counted against
    `budget_bytes` (4 MiB here): a token holder wrote 12 MiB into the data folder."""
    base, store = world
    tier = Tier(base, store)
    try:
        got = as_nobody(_script_budget(tier))
        assert errno.ENOSPC in got["errors"], got
        held = sum(f.stat().st_size for f in (base / "tier").rglob("stream-*.part"))
        assert held <= 4 << 20, held
        assert tier.log_lines("ENOSPC") or tier.log_lines("budget"), tier.log.read_text()[-2000:]
    finally:
        tier.stop()


def _script_budget(tier: Tier) -> str:
    return _script(tier, """
        chunk = b"Z" * 65536
        crc = crc32c(chunk)
        errors = []
        for s in range(3):
            desc = {"op": "stream", "stream": f"fill-{s}", "gen": 0,
                    "open": {"stream": f"fill-{s}", "gen": 0, "path": f"ckpt/fill/{s}", "chunk": 65536}}
            for call in range(8):
                rows = [(65536 * (call * 8 + k), crc, chunk) for k in range(8)]
                ans, err = put(desc, rows)
                desc.pop("open", None)
                if err is not None:
                    errors.append(err)
                    break
        out["errors"] = errors
    """)


def test_a_publish_with_a_huge_crc_list_is_refused_and_costs_bounded_memory(world):
    """Before the fix: a publish of a 10-byte file with 2^20 CRCs was parsed whole (the JSON, then
    a validated copy: about 100 MiB) by every caller at once before it was refused, and what it
    parsed stayed in a reference cycle until a full collection: the agent's peak grew by 351 MiB
    with 6 callers. Now large requests are parsed one at a time and leave nothing behind; what
    remains per caller is gRPC's own buffer of the message (about twice its size)."""
    base, store = world
    tier = Tier(base, store)
    callers = 10
    try:
        tier.v4.stream_open("tiny", 0, "ckpt/t/tiny", CHUNK)
        base_rss = tier.peak_rss()
        got = as_nobody(_script(tier, f"""
            import threading
            body = {{"stream": "tiny", "gen": 0, "path": "ckpt/t/tiny", "size": 10, "mtime_ns": 1,
                    "crcs": [4294967295] * (1 << 20)}}
            out["body_bytes"] = len(json.dumps(body))
            errs = []
            def one():
                errs.append(act("stream_publish", body)[1])
            threads = [threading.Thread(target=one) for _ in range({callers})]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            out["errors"] = errs
        """), timeout=150)
        assert got["errors"] == [errno.EINVAL] * callers, got
        grew = tier.peak_rss() - base_rss
        transport = callers * 2 * got["body_bytes"]
        # Slack: with the fix the peak grew 84-129 MiB over the buffers in three runs side by side,
        # 217 MiB once and 306 MiB once in a fresh-clone make test (glibc's arenas, gRPC's threads:
        # 3 runs of this test alone then passed); with parses at once, 111-265 MiB; the reference
        # cycle kept ~35 MiB per caller more (~350 MiB with 10 callers, so 460-615 MiB over the
        # buffers in all). Peak RSS cannot tell those apart reliably: tests/unit/test_agent_rpc.py
        # checks exactly that large parses never overlap and that a refusal keeps nothing; this
        # bounds the whole.
        assert grew < transport + (400 << 20), \
            f"the agent's peak memory grew by {grew >> 20} MiB ({transport >> 20} MiB of it gRPC's buffers)"
        assert tier.v6.ping()
    finally:
        tier.stop()


def test_a_streamed_version_the_store_does_not_have_is_never_served(world):
    """Before the fix: a publish whose mtime was in 2100 became the replica eval mounts read,
    and the store's real version was then refused as older; a file the store does not have at all
    appeared at the tier. A stream at the prefix itself made the routed folder a file."""
    base, store = world
    real = os.urandom(2 * CHUNK + 3)
    rel = "ckpt/run/step_1/w.distcp"
    (store / rel).write_bytes(real)
    tier = Tier(base, store)
    try:
        year_2100 = 4102444800 * 10**9
        got = as_nobody(_script(tier, f"""
            fake = b"F" * 1000
            for sid, path, mtime in (("forged", {rel!r}, {year_2100}), ("ghost", "ckpt/run/step_1/ghost.bin", 5),
                                     ("prefix", "ckpt", 5)):
                desc = {{"op": "stream", "stream": sid, "gen": 0,
                        "open": {{"stream": sid, "gen": 0, "path": path, "chunk": 65536}},
                        "publish": {{"stream": sid, "gen": 0, "path": path, "size": len(fake), "mtime_ns": mtime,
                                    "crcs": [crc32c(fake)]}}}}
                out[sid] = put(desc, [(0, crc32c(fake), fake)])
        """), timeout=120)
        assert got["prefix"][0] is None and got["prefix"][1] in (errno.EACCES, errno.EINVAL), got
        # Once the tier has verified both (its batched stat refuses them), neither is ready.
        assert wait_for(lambda: len(tier.log_lines("the store does not have")) >= 2, timeout=30), \
            tier.log.read_text()[-3000:]
        for path in (rel, "ckpt/run/step_1/ghost.bin", "ckpt"):
            state = tier.v6.tier_stat(path)["state"]
            assert state not in ("ready", "copying"), (path, state)
            with pytest.raises(AgentError):
                tier.v6.read(path, 0, 10, replica_only=True)
        assert tier.v6.tier_stat("ckpt/run")["state"] != "ready"
        # The store's real version is copied and served as usual.
        st = os.stat(store / rel)
        assert tier.v6.replicate(rel, 600)["size"] == len(real)
        assert tier.v6.has(rel, st.st_size, st.st_mtime_ns)
        assert tier.v6.read(rel, 0, len(real), replica_only=True) == real
        assert tier.log_lines("the store does not have"), tier.log.read_text()[-3000:]
    finally:
        tier.stop()

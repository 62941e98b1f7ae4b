"""Blocking client of a storage agent (Arrow Flight). Used from worker threads of the mount,
from other agents (tree fan-out) and from the benchmarks."""
from __future__ import annotations

import json
import struct
from typing import Optional

import pyarrow as pa
import pyarrow.flight as fl

from agent.rpc import errno_of_flight_error


class AgentError(OSError):
    pass


def _errno_of(err: Exception) -> int:
    return errno_of_flight_error(err)


def _binary_array(items: list[bytes]) -> pa.Array:
    """A large_binary array over the bytes without copying them when there is one (a chunk)."""
    if len(items) != 1:
        return pa.array(items, pa.large_binary())
    offsets = pa.py_buffer(struct.pack("<qq", 0, len(items[0])))
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), 1, [None, offsets, pa.py_buffer(items[0])])


class AgentClient:
    def __init__(self, location: str, token: Optional[str] = None, tls_root: Optional[bytes] = None,
                 timeout_s: float = 30.0, own_connection: bool = False):
        """`own_connection`: a TCP connection of its own, not shared with other clients of the
        same agent in this process (gRPC shares them otherwise): small control calls then do not
        queue behind another client's bulk transfers on a long link."""
        self.location = location
        kwargs: dict = {}
        if tls_root:
            kwargs["tls_root_certs"] = tls_root
        if own_connection:
            kwargs["generic_options"] = [("grpc.use_local_subchannel_pool", 1)]
        self._client = fl.FlightClient(location, **kwargs)
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._opts = fl.FlightCallOptions(headers=headers, timeout=timeout_s)

    def _call(self, kind: str, body: dict) -> dict:
        try:
            results = list(self._client.do_action(fl.Action(kind, json.dumps(body).encode()), self._opts))
        except fl.FlightError as err:
            raise AgentError(_errno_of(err), f"agent {self.location}: {kind} failed: {err}") from None
        return json.loads(results[0].body.to_pybytes()) if results else {}

    def _get(self, doc: dict, what: str):
        """One do_get stream, read whole; Flight errors become AgentError naming `what`."""
        try:
            return self._client.do_get(fl.Ticket(json.dumps(doc).encode()), self._opts).read_all()
        except fl.FlightError as err:
            raise AgentError(_errno_of(err), f"agent {self.location}: {what} failed: {err}") from None

    def read(self, path: str, offset: int, length: int, replica_only: bool = False,
             expect: Optional[tuple[int, int]] = None, demand: bool = False) -> bytes:
        """Bytes of `path`; with `expect` = (size, mtime_ns), never from a replica of another
        version; with `demand` too, also while that version is still arriving (agent/demand.py)."""
        req = {"path": path, "offset": offset, "length": length, "replica_only": replica_only}
        if expect is not None:
            req["expect"] = list(expect)
        if demand:
            req["demand"] = True
        table = self._get(req, f"read {path}")
        col = table.column(0)
        return col[0].as_py() if len(col) else b""

    def sample(self, path: str, kind: str, params_json: str, aug_seed: int, allow_raw: bool = True) -> bytes:
        """The bytes of `path`'s `.tensor` file, transformed on the agent (or raw, see samples.py)."""
        table = self._get({"op": "sample", "path": path, "kind": kind, "params": params_json,
                           "aug_seed": aug_seed, "allow_raw": allow_raw}, f"sample {path}")
        return table.column(0)[0].as_py()

    def samples_ready(self, samples: list) -> list[tuple[str, int, bytes]]:
        """Of [path, kind, params_json, aug_seed] items, the `.tensor` bytes the agent has ready,
        as (path, aug_seed, bytes), in one call; samples not ready are left out."""
        table = self._get({"op": "samples_ready", "samples": samples}, "samples_ready")
        return list(zip(table.column("path").to_pylist(), table.column("seed").to_pylist(),
                        table.column("data").to_pylist()))

    def plan_window(self, keep: list, want: list, job: Optional[str] = None) -> dict:
        """`job`'s plan window: free its transformed samples not in `keep`, start making `want`
        (one call per plan step). Another job's samples are never freed by it; None: the window
        shared by every plan that names no job (older agents know no job)."""
        body: dict = {"keep": keep, "want": want}
        if job is not None:
            body["job"] = job
        return self._call("plan_window", body)

    def replicate(self, path: str, ttl_s: float, source: Optional[str] = None, priority: str = "background",
                  job: Optional[str] = None, importance: float = 1.0,
                  expect: Optional[tuple[int, int]] = None) -> dict:
        return self._call("replicate", {"path": path, "ttl_s": ttl_s, "source": source, "priority": priority,
                                        "job": job, "importance": importance,
                                        "expect": list(expect) if expect is not None else None})

    def tier_stat(self, path: str, wait_s: float = 0.0, appear_s: float = 0.0) -> dict:
        """{"state": "ready"|"copying", "size", "mtime_ns"} | {"state": "streaming"|"dir"|"absent"};
        `wait_s`: the agent waits that long for an unpublished stream of `path` to be published;
        `appear_s`: that long for an absent file whose folder is being streamed in ("expected")."""
        body: dict = {"path": path}
        if wait_s:
            body["wait_s"] = wait_s
        if appear_s:
            body["appear_s"] = appear_s
        return self._call("tier_stat", body)

    # -- write-time streams (the training mount's side) ------------------------------------------
    _CHUNKS = pa.schema([("offset", pa.int64()), ("crc", pa.int64()), ("data", pa.large_binary())])

    def stream_open(self, sid: str, gen: int, path: str, chunk: int,
                    job: Optional[str] = None) -> tuple[dict[int, int], list[int]]:
        """Start or resume a stream; the chunks the tier holds (index -> CRC) and those eval reads
        will want first (an older agent names none)."""
        doc = self._call("stream_open", {"stream": sid, "gen": gen, "path": path, "chunk": chunk, "job": job})
        return {int(i): int(c) for i, c in doc.get("held", [])}, [int(i) for i in doc.get("first", [])]

    def stream_put(self, sid: str, gen: int, chunks, opening: Optional[dict] = None,
                   publish: Optional[dict] = None, seen: Optional[int] = None) -> dict:
        """One `do_put`: the stream's open (if given), its chunks [(offset, data, crc)], its
        publish (if given); the agent's answer."""
        desc = {"op": "stream", "stream": sid, "gen": gen}
        if opening is not None:
            desc["open"] = {"stream": sid, "gen": gen, **opening}
        if publish is not None:
            desc["publish"] = {"stream": sid, "gen": gen, **publish}
        if seen is not None:
            desc["seen"] = seen
        try:
            writer, reader = self._client.do_put(fl.FlightDescriptor.for_command(json.dumps(desc).encode()),
                                                 self._CHUNKS, self._opts)
            try:
                for off, data, crc in chunks:   # a batch each: no copy of the chunk's bytes
                    writer.write_batch(pa.record_batch(
                        [pa.array([off], pa.int64()), pa.array([crc], pa.int64()), _binary_array([data])],
                        schema=self._CHUNKS))
                writer.done_writing()
                buf = reader.read()
            finally:
                writer.close()
        except fl.FlightError as err:
            raise AgentError(_errno_of(err), f"agent {self.location}: stream {sid} failed: {err}") from None
        return json.loads(buf.to_pybytes()) if buf is not None else {}

    def stream_publish(self, sid: str, gen: int, path: str, size: int, mtime_ns: int, crcs: list[int],
                       record: Optional[str] = None) -> dict:
        return self._call("stream_publish", {"stream": sid, "gen": gen, "path": path, "size": size,
                                             "mtime_ns": mtime_ns, "crcs": crcs, "record": record})

    def stream_abort(self, sid: str) -> bool:
        return bool(self._call("stream_abort", {"stream": sid}).get("dropped"))

    def signal(self, job: str, severity: float = 1.0, clear: bool = False) -> dict:
        return self._call("signal", {"job": job, "severity": severity, "clear": clear})

    def prefetch(self, path: str, version: Optional[tuple[int, int]], ranges: list[tuple[int, int]]) -> int:
        """Ask the tier to fetch these (offset, length) ranges of a file still arriving, at once;
        how many pieces it started (agent/demand.py). `version` None: the tier knows no version
        of the file yet; it holds the hint until one is announced (and answers 0 meanwhile)."""
        doc = self._call("prefetch", {"path": path, "expect": None if version is None else list(version),
                                      "ranges": [list(r) for r in ranges]})
        return int(doc.get("fetching", 0))

    def has(self, path: str, size: int, mtime_ns: int) -> bool:
        return bool(self._call("has", {"path": path, "size": size, "mtime_ns": mtime_ns}).get("has"))

    def drop(self, path: str) -> dict:
        return self._call("drop", {"path": path})

    def status(self) -> dict:
        return self._call("status", {})

    def ping(self) -> bool:
        return bool(self._call("ping", {}).get("ok"))

    def close(self) -> None:
        self._client.close()

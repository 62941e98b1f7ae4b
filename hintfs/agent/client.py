"""Blocking client of a storage agent (Arrow Flight). Used from worker threads of the mount,
from other agents (tree fan-out) and from the benchmarks.

Requests are the agent's own models (hintfs/agent/rpc.py), built with `model_construct` (the agent
validates them; an invalid one comes back as its EINVAL) and sent without their default fields;
replies are parsed into the reply models the dispatch table names (hintfs/agent/actions.py)."""
from __future__ import annotations

import errno
import logging
import struct
import threading
from typing import TypeVar

import pyarrow as pa
import pyarrow.flight as fl
from pydantic import ValidationError

from hintfs.agent import rpc
from hintfs.agent.rpc import errno_of_flight_error

log = logging.getLogger("hintfs.agent.client")


class AgentError(OSError):
    pass


def _errno_of(err: Exception) -> int:
    return errno_of_flight_error(err)


R = TypeVar("R", bound=rpc.Reply)


def _binary_array(items: list[bytes]) -> pa.Array:
    """A large_binary array over the bytes without copying them when there is one (a chunk)."""
    if len(items) != 1:
        return pa.array(items, pa.large_binary())
    offsets = pa.py_buffer(struct.pack("<qq", 0, len(items[0])))
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), 1, [None, offsets, pa.py_buffer(items[0])])


class _Versioned(fl.ClientMiddleware):
    def __init__(self, seen: _AgentVersion):
        self.seen = seen

    def sending_headers(self):
        return {rpc.VERSION_HEADER: str(rpc.PROTOCOL)}

    def received_headers(self, headers):
        if rpc.VERSION_HEADER in headers:    # (the trailers of a call come without it)
            self.seen.version = rpc.header_version(headers[rpc.VERSION_HEADER])


class _AgentVersion(fl.ClientMiddlewareFactory):
    """Sends this client's protocol version with every call and keeps the agent's, as its last
    answer gave it (1 until one did: an agent from before versions sends none)."""

    def __init__(self) -> None:
        self.version: int | None = 1

    def start_call(self, info):
        return _Versioned(self)


def _failure(location: str, what: str, err: fl.FlightError) -> AgentError:
    """The error as one AgentError without gRPC's debug context (that goes to the debug log), so
    no caller has to cut it."""
    code = _errno_of(err)
    log.debug("agent %s: %s: %s", location, what, err)
    if code == errno.EPROTONOSUPPORT:     # a version mismatch: the agent's one line, as it is
        return AgentError(code, f"agent {location}: {what}: {rpc.error_message(err)}")
    return AgentError(code, f"agent {location}: {what} failed: {rpc.without_grpc_context(str(err))}")


class AgentClient:
    def __init__(self, location: str, token: str | None = None, tls_root: bytes | None = None,
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
        self._agent_version = _AgentVersion()
        self._client = fl.FlightClient(location, middleware=[self._agent_version], **kwargs)
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._opts = fl.FlightCallOptions(headers=headers, timeout=timeout_s)
        self._status_whole = False   # the agent refused `status` without its replicas (older)
        # ranges are asked plainly of an agent that refused compressed ones (older), and of one on
        # this host's unix socket (the mount's own agent), where compressing only costs CPU
        self._plain_reads = location.startswith("grpc+unix:")
        self._plain_streams = False   # the agent refused compressed stream chunks (older)
        self.stream_raw_bytes = 0     # stream chunk bytes put, and what crossed for them (compressed)
        self.stream_wire_bytes = 0
        self._counts = threading.Lock()

    def _action(self, kind: str, body: bytes) -> bytes:
        """One action with this body; the reply's bytes (b"" when the agent sent none)."""
        try:
            results = list(self._client.do_action(fl.Action(kind, body), self._opts))
        except fl.FlightError as err:
            raise _failure(self.location, kind, err) from None
        self._check_version(kind)
        return results[0].body.to_pybytes() if results else b""

    def _check_version(self, what: str) -> None:
        """An answer of an agent this client does not understand is not taken (docs/versions.md)."""
        why = rpc.agent_refusal(self._agent_version.version)
        if why:
            raise AgentError(errno.EPROTONOSUPPORT, f"agent {self.location}: {what}: {why}")

    def _reply(self, model: type[R], data: bytes, what: str) -> R:
        try:
            return model.model_validate_json(data) if data else model.model_validate({})
        except ValidationError as err:
            raise AgentError(errno.EIO, f"agent {self.location}: {what}: unexpected reply: "
                                        f"{err.errors(include_url=False)[0]['msg']}") from None

    def _call(self, kind: str, req: rpc.Request, reply: type[R]) -> R:
        return self._reply(reply, self._action(kind, rpc.encode(req)), kind)

    def _ticket(self, body: bytes, what: str) -> pa.Table:
        """One do_get stream, read whole; Flight errors become AgentError naming `what`."""
        try:
            table = self._client.do_get(fl.Ticket(body), self._opts).read_all()
        except fl.FlightError as err:
            raise _failure(self.location, what, err) from None
        self._check_version(what)
        return table

    def read(self, path: str, offset: int, length: int, replica_only: bool = False,
             expect: tuple[int, int] | None = None, demand: bool = False, compress: bool = True) -> bytes:
        """Bytes of `path`; with `expect` = (size, mtime_ns), never from a replica of another
        version; with `demand` too, also while that version is still arriving (hintfs/agent/demand.py).
        With `compress` the agent may send the range compressed where that saves a quarter of
        its bytes (`rpc.pack_range`); an agent from before that option is asked plainly."""
        packed = compress and not self._plain_reads
        req = rpc.ReadRequest.model_construct(path=path, offset=offset, length=length, replica_only=replica_only,
                                              expect=rpc.as_version(expect) if expect is not None else None,
                                              demand=demand, compress="zstd" if packed else None)
        try:
            table = self._ticket(rpc.encode(req), f"read {path}")
        except OSError as err:
            if not packed or err.errno != errno.EINVAL or "compress" not in str(err):
                raise
            self._plain_reads = True     # (an older agent refuses the key: ask again without it)
            return self.read(path, offset, length, replica_only, expect, demand, compress=False)
        col = table.column(0)
        data: bytes = col[0].as_py() if len(col) else b""
        if packed and "raw_size" in table.column_names:
            data = rpc.unpack_range(data, table.column("raw_size")[0].as_py(), length)
        return data

    def sample(self, path: str, kind: rpc.Kind, params_json: str, aug_seed: int, allow_raw: bool = True) -> bytes:
        """The bytes of `path`'s `.tensor` file, transformed on the agent (or raw, see samples.py)."""
        req = rpc.SampleRequest.model_construct(op="sample", path=path, kind=kind, params=params_json,
                                                aug_seed=aug_seed, allow_raw=allow_raw)
        data: bytes = self._ticket(rpc.encode(req), f"sample {path}").column(0)[0].as_py()
        return data

    def samples_ready(self, samples: list) -> list[tuple[str, int, bytes]]:
        """Of [path, kind, params_json, aug_seed] items, the `.tensor` bytes the agent has ready,
        as (path, aug_seed, bytes), in one call; samples not ready are left out."""
        req = rpc.SamplesReadyRequest.model_construct(op="samples_ready", samples=[tuple(x) for x in samples])
        table = self._ticket(rpc.encode(req), "samples_ready")
        return list(zip(table.column("path").to_pylist(), table.column("seed").to_pylist(),
                        table.column("data").to_pylist()))

    def plan_window(self, keep: list, want: list, job: str | None = None, steps: list[int] | None = None,
                    step: int | None = None, costs: list[float] | None = None,
                    lookahead: int | None = None) -> rpc.PlanWindowReply:
        """`job`'s plan window: free its transformed samples not in `keep`, start making `want`
        (one call per plan step). Another job's samples are never freed by it; None: the window
        shared by every plan that names no job (older agents know no job). `steps` (each wanted
        sample's plan step), `step` (the readers' step), `costs` (the plan's est_cost_ms) and
        `lookahead` let the agent schedule by deadline (issue 40); sent only when given."""
        req = rpc.PlanWindowRequest.model_construct(keep=[tuple(x) for x in keep], want=[tuple(x) for x in want],
                                                    job=job, steps=steps, step=step, costs=costs,
                                                    lookahead=lookahead)
        return self._call("plan_window", req, rpc.PlanWindowReply)

    def replicate(self, path: str, ttl_s: float, source: str | None = None, priority: rpc.Priority = "background",
                  job: str | None = None, importance: float = 1.0,
                  expect: tuple[int, int] | None = None, holder: str | None = None) -> rpc.ReplicateReply:
        req = rpc.ReplicateRequest.model_construct(path=path, ttl_s=ttl_s, source=source, priority=priority, job=job,
                                                   importance=importance,
                                                   expect=rpc.as_version(expect) if expect is not None else None,
                                                   holder=holder)
        return self._call("replicate", req, rpc.ReplicateReply)

    def tier_stat(self, path: str, wait_s: float = 0.0, appear_s: float = 0.0) -> rpc.TierStatReply:
        """{"state": "ready"|"copying", "size", "mtime_ns"} | {"state": "streaming"|"dir"|"absent"};
        `wait_s`: the agent waits that long for an unpublished stream of `path` to be published;
        `appear_s`: that long for an absent file whose folder is being streamed in ("expected")."""
        req = rpc.TierStatRequest.model_construct(path=path, wait_s=wait_s, appear_s=appear_s)
        return self._call("tier_stat", req, rpc.TierStatReply)

    # -- write-time streams (the training mount's side) ------------------------------------------
    _CHUNKS = pa.schema([("offset", pa.int64()), ("crc", pa.int64()), ("data", pa.large_binary())])
    _PACKED_CHUNKS = _CHUNKS.append(pa.field("raw_size", pa.int64()))

    def stream_open(self, sid: str, gen: int, path: str, chunk: int,
                    job: str | None = None) -> tuple[dict[int, int], list[int]]:
        """Start or resume a stream; the chunks the tier holds (index -> CRC) and those eval reads
        will want first (an older agent names none)."""
        req = rpc.StreamOpenRequest.model_construct(stream=sid, gen=gen, path=path, chunk=chunk, job=job)
        reply = self._call("stream_open", req, rpc.StreamOpenReply)
        return {int(i): int(c) for i, c in reply.held}, [int(i) for i in reply.first]

    def stream_put(self, sid: str, gen: int, chunks, opening: dict | None = None,
                   publish: dict | None = None, seen: int | None = None,
                   compress: bool = False) -> rpc.StreamPutReply:
        """One `do_put`: the stream's open (if given: the fields of `stream_open` but the stream's),
        its chunks [(offset, data, crc)], its publish (if given: those of `stream_publish`), the
        sender's file size (`seen`); the agent's answer. With `compress`, each chunk goes
        compressed where that saves a twentieth of its bytes (`rpc.STREAM_COMPRESS_KEEP`); an
        agent from before that option gets them plainly."""
        packed = compress and not self._plain_streams
        chunks = list(chunks)        # (sent again plainly if an older agent refuses `compress`)
        req = rpc.StreamPutRequest.model_construct(
            op="stream", stream=sid, gen=gen, seen=seen, compress="zstd" if packed else None,
            open=None if opening is None else rpc.StreamOpenRequest.model_construct(stream=sid, gen=gen, **opening),
            publish=None if publish is None else rpc.StreamPublishRequest.model_construct(stream=sid, gen=gen,
                                                                                          **publish))
        schema = self._PACKED_CHUNKS if packed else self._CHUNKS
        raw = wire = 0
        try:
            writer, reader = self._client.do_put(fl.FlightDescriptor.for_command(rpc.encode(req)), schema, self._opts)
            try:
                for off, data, crc in chunks:   # a batch each: no copy of the chunk's bytes
                    cols = [pa.array([off], pa.int64()), pa.array([crc], pa.int64())]
                    small = rpc.pack_range(data, rpc.STREAM_COMPRESS_KEEP) if packed else None
                    cols.append(_binary_array([data if small is None else small]))
                    if packed:
                        cols.append(pa.array([None if small is None else len(data)], pa.int64()))
                    raw += len(data)
                    wire += len(data) if small is None else len(small)
                    writer.write_batch(pa.record_batch(cols, schema=schema))
                writer.done_writing()
                buf = reader.read()
            finally:
                writer.close()
        except fl.FlightError as err:
            failure = _failure(self.location, f"stream {sid}", err)
            if packed and failure.errno == errno.EINVAL and "compress" in str(failure):
                self._plain_streams = True    # (an older agent refuses the key: send again plainly)
                return self.stream_put(sid, gen, chunks, opening, publish, seen)
            raise failure from None
        with self._counts:
            self.stream_raw_bytes += raw
            self.stream_wire_bytes += wire
        self._check_version(f"stream {sid}")
        return self._reply(rpc.StreamPutReply, buf.to_pybytes() if buf is not None else b"", f"stream {sid}")

    def stream_publish(self, sid: str, gen: int, path: str, size: int, mtime_ns: int, crcs: list[int],
                       record: str | None = None) -> rpc.StreamPublishReply:
        req = rpc.StreamPublishRequest.model_construct(stream=sid, gen=gen, path=path, size=size, mtime_ns=mtime_ns,
                                                       crcs=crcs, record=record)
        return self._call("stream_publish", req, rpc.StreamPublishReply)

    def stream_abort(self, sid: str) -> bool:
        return self._call("stream_abort", rpc.StreamAbortRequest.model_construct(stream=sid),
                          rpc.StreamAbortReply).dropped

    def signal(self, job: str, severity: float = 1.0, clear: bool = False) -> rpc.SignalReply:
        req = rpc.SignalRequest.model_construct(job=job, severity=severity, clear=clear)
        return self._call("signal", req, rpc.SignalReply)

    def prefetch(self, path: str, version: tuple[int, int] | None, ranges: list[tuple[int, int]]) -> int:
        """Ask the tier to fetch these (offset, length) ranges of a file still arriving, at once;
        how many pieces it started (hintfs/agent/demand.py). `version` None: the tier knows no version
        of the file yet; it holds the hint until one is announced (and answers 0 meanwhile)."""
        req = rpc.PrefetchRequest.model_construct(path=path, expect=None if version is None else rpc.as_version(version),
                                                  ranges=[(offset, length) for offset, length in ranges])
        return self._call("prefetch", req, rpc.PrefetchReply).fetching

    def has(self, path: str, size: int, mtime_ns: int) -> bool:
        return self._call("has", rpc.HasRequest.model_construct(path=path, size=size, mtime_ns=mtime_ns),
                          rpc.HasReply).has

    def drop(self, path: str, holder: str | None = None) -> rpc.DropReply:
        """Remove the replica of `path`; with `holder`, release that holder's claim only."""
        return self._call("drop", rpc.DropRequest.model_construct(path=path, holder=holder), rpc.DropReply)

    def status(self, replicas: bool = True) -> rpc.StatusReply:
        """The agent's state; `replicas=False`: without the list of replicas, their number only
        (`replica_count`; cheap to ask often). An agent from before that option is asked for all."""
        if not replicas and not self._status_whole:
            try:
                return self._call("status", rpc.StatusRequest.model_construct(replicas=False), rpc.StatusReply)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                self._status_whole = True   # (an older agent refuses the key: it lists them all)
        reply = self._call("status", rpc.StatusRequest.model_construct(), rpc.StatusReply)
        if not reply.replica_count and reply.replicas:   # (an older agent's reply)
            reply = reply.model_copy(update={"replica_count": len(reply.replicas)})
        return reply

    def ping(self) -> bool:
        return self._call("ping", rpc.EmptyRequest.model_construct(), rpc.PingReply).ok

    def close(self) -> None:
        self._client.close()

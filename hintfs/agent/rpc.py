"""The agent's wire messages: one typed, bounded request model and one typed reply model per
RPC, and errors that carry an errno across the wire. Which action takes which request, runs which
handler and answers which reply: the dispatch table beside these models, `hintfs.agent.actions`.

Every request from a client is hostile until it parses here: paths go through the one resolver's
lexical rule (`hintfs.common.paths.relpath`; the store then resolves them beneath its root), numbers
have bounds, lists have lengths. A request that does not parse is EINVAL with a one-line reason.
An error crosses the wire as a FlightServerError whose `extra_info` is
`{"errno": N, "message": "..."}` (its text starts with the errno's name, for humans and logs);
`AgentClient` turns it back into an OSError with the same errno.
"""
from __future__ import annotations

import contextlib
import errno
import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Any, Literal, Union

import pyarrow as pa
import pyarrow.flight as fl
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from hintfs.common.paths import job_name, relpath
from hintfs.common.formatversion import placed

MAX_READ_BYTES = 256 << 20          # one do_get range
MAX_OFFSET = (1 << 63) - 1          # a range's end (offset + length) fits a signed 64-bit off_t
MAX_TTL_S = 30 * 86400.0            # a replica lives at most 30 days per request (renewable)
MAX_BATCH = 100_000                 # samples in one plan_window / samples_ready call
MAX_PARAMS_JSON = 64 << 10
MAX_NAME = 4096                     # job names, records, locations
MAX_HOLDER = 256                    # a replica's holder: a mount's id and a hint job's name

# -- a range on the wire, compressed where it pays (ReadRequest.compress) ---------------------------
# A restart storm is bound by the agents' NICs, and some of what every host reads compresses well:
# DCP's `.metadata` (a pickle, O(world): 1.29 MB at 4,096 ranks, 84 KB with zstd at level 1, 3 ms).
# Tensor bytes mostly do not (bf16 weights save 10-20%), so a range is sent compressed only when
# that saves at least a quarter of its bytes, and a probe of its first 64 KiB decides first, so
# incompressible ranges cost ~1% of the full attempt. The agent's token bucket and `bytes_served`
# count the bytes it sends.
COMPRESS_MIN_BYTES = 4096
COMPRESS_PROBE_BYTES = 64 << 10
COMPRESS_KEEP = 0.75                # sent compressed only when at most this share of the bytes
# A write-time stream's chunks cross the link between datacenters, the scarce one: compressed when
# that saves a twentieth (DCP's torch.save'd tensors of random values: ~0.89 at level 1).
STREAM_COMPRESS_KEEP = 0.95
_ZSTD = pa.Codec("zstd", compression_level=1)


def pack_range(data: bytes | memoryview, keep: float = COMPRESS_KEEP) -> bytes | None:
    """`data` compressed (zstd, level 1) when that leaves at most `keep` of its bytes (a quarter
    saved by default); None otherwise."""
    n = len(data)
    if n < COMPRESS_MIN_BYTES:
        return None
    if n > 2 * COMPRESS_PROBE_BYTES:
        probe = memoryview(data)[:COMPRESS_PROBE_BYTES]
        if _ZSTD.compress(probe).size > keep * COMPRESS_PROBE_BYTES:
            return None
    packed: bytes = _ZSTD.compress(data, asbytes=True)
    return packed if len(packed) <= keep * n else None


def unpack_range(packed: bytes | memoryview, raw_size: int, asked: int) -> bytes:
    """(a client) The bytes of a compressed range: `raw_size` must be within what was asked, and
    the stream must inflate to exactly that (a hostile or broken agent gets EIO, never a bigger
    allocation than the read asked for)."""
    if not 0 <= raw_size <= asked:
        raise OSError(errno.EIO, f"a compressed range of {raw_size} bytes where at most {asked} may come")
    try:
        data: bytes = _ZSTD.decompress(packed, decompressed_size=raw_size, asbytes=True)
    except (pa.ArrowException, OSError, ValueError) as err:   # (pyarrow raises OSError for a bad stream)
        raise OSError(errno.EIO, f"a compressed range does not inflate: {err}") from None
    if len(data) != raw_size:
        raise OSError(errno.EIO, f"a compressed range inflates to {len(data)} bytes, not {raw_size}")
    return data


StorePath = Annotated[str, AfterValidator(lambda v: relpath(v, what="path"))]
Int64 = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]
NonNeg = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]
Params = Annotated[str, Field(max_length=MAX_PARAMS_JSON)]
Kind = Literal["image", "video"]
Priority = Literal["anomaly", "eval", "background"]


# -- the protocol's version (docs/versions.md) --------------------------------------------------------
# Every Flight call carries the caller's protocol version in the VERSION_HEADER header and every
# answer the agent's (gRPC metadata: an agent or client older than versions ignores it; none is
# version 1, the protocol as it was). The agent refuses a call of a version outside
# OLDEST..PROTOCOL with one EPROTONOSUPPORT line naming both versions and the side to upgrade;
# it answers an older caller it accepts in that caller's version. A client refuses the answers of
# an agent older than its OLDEST the same way. One check per call, on a header: never per byte.
PROTOCOL = 1                    # the agent protocol this code speaks
OLDEST = 1                      # the oldest peer version it still understands
VERSION_HEADER = "hintfs-agent-protocol"
_MAX_VERSION = 1 << 16


def header_version(values: object) -> int | None:
    """The version in a VERSION_HEADER header's values (gRPC gives a list of str); 1 when there is
    none (a peer from before versions); None when it is not a version number."""
    if not values:
        return 1
    value = values[0] if isinstance(values, list | tuple) else values
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    text = str(value)
    if not (text.isascii() and text.isdigit()) or len(text) > 5 or not 1 <= int(text) <= _MAX_VERSION:
        return None
    return int(text)


def client_refusal(client: int | None) -> str | None:
    """(the agent) Why a call of protocol version `client` is refused; None when it is served."""
    where = placed(client, (OLDEST, PROTOCOL))
    if where is None:
        return None
    if where == "unreadable":
        return f"unreadable {VERSION_HEADER} header (this agent speaks agent protocol {PROTOCOL})"
    side = ("upgrade this agent first (agents before mounts: docs/versions.md)" if where == "newer"
            else "upgrade hintfs on the client's host (the mount or job that called)")
    return f"the client speaks agent protocol {client}, this agent {PROTOCOL} (accepts {OLDEST}..{PROTOCOL}): {side}"


def agent_refusal(agent: int | None) -> str | None:
    """(a client) Why the answers of an agent of protocol version `agent` are not taken; None
    when they are (a newer agent that served the call answered in this client's version)."""
    if agent is None:
        return f"unreadable {VERSION_HEADER} header (this client speaks agent protocol {PROTOCOL})"
    if agent < OLDEST:
        return (f"the agent speaks agent protocol {agent}, this client {PROTOCOL} (accepts {OLDEST}..{PROTOCOL}): "
                "upgrade the agent (agents before mounts: docs/versions.md)")
    return None


def as_version(version: Sequence[int]) -> tuple[int, int]:
    """A (size, mtime_ns) given as any pair (a tuple, a JSON list) as the tuple the models, the
    catalog and the streams hold."""
    size, mtime_ns = version
    return (size, mtime_ns)


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _range_fits(offset: int, length: int) -> None:
    """A range's end must fit an off_t: a read at 2^63 - 1 is EINVAL here, not an OverflowError
    (EIO) deep in a store reader."""
    if offset + length > MAX_OFFSET:
        raise ValueError(f"offset {offset} + length {length} is past the largest file offset (2^63 - 1)")


class ReadRequest(Request):
    op: Literal["read"] = "read"
    path: StorePath
    offset: NonNeg
    length: int = Field(ge=0, le=MAX_READ_BYTES)
    replica_only: bool = False
    # (size, mtime_ns) the reader opened: a replica of another version is never read (ESTALE)
    expect: tuple[NonNeg, NonNeg] | None = None
    # also while that version is still arriving (a stream or a copy): held bytes, else fetched
    demand: bool = False
    # the caller takes the range compressed (`pack_range`) where that saves a quarter of its bytes
    compress: Literal["zstd"] | None = None

    @model_validator(mode="after")
    def _fits(self):
        _range_fits(self.offset, self.length)
        return self


class SampleRequest(Request):
    op: Literal["sample"]
    path: StorePath
    kind: Kind
    params: Params
    aug_seed: Int64
    allow_raw: bool = True


class SamplesReadyRequest(Request):
    op: Literal["samples_ready"]
    samples: list[tuple[StorePath, Kind, Params, Int64]] = Field(max_length=MAX_BATCH)


class ReplicateRequest(Request):
    path: StorePath
    ttl_s: float = Field(600.0, gt=0, le=MAX_TTL_S)
    source: str | None = Field(None, max_length=MAX_NAME)
    priority: Priority = "background"
    job: str | None = Field(None, max_length=MAX_NAME)
    importance: float = Field(1.0, ge=0, le=1e6)
    expect: tuple[NonNeg, NonNeg] | None = None
    record: str | None = Field(None, max_length=MAX_NAME)
    # who keeps the copy (a mount's hint job): `drop` with the same holder releases only its claim
    holder: str | None = Field(None, min_length=1, max_length=MAX_HOLDER)


class SignalRequest(Request):
    job: str = Field(min_length=1, max_length=MAX_NAME)
    severity: float = Field(1.0, ge=0, le=1e6)
    clear: bool = False


class PathRequest(Request):
    path: StorePath


class DropRequest(PathRequest):
    """Without `holder`: the replica goes. With one: that holder's claim goes, and the replica
    with it only if no other claim is live (`Catalog.unhold`)."""
    holder: str | None = Field(None, min_length=1, max_length=MAX_HOLDER)


class HasRequest(Request):
    path: StorePath
    size: NonNeg
    mtime_ns: Int64


class LocalFdRequest(HasRequest):
    """A mount on the agent's host asks for a descriptor (`hintfs.agent.fdserver`): of the complete
    replica of exactly this version, or with `partial`, failing that, of a published stream of
    it still filling, with the ranges verified so far."""
    partial: bool = False


JobName = Annotated[str, AfterValidator(lambda v: job_name(v))]


MAX_STEP = (1 << 62) - 1            # a plan step (int64 in the plan; steps are differenced as floats)
MAX_EST_MS = 3.6e6                  # a plan's est_cost_ms (an hour)


class PlanWindowRequest(Request):
    keep: list[tuple[StorePath, Int64]] = Field(max_length=MAX_BATCH)
    want: list[tuple[StorePath, Kind, Params, Int64]] = Field(max_length=MAX_BATCH)
    # the plan's job: its prefetched samples are freed only by its own windows (hintfs/agent/samples.py);
    # None: the mounts' shared window of older clients
    job: JobName | None = None
    # Issue 40 (optional: older mounts send none, and the agent then orders as before): the plan
    # step of each `want` sample (same order), the step the job's readers are at, the plan's
    # est_cost_ms of each `want` sample (0: none), and the job's lookahead (steps).
    steps: list[Annotated[int, Field(ge=0, le=MAX_STEP)]] | None = Field(None, max_length=MAX_BATCH)
    step: int | None = Field(None, ge=0, le=MAX_STEP)
    costs: list[Annotated[float, Field(ge=0, le=MAX_EST_MS)]] | None = Field(None, max_length=MAX_BATCH)
    lookahead: int | None = Field(None, ge=0, le=4096)

    @model_validator(mode="after")
    def _aligned(self):
        for name in ("steps", "costs"):
            v = getattr(self, name)
            if v is not None and len(v) != len(self.want):
                raise ValueError(f"{name} has {len(v)} entries for {len(self.want)} wanted samples")
        if self.steps is not None and self.step is None:
            raise ValueError("steps without step")
        return self


class EmptyRequest(Request):
    pass


class StatusRequest(Request):
    # False: no replica list in the reply, their number only (`replica_count`): with tens of
    # thousands of replicas the list is most of the status's cost (~65 ms of the agent's CPU a
    # call at 11,000; bench/scale_xdc.py polls twice a second). Sent only when False (an agent
    # from before the key refuses it: `AgentClient.status` asks again without it).
    replicas: bool = True


StreamId = Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,128}$")]
MAX_CHUNKS = 1 << 20                 # chunks of one streamed file (4 TiB at 4 MiB)
MIN_CHUNK = 4096                     # the smallest chunk a stream may have (its open's `chunk`)


def crcs_bound(size: int) -> int:
    """The most CRCs a publish of a file of `size` bytes can need (one per chunk of the smallest
    size); the tier then checks the exact count against its stream's chunk."""
    return min(MAX_CHUNKS, -(-size // MIN_CHUNK))


class StreamOpenRequest(Request):
    stream: StreamId
    gen: NonNeg
    path: StorePath
    chunk: int = Field(ge=4096, le=MAX_READ_BYTES)
    job: str | None = Field(None, max_length=MAX_NAME)


class StreamPublishRequest(Request):
    stream: StreamId
    gen: NonNeg
    path: StorePath
    size: NonNeg
    mtime_ns: Int64
    crcs: list[Annotated[int, Field(ge=0, le=0xFFFFFFFF)]] = Field(max_length=MAX_CHUNKS)
    record: str | None = Field(None, max_length=MAX_NAME)
    ttl_s: float = Field(86400.0, gt=0, le=MAX_TTL_S)

    @model_validator(mode="before")
    @classmethod
    def _crcs_fit_the_size(cls, doc):
        """Before the list is validated item by item (a copy as large as the list itself): no
        more CRCs than a file of `size` bytes has chunks of the smallest size."""
        if isinstance(doc, dict):
            size, crcs = doc.get("size"), doc.get("crcs")
            if isinstance(size, int) and isinstance(crcs, list) and size >= 0 and len(crcs) > crcs_bound(size):
                raise ValueError(f"{len(crcs)} CRCs for a file of {size} bytes (at most {crcs_bound(size)})")
        return doc


class StreamPutRequest(Request):
    """The descriptor of one `do_put` of stream chunks (rows: offset, crc, data): `open` first
    when the stream is new here, `publish` after the chunks are written; one round trip for a
    small file."""
    op: Literal["stream"]
    stream: StreamId
    gen: NonNeg
    open: StreamOpenRequest | None = None
    publish: StreamPublishRequest | None = None
    # the sender's file size when it sent these chunks (at most the final size): the tier's
    # estimate of what is still to come before the publish tells the size
    seen: NonNeg | None = None
    # "zstd": the rows carry a fourth column, raw_size: a chunk's length before it was compressed
    # (`pack_range`), null for a chunk sent as it is; its CRC is of the raw bytes. An agent from
    # before the key refuses it (EINVAL naming it): `AgentClient.stream_put` sends plainly then.
    compress: Literal["zstd"] | None = None


class StreamAbortRequest(Request):
    stream: StreamId


class TierStatRequest(Request):
    path: StorePath
    # wait this long while an unpublished stream is headed for `path` (0: answer at once)
    wait_s: float = Field(0.0, ge=0, le=600)
    # wait this long for an absent file to appear while its folder is being streamed in (0: at once)
    appear_s: float = Field(0.0, ge=0, le=10)


MAX_PREFETCH_RANGES = 65536          # ranges of one file in one prefetch


class PrefetchRequest(Request):
    path: StorePath
    # (size, mtime_ns): the version the eval mount opened; None: the mount saw no version at the
    # tier yet (a stream not published), so the tier holds the hint until one is announced
    expect: tuple[NonNeg, NonNeg] | None = None
    ranges: list[tuple[NonNeg, Annotated[int, Field(ge=1, le=MAX_READ_BYTES)]]] = Field(
        min_length=1, max_length=MAX_PREFETCH_RANGES)

    @model_validator(mode="after")
    def _fits(self):
        for off, n in self.ranges:
            _range_fits(off, n)
        return self


# -- replies ----------------------------------------------------------------------------------------
class Reply(BaseModel):
    """A typed reply. It crosses the wire as JSON without its unset (None) fields, so an optional
    key is absent, as in the dicts replies were before; `AgentClient` parses it with the same
    model (unknown keys of a newer agent are ignored).

    Callers written for those dicts read a reply the same way meanwhile (`reply["state"]`,
    `reply.get("expected")`, `"size" in reply`, `reply == {"state": "absent"}`); new code reads
    attributes."""
    model_config = ConfigDict(extra="ignore", frozen=True)

    def wire(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()

    def __getitem__(self, key: str) -> Any:
        value = getattr(self, key) if key in type(self).model_fields else None
        if value is None:
            raise KeyError(key)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self.model_dump(exclude_none=True) == dict(other)
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]


class PrefetchReply(Reply):
    fetching: int = 0                  # pieces the tier started fetching


class ReplicateReply(Reply):
    path: str
    size: int
    already: bool                      # the replica was here (its TTL is renewed)
    newer: bool | None = None       # a newer version than the one asked for is here
    removed: bool | None = None     # copied, but the store removed the file since: not kept


class SignalReply(Reply):
    applied: bool                      # False: this agent schedules no link


class DropReply(Reply):
    dropped: bool


class PlanWindowReply(Reply):
    started: int = 0
    # issue 40: the steps past the readers' step the agent wants the job's next windows to reach
    # (its lookahead grown near capacity, within memory); older mounts ignore it
    lookahead: int | None = None


TierState = Literal["ready", "copying", "streaming", "dir", "absent"]


class TierStatReply(Reply):
    """What the tier holds at a path: "ready" (a replica) or "copying" (a copy, a published
    stream or a journaled version on its way) with the version; "streaming" (an unpublished
    stream: never served); "dir"; "absent", `expected` while its folder is being streamed in."""
    state: TierState
    size: int | None = None
    mtime_ns: int | None = None
    expected: bool | None = None


class StreamOpenReply(Reply):
    held: list[tuple[int, int]] = Field(default_factory=list)   # (chunk index, CRC) the tier holds
    first: list[int] = Field(default_factory=list)              # chunks eval reads will want first


PublishState = Literal["ready", "fill", "stale"]


class StreamPublishReply(Reply):
    state: PublishState
    fetch: list[int] = Field(default_factory=list)   # chunks to send (again)
    pending: bool | None = None                   # the store's word for the version is to come


class StreamPutReply(Reply):
    """A `do_put`: its open's answer (when it opened), "ready" when the stream is the replica,
    and its publish's answer (when it published)."""
    held: list[tuple[int, int]] | None = None
    first: list[int] | None = None
    state: PublishState | None = None
    fetch: list[int] | None = None
    pending: bool | None = None


class StreamAbortReply(Reply):
    dropped: bool


class HasReply(Reply):
    has: bool


class PingReply(Reply):
    ok: bool = True


class ReplicaStatus(Reply):
    size: int
    expires_in_s: float
    holders: int = 0          # live claims on it (hint jobs of mounts that asked to keep it)


class LoadStatus(Reply):
    reads_in_flight: int = 0
    reads_served: int = 0
    bytes_served: int = 0
    bytes_per_s: float = 0.0
    bytes_saved: int = 0      # not sent thanks to compressed ranges (ReadRequest.compress)


class BudgetStatus(Reply):
    bytes: int = 0
    used: int = 0
    evictions: int = 0


class FollowStatus(Reply):
    complete: list[str] = Field(default_factory=list)
    complete_at: dict[str, float] = Field(default_factory=dict)
    copied: int = 0
    queued: int = 0
    copying: list[str] = Field(default_factory=list)
    pending_markers: list[str] = Field(default_factory=list)
    errors: dict[str, str] = Field(default_factory=dict)


class StatusReply(Reply):
    replicas: dict[str, ReplicaStatus] = Field(default_factory=dict)
    replica_count: int = 0     # len(replicas), also when the request left the list out
    load: LoadStatus = Field(default_factory=LoadStatus)
    budget: BudgetStatus = Field(default_factory=BudgetStatus)
    resumed_ranges: int = 0
    copies: int = 0
    streams: dict[str, Any] = Field(default_factory=dict)
    demand: dict[str, int] = Field(default_factory=dict)
    samples: dict[str, Any] | None = None
    follow: FollowStatus | None = None
    link_bytes_by_class: dict[str, int] | None = None
    # the replicas' fds: open now, the most kept open (half the open-file limit), opens so far
    replica_fds: dict[str, int] | None = None


def rpc_error(code: int, message: str) -> fl.FlightServerError:
    """The error to raise in a Flight handler: the errno travels in `extra_info`."""
    name = errno.errorcode.get(code, "EIO")
    return fl.FlightServerError(f"{name} {message}",
                                extra_info=json.dumps({"errno": code, "message": message}).encode())


# Request bodies: a stream's publish carries one CRC per chunk, up to MAX_CHUNKS (about 11 MiB of
# JSON, 50-100 MiB of Python objects while parsed). Larger bodies are refused; those above
# LARGE_BODY are parsed one at a time, so that callers arriving together cannot multiply that.
MAX_BODY = 16 << 20
LARGE_BODY = 1 << 20
_large_parse = threading.Lock()


Body = Union[bytes, "pa.Buffer"]


@contextlib.contextmanager
def _parsing(body: Body) -> Iterator[bytes]:
    """Around the parse of a request body (JSON, then the model), the body as bytes: one over
    MAX_BODY is refused, one over LARGE_BODY is copied out of Flight's buffer and parsed only
    while no other large one is."""
    size = body.size if isinstance(body, pa.Buffer) else len(body)
    if size > MAX_BODY:
        raise rpc_error(errno.EINVAL, f"request of {size} bytes (at most {MAX_BODY})")
    if size <= LARGE_BODY:
        yield body.to_pybytes() if isinstance(body, pa.Buffer) else body
        return
    with _large_parse:
        yield body.to_pybytes() if isinstance(body, pa.Buffer) else body


def _load(body: bytes) -> dict:
    try:
        doc = json.loads(body or b"{}")
    except (ValueError, RecursionError) as err:
        raise rpc_error(errno.EINVAL, f"request is not JSON: {err}") from None
    if not isinstance(doc, dict):
        raise rpc_error(errno.EINVAL, "request must be a JSON object")
    return doc


def _validate(model: type[Request], doc: dict) -> Request:
    try:
        return model.model_validate(doc)
    except ValidationError as err:
        e = err.errors(include_url=False, include_input=False, include_context=False)[0]
        where = ".".join(str(p) for p in e["loc"]) or "(request)"
        code, message = errno.EINVAL, f"{where}: {e['msg'].removeprefix('Value error, ')}"
        del e
    except OSError as err:   # the path rule raises HintfsError (ENAMETOOLONG keeps its errno)
        code, message = err.errno or errno.EINVAL, err.strerror or str(err)
    # Raised outside the handler, and no error detail kept: nothing refers back to the request
    # (a refused publish of 2^20 CRCs kept its 40 MiB alive in a reference cycle through the
    # validator's exception until a full collection: 6 callers, 300 MiB).
    raise rpc_error(code, message)


def parse(model: type[Request], body: Body) -> Request:
    """A request body parsed into `model` (EINVAL with a one-line reason if it does not)."""
    with _parsing(body) as data:
        return _validate(model, _load(data))


def parse_local_fd(body: Body) -> LocalFdRequest:
    """A request on the agent's local fd socket (`hintfs.agent.fdserver`). Its protocol version
    is its `v` key (none: version 1, written so that an agent from before versions, which refuses
    unknown keys, still answers); a version this agent does not accept is EPROTONOSUPPORT."""
    with _parsing(body) as data:
        doc = _load(data)
        version = doc.pop("v", 1)
        why = client_refusal(version if type(version) is int and 1 <= version <= _MAX_VERSION else None)
        if why:
            raise rpc_error(errno.EPROTONOSUPPORT, why)
        return _validate(LocalFdRequest, doc)  # type: ignore[return-value]


def local_fd_request(doc: dict) -> dict:
    """A local fd request as a mount sends it: `v` only above version 1 (`parse_local_fd`)."""
    return doc if PROTOCOL == 1 else {**doc, "v": PROTOCOL}


def parse_put(command: Body) -> StreamPutRequest:
    """The descriptor of a `do_put`: only stream chunks are accepted (its publish may be large)."""
    return parse(StreamPutRequest, command)  # type: ignore[return-value]


def parse_ticket(body: Body, models: Mapping[str, type[Request]]) -> Request:
    """A `do_get` ticket: its `op` ("read" when none) names its model in `models`."""
    with _parsing(body) as data:
        doc = _load(data)
        op = doc.get("op", "read")
        model = models.get(op) if isinstance(op, str) else None
        if model is None:
            raise rpc_error(errno.EINVAL, f"unknown ticket op {op!r}")
        return _validate(model, doc)


def encode(req: Request) -> bytes:
    """A request as the client sends it: JSON of the fields not at their default (an older agent
    never sees a key it does not know unless the caller set it). Built with `model_construct`
    by the client: the agent validates, the client only types."""
    return json.dumps(req.model_dump(exclude_defaults=True, warnings=False), separators=(",", ":")).encode()


# The tail pyarrow's Flight errors carry (gRPC's debug context: ~300 characters of client state):
# for a debug log only, never a user's line.
_GRPC_CONTEXT = (". Detail:", " Detail:", ". gRPC client debug context", " gRPC client debug context",
                 ". Client context:")


def without_grpc_context(text: str) -> str:
    """`text` up to gRPC's debug context."""
    for marker in _GRPC_CONTEXT:
        text = text.split(marker, 1)[0]
    return text


def error_message(err: Exception) -> str:
    """The one-line message an agent sent with its error (its `rpc_error`), else the error's text
    up to gRPC's debug context (a call the agent never answered)."""
    info = getattr(err, "extra_info", None)
    if info:
        try:
            message = json.loads(info)["message"]
            if isinstance(message, str):
                return message[:500]
        except (ValueError, KeyError, TypeError):
            pass
    return without_grpc_context(str(err))


def errno_of_flight_error(err: Exception) -> int:
    """The errno an agent sent with its error (EACCES for a refused token, EIO otherwise)."""
    info = getattr(err, "extra_info", None)
    if info:
        try:
            code = int(json.loads(info)["errno"])
            if code > 0:
                return code
        except (ValueError, KeyError, TypeError):
            pass
    if isinstance(err, fl.FlightUnauthenticatedError):
        return errno.EACCES
    if isinstance(err, fl.FlightUnavailableError):
        return errno.EHOSTUNREACH
    if isinstance(err, fl.FlightTimedOutError):
        return errno.ETIMEDOUT
    return errno.EIO

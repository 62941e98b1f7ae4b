"""The documents jobs write to a mount's control files (`.hintfs/hints|plans|signals/<job>`).

Both sides validate with these models: the job-side helpers (`hintfs.client`, `hintfs.plan`)
before they write, the mount (`fusefs.control`) when it receives. Every path is checked by the one
path rule (`hintfs.common.paths.user_relpath`), every number has a bound, unknown keys are errors, and a
refusal is a `DocumentError` whose message is one line naming the key.
"""
from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hintfs.common.errors import validation_message
from hintfs.common.formatversion import placed
from hintfs.common.paths import user_relpath

MAX_READERS = 1 << 24       # expected readers of one file: far above any cluster's rank count
MAX_HINT_TTL_S = 7 * 86400
MAX_HINT_DEADLINE_S = 86400
MAX_LOOKAHEAD = 4096        # plan steps prepared ahead
MAX_STEP = 1 << 48


class DocumentError(ValueError):
    """A control document that is not accepted; the message is what `<name>.error` shows."""


def _path(v: object, what: str) -> str:
    try:
        return user_relpath(v, what=what)
    except OSError as err:   # pydantic reports a ValueError under the key it belongs to
        raise ValueError(err.strerror) from None


M = TypeVar("M", bound=BaseModel)

# The documents' version (docs/versions.md): a job API of a later version writes `"v": N` in each
# document; none is version 1, the documents as they were (a mount from before versions refuses
# unknown keys, so version 1 is written without it). A mount refuses a version it does not read
# in the one line `<name>.error` shows, naming both versions and the side to upgrade.
DOCUMENT_VERSION = 1
DOCUMENT_READS = (1, 1)


def document_refusal(version: object) -> str | None:
    """Why a document of `version` is not read by this mount; None when it is."""
    where = placed(version, DOCUMENT_READS)
    if where is None:
        return None
    if where == "unreadable":
        return "v: the document's version must be an integer"
    lo, hi = DOCUMENT_READS
    side = ("upgrade the mount (mounts before the jobs' images)" if where == "newer"
            else "upgrade hintfs in the job's image")
    return (f"v: a document of version {version} (the job's hintfs), this mount reads versions {lo}..{hi}: "
            f"{side}")


def _validate(model: type[M], doc: object) -> M:
    if not isinstance(doc, dict):
        raise DocumentError("(document): expected a JSON object")
    if "v" in doc:
        why = document_refusal(doc["v"])
        if why:
            raise DocumentError(why)
        doc = {k: v for k, v in doc.items() if k != "v"}
    try:
        return model.model_validate(doc)
    except ValidationError as err:
        raise DocumentError(validation_message(err, first_only=True)) from None


class HintDocument(BaseModel):
    """`.hintfs/hints/<job>`: which files the job will read, and by how many readers."""
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    files: dict[str, int] = Field(min_length=1)
    safe_readers_per_replica: int | None = Field(None, ge=1, le=MAX_READERS)
    ttl_s: float = Field(600.0, gt=0, le=MAX_HINT_TTL_S)
    deadline_s: float = Field(300.0, gt=0, le=MAX_HINT_DEADLINE_S)

    @field_validator("files")
    @classmethod
    def _paths_inside(cls, files: dict[str, int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for path, readers in files.items():
            rel = _path(path, "file")
            if rel in out:
                raise ValueError(f"{path!r} names the same file as another entry")
            if isinstance(readers, bool) or not isinstance(readers, int) or not 1 <= readers <= MAX_READERS:
                raise ValueError(f"{path!r}: expected_readers must be an integer in 1..{MAX_READERS}")
            out[rel] = readers
        return out


def parse_hint(doc: object, max_files: int) -> HintDocument:
    if isinstance(doc, dict) and isinstance(doc.get("files"), dict) and len(doc["files"]) > max_files:
        raise DocumentError(f"files: {len(doc['files'])} entries exceed replicas.max_hint_files={max_files}")
    return _validate(HintDocument, doc)


class Signal(BaseModel):
    """`.hintfs/signals/<job>`: an anomaly that gives the job folder's copies the link first."""
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    path: str = Field(min_length=1)
    kind: Literal["loss_spike", "grad_norm_spike", "clear"]
    severity: float = Field(1.0, ge=0, le=1e6)

    @field_validator("path")
    @classmethod
    def _inside(cls, v: str) -> str:
        return _path(v, "path")


def parse_signal(doc: object) -> Signal:
    return _validate(Signal, doc)


MAX_READ_HINT_RANGES = 65536      # ranges in one read hint
MAX_READ_HINT_FILES = 4096        # files in one read hint
MAX_READ_HINT_LENGTH = 256 << 20  # bytes of one range


class ReadHint(BaseModel):
    """`.hintfs/reads/<job>`: byte ranges the job is about to read, `[[path, offset, length], ...]`
    (e.g. the tensors a DCP load takes): fetched first when the file is still arriving at the
    eval tier."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    ranges: list[list] = Field(min_length=1, max_length=MAX_READ_HINT_RANGES)

    @field_validator("ranges")
    @classmethod
    def _ranges(cls, ranges: list[list]) -> list[list]:
        out = []
        for r in ranges:
            if not (isinstance(r, list) and len(r) == 3):
                raise ValueError("each range is [path, offset, length]")
            path, off, n = r
            rel = _path(path, "path")
            for what, v, lo, hi in (("offset", off, 0, (1 << 62)), ("length", n, 1, MAX_READ_HINT_LENGTH)):
                if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                    raise ValueError(f"{path!r}: {what} must be an integer in {lo}..{hi}")
            out.append([rel, off, n])
        if len({r[0] for r in out}) > MAX_READ_HINT_FILES:
            raise ValueError(f"more than {MAX_READ_HINT_FILES} files in one hint")
        return out

    def by_file(self) -> dict[str, list[tuple[int, int]]]:
        files: dict[str, list[tuple[int, int]]] = {}
        for path, off, n in self.ranges:
            files.setdefault(path, []).append((off, n))
        return files


def parse_read_hint(doc: object) -> ReadHint:
    return _validate(ReadHint, doc)


class PlanRegistration(BaseModel):
    """`.hintfs/plans/<job>`: a registration (with `plan`) or a step-only update of a registered
    job; both are validated here, the same way."""
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    plan: str | None = Field(None, description="the plan's relpath inside the mount (absent: a step "
                                "update of the job's registered plan)")
    step: int = Field(ge=0, le=MAX_STEP, description="the step the job is consuming now")
    lookahead: int | None = Field(None, ge=0, le=MAX_LOOKAHEAD,
                                     description="steps to prepare ahead (the config's default if absent)")

    @field_validator("plan")
    @classmethod
    def _plan_inside(cls, v: str | None) -> str | None:
        return None if v is None else _path(v, "plan")


def parse_plan_registration(doc: object) -> PlanRegistration:
    return _validate(PlanRegistration, doc)

"""The closed-file journal: the training-side mount records every file it publishes, one small
object per file (`<time_ns>-<host>-<pid>-<seq>.json` under `journal.dir`), so eval-side agents
learn of new checkpoint files at once instead of listing the remote store. Object names sort by
time; an object store needs no append."""
from __future__ import annotations

import itertools
import json
import os
import socket
import time

_seq = itertools.count()
_HOST = socket.gethostname().replace("/", "_").replace("-", "_")


def record_name() -> str:
    return f"{time.time_ns():020d}-{_HOST}-{os.getpid()}-{next(_seq)}.json"


def encode_record(path: str, size: int, mtime_ns: int) -> bytes:
    return json.dumps({"path": path, "size": size, "mtime_ns": mtime_ns}).encode()


def decode_record(data: bytes) -> dict:
    doc = json.loads(data)
    return {"path": str(doc["path"]), "size": int(doc["size"]), "mtime_ns": int(doc["mtime_ns"])}

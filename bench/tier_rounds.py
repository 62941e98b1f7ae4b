"""What the two eval-tier round benches share (removal_rounds.py, follower_queue.py): journal
records written as a training mount writes them, and a results file of labelled runs (a build
before a change, run from a worktree of it, beside the build after)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from hintfs.common.journal import encode_record, record_key, record_name


def write_record(store: Path, path: str, removed: bool = False) -> None:
    """The journal record a training mount writes at a close (or at an unlink: `removed`)."""
    size = mtime_ns = 0
    if not removed:
        st = os.stat(store / path)
        size, mtime_ns = st.st_size, st.st_mtime_ns
    name = record_name(removed=removed)
    dst = store / ".hintfs-journal" / record_key(name)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(encode_record(path, size, mtime_ns))


def save_run(out: Path, label: str, result: dict) -> None:
    """Put `result` into the results file `out` under `label`, beside the runs already there."""
    runs = json.loads(out.read_text()).get("runs", {}) if out.exists() else {}
    runs[label] = result
    out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")

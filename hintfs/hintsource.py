"""Derive replication hints ({relpath: expected_readers}) from checkpoints, without reading tensor data.

These run in the training job (they may import torch); the mount never does. Issue 3 adds the
helpers that write the result to `.hintfs/hints/<job>`.

Who reads what at a restart with `world_size` ranks:
- global metadata (DCP `.metadata`, Megatron `common.pt`, a safetensors index) is read by every rank;
- a tensor that DCP stored once (deduplicated replicated tensor: one chunk covering it all) is read
  by every rank that holds a replica of it, `replicated_readers` (default: all ranks);
- a tensor stored in k chunks (sharded over k ranks) is read, chunk by chunk, by the ranks that
  hold that shard: `world_size // k` of them when the load uses the same sharding (e.g. the data-
  parallel replicas of a tensor-parallel shard). `readers_of(fqn, n_chunks)` overrides this for
  other parallel layouts.
A file's expected readers is the most readers any of its chunks has.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable


def _dcp_metadata(ckpt_dir: str):
    """A DCP checkpoint's `.metadata`, read by torch's own reader (the format is torch's pickle).
    torch is imported here, at the first call: `hintfs.client` imports without it."""
    try:
        from torch.distributed.checkpoint import FileSystemReader
    except ImportError as err:
        raise ImportError("reading a DCP checkpoint needs torch: pip install 'hintfs-client[torch]' "
                          "(or torch itself)") from err
    return FileSystemReader(ckpt_dir).read_metadata()


def hints_from_dcp(ckpt_dir: str, world_size: int, replicated_readers: int | None = None,
                   readers_of: Callable[[str, int], int] | None = None,
                   metadata_name: str = ".metadata") -> dict[str, int]:
    """Hints for a `torch.distributed.checkpoint` directory; reads only its `.metadata`."""
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    meta = _dcp_metadata(ckpt_dir)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    full = replicated_readers or world_size
    chunks_of = {}
    for fqn, md in meta.state_dict_metadata.items():
        chunks_of[fqn] = len(md.chunks) if isinstance(md, TensorStorageMetadata) else 1

    def readers(fqn: str) -> int:
        n = chunks_of.get(fqn, 1)
        if readers_of is not None:
            return max(1, int(readers_of(fqn, n)))
        return full if n == 1 else max(1, world_size // n)

    hints: dict[str, int] = {metadata_name: world_size}
    for index, info in meta.storage_data.items():
        path = info.relative_path
        hints[path] = max(hints.get(path, 0), readers(index.fqn))
    return hints


def dcp_read_ranges(ckpt_dir: str, keys) -> list[tuple[str, int, int]]:
    """The byte ranges (file name, offset, length) a DCP load of the tensors named in `keys` will
    read, from the checkpoint's `.metadata` (for `hintfs.client.hint_reads`). Paths are relative
    to `ckpt_dir`."""
    meta = _dcp_metadata(ckpt_dir)
    wanted = set(keys)
    return [(info.relative_path, int(info.offset), int(info.length))
            for index, info in meta.storage_data.items() if index.fqn in wanted and info.length > 0]


def hints_from_safetensors(model_dir: str, world_size: int, readers_per_shard: int | None = None) -> dict[str, int]:
    """Hints for safetensors shards: the index is read by all ranks, each shard by
    `readers_per_shard` ranks (default: all, as when every rank loads the whole model).
    Only the headers are read (to check the files are safetensors)."""
    from safetensors import safe_open

    hints: dict[str, int] = {}
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if name.endswith(".safetensors.index.json"):
            with open(path) as f:
                json.load(f)
            hints[name] = world_size
        elif name.endswith(".safetensors"):
            with safe_open(path, framework="numpy") as f:
                f.keys()
            hints[name] = readers_per_shard or world_size
    return hints


def hints_from_megatron(ckpt_dir: str, world_size: int, tensor_parallel: int = 1,
                        pipeline_parallel: int = 1) -> dict[str, int]:
    """Hints for a Megatron-style checkpoint: `common.pt` (and `metadata.json`) are read by every
    rank; each `mp_rank_*` shard by the data-parallel replicas of its model-parallel rank."""
    dp = max(1, world_size // max(1, tensor_parallel * pipeline_parallel))
    hints: dict[str, int] = {}
    for root, _dirs, files in os.walk(ckpt_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), ckpt_dir)
            if name in ("common.pt", "metadata.json", ".metadata"):
                hints[rel] = world_size
            elif rel.startswith("mp_rank_") or "/mp_rank_" in rel:
                hints[rel] = dp
    return hints

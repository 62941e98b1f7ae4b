"""Replication hints derived from real checkpoints written by torch with several processes."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from hintfs.hintsource import hints_from_dcp, hints_from_megatron, hints_from_safetensors
from tests.conftest import REPO

torch = pytest.importorskip("torch")

SAVE = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DeviceMesh, distribute_tensor, Shard, Replicate
    out = sys.argv[1]
    dist.init_process_group("gloo")
    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
    for kind in ("sharded", "replicated"):   # one launch for both (each costs every rank a torch import)
        g = torch.Generator().manual_seed(0)
        placement = [Shard(0)] if kind == "sharded" else [Replicate()]
        sd = {f"t{i}": distribute_tensor(torch.randn(64, 8, generator=g), mesh, placement) for i in range(6)}
        dcp.save(sd, checkpoint_id=out + "/" + kind)
    dist.barrier()
    dist.destroy_process_group()
    import os
    os._exit(0)   # see tests/mount/test_real_clients.py: gloo teardown has aborted a rank after the save
""")


def _save(tmp_path):
    """Both checkpoints, saved by 2 ranks: `tmp_path`/sharded and `tmp_path`/replicated (each rank
    is a process that imports torch: 2, not 4, halves the test on a 2-core machine)."""
    script = tmp_path / "save.py"
    script.write_text(SAVE)
    out = tmp_path
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=0",
           "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", str(script), str(out)]
    (tmp_path / "tmp").mkdir(exist_ok=True)    # torchrun leaves its log folder (torchelastic_*) there
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO,
                       # gloo on loopback: resolving the host name can pick an address that
                       # aborts the rendezvous (seen once in CI); test_real_clients does the same.
                       env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                            "TMPDIR": str(tmp_path / "tmp")})
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.mark.slow
def test_dcp_sharded_and_replicated(tmp_path):
    sharded = _save(tmp_path) / "sharded"
    hints = hints_from_dcp(str(sharded), world_size=8)
    data_files = {f for f in os.listdir(sharded) if f.endswith(".distcp")}
    assert hints.pop(".metadata") == 8
    # Each rank wrote its shard of every tensor: 2 chunks, each read by 8 // 2 = 4 ranks.
    assert set(hints) == data_files and len(data_files) == 2
    assert set(hints.values()) == {4}

    replicated = tmp_path / "replicated"
    hints = hints_from_dcp(str(replicated), world_size=8)
    assert hints.pop(".metadata") == 8
    # Deduplicated replicated tensors: stored once, read by every rank.
    assert hints and set(hints.values()) == {8}
    assert set(hints) <= {f for f in os.listdir(replicated) if f.endswith(".distcp")}
    # A parallel layout given explicitly: replicas of each tensor only within groups of 2.
    assert set(hints_from_dcp(str(replicated), 8, readers_of=lambda fqn, n: 2).values()) == {2, 8}


def test_safetensors_shards(tmp_path):
    from safetensors.torch import save_file
    for i in range(3):
        save_file({"w": torch.zeros(4)}, tmp_path / f"model-0000{i}-of-00003.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    (tmp_path / "README").write_text("not a shard")
    hints = hints_from_safetensors(str(tmp_path), world_size=64, readers_per_shard=16)
    assert hints == {"model.safetensors.index.json": 64, **{f"model-0000{i}-of-00003.safetensors": 16 for i in range(3)}}


def test_megatron_layout(tmp_path):
    (tmp_path / "mp_rank_00").mkdir()
    (tmp_path / "mp_rank_01").mkdir()
    torch.save({"args": 1}, tmp_path / "common.pt")
    for r in ("mp_rank_00", "mp_rank_01"):
        torch.save({"w": torch.zeros(2)}, tmp_path / r / "model_optim_rng.pt")
    hints = hints_from_megatron(str(tmp_path), world_size=16, tensor_parallel=2)
    assert hints == {"common.pt": 16, "mp_rank_00/model_optim_rng.pt": 8, "mp_rank_01/model_optim_rng.pt": 8}

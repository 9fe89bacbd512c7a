"""Functions that run inside gloo ranks for the dcp-reader tests (not a test module).

The tests put this folder on ``sys.path`` so that ``run_ranks`` children can import them by
name (pytest's importlib mode gives test modules names that children cannot import).
"""

from __future__ import annotations

import os

CONSOLIDATION_SKIPS = ("grid", "scalar")


def full_tensors() -> dict:
    """The global tensors every rank shards; deterministic so the parent can rebuild them."""
    import torch

    g = torch.Generator().manual_seed(1234)
    return {
        "rows": torch.randn(6, 5, generator=g),
        "cols": torch.randn(4, 7, generator=g).to(torch.bfloat16),
        "grid": torch.arange(8 * 6, dtype=torch.int64).reshape(8, 6),
        "rep": torch.randn(3, 3, generator=g),
        "scalar": torch.tensor(2.5),
    }


def save_sharded(rank: int, world_size: int, out: str) -> list[str]:
    """Save DTensor-sharded state with torch.distributed.checkpoint: default format into
    ``out/dcp``, HF storage writer (one file per rank) into ``out/hf-sharded`` and the same
    with consolidation into ``out/hf-consolidated``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = full_tensors()
    placements = {"rows": [Shard(0)], "cols": [Shard(1)], "grid": [Shard(0)], "rep": [Replicate()],
                  "scalar": [Replicate()]}

    def state(skip: tuple[str, ...] = ()) -> dict:
        return {k: distribute_tensor(v, mesh, placements[k]) for k, v in full.items() if k not in skip}

    dcp.save({**state(), "step": 7}, storage_writer=dcp.FileSystemWriter(os.path.join(out, "dcp")))
    dcp.save(state(), storage_writer=dcp.HuggingFaceStorageWriter(os.path.join(out, "hf-sharded"),
                                                                   save_distributed=True))
    # torch 2.13's consolidation calls torch.finfo on every dtype (integer tensors fail) and
    # writes 0-dim tensors as zeros, so those two stay out of the consolidated save
    dcp.save(state(skip=CONSOLIDATION_SKIPS),
             storage_writer=dcp.HuggingFaceStorageWriter(os.path.join(out, "hf-consolidated"),
                                                                   save_distributed=True,
                                                                   enable_consolidation=True))
    return sorted(os.listdir(out))

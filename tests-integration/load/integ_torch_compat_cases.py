"""In-rank functions of test_integ_torch_compat: ``dcp_load.torch_compat`` beside
torch.distributed.checkpoint on real gloo ranks, with values each rank holds under a key of
its own (as torchtitan's dataloader keeps its state)."""

from __future__ import annotations

import os
import pickle
import time
from typing import Any

import dcp_load.torch_compat as compat
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp

POISON = -4242.0


def _state(rank: int, world: int) -> dict[str, Any]:
    return {"w": torch.arange(12.0).reshape(3, 4),  # replicated: the same on every rank
            "loader": {f"dp_rank_{rank}": pickle.dumps({"seen": 10 + rank}), "world_size": world},
            "shared": {"step": 5}}


def _poisoned(rank: int) -> dict[str, Any]:
    return {"w": torch.full((3, 4), POISON), "loader": {f"dp_rank_{rank}": b"", "world_size": -1},
            "shared": {"step": -1}}


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    return {"w": state["w"].tolist(), "loader": dict(state["loader"]), "shared": dict(state["shared"])}


def per_rank_values(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save with torch DCP and with torch_compat (save, async_save); load each back into
    poisoned targets with the implementation that saved it."""
    out: dict[str, Any] = {}
    tdcp.save(_state(rank, world), checkpoint_id=os.path.join(root, "torch"))
    t0 = time.perf_counter()
    compat.save(_state(rank, world), checkpoint_id=os.path.join(root, "dcp"))
    compat.async_save(_state(rank, world), checkpoint_id=os.path.join(root, "dcp-async")).result(timeout=120)
    out["save_seconds"] = time.perf_counter() - t0
    dist.barrier()
    for name, load in (("torch", tdcp.load), ("dcp", compat.load), ("dcp-async", compat.load)):
        got = _poisoned(rank)
        load(got, checkpoint_id=os.path.join(root, name))
        out[name] = _plain(got)
    return out

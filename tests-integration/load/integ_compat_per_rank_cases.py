"""In-rank functions of test_integ_compat_per_rank: tensors under a key of each rank's own
(``{"rng": {f"dp_rank_{r}": tensor}}``, as frameworks keep per-rank RNG and dataloader
state) saved by torch DCP and by dcp, loaded by dcp into poisoned targets on real gloo ranks."""

from __future__ import annotations

import os
from typing import Any

import dcp_load
import dcp_load.torch_compat as compat
import torch
import torch.distributed.checkpoint as tdcp

POISON = -4242.0


def _state(rank: int) -> dict[str, Any]:
    return {"w": torch.arange(6.0).reshape(2, 3),
            "rng": {f"dp_rank_{rank}": torch.arange(4, dtype=torch.int64) + 100 * rank},
            "loader": {f"dp_rank_{rank}": {"seen": torch.tensor([10.0 + rank])}}}


def _poisoned(rank: int) -> dict[str, Any]:
    return {"w": torch.full((2, 3), POISON),
            "rng": {f"dp_rank_{rank}": torch.full((4,), -1, dtype=torch.int64)},
            "loader": {f"dp_rank_{rank}": {"seen": torch.tensor([POISON])}}}


def _plain(state: dict[str, Any], rank: int) -> dict[str, Any]:
    key = f"dp_rank_{rank}"
    return {"w": state["w"].tolist(), "rng": state["rng"][key].tolist(),
            "seen": state["loader"][key]["seen"].tolist()}


def per_rank_tensors(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save with torch DCP and torch_compat; load each back with dcp (torch_compat and
    dcp_load.load) and with torch DCP its own, into poisoned targets."""
    tdcp.save(_state(rank), checkpoint_id=os.path.join(root, "torch"))
    compat.save(_state(rank), checkpoint_id=os.path.join(root, "compat"))
    out: dict[str, Any] = {}
    for name, load, saved in (("torch", tdcp.load, "torch"), ("compat<-torch", compat.load, "torch"),
                              ("compat", compat.load, "compat"), ("dcp", dcp_load.load, "compat")):
        got = _poisoned(rank)
        load(got, checkpoint_id=os.path.join(root, saved))
        out[name] = _plain(got, rank)
    return out


def other_ranks_key(rank: int, world: int, root: str) -> str:
    """Rank 1 asks for a per-rank key no rank saved: still refused, naming it."""
    compat.save(_state(rank), checkpoint_id=os.path.join(root, "dcp"))
    got = _poisoned(rank)
    if rank == 1:
        got["rng"]["dp_rank_7"] = torch.zeros(4, dtype=torch.int64)
    try:
        dcp_load.load(got, checkpoint_id=os.path.join(root, "dcp"))
    except dcp_load.LoadError as exc:
        return str(exc)
    return "loaded"

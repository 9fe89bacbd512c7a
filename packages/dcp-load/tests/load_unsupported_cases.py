"""Runs inside each gloo rank of test_load_unsupported.py."""

from __future__ import annotations

import torch


def load_with_module_on_rank_1(rank: int, world_size: int, checkpoint: str) -> tuple[str, bool]:
    import dcp_load

    w = torch.full((4,), float("nan"))
    state = {"w": w, "step": 0}
    if rank == 1:
        state["extra"] = torch.nn.Linear(2, 2)
    try:
        dcp_load.load(state, checkpoint_id=checkpoint, timeout=60)
    except dcp_load.LoadError as exc:
        return str(exc), bool(torch.isnan(w).all()) and state["step"] == 0
    return "", False

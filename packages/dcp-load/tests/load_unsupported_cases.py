"""Runs inside each gloo rank of test_load_unsupported.py and test_load_stateful.py."""

from __future__ import annotations

import torch


class Broken:
    """A Stateful whose ``state_dict`` or ``load_state_dict`` raises, as asked."""

    def __init__(self, fail_in: str, w: torch.Tensor):
        self.fail_in, self.w, self.loaded = fail_in, w, None

    def state_dict(self) -> dict:
        if self.fail_in == "state_dict":
            raise RuntimeError("no state here")
        return {"w": self.w}

    def load_state_dict(self, state: dict) -> None:
        if self.fail_in == "load_state_dict":
            raise RuntimeError("refused the state")
        self.loaded = dict(state)


def stateful_fails_on_rank_1(rank: int, world_size: int, checkpoint: str, fail_in: str) -> tuple[str, bool]:
    """Every rank loads a Stateful holding ``w``; on rank 1 its ``fail_in`` method raises."""
    import dcp_load

    w = torch.full((4,), float("nan"))
    obj = Broken(fail_in if rank == 1 else "", w)
    state = {"model": obj, "step": 0}
    try:
        dcp_load.load(state, checkpoint_id=checkpoint, timeout=60)
    except dcp_load.LoadError as exc:
        untouched = bool(torch.isnan(w).all()) and state["step"] == 0
        return str(exc), untouched if fail_in == "state_dict" else obj.loaded is not None or rank == 1
    return "", False

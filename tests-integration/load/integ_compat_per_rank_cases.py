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


def _values(rank: int) -> dict[str, Any]:
    import fractions

    import numpy as np

    return {"w": torch.arange(4.0),
            "sampler": {f"dp_rank_{rank}": {"epoch": rank, "order": (rank, rank + 1), "done": None}},
            "np_rng": {f"dp_rank_{rank}": np.random.RandomState(rank).get_state()},
            "share": {f"dp_rank_{rank}": fractions.Fraction(rank + 1, 3)},
            "raw": {f"dp_rank_{rank}": bytearray(b"r%d" % rank)}}


def _shown(state: dict[str, Any], rank: int) -> list[Any]:
    key = f"dp_rank_{rank}"
    rng = state["np_rng"][key]
    return [state["w"].tolist(), state["sampler"][key], str(state["share"][key]),
            [rng[0], rng[1][:4].tolist(), rng[2]] if isinstance(rng, tuple) else repr(rng),
            [type(state["raw"][key]).__name__, bytes(state["raw"][key])]]


def per_rank_values(rank: int, world: int, root: str) -> dict[str, Any]:
    """Non-tensor values under each rank's own key, plain data or not (a NumPy RNG state, a
    Fraction), saved by ``torch_compat`` (each sent to rank 0 as plain data or as the bytes
    its holder's ``torch.save`` wrote, never unpickled there), loaded by torch DCP and by dcp."""
    path = os.path.join(root, "values")
    compat.save(_values(rank), checkpoint_id=path)
    out: dict[str, Any] = {"want": _shown(_values(rank), rank)}
    for name, load in (("torch", tdcp.load), ("compat", compat.load)):
        got = {"w": torch.full((4,), POISON),
               "sampler": {f"dp_rank_{rank}": {"epoch": -1, "order": "poison", "done": "poison"}},
               "np_rng": {f"dp_rank_{rank}": "poison"}, "share": {f"dp_rank_{rank}": "poison"},
               "raw": {f"dp_rank_{rank}": b"poison"}}
        load(got, checkpoint_id=path)
        out[name] = _shown(got, rank)
    planner = tdcp.FileSystemReader(path).read_metadata().planner_data
    out["planner_data"] = {n: list(k) for n, k in planner.items() if "dp_rank" in n}
    return out

"""In-rank functions of test_integ_torch_format: one state dict (DTensors sharded on rows,
on a trailing dim and unevenly, replicated ones, bf16 and int64, a plain tensor every rank
holds, nested optimizer-style keys, JSON values) saved on 2 real gloo ranks by torch DCP's
own ``save`` and by dcp in torch DCP's format (``save``, a second save of the same holdings,
``async_save``), then loaded by torch DCP's own ``load`` and by dcp into poisoned targets of
another sharding."""

from __future__ import annotations

import os
from typing import Any

import torch

#: Checkpoint directories under the test's root, by who wrote them.
DIRS = ("torch", "dcp", "dcp-again", "dcp-async")


def full_values() -> dict[str, torch.Tensor]:
    """The whole tensors, the same on every rank (a seeded generator)."""
    g = torch.Generator().manual_seed(7)
    return {"w_rows": torch.randn(7, 4, generator=g), "w_cols": torch.randn(4, 6, generator=g),
            "bias": torch.randn(5, generator=g), "emb": torch.randn(6, 3, generator=g).to(torch.bfloat16),
            "steps": torch.arange(10, dtype=torch.int64).reshape(2, 5), "plain": torch.randn(3, 2, generator=g),
            "exp_avg": torch.randn(7, 4, generator=g)}


VALUES = {"step": 3, "name": "run-1", "lrs": [0.5, 0.25]}


def _state(mesh: Any, placements: dict[str, Any], poison: bool) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    full = full_values()
    if poison:
        full = {k: torch.full_like(v, -7) for k, v in full.items()}

    def d(name: str) -> Any:
        return distribute_tensor(full[name], mesh, [placements[name]])

    return {"model": {"w_rows": d("w_rows"), "w_cols": d("w_cols"), "bias": d("bias"), "emb": d("emb"),
                      "steps": d("steps"), "plain": full["plain"]},
            "optim": {"state": {"0": {"exp_avg": d("exp_avg")}}},
            "extra": {} if poison else dict(VALUES)}


def _placements(resharded: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard

    if resharded:
        return {"w_rows": Shard(1), "w_cols": Shard(0), "bias": Shard(0), "emb": Replicate(),
                "steps": Shard(1), "exp_avg": Replicate()}
    return {"w_rows": Shard(0), "w_cols": Shard(1), "bias": Replicate(), "emb": Shard(0),
            "steps": Shard(0), "exp_avg": Shard(0)}


def save_all(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every directory of ``DIRS`` saved from the same state; the files each holds."""
    import dcp_load
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    state = _state(mesh, _placements(False), poison=False)
    tdcp.save(state, checkpoint_id=os.path.join(root, "torch"))
    dcp_load.save(state, checkpoint_id=os.path.join(root, "dcp"), format="torch_dcp")
    dcp_load.save(state, checkpoint_id=os.path.join(root, "dcp-again"), format="torch_dcp")
    dcp_load.async_save(state, checkpoint_id=os.path.join(root, "dcp-async"), format="torch_dcp").result()
    dcp_load.save(state, checkpoint_id=os.path.join(root, "native"))  # the same holdings, the other format
    return {d: sorted(os.listdir(os.path.join(root, d))) for d in (*DIRS, "native")}


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """Whole tensors as lists (DTensors gathered), values as they are."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in _plain(value).items()})
        elif isinstance(value, torch.Tensor):
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[key] = [str(whole.dtype), whole.float().tolist()]
        else:
            out[key] = value
    return out


def load_all(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each directory loaded by torch DCP and by dcp into poisoned targets of another sharding."""
    import dcp_load
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for d in (*DIRS, "native"):
        for who, load in (("torch", tdcp.load), ("dcp", dcp_load.load)):
            if who == "torch" and d == "native":
                continue
            target = _state(mesh, _placements(True), poison=True)
            target["extra"] = {k: None for k in VALUES}
            load(target, checkpoint_id=os.path.join(root, d))
            out[f"{who}<-{d}"] = _plain(target)
    return out


def expected() -> dict[str, Any]:
    """What every load must give: the saved state, whole."""
    full = full_values()
    state = {"model": {k: full[k] for k in ("w_rows", "w_cols", "bias", "emb", "steps", "plain")},
             "optim": {"state": {"0": {"exp_avg": full["exp_avg"]}}}, "extra": dict(VALUES)}
    return _plain(state)

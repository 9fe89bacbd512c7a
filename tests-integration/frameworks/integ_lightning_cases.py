"""In-rank functions of test_integ_frameworks for Lightning Fabric: ``ModelParallelStrategy``
(FSDP2 through its ``parallelize_fn``) ``save``/``load`` with torch DCP and with dcp
swapped in.

Fabric's ``FSDPStrategy`` (FSDP1) refuses CPU in torch 2.13, so it is not run here.
The processes are the test's gloo ranks: with ``LOCAL_RANK`` set, Fabric takes them as
launched outside it and reuses their process group.
"""

from __future__ import annotations

import os
from typing import Any

import integ_frameworks_cases as fw
import torch


def _fully_shard(model: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=device_mesh["data_parallel"])


def _fabric(world: int) -> Any:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(parallelize_fn=_fully_shard, data_parallel_size=world, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    return fabric


def _setup(fabric: Any, seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = fabric.setup_module(fw.Small())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optimizer


def round_trip(rank: int, world: int, root: str) -> dict[str, Any]:
    """Train, ``fabric.save`` with each implementation, then ``fabric.load`` each into the
    poisoned model and optimizer with the implementation that saved it; the step (a plain
    value, in Fabric's ``meta.pt``) comes back too."""
    fw.launched_as(rank, world)
    fabric = _fabric(world)
    model, optimizer = _setup(fabric, seed=5)
    fw.train(model, optimizer, steps=2, backward=fabric.backward)
    out: dict[str, Any] = {"saved": _snapshot(model, optimizer), "fsdp2": _is_fsdp2(model), "files": {},
                           "dcp_calls": []}
    for impl in fw.IMPLS:
        path = os.path.join(root, f"lightning-{impl}")
        with fw.checkpoint_impl(impl) as called:
            fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
        out["dcp_calls"] += called
        out["files"][impl] = sorted(os.listdir(path))
    for impl in fw.IMPLS:
        fw.poison(model, optimizer)
        state = {"model": model, "optimizer": optimizer, "step": -77}
        with fw.checkpoint_impl(impl) as called:
            rest = fabric.load(os.path.join(root, f"lightning-{impl}"), state)
        out["dcp_calls"] += called
        out[impl] = {**_snapshot(model, optimizer), "step": state["step"], "rest": sorted(rest)}
    return out


def _snapshot(model: Any, optimizer: Any) -> dict[str, Any]:
    """``fw.snapshot`` of the module and optimizer inside Fabric's wrappers (the names they save under)."""
    return fw.snapshot(model.module, optimizer.optimizer)


def _is_fsdp2(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model.module, FSDPModule)

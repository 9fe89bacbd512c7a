"""In-rank functions of test_integ_frameworks: Accelerate's and Lightning Fabric's
checkpoint calls, run once with torch.distributed.checkpoint and once with
``dcp_load.torch_compat`` swapped in for it (its ``save``, ``load`` and ``async_save``
put on torch's module, where both frameworks look them up when they save or load).

The model is a small module of this file, fully sharded with FSDP2 on gloo ranks.
Values cross back to the test as NumPy arrays of whole tensors, gathered on every rank
(``integ_torchtitan_cases._full``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import dcp_load.torch_compat
import integ_torchtitan_cases as titan_cases
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp

POISON = titan_cases.POISON
IMPLS = ("torch", "dcp")
IN, HIDDEN, OUT = 16, 24, 8


class Small(torch.nn.Module):
    """Two linear layers; ``forward`` returns a scalar loss."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(IN, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))).pow(2).mean()


@contextlib.contextmanager
def checkpoint_impl(impl: str) -> Iterator[list[str]]:
    """torch DCP's ``save``/``load``/``async_save`` replaced by dcp's when ``impl == "dcp"``;
    yields the names of dcp's functions called inside the block (the proof the frameworks
    took them)."""
    names = ("save", "load", "async_save")
    original = {n: getattr(torch_dcp, n) for n in names}
    called: list[str] = []
    if impl == "dcp":
        for n in names:
            setattr(torch_dcp, n, _recorded(n, called))
    try:
        yield called
    finally:
        for n, f in original.items():
            setattr(torch_dcp, n, f)


def _recorded(name: str, called: list[str]) -> Any:
    function = getattr(dcp_load.torch_compat, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        called.append(name)
        return function(*args, **kwargs)

    return call


def launched_as(rank: int, world: int) -> None:
    """The variables a launcher (torchrun) sets, by which both frameworks find their rank."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), NODE_RANK="0",
                      OMP_NUM_THREADS="1")  # as run_ranks sets torch's; Accelerate warns when unset


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, backward: Any = None) -> None:
    """``steps`` steps on the same seeded inputs on every rank."""
    gen = torch.Generator().manual_seed(17)
    for _ in range(steps):
        loss = model(torch.randn(4, IN, generator=gen))
        (backward or torch.Tensor.backward)(loss)
        optimizer.step()
        optimizer.zero_grad()


def poison(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Parameters and every optimizer state tensor (a step count included) filled with POISON."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(POISON)
        for state in optimizer.state.values():
            for value in state.values():
                value.fill_(POISON)


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state as full arrays, under torch DCP's state-dict names."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": {k: titan_cases._full(v) for k, v in get_model_state_dict(model).items()},
            "optim": _arrays(get_optimizer_state_dict(model, optimizer))}


def _arrays(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _arrays(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_arrays(v) for v in tree]
    return titan_cases._full(tree)


def barrier_then(rank: int, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on rank 0 only, between barriers (a no-dist read every rank then sees)."""
    dist.barrier()
    out = fn(*args) if rank == 0 else None
    dist.barrier()
    return out

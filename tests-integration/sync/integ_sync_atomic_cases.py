"""Functions that run inside ranks for test_integ_sync_atomic (not a test module).

Two jobs launched apart (a "trainer" job of 2 ranks, an "engine" job of 2), joined by
``dcp_load.transfer_group`` as in integ_sync_cases. A transfer fails part way (a trainer
rank raises, or exits, after the dense pieces were broadcast and before the sparse ones
are); the engine's destinations are then compared with the previous step bit for bit, and
a following transfer in a new group (on a second port) must give the next step exactly.
Engine rank r holds columns [32r, 32r + 32) of each bf16 tensor; trainer rank h rows
[64h, 64h + 64) (``Shard(0)``). Destinations are poisoned before the first transfer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import dcp_load
import torch
from dcp_platform import group_key
from group_guards import poison
from integ_sync_cases import join, linger, truth
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from transfer_faults import failing_sparse_round

SHAPES = {"a": (128, 64), "b": (128, 64), "c": (128, 64)}
#: Step 2's changes: "a" mostly (it goes whole, in the dense rounds), "b" a little (bitmask
#: + values, in the sparse round that runs after them), "c" not at all.
SHARES = {"a": 0.95, "b": 0.02}


def full(step: int) -> dict[str, torch.Tensor]:
    """Every tensor's whole value at ``step`` (the same on every rank)."""
    now = {n: truth(n, 0, s).bfloat16() for n, s in SHAPES.items()}
    for k in range(1, step + 1):
        for name, share in SHARES.items():
            g = torch.Generator().manual_seed(sum(map(ord, name)) * 31 + k)
            picks = torch.randperm(now[name].numel(), generator=g)[:round(now[name].numel() * share)]
            now[name].view(-1)[picks] += k
    return now


def _engine(rank: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    tensors = {n: torch.empty(s, dtype=torch.bfloat16).chunk(2, 1)[rank].contiguous() for n, s in SHAPES.items()}
    for t in tensors.values():
        poison(t)
    return dcp_load.engine_shards({n: (t, (0, rank * t.shape[1])) for n, t in tensors.items()}, SHAPES), tensors


@contextlib.contextmanager
def _fail_to_move() -> Iterator[None]:
    """Inside, this rank raises as its pieces start to move (nothing sent by it)."""
    from dcp_load.transferring import _transfer

    def move(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected: trainer rank 1 fails as the data starts to move")

    saved, _transfer.move = _transfer.move, move
    try:
        yield
    finally:
        _transfer.move = saved


def _matches(tensors: dict[str, torch.Tensor], values: dict[str, torch.Tensor], rank: int) -> list[str]:
    """Names whose destination equals ``values``' columns of this engine rank, bit for bit."""
    return sorted(n for n, t in tensors.items()
                  if torch.equal(t.view(torch.int16), values[n].chunk(2, 1)[rank].contiguous().view(torch.int16)))


def _report(report: Any) -> dict[str, Any]:
    return {"received": report.bytes_received, "kept": report.bytes_kept, "reused": report.plan_reused}


def delta_fails_midway(rank: int, world: int, side: str, port: int, sizes: tuple[int, int], port2: int,
                       how: str) -> dict[str, Any]:
    """Step 1 (delta=True: the first call, all), step 2 (delta=True) in which trainer rank 1
    fails (``how``: "raise" or "exit") after the dense pieces moved, then step 3 with
    delta=True in a new group: of the same 2 + 2 ranks after a raise, of trainer rank 0
    (passing whole tensors) and the 2 engine ranks after an exit."""
    mesh = init_device_mesh("cpu", (world,))
    group = join(side, rank, port, sizes)
    shards, tensors = _engine(rank) if side == "engine" else ({}, {})
    out: dict[str, Any] = {}
    for step in (1, 2):
        src = ({n: distribute_tensor(v, mesh, [Shard(0)]) for n, v in full(step).items()} if side == "trainer"
               else {})
        fails = step == 2 and side == "trainer" and rank == 1
        start = time.monotonic()
        try:
            with failing_sparse_round(how, "trainer rank 1 fails after the dense pieces were broadcast") if fails else contextlib.nullcontext():
                out[f"step{step}"] = _report(dcp_load.transfer(src, shards, process_group=group, delta=True,
                                                               timeout=10))
        except dcp_load.LoadError as exc:
            out[f"error{step}"] = str(exc)
            out["seconds"] = time.monotonic() - start
        out[f"matches{step}"] = _matches(tensors, full(1), rank) if side == "engine" else []
    linger(group, side, rank, 3 if how == "exit" else 4)
    start = time.monotonic()
    group.close(timeout=5)  # after a failed call (a dead peer only makes the host wait the 5 s)
    out["close_seconds"] = time.monotonic() - start
    sizes3 = sizes if how == "raise" else (1, sizes[1])
    group3 = join(side, rank, port2, sizes3)
    src = ({n: distribute_tensor(v, mesh, [Shard(0)]) for n, v in full(3).items()} if how == "raise"
           else full(3)) if side == "trainer" else {}
    out["step3"] = _report(dcp_load.transfer(src, shards, process_group=group3, delta=True, timeout=60))
    out["matches3"] = _matches(tensors, full(3), rank) if side == "engine" else []
    group3.close()
    return out


def full_fails_midway(rank: int, world: int, side: str, port: int, sizes: tuple[int, int], port2: int,
                      delta: bool) -> dict[str, Any]:
    """A transfer that writes in place fails part way (trainer rank 1 raises as it starts to
    move): the second call with delta=False, or the first call of a delta plan. Every rank's
    error says the destinations may hold a mix of two steps and that the next transfer sends
    everything; the plan is forgotten; a delta=True transfer in a new group sends everything."""
    from dcp_load.transferring import _kept

    mesh = init_device_mesh("cpu", (world,))
    group = join(side, rank, port, sizes)
    shards, tensors = _engine(rank) if side == "engine" else ({}, {})
    out: dict[str, Any] = {}
    for step in (1, 2) if not delta else (2,):
        src = ({n: distribute_tensor(v, mesh, [Shard(0)]) for n, v in full(step).items()} if side == "trainer"
               else {})
        fails = step == 2 and side == "trainer" and rank == 1
        try:
            with _fail_to_move() if fails else contextlib.nullcontext():
                out[f"step{step}"] = _report(dcp_load.transfer(src, shards, process_group=group, delta=delta,
                                                               timeout=10))
        except dcp_load.LoadError as exc:
            out[f"error{step}"] = str(exc)
    out["plans_kept"] = len(_kept._PLANS.get(group_key(group), []))
    linger(group, side, rank, 4)
    group.close(timeout=5)
    group3 = join(side, rank, port2, sizes)
    src = {n: distribute_tensor(v, mesh, [Shard(0)]) for n, v in full(3).items()} if side == "trainer" else {}
    if side == "engine":
        for t in tensors.values():
            poison(t)
    out["step3"] = _report(dcp_load.transfer(src, shards, process_group=group3, delta=True, timeout=60))
    out["matches3"] = _matches(tensors, full(3), rank) if side == "engine" else []
    group3.close()
    return out

"""Functions that run inside ranks for test_integ_delta_atomic (not a test module).

One world of 2 gloo ranks, each both trainer and engine: rank r holds rows [64r, 64r + 64)
of each bf16 tensor (``Shard(0)``) and fills the whole tensor, so that it copies its own
half locally and receives the other. Step 2 (``delta=True``, after the plan's first call)
fails on rank 1 after the dense pieces moved; every destination must still hold step 1,
and a transfer over a new process group gives step 3 exactly.
"""

from __future__ import annotations

import contextlib
from typing import Any

import dcp_load
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from transfer_faults import failing_sparse_round

SHAPE = (128, 64)
#: Step k's changes: "a" mostly (whole, in the dense round: local copy and broadcast), "b"
#: a little (bitmask + values, in the sparse round after it), "c" not at all.
SHARES = {"a": 0.95, "b": 0.02}


def full(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    now = {n: torch.randn(SHAPE, generator=g).bfloat16() for n in ("a", "b", "c")}
    for k in range(1, step + 1):
        for name, share in SHARES.items():
            picks = torch.randperm(now[name].numel(), generator=torch.Generator().manual_seed(k * 7 + len(name)))
            now[name].view(-1)[picks[:round(now[name].numel() * share)]] += k
    return now


def _src(mesh: Any, step: int, rank: int) -> dict[str, Any]:
    # from local shards: no collective (the default group is not used after the failure)
    return {n: DTensor.from_local(v.chunk(2)[rank].clone(), mesh, [Shard(0)], run_check=False)
            for n, v in full(step).items()}


def colocated_delta_fails(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    dst = {n: torch.empty(SHAPE, dtype=torch.bfloat16) for n in ("a", "b", "c")}
    for t in dst.values():
        t.view(torch.uint8).fill_(0x7F)  # poisoned: no step holds it
    out: dict[str, Any] = {}
    for step in (1, 2):
        src = _src(mesh, step, rank)
        try:
            with failing_sparse_round("raise", "rank 1 fails after the dense pieces moved") if step == 2 and rank == 1 else contextlib.nullcontext():
                report = dcp_load.transfer(src, dst, delta=True, timeout=10)
            out[f"step{step}"] = {"copied": report.bytes_copied, "received": report.bytes_received}
        except dcp_load.LoadError as exc:
            out[f"error{step}"] = str(exc)
        out[f"matches{step}"] = sorted(n for n, t in dst.items() if torch.equal(t.view(torch.int16),
                                                                                 full(1)[n].view(torch.int16)))
    group = dist.new_group(list(range(world)))  # the default group may hold an unfinished collective
    src = _src(mesh, 3, rank)
    report = dcp_load.transfer(src, dst, delta=True, timeout=60, process_group=group)
    out["step3"] = {"copied": report.bytes_copied, "received": report.bytes_received, "kept": report.bytes_kept}
    out["matches3"] = sorted(n for n, t in dst.items() if torch.equal(t.view(torch.int16),
                                                                       full(3)[n].view(torch.int16)))
    return out

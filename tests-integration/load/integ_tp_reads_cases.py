"""Rank side of test_integ_tp_reads: row-parallel ``Shard(1)`` weights and a conv kernel
sharded on its last dim (``Shard(3)``) loaded into poisoned DTensors on 2 gloo ranks, from
a Hugging Face file and from torch DCP's own files, each value compared with ``narrow`` of
the saved tensor; the bytes each rank read and fetched are returned."""

from __future__ import annotations

import os
import warnings
from typing import Any

SHAPES = {"o_proj.weight": ((96, 64), 1), "down_proj.weight": ((64, 160), 1), "conv.weight": ((16, 8, 3, 3), 3),
          "q_proj.weight": ((64, 64), 0)}


def full_tensors() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(shape, generator=g).to(torch.bfloat16) for n, (shape, _) in SHAPES.items()}


def write(root: str) -> None:
    """The same tensors as a Hugging Face file (``root/hf``) and torch DCP's (``root/dcp``)."""
    import torch.distributed.checkpoint as tdcp
    from safetensors.torch import save_file

    full = full_tensors()
    os.makedirs(os.path.join(root, "hf"), exist_ok=True)
    save_file(full, os.path.join(root, "hf", "model.safetensors"))
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        tdcp.save(full, checkpoint_id=os.path.join(root, "dcp"), no_dist=True)


def tp_reads_cases(rank: int, world: int, root: str) -> dict[str, Any]:
    import dcp_load
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors()
    out: dict[str, Any] = {}
    for fmt in ("hf", "dcp"):
        for dtype in (torch.bfloat16, torch.float32):  # the saved dtype, and a cast
            state = {n: distribute_tensor(torch.empty(shape, dtype=dtype), mesh, [Shard(d)], src_data_rank=None)
                     for n, (shape, d) in SHAPES.items()}
            for t in state.values():
                t.to_local().view(torch.uint8).fill_(0x7F)
            report = dcp_load.load(state, checkpoint_id=os.path.join(root, fmt))
            errors = []
            for n, (shape, d) in SHAPES.items():
                step = -(-shape[d] // world)
                start = min(rank * step, shape[d])
                want = full[n].narrow(d, start, min(step, shape[d] - start)).to(dtype)
                if not torch.equal(state[n].to_local(), want):
                    errors.append(f"rank {rank}: {n} from {fmt} as {dtype} differs")
            out[f"{fmt}/{dtype}"] = {"errors": errors, "bytes_read": report.bytes_read,
                                     "held": sum(t.to_local().numel() * full[n].element_size()
                                                 for n, t in state.items()),
                                     "fetched": report.bytes_fetched, "job_fetched": report.job_bytes_fetched,
                                     "job_unique": report.job_unique_bytes,
                                     "saved": sum(t.numel() * t.element_size() for t in full.values())}
    return out

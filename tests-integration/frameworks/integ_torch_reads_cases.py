"""In-rank functions of test_integ_frameworks: torch.distributed.checkpoint itself (never
swapped) reading the checkpoints the frameworks wrote through dcp, beside the ones they
wrote through torch DCP.

A new launch resumes each framework's folders with ``torch.distributed.checkpoint.load``
into a poisoned FSDP2 model and optimizer (the state-dict layout each framework saves:
Accelerate's ``{"model": ...}`` and ``{"optimizer": ...}`` in two folders, Fabric's
``{"model": ..., "optimizer": ...}`` in one).
"""

from __future__ import annotations

import os
from typing import Any

import integ_accelerate_cases as accelerate_cases
import integ_frameworks_cases as fw
import torch
import torch.distributed.checkpoint as torch_dcp

#: Per framework: the folders torch DCP reads, each with the top-level keys saved in it.
FOLDERS = {"accelerate": ((accelerate_cases.MODEL_DIR, ("model",)), (accelerate_cases.OPTIM_DIR, ("optimizer",))),
           "lightning": ((".", ("model", "optimizer")),)}


def _fresh(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An FSDP2 model and an AdamW with its state made (one step), as a resumed job has them."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = fully_shard(fw.Small())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fw.train(model, optimizer, steps=1)
    return model, optimizer


def _torch_resume(model: torch.nn.Module, optimizer: torch.optim.Optimizer, root: str, framework: str) -> None:
    """torch DCP's ``load`` of every folder ``framework`` saved under ``root``, then the values set on the model and
    optimizer through torch's state-dict API."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    for folder, keys in FOLDERS[framework]:
        part = {k: state[k] for k in keys}
        torch_dcp.load(part, checkpoint_id=os.path.join(root, folder))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def resume(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each framework's torch-written and dcp-written folders loaded by torch DCP into the
    poisoned model and optimizer."""
    out: dict[str, Any] = {}
    for framework in FOLDERS:
        for impl in fw.IMPLS:
            model, optimizer = _fresh(seed=9)
            fw.poison(model, optimizer)
            _torch_resume(model, optimizer, os.path.join(root, f"{framework}-{impl}"), framework)
            out[f"{framework}-{impl}"] = fw.snapshot(model, optimizer)
    return out

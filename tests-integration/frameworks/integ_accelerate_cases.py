"""In-rank functions of test_integ_frameworks for Hugging Face Accelerate: FSDP2
``save_state``/``load_state`` with torch DCP and with dcp swapped in.

On CPU Accelerate sets up MULTI_CPU and leaves its FSDP plugin unused (FSDP1, its
CUDA-era default, refuses CPU in torch 2.13); setting the state's distributed type to
FSDP and its plugin after the accelerator is built is what makes ``prepare`` apply FSDP2
(``fully_shard``) on gloo, and ``save_state`` write the model and optimizer through
``torch.distributed.checkpoint.save`` with a ``FileSystemWriter``.
"""

from __future__ import annotations

import os
from typing import Any

import integ_frameworks_cases as fw
import torch

#: Accelerate's folder names for the first model's and optimizer's torch DCP checkpoints.
MODEL_DIR, OPTIM_DIR = "pytorch_model_fsdp_0", "optimizer_0"


def _accelerator() -> Any:
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT",
                                            reshard_after_forward=True)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    # AcceleratorState copies PartialState's values again each time one is built (prepare
    # builds one): both are set.
    PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin  # set only on the accelerator types the plugin takes
    return accelerator


def _prepared(accelerator: Any, seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = fw.Small()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return accelerator.prepare(model, optimizer)


def round_trip(rank: int, world: int, root: str) -> dict[str, Any]:
    """Train, ``save_state`` with each implementation, then ``load_state`` each folder into
    the poisoned model and optimizer with the implementation that saved it."""
    fw.launched_as(rank, world)
    accelerator = _accelerator()
    model, optimizer = _prepared(accelerator, seed=3)
    fw.train(model, optimizer, steps=2, backward=accelerator.backward)
    out: dict[str, Any] = {"saved": fw.snapshot(model, optimizer), "fsdp2": _is_fsdp2(model), "files": {},
                           "dcp_calls": []}
    for impl in fw.IMPLS:
        with fw.checkpoint_impl(impl) as called:
            accelerator.save_state(os.path.join(root, f"accelerate-{impl}"))
        out["dcp_calls"] += called
        out["files"][impl] = {d: sorted(os.listdir(os.path.join(root, f"accelerate-{impl}", d)))
                              for d in (MODEL_DIR, OPTIM_DIR)}
    for impl in fw.IMPLS:
        fw.poison(model, optimizer)
        with fw.checkpoint_impl(impl) as called:
            accelerator.load_state(os.path.join(root, f"accelerate-{impl}"))
        out["dcp_calls"] += called
        out[impl] = fw.snapshot(model, optimizer)
    return out


def _is_fsdp2(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return isinstance(model, FSDPModule) and all(isinstance(p, DTensor) for p in model.parameters())


def merge(rank: int, world: int, root: str) -> dict[str, Any]:
    """``accelerate.utils.merge_fsdp_weights`` on each implementation's model folder (it reads
    with torch DCP's own reader, on the main process); the merged safetensors file as arrays."""
    from accelerate.utils import merge_fsdp_weights
    from safetensors.numpy import load_file

    fw.launched_as(rank, world)
    out: dict[str, Any] = {}
    for impl in fw.IMPLS:
        merged = os.path.join(root, f"accelerate-{impl}-merged")
        merge_fsdp_weights(os.path.join(root, f"accelerate-{impl}", MODEL_DIR), merged)
        out[impl] = load_file(os.path.join(merged, "model.safetensors"))
    return out

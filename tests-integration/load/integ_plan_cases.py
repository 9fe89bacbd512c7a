"""Functions that run inside ranks for test_integ_plan.py (not a test module).

A small Llama-like model saved as one Hugging Face safetensors file, held by 4 gloo ranks
as DP2 x TP2 DTensors laid out the way ``dcp plan`` assumes (README, "``dcp plan``"):
column-parallel weights ``Shard(0)`` over tp, row-parallel ones (``o_proj``,
``down_proj``) ``Shard(1)``, 1-D norms replicated, every tensor replicated over dp. Each
rank poisons its targets, loads them in each ``broadcast_replicated_tensors`` mode,
checks every value and returns what its report says it read and broadcast.
"""

from __future__ import annotations

import os
from typing import Any

import torch

H, INTER, VOCAB, LAYERS = 32, 48, 96, 2
#: --broadcast of ``dcp plan`` -> load's broadcast_replicated_tensors
MODES = {"auto": "auto", "true": True, "false": False}


def shapes() -> dict[str, tuple[int, ...]]:
    out = {"model.embed_tokens.weight": (VOCAB, H)}
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        out |= {p + "input_layernorm.weight": (H,), p + "self_attn.q_proj.weight": (H, H),
                p + "self_attn.o_proj.weight": (H, H), p + "mlp.up_proj.weight": (INTER, H),
                p + "mlp.down_proj.weight": (H, INTER)}
    return out | {"model.norm.weight": (H,), "lm_head.weight": (VOCAB, H)}


def tp_placement(name: str, ndim: int) -> str:
    """"S0", "S1" or "R" over tp (dp is always Replicate), as written in the module docstring."""
    if ndim < 2:
        return "R"
    return "S1" if ("o_proj" in name or "down_proj" in name) else "S0"


def full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shapes()[name], generator=g)


def write_hf(path: str) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({n: full(n) for n in shapes()}, os.path.join(path, "model.safetensors"))
    return path


def _state(mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    out = {}
    for name, shape in shapes().items():
        tp = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}[tp_placement(name, len(shape))]
        d = distribute_tensor(torch.zeros(shape), mesh, [Replicate(), tp])
        d.to_local().fill_(float("nan"))  # poisoned: no saved value is NaN
        assert isinstance(d, DTensor)
        out[name] = d
    return out


def _check(state: dict[str, Any]) -> list[str]:
    return [n for n, d in state.items() if not torch.equal(d.full_tensor(), full(n))]


def load_modes(rank: int, world: int, paths: dict[str, str]) -> dict[str, Any]:
    """{(where, mode): {"read", "broadcasts", "bad"}} for each checkpoint in ``paths``
    ({where: directory or s3:// URI}) and each mode of ``MODES``."""
    import dcp_load
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out: dict[str, Any] = {}
    for where, path in paths.items():
        for mode, setting in MODES.items():
            state = _state(mesh)
            report = dcp_load.load(state, checkpoint_id=path, broadcast_replicated_tensors=setting, timeout=120)
            out[f"{where}/{mode}"] = {"read": report.bytes_read, "broadcasts": report.broadcasts,
                                      "bad": _check(state)}
    return out

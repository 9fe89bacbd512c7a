"""Functions that run inside 4 gloo ranks for the FSDP2 + TP tests (not a test module).

A small decoder is built as torchtitan builds one: ``parallelize_module`` with colwise and
rowwise plans over the ``tp`` mesh dimension, then ``fully_shard`` over ``dp`` on a
(dp=2, tp=2) CPU mesh, which gives placements ``[_StridedShard(0, sf=2), Shard(0)]``. One
AdamW step gives the optimizer state. It is saved with ``torch.distributed.checkpoint.save``
and with ``dcp_load.save``, then loaded into four layouts (the same FSDP2 + TP, TP only over
4 ranks, FSDP only over 4 ranks, one process holding whole tensors) with model and
optimizer state dicts from ``get_state_dict``. Every destination is poisoned (NaN) first,
and every value dcp loads must equal bit for bit what ``torch.distributed.checkpoint.load``
gives for the same poisoned destination. All scenarios run in one launch.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
from torch import nn

DIM, HIDDEN, VOCAB, LAYERS = 8, 12, 16, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.wo(torch.tanh(self.wq(self.norm(x))))
        return x + self.w2(torch.relu(self.w1(x)))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(x)


def _tp(model: Decoder, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in model.layers:
        parallelize_module(layer, mesh, {"wq": ColwiseParallel(), "wo": RowwiseParallel(),
                                         "w1": ColwiseParallel(), "w2": RowwiseParallel()})
    parallelize_module(model, mesh, {"embed": RowwiseParallel(), "output": ColwiseParallel()})


def _fsdp(model: Decoder, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build(layout: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh model in ``layout`` ("fsdp_tp", "tp", "fsdp", "single") and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = Decoder()
    if layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        _tp(model, mesh["tp"])
        _fsdp(model, mesh["dp"])
    elif layout == "tp":
        _tp(model, init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)))
    elif layout == "fsdp":
        _fsdp(model, init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 5), generator=g)
    model(tokens).float().pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def state_dicts(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _walk(obj: Any, prefix: str = ""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list) and any(isinstance(v, (dict, torch.Tensor)) for v in obj):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{prefix}.{i}")
    else:
        yield prefix, obj


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def poison(sd: dict[str, Any]) -> None:
    with torch.no_grad():
        for _, v in _walk(sd):
            if isinstance(v, torch.Tensor):
                _local(v).fill_(float("nan"))


def placements(sd: dict[str, Any]) -> dict[str, str]:
    from torch.distributed.tensor import DTensor

    return {k: str(list(v.placements)) for k, v in _walk(sd) if isinstance(v, DTensor)}


def compare(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Every entry of ``got`` equals ``want`` bit for bit, and no tensor kept its poison."""
    errors = []
    want_flat = dict(_walk(want))
    for name, v in _walk(got):
        w = want_flat.get(name)
        if isinstance(v, torch.Tensor):
            a, b = _local(v), _local(w)
            if torch.isnan(a).any():
                errors.append(f"{name}: still poisoned after dcp_load.load")
            elif a.shape != b.shape or not torch.equal(a, b):
                errors.append(f"{name}: dcp {a.flatten()[:4].tolist()} != torch DCP {b.flatten()[:4].tolist()}")
        elif v != w:
            errors.append(f"{name}: value {v!r} != torch DCP {w!r}")
    return errors


def _scenario(out: dict, key: str, fn: Any, *args: Any) -> None:
    try:
        out[key] = {"errors": fn(*args) or []}
    except Exception:  # noqa: BLE001 - the test asserts on the message
        out[key] = {"errors": [traceback.format_exc()]}


def _save(root: str) -> list[str]:
    import dcp_load
    import torch.distributed.checkpoint as dcp

    model, optim = build("fsdp_tp")
    train_step(model, optim, seed=1)
    sd = state_dicts(model, optim)
    dcp.save(sd, checkpoint_id=os.path.join(root, "torch"))
    dcp_load.save(sd, checkpoint_id=os.path.join(root, "native"), allow_pickle=True)
    return []


def _load(root: str, layout: str, source: str) -> list[str]:
    import dcp_load
    import torch.distributed.checkpoint as dcp

    single = layout == "single"
    model, optim = build(layout)
    got = state_dicts(model, optim)
    model2, optim2 = build(layout)
    want = state_dicts(model2, optim2)
    poison(got)
    poison(want)
    dcp.load(want, checkpoint_id=os.path.join(root, "torch"), no_dist=single)
    dcp_load.load(got, checkpoint_id=os.path.join(root, source), allow_pickle=True, no_dist=single)
    errors = compare(got, want)
    if layout == "fsdp_tp" and not errors:
        # The loaded state dicts are usable: set them and take one more step on both models.
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, optim, model_state_dict=got["model"], optim_state_dict=got["optim"])
        set_state_dict(model2, optim2, model_state_dict=want["model"], optim_state_dict=want["optim"])
        train_step(model, optim, seed=2)
        train_step(model2, optim2, seed=2)
        errors = compare(state_dicts(model, optim), state_dicts(model2, optim2))
    return errors


def fsdp2_tp_cases(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    model, optim = build("fsdp_tp")
    out["placements"] = placements(state_dicts(model, optim))
    _scenario(out, "save", _save, root)
    dist.barrier()
    for source in ("torch", "native"):
        for layout in ("fsdp_tp", "tp", "fsdp", "single"):
            _scenario(out, f"{layout}<-{source}", _load, root, layout, source)
            dist.barrier()
    dtensor_edge_cases(out, root)
    return out


# -- DTensor edge cases (same launch) ----------------------------------------------------------
def _strided_1d(root: str) -> list[str]:
    """A _StridedShard alone on a 1-D mesh of 4: each rank's rows are not contiguous (rows
    r and 4 + r of 8), so its target holds two boxes; save and load must follow torch's own
    reading of the layout (``full_tensor``)."""
    import dcp_load
    from dcp_load.layouts._state import Leaf
    from dcp_load.layouts._target_for import target_for
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (4,))
    full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    src = distribute_tensor(full, mesh, [_StridedShard(0, split_factor=2)])
    errors = []
    boxes = target_for(Leaf("w", src, {}, "w")).boxes
    if len(boxes) != 2:
        errors.append(f"expected two boxes, got {boxes}")
    path = os.path.join(root, "strided")
    dcp_load.save({"w": src}, checkpoint_id=path)
    dest = distribute_tensor(torch.full((8, 3), float("nan")), mesh, [_StridedShard(0, split_factor=2)])
    dcp_load.load({"w": dest}, checkpoint_id=path)
    if not torch.equal(dest.full_tensor(), full):
        errors.append(f"strided load: {dest.full_tensor().tolist()} != {full.tolist()}")
    whole = torch.full((8, 3), float("nan"))
    dcp_load.load({"w": whole}, checkpoint_id=path, no_dist=True)
    rep = distribute_tensor(torch.full((8, 3), float("nan")), mesh, [Replicate()])
    dcp_load.load({"w": rep}, checkpoint_id=path)
    for what, got in (("plain", whole), ("replicated", rep.to_local())):
        if not torch.equal(got, full):
            errors.append(f"{what} load of the strided save: {got.tolist()}")
    return errors


def _partial() -> list[str]:
    import dcp_load
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (4,))
    value = DTensor.from_local(torch.zeros(2), mesh, [Partial()])
    try:
        dcp_load.save({"p": value}, checkpoint_id="/nonexistent/never-written")
    except dcp_load.LoadError as exc:
        if "Partial" not in str(exc) or "redistribute" not in str(exc):
            return [f"unclear Partial error: {exc}"]
        return []
    return ["a Partial DTensor was saved"]


def _not_in_mesh(root: str) -> list[str]:
    """A DTensor on a mesh of ranks 0 and 1 only: ranks 2 and 3 skip it and say so."""
    import dcp_load
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", [0, 1])
    full = torch.arange(6, dtype=torch.float32)
    path = os.path.join(root, "half_mesh")
    dcp_load.save({"a": distribute_tensor(full, mesh, [Shard(0)]), "b": full * 2}, checkpoint_id=path)
    a = distribute_tensor(torch.full((6,), float("nan")), mesh, [Shard(0)])
    b = torch.full((6,), float("nan"))
    report = dcp_load.load({"a": a, "b": b}, checkpoint_id=path)
    rank = torch.distributed.get_rank()
    errors = []
    if not torch.equal(b, full * 2):
        errors.append(f"b: {b.tolist()}")
    if rank < 2:
        if report.skipped_not_in_mesh or not torch.equal(a.to_local(), full[3 * rank:3 * rank + 3]):
            errors.append(f"rank {rank}: a {a.to_local().tolist()}, skipped {report.skipped_not_in_mesh}")
    elif report.skipped_not_in_mesh != ("a",):
        errors.append(f"rank {rank}: skipped_not_in_mesh {report.skipped_not_in_mesh}, expected ('a',)")
    return errors


def dtensor_edge_cases(out: dict[str, Any], root: str) -> None:
    import torch.distributed as dist

    _scenario(out, "strided_1d", _strided_1d, root)
    dist.barrier()
    _scenario(out, "partial", _partial)
    dist.barrier()
    _scenario(out, "not_in_mesh", _not_in_mesh, root)
    dist.barrier()

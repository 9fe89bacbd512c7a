"""The tensors of the hyper-parallel load tests and the function that runs inside the 4 gloo
ranks (not a test module). Targets are poisoned before every load and compared byte for
byte with the global tensors the checkpoints were written from (``full``)."""

from __future__ import annotations

import os
from typing import Any

import torch
from integ_load_cases import local_expected, local_of, poison_like, report, run_case, same

# name -> (shape, dtype); saved as 4 ranks' Shard(0) chunks (odd.w unevenly), "embed.weight"
# and "ints" with each rank's rows in two chunks (ragged __dcp_chunk_ keys)
SPECS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "embed.weight": ((16, 8), torch.float32), "layers.0.w": ((12, 6), torch.bfloat16),
    "layers.0.norm": ((12,), torch.float32), "ints": ((8, 4), torch.int64), "odd.w": ((7, 5), torch.float32),
    "scalar": ((), torch.float32),
}
RAGGED = ("embed.weight", "ints")
VALUES = {"step": 11, "optim.param_groups": [{"lr": 0.01, "betas": (0.9, 0.95)}]}


def full(name: str) -> torch.Tensor:
    shape, dtype = SPECS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 131)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-500, 500, shape, generator=g, dtype=dtype)


def shard0(name: str, rank: int, world: int) -> tuple[tuple[int, ...], torch.Tensor]:
    """(offsets, rows) of ``rank``'s Shard(0) piece, as torch.chunk cuts it (may be empty)."""
    t = full(name)
    step = -(-t.shape[0] // world)
    lo, hi = min(rank * step, t.shape[0]), min((rank + 1) * step, t.shape[0])
    return (lo,) + (0,) * (t.dim() - 1), t[lo:hi].clone()


def saved_by(rank: int, world: int) -> dict[str, Any]:
    """What ``rank`` saved: its Shard(0) rows (two chunks for RAGGED), rank 0 the values."""
    out: dict[str, Any] = {}
    for name in SPECS:
        if not SPECS[name][0]:
            if rank == 0:
                out[name] = [((), full(name))]
            continue
        off, rows = shard0(name, rank, world)
        if rows.shape[0] == 0:
            continue
        if name in RAGGED and rows.shape[0] > 1:
            half = rows.shape[0] // 2
            out[name] = [(off, rows[:half].clone()), ((off[0] + half,) + off[1:], rows[half:].clone())]
        else:
            out[name] = [(off, rows)]
    if rank == 0:
        out.update(VALUES)
    return out


def expected(name: str, value: Any) -> torch.Tensor:
    return local_expected(name, value, full)


def _check(state: dict[str, Any], errors: list[str], where: str, values: bool = True) -> None:
    for name in SPECS:
        if name in state and not same(local_of(state[name]), expected(name, state[name])):
            errors.append(f"{where}: {name!r} holds wrong values")
    if values and (state.get("step") != 11 or state["optim"]["param_groups"] != VALUES["optim.param_groups"]):
        errors.append(f"{where}: values are {state.get('step')!r}, {state.get('optim')!r}")


def _mesh_state(mesh: Any, placements: list[Any]) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, distribute_tensor

    state: dict[str, Any] = {"step": None, "optim": {"param_groups": None}}
    for name, (shape, _) in SPECS.items():
        pl = [p if getattr(p, "dim", 0) < len(shape) else Replicate() for p in placements]
        t = poison_like(full(name))
        state[name] = distribute_tensor(t, mesh, pl, src_data_rank=None) if shape else t
    return state


def _own_rows(name: str, rank: int, world: int, sub: bool) -> Any:
    """A poisoned Chunk of the rows ``rank`` saved (``sub``: all but the first row)."""
    from dcp_load import Chunk

    off, rows = shard0(name, rank, world)
    if sub and rows.shape[0] > 1:
        off, rows = (off[0] + 1,) + off[1:], rows[1:]
    return Chunk(poison_like(rows), SPECS[name][0], off)


def hyper_cases(rank: int, world: int, ckpts: dict[str, str]) -> dict[str, Any]:
    import dcp_load
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    os.environ["DCP_HOST_ID"] = f"node{rank}"  # one node per rank: replicated boxes broadcast
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results: dict[str, Any] = {}

    def load(state: dict[str, Any], errors: list[str], where: str, path: str, values: bool = True,
             **kw: Any) -> dict[str, Any]:
        r = dcp_load.load(state, checkpoint_id=path, allow_pickle=True, **kw)
        _check(state, errors, where, values)
        return report(r)

    for label, pl in (("RS1", [Replicate(), Shard(1)]), ("S0S1", [Shard(0), Shard(1)]),
                      ("S1S0", [Shard(1), Shard(0)])):
        run_case(results, f"dp2tp2_{label}", lambda e, p=pl, k=label: load(_mesh_state(mesh, p), e, k, ckpts["global"]))

    def plain(errors: list[str]) -> Any:
        state = {"step": None, "optim": {"param_groups": None},
                 **{n: poison_like(full(n)) for n in SPECS}}
        return load(state, errors, "plain", ckpts["global"])

    run_case(results, "plain", plain)

    def ms_style(errors: list[str]) -> Any:  # MindSpore dtype names and file header
        state = {n: poison_like(full(n)) for n in ("embed.weight", "ints", "odd.w")}
        return load(state, errors, "ms-style", ckpts["ms_style"], values=False)

    run_case(results, "ms_style", ms_style)

    def rank_local(errors: list[str]) -> Any:
        state = {n: _own_rows(n, rank, world, sub=n == "layers.0.w") for n in ("embed.weight", "layers.0.w", "ints")}
        if rank == 0:
            state.update({"step": None, "optim": {"param_groups": None}})
        return load(state, errors, "rank-local", ckpts["rank_local"], values=rank == 0)

    run_case(results, "rank_local", rank_local)

    def rank_local_foreign(errors: list[str]) -> Any:
        state = {"embed.weight": _own_rows("embed.weight", (rank + 1) % world, world, sub=False)}
        try:
            dcp_load.load(state, checkpoint_id=ckpts["rank_local"])
        except dcp_load.LoadError as exc:
            return {"message": str(exc), "untouched": bool(torch.isnan(state["embed.weight"].tensor).all())}
        errors.append(f"rank {rank}: loading another rank's rows from a rank-local checkpoint succeeded")
        return None

    run_case(results, "rank_local_foreign", rank_local_foreign)
    return results

"""The model, the checkpoint builders and the functions that run inside ranks for
test_integ_load_flat (not a test module).

The model's tensors of each dtype form one flat space (in ``SPECS`` order), partitioned
ZeRO-style by ``cuts``: uneven cuts that fall inside rows and across tensors. Flat
buffers are poisoned before every load and compared byte for byte with the same interval
of the concatenated global tensors.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import torch
from integ_load_cases import poison_like, report, run_case, same

# name -> (shape, dtype): two dtype spaces, uneven shapes, a 3-D and a 0-dim tensor.
SPECS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "embed.weight": ((13, 12), torch.float32), "layers.0.wq": ((12, 12), torch.bfloat16),
    "layers.0.norm": ((12,), torch.float32), "layers.0.w1": ((18, 12), torch.bfloat16),
    "layers.0.conv": ((4, 6, 5), torch.float32), "layers.1.wq": ((12, 12), torch.bfloat16),
    "odd.w": ((7, 5), torch.float32), "scalar": ((), torch.float32),
}
DTYPES = (torch.float32, torch.bfloat16)
#: fractions of each dtype space where the ZeRO cuts fall (uneven; inside rows)
FRACTIONS = {4: (0.23, 0.51, 0.86), 2: (0.37,)}


def full(name: str) -> torch.Tensor:
    shape, dtype = SPECS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 613)
    return torch.randn(shape, generator=g).to(dtype)


def space(dtype: torch.dtype) -> list[tuple[str, tuple[int, ...]]]:
    """The flat space of ``dtype``: its tensors' (name, shape), in order."""
    return [(n, s) for n, (s, d) in SPECS.items() if d == dtype]


def space_values(dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([full(n).reshape(-1) for n, _ in space(dtype)])


def cuts(dtype: torch.dtype, parts: int) -> list[tuple[int, int]]:
    """(offset, numel) of each of ``parts`` ZeRO partitions of the ``dtype`` space."""
    total = sum(math.prod(s) for _, s in space(dtype))
    edges = [0, *(int(total * f) | 1 for f in FRACTIONS[parts]), total]  # odd: never on a row edge
    return [(a, b - a) for a, b in zip(edges, edges[1:], strict=False)]


def zero_state(part: int, parts: int) -> tuple[dict[str, Any], dict[torch.dtype, torch.Tensor]]:
    """Partition ``part`` of ``parts`` of every dtype space: {name: Flat}, and the poisoned
    buffers (a dtype's views share its buffer)."""
    import dcp_load

    state: dict[str, Any] = {}
    buffers = {}
    for dtype in DTYPES:
        offset, numel = cuts(dtype, parts)[part]
        buffers[dtype] = buf = poison_like(torch.empty(numel, dtype=dtype))
        state.update(dcp_load.flat_views(space(dtype), buf, offset))
    return state, buffers


def check_buffers(buffers: dict[torch.dtype, torch.Tensor], part: int, parts: int, errors: list[str],
                  where: str) -> None:
    for dtype, buf in buffers.items():
        offset, numel = cuts(dtype, parts)[part]
        if not same(buf, space_values(dtype)[offset:offset + numel]):
            errors.append(f"{where}: the {dtype} buffer of partition {part}/{parts} holds wrong values")


def model_bytes() -> int:
    return sum(full(n).numel() * full(n).element_size() for n in SPECS)


# -- checkpoint builders (the test process) ----------------------------------------------------
def write_hf(path: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({n: full(n) for n in SPECS}, os.path.join(path, "model.safetensors"))


def ragged_ranks(world: int) -> dict[int, dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]]:
    """What the seed's ``RaggedShard`` saves: rank ``r`` holds partition ``r`` of each dtype
    space, and writes each tensor's part as the boxes its interval decomposes into (several
    ``__dcp_chunk_{i}`` keys of one tensor in one file)."""
    from dcp_load.layouts._flat import flat_boxes

    out: dict[int, dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]] = {r: {} for r in range(world)}
    for dtype in DTYPES:
        begin = 0
        for name, shape in space(dtype):
            n = math.prod(shape)
            for r, (offset, numel) in enumerate(cuts(dtype, world)):
                lo, hi = max(begin, offset), min(begin + n, offset + numel)
                if hi > lo:
                    t = full(name)
                    out[r][name] = [(o, t[tuple(slice(a, a + k) for a, k in zip(o, s, strict=True))].clone())
                                    for o, s, _ in flat_boxes(shape, lo - begin, hi - lo)]
            begin += n
    return out


# -- inside the ranks ----------------------------------------------------------------------------
def _dtensor_state(mesh: Any, placements: list[Any]) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, distribute_tensor

    out: dict[str, Any] = {}
    for name, (shape, _) in SPECS.items():
        pl = [p if getattr(p, "dim", 0) < len(shape) else Replicate() for p in placements]
        out[name] = distribute_tensor(poison_like(full(name)), mesh, pl, src_data_rank=None) if shape else \
            poison_like(full(name))
    return out


def _check_dtensors(state: dict[str, Any], errors: list[str], where: str) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, value in state.items():
        if isinstance(value, DTensor):
            want = distribute_tensor(full(name), value.device_mesh, list(value.placements), src_data_rank=None)
            ok = same(value.to_local(), want.to_local())
        else:
            ok = same(value, full(name))
        if not ok:
            errors.append(f"{where}: {name!r} holds wrong values")


def save_torch_dcp_dp2tp2(rank: int, world: int, path: str) -> None:
    """The model as DP2 x TP2 DTensors ([Replicate, Shard(1)], 1-D tensors Shard(0)),
    saved by torch.distributed.checkpoint (replicated boxes once)."""
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sd = {n: distribute_tensor(full(n), mesh, [Replicate(), Shard(min(1, len(s) - 1))], src_data_rank=None)
          if s else full(n) for n, (s, _) in SPECS.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(sd, checkpoint_id=path)


def flat4_cases(rank: int, world: int, ckpts: dict[str, str]) -> dict[str, Any]:
    import dcp_load
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    os.environ["DCP_HOST_ID"] = f"node{rank}"  # one node per rank: replicated boxes broadcast
    results: dict[str, Any] = {}

    def zero(errors: list[str], where: str, path: str, part: int, parts: int, **kw: Any) -> dict[str, Any]:
        state, buffers = zero_state(part, parts)
        r = dcp_load.load(state, checkpoint_id=path, **kw)
        check_buffers(buffers, part, parts, errors, where)
        return report(r)

    for src in ("hf", "tdcp", "ragged"):
        run_case(results, f"zero4_{src}", lambda e, s=src: zero(e, f"zero4 from {s}", ckpts[s], rank, 4))
    # DP2 x ZeRO-2: ranks 0, 1 and ranks 2, 3 are two replicas of one ZeRO-2 partition
    run_case(results, "dp2_zero2", lambda e: zero(e, "dp2 x zero2", ckpts["hf"], rank % 2, 2,
                                                   broadcast_replicated_tensors=True))
    # the same from torch DCP's column chunks, unpacked: broadcasts go straight into the
    # (partly non-contiguous) views of the flat buffers
    run_case(results, "dp2_zero2_unpacked", lambda e: zero(e, "dp2 x zero2 unpacked", ckpts["tdcp"], rank % 2, 2,
                                                            broadcast_replicated_tensors=True,
                                                            broadcast_batch_bytes=0))

    def ragged_boxes(errors: list[str]) -> Any:  # the seed's ragged checkpoint into boxes
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        state = _dtensor_state(mesh, [Shard(0), Shard(1)])
        r = dcp_load.load(state, checkpoint_id=ckpts["ragged"])
        _check_dtensors(state, errors, "ragged into S0S1")
        return report(r)

    run_case(results, "ragged_boxes", ragged_boxes)

    def save_zero4(errors: list[str]) -> Any:
        state, buffers = zero_state(rank, 4)
        for dtype, buf in buffers.items():
            offset, numel = cuts(dtype, 4)[rank]
            buf.copy_(space_values(dtype)[offset:offset + numel])
        saved = dcp_load.save(state, checkpoint_id=ckpts["zero4"])
        return {"chunks_written": saved.chunks_written, "bytes_written": saved.bytes_written,
                "job_bytes": saved.job_bytes}

    run_case(results, "save_zero4", save_zero4)

    def zero4_to_dp2tp2(errors: list[str]) -> Any:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        state = _dtensor_state(mesh, [Replicate(), Shard(1)])
        r = dcp_load.load(state, checkpoint_id=ckpts["zero4"])
        _check_dtensors(state, errors, "zero4 into dp2 x tp2")
        return report(r)

    run_case(results, "zero4_to_dp2tp2", zero4_to_dp2tp2)

    def planning(errors: list[str], whole: bool) -> Any:
        """DTensors next to a Flat, whole or part of its tensor: loaded on the gathered path."""
        import dcp_load.run._steps as load_module

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        state = _dtensor_state(mesh, [Replicate(), Shard(0)])
        t = full("odd.w")
        lo, n = (0, t.numel()) if whole else (rank * 8, 8)
        buf = poison_like(torch.empty(n, dtype=t.dtype))
        state["odd.w"] = dcp_load.Flat(buf, tuple(t.shape), lo)
        seen: list[bool] = []
        inner = load_module.derived_plan

        def spy(*a: Any, **k: Any) -> Any:
            plan = inner(*a, **k)
            seen.append(plan is not None)
            return plan

        load_module.derived_plan = spy
        try:
            dcp_load.load(state, checkpoint_id=ckpts["hf"])
        finally:
            load_module.derived_plan = inner
        if not same(buf, t.reshape(-1)[lo:lo + n]):
            errors.append(f"planning whole={whole}: the Flat holds wrong values")
        _check_dtensors({k: v for k, v in state.items() if k != "odd.w"}, errors, f"planning whole={whole}")
        return {"derived": seen == [True]}

    run_case(results, "planning_whole", lambda e: planning(e, True))
    run_case(results, "planning_part", lambda e: planning(e, False))

    def at_tensor_edges(errors: list[str]) -> Any:
        """ZeRO-4 cut at tensor boundaries: each rank holds its tensors whole and lacks the
        others' (rank 3 holds no bf16 tensor), as partitions aligned to parameters do."""
        state: dict[str, Any] = {}
        buffers = []
        for dtype in DTYPES:
            edges, begin = [0], 0
            for _, shape in space(dtype):
                begin += math.prod(shape)
                edges.append(begin)
            last = len(edges) - 1  # the last rank takes every tensor from its first on
            lo, hi = edges[min(rank, last)], edges[last if rank == world - 1 else min(rank + 1, last)]
            buf = poison_like(torch.empty(hi - lo, dtype=dtype))
            state.update(dcp_load.flat_views(space(dtype), buf, lo))
            buffers.append((buf, space_values(dtype)[lo:hi]))
        r = dcp_load.load(state, checkpoint_id=ckpts["hf"])
        if not all(same(b, want) for b, want in buffers):
            errors.append("ZeRO-4 at tensor edges: a buffer holds wrong values")
        return report(r)

    run_case(results, "zero4_at_tensor_edges", at_tensor_edges)
    return results


def zero2_cases(rank: int, world: int, path: str) -> dict[str, Any]:
    """A world of 2 loading a ZeRO-4 save into ZeRO-2 partitions."""
    import dcp_load

    results: dict[str, Any] = {}

    def zero2(errors: list[str]) -> Any:
        state, buffers = zero_state(rank, 2)
        r = dcp_load.load(state, checkpoint_id=path)
        check_buffers(buffers, rank, 2, errors, "zero4 save into zero2")
        return report(r)

    run_case(results, "zero2", zero2)
    return results

"""Functions that run inside ranks for test_integ_transfer (not a test module).

4 gloo ranks. Ranks 0-1 are a trainer (FSDP2: ``Shard(0)`` over their own 1-D mesh), ranks
2-3 an inference engine (tensor parallel over theirs: column-parallel ``Shard(0)``,
row-parallel ``Shard(1)``, replicated norms); the two meshes are the rows of one 2 x 2
mesh. Colocated: all four ranks hold FSDP4 shards and fill DP2 x TP2 DTensors. Every
destination is poisoned (0x7F bytes) before each transfer and compared with the truth
after it; every source is compared with a copy taken before (values and version counter).
"""

from __future__ import annotations

import math
from typing import Any

import dcp_load
import torch
from dcp_load import Chunk, Concat, Flat, LoadError
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

H, KV, HD, D, F = 4, 2, 8, 32, 48


def truth(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + step)
    return torch.randn(*shape, generator=g).to(dtype)


def poison(t: torch.Tensor) -> None:
    t.view(torch.uint8).fill_(0x7F)


def shard(value: torch.Tensor, mesh: Any, placements: list[Any]) -> Any:
    return distribute_tensor(value, mesh, placements, src_data_rank=None)


def empty_like_layout(shape: tuple[int, ...], dtype: torch.dtype, mesh: Any, placements: list[Any]) -> Any:
    out = shard(torch.empty(shape, dtype=dtype), mesh, placements)
    poison(out.to_local())
    return out


def meshes() -> dict[str, Any]:
    """The 1-D meshes of the trainer (ranks 0-1) and the engine (ranks 2-3), FSDP4 and DP2 x TP2."""
    rows = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("role", "x"))["x"]
    return {"row": rows, "w4": init_device_mesh("cpu", (4,)), "w22": init_device_mesh("cpu", (2, 2))}


SHAPES = {"wq": (H * HD, D), "wk": (KV * HD, D), "wv": (KV * HD, D), "wo": (D, H * HD), "up": (F, D),
          "down": (D, F), "norm": (D,)}


def _trainer_src(mesh: Any, dtype: torch.dtype, step: int) -> dict[str, Any]:
    return {f"layers.0.{n}": shard(truth(n, s, step=step).to(dtype), mesh, [Shard(0)]) for n, s in SHAPES.items()}


def _engine_dst(mesh: Any, dtype: torch.dtype) -> dict[str, Any]:
    qkv = ((H + 2 * KV) * HD, D)
    return {"layers.0.qkv": empty_like_layout(qkv, dtype, mesh, [Shard(0)]),
            "layers.0.wo": empty_like_layout(SHAPES["wo"], dtype, mesh, [Shard(1)]),
            "layers.0.up": empty_like_layout(SHAPES["up"], dtype, mesh, [Shard(0)]),
            "layers.0.down": empty_like_layout(SHAPES["down"], dtype, mesh, [Shard(1)]),
            "layers.0.norm": empty_like_layout(SHAPES["norm"], dtype, mesh, [Replicate()])}


SOURCES = {"layers.{i}.qkv": Concat(["layers.{i}.wq", "layers.{i}.wk", "layers.{i}.wv"], dim=0, groups=KV)}


def _expected(name: str, src_dtype: torch.dtype, dst_dtype: torch.dtype, step: int) -> torch.Tensor:
    short = name.split(".")[-1]
    if short == "qkv":
        parts = [truth(n, SHAPES[n], step=step).to(src_dtype) for n in ("wq", "wk", "wv")]
        blocks = [p.chunk(KV, 0) for p in parts]
        return torch.cat([b[g] for g in range(KV) for b in blocks]).to(dst_dtype)
    return truth(short, SHAPES[short], step=step).to(src_dtype).to(dst_dtype)


def _check_dst(dst: dict[str, Any], src_dtype: torch.dtype, step: int) -> list[str]:
    bad = []
    for name, value in dst.items():
        want = shard(_expected(name, src_dtype, value.dtype, step), value.device_mesh, list(value.placements))
        if not torch.equal(value.to_local(), want.to_local()):
            bad.append(name)
    return bad


def _snapshot(src: dict[str, Any]) -> dict[str, tuple[torch.Tensor, int]]:
    return {n: (v.to_local().clone(), v.to_local()._version) for n, v in src.items()}


def _untouched(src: dict[str, Any], before: dict[str, tuple[torch.Tensor, int]]) -> bool:
    return all(torch.equal(v.to_local(), before[n][0]) and v.to_local()._version == before[n][1]
               for n, v in src.items())


def _summary(report: Any) -> dict[str, Any]:
    return {k: getattr(report, k) for k in ("bytes_kept", "bytes_received", "bytes_sent", "bytes_copied",
                                            "broadcasts", "collectives", "plan_reused", "cast", "composed")}


def trainer_to_engine(rank: int, world: int) -> dict[str, Any]:
    """2 trainer ranks -> 2 engine ranks, q/k/v into a fused grouped qkv, bf16 -> fp32; a
    second transfer after an optimizer step reuses the plan; a changed layout replans."""
    m = meshes()
    trainer = rank < 2
    out: dict[str, Any] = {}
    src = _trainer_src(m["row"], torch.bfloat16, 0) if trainer else None
    dst = None if trainer else _engine_dst(m["row"], torch.float32)
    before = _snapshot(src) if trainer else None
    first = dcp_load.transfer(src, dst, sources=SOURCES)
    out["first"] = _summary(first)
    out["first_bad"] = [] if trainer else _check_dst(dst, torch.bfloat16, 0)
    out["src_untouched"] = _untouched(src, before) if trainer else True
    # an optimizer step: the trainer's shards change in place; the layouts do not
    if trainer:
        for n, v in src.items():
            v.to_local().copy_(shard(truth(n.split(".")[-1], SHAPES[n.split(".")[-1]], step=1).to(torch.bfloat16),
                                     m["row"], [Shard(0)]).to_local())
    else:
        for v in dst.values():
            poison(v.to_local())
    second = dcp_load.transfer(src, dst, sources=SOURCES)
    out["second"] = _summary(second)
    out["second_bad"] = [] if trainer else _check_dst(dst, torch.bfloat16, 1)
    # the engine changes one layout: every rank plans again
    if not trainer:
        dst["layers.0.up"] = empty_like_layout(SHAPES["up"], torch.float32, m["row"], [Shard(1)])
        for v in dst.values():
            poison(v.to_local())
    third = dcp_load.transfer(src, dst, sources=SOURCES)
    out["third"] = _summary(third)
    out["third_bad"] = [] if trainer else _check_dst(dst, torch.bfloat16, 1)
    out["times"] = (first.seconds["total"], second.seconds["total"])
    return out


def colocated(rank: int, world: int) -> dict[str, Any]:
    """FSDP4 shards -> DP2 x TP2 DTensors on the same 4 ranks, plus a whole tensor, a Chunk
    and a Flat destination."""
    m = meshes()
    names = {"a": (13, 10), "b": (9, 7), "c": (5,), "d": (6, 4), "e": (11, 3)}
    src = {n: shard(truth(n, s), m["w4"], [Shard(0)]) for n, s in names.items()}
    before = _snapshot(src)
    dst: dict[str, Any] = {"a": empty_like_layout(names["a"], torch.float32, m["w22"], [Replicate(), Shard(0)]),
                           "b": empty_like_layout(names["b"], torch.float32, m["w22"], [Shard(1), Shard(0)])}
    c = torch.empty(names["c"])
    poison(c)
    dst["c"] = c
    lo = (rank % 2) * 3
    d_local = torch.empty(3, 4)
    poison(d_local)
    dst["d"] = Chunk(d_local, names["d"], (lo, 0))
    per = math.ceil(33 / world)
    e_local = torch.empty(min(per, 33 - rank * per))
    poison(e_local)
    dst["e"] = Flat(e_local, names["e"], rank * per)
    report = dcp_load.transfer(src, dst)
    bad = [n for n in ("a", "b") if not torch.equal(
        dst[n].to_local(), shard(truth(n, names[n]), dst[n].device_mesh, list(dst[n].placements)).to_local())]
    if not torch.equal(c, truth("c", names["c"])):
        bad.append("c")
    if not torch.equal(d_local, truth("d", names["d"])[lo:lo + 3]):
        bad.append("d")
    if not torch.equal(e_local, truth("e", names["e"]).reshape(-1)[rank * per:rank * per + e_local.numel()]):
        bad.append("e")
    return {"bad": bad, "untouched": _untouched(src, before), "report": _summary(report)}


def _refused(src: Any, dst: Any, **kwargs: Any) -> str:
    try:
        dcp_load.transfer(src, dst, **kwargs)
    except LoadError as exc:
        return f"{exc.phase}: {exc}"
    return "no error"


def mistakes(rank: int, world: int) -> dict[str, Any]:
    """Refused on every rank before any write, the failing rank named: a destination of
    another shape on one rank, a name no rank holds, ranks passing different settings."""
    m = meshes()
    src = {"w": shard(truth("w", (8, 6)), m["row"], [Shard(0)])} if rank < 2 else None
    out: dict[str, Any] = {}

    def fresh(shape: tuple[int, ...] = (8, 6), name: str = "w") -> dict[str, Any]:
        return {name: empty_like_layout(shape, torch.float32, m["w4"], [Shard(1)])}

    for case, (d, kw) in {
        "shape_on_rank3": (fresh((8, 7)) if rank == 3 else fresh(), {}),
        "missing": (fresh(name="w2") if rank == 2 else fresh(), {}),
        "settings": (fresh(), {"batch_bytes": 1024 if rank == 1 else 4096}),
        "cast_refused": ({"w": empty_like_layout((8, 6), torch.float64, m["w4"], [Shard(1)])},
                         {"allow_dtype_cast": False}),
    }.items():
        message = _refused(src, d, **kw)
        untouched = all(bool((v.to_local().view(torch.uint8) == 0x7F).all()) for v in d.values())
        out[case] = (message, untouched)
    return out


def random_layouts(rank: int, world: int, cases: list[dict[str, Any]]) -> list[Any]:
    """Each case: tensors with a source layout and a destination layout drawn by the test."""
    m = meshes()
    results = []
    for case in cases:
        src: dict[str, Any] = {}
        dst: dict[str, Any] = {}
        for name, spec in case.items():
            shape, src_dtype, dst_dtype = tuple(spec["shape"]), getattr(torch, spec["src_dtype"]), getattr(
                torch, spec["dst_dtype"])
            value = truth(name, shape).to(src_dtype)
            for side, out, dtype in (("src", src, src_dtype), ("dst", dst, dst_dtype)):
                mesh_name, placements = spec[side]
                if mesh_name == "lo" and rank >= 2 or mesh_name == "hi" and rank < 2:
                    continue
                mesh = m["row"] if mesh_name in ("lo", "hi") else m[mesh_name]
                pl = [Shard(p) if p >= 0 else Replicate() for p in placements]
                out[name] = shard(value, mesh, pl) if side == "src" else empty_like_layout(shape, dtype, mesh, pl)
        report = dcp_load.transfer(src, dst)
        bad = [n for n, v in dst.items() if not torch.equal(v.to_local(), shard(
            truth(n, tuple(case[n]["shape"])).to(getattr(torch, case[n]["src_dtype"])).to(v.dtype),
            v.device_mesh, list(v.placements)).to_local())]
        results.append((bad, report.bytes_received, report.bytes_kept, report.bytes_copied))
    return results


def absent_rank(rank: int, world: int) -> dict[str, Any]:
    """Rank 3 never calls transfer: the others raise LoadError naming it within timeout."""
    import time

    m = meshes()
    if rank == 3:
        time.sleep(12)  # alive, but elsewhere
        return {}
    src = {"w": shard(truth("w", (8, 6)), m["row"], [Shard(0)])} if rank < 2 else None
    dst = {"w": torch.full((8, 6), float("nan"))} if rank == 2 else None
    start = time.monotonic()
    message = _refused(src, dst, timeout=3)
    return {"message": message, "seconds": time.monotonic() - start,
            "untouched": dst is None or bool(dst["w"].isnan().all())}

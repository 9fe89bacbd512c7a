"""Functions that run inside ranks for test_integ_sync (not a test module).

Two jobs launched apart, each with its own default gloo group (``run_ranks`` with its own
init file): a "trainer" job and an "engine" job. Their ranks join one transfer group
through a TCPStore on 127.0.0.1 (``dcp_load.transfer_group``) and move weights with
``transfer(..., process_group=group)``. While they do, any collective on a job's default
group raises (``default_group_forbidden``); afterwards each default group still works.
Destinations are poisoned (0x7F bytes) before each transfer.
"""

from __future__ import annotations

import os
import time
from typing import Any

import dcp_load
import torch
import torch.distributed as dist
from group_guards import default_group_forbidden, poison
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

SHAPES = {"wq": (16, 8), "wk": (8, 8), "wv": (8, 8), "wo": (8, 16), "norm": (8,)}


def truth(name: str, step: int = 0, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + step)
    return torch.randn(*(shape or SHAPES[name]), generator=g)


def join(side: str, rank: int, port: int, sizes: tuple[int, int], timeout: float = 60.0) -> Any:
    return dcp_load.transfer_group("127.0.0.1", port, side=side, rank=rank, world_sizes=sizes, timeout=timeout)


def linger(group: Any, side: str, rank: int, survivors: int) -> None:
    """After a failure: trainer rank 0 (which serves the store) stays until every surviving
    rank has its result, as a real trainer outlives one failed update (at most 30 s)."""
    store = group.get_group_store()
    done = store.add("test-reported", 1)
    deadline = time.monotonic() + 30
    while side == "trainer" and rank == 0 and done < survivors and time.monotonic() < deadline:
        time.sleep(0.05)
        done = store.add("test-reported", 0)


def _default_group_works(world: int) -> bool:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item() == world


def _trainer_src(mesh: Any, step: int) -> dict[str, Any]:
    src = {n: distribute_tensor(truth(n, step), mesh, [Shard(0)]) for n in ("wq", "wk", "wv", "wo")}
    src["norm"] = distribute_tensor(truth("norm", step).bfloat16(), mesh, [Replicate()])
    return src


def _engine_dst(mesh: Any) -> dict[str, Any]:
    dst = {"wq": distribute_tensor(torch.empty(SHAPES["wq"]), mesh, [Shard(0)]),
           "wo": distribute_tensor(torch.empty(SHAPES["wo"]), mesh, [Shard(1)]),
           "wk": torch.empty(SHAPES["wk"]), "norm": torch.empty(SHAPES["norm"])}
    return dst


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def _bad(dst: dict[str, Any], step: int) -> list[str]:
    bad = []
    for name, value in dst.items():
        want = truth(name, step)
        if name == "norm":
            want = want.bfloat16().float()
        if hasattr(value, "full_tensor"):
            want = distribute_tensor(want, value.device_mesh, list(value.placements)).to_local()
        if not torch.equal(_local(value), want):
            bad.append(name)
    return bad


def two_jobs(rank: int, world: int, side: str, port: int, sizes: tuple[int, int]) -> dict[str, Any]:
    """Trainer DTensors (FSDP Shard(0), a replicated bf16 norm) into engine DTensors on the
    engine's own mesh and whole plain tensors, twice (the plan kept), then a changed layout."""
    mesh = init_device_mesh("cpu", (world,))
    group = join(side, rank, port, sizes)
    out: dict[str, Any] = {"group": (group.rank(), group.size(), group.side_rank, group.world_sizes)}
    dst = _engine_dst(mesh) if side == "engine" else {}
    with default_group_forbidden():
        for step in range(2):
            src = _trainer_src(mesh, step) if side == "trainer" else {}
            for v in dst.values():
                poison(_local(v))
            report = dcp_load.transfer(src, dst, process_group=group, timeout=60)
            out[f"bad{step}"] = _bad(dst, step) if side == "engine" else []
            out[f"report{step}"] = {"reused": report.plan_reused, "received": report.bytes_received,
                                    "sent": report.bytes_sent, "kept": report.bytes_kept, "rank": report.rank,
                                    "world": report.world_size}
    out["default_ok"] = _default_group_works(world)
    group.close()
    return out


def disagree(rank: int, world: int, side: str, port: int, sizes: tuple[int, int]) -> dict[str, Any]:
    """The engine job believes in 3 engine ranks (it has 2): every rank of both raises."""
    claimed = sizes if side == "trainer" else (sizes[0], sizes[1] + 1)
    start = time.monotonic()
    try:
        join(side, rank, port, claimed, timeout=20)
    except dcp_load.TransferGroupError as exc:
        return {"message": str(exc), "seconds": time.monotonic() - start, "default_ok": _default_group_works(world)}
    return {"message": None}


def engine_dies(rank: int, world: int, side: str, port: int, sizes: tuple[int, int]) -> dict[str, Any]:
    """Engine rank 1 joins, then exits instead of calling transfer: the others are told
    within the timeout, naming it, and the default groups of the trainer stay usable."""
    group = join(side, rank, port, sizes)
    if side == "engine" and rank == 1:
        os._exit(3)
    mesh = init_device_mesh("cpu", (world,))
    src = {"w": distribute_tensor(truth("wo"), mesh, [Shard(0)])} if side == "trainer" else {}
    dst = {"w": torch.full(SHAPES["wo"], float("nan"))} if side == "engine" else {}
    start = time.monotonic()
    try:
        dcp_load.transfer(src, dst, process_group=group, timeout=5)
    except dcp_load.LoadError as exc:
        out = {"message": str(exc), "seconds": time.monotonic() - start,
               "untouched": side == "trainer" or bool(dst["w"].isnan().all())}
        linger(group, side, rank, 3)
        return out
    return {"message": None}


# -- an engine's plain tensor-parallel shards, fused q/k/v and gate/up --------------------------
HEADS, KV_HEADS, HEAD_DIM, DIM, FFN = 4, 2, 4, 8, 16
TP_SHAPES = {"wq": (HEADS * HEAD_DIM, DIM), "wk": (KV_HEADS * HEAD_DIM, DIM), "wv": (KV_HEADS * HEAD_DIM, DIM),
             "gate": (FFN, DIM), "up": (FFN, DIM), "down": (DIM, FFN), "norm": (DIM,)}
ENGINE_SHAPES = {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, DIM), "gate_up": (2 * FFN, DIM), "down": (DIM, FFN),
                 "norm": (DIM,)}
TP_DIMS = {"qkv": 0, "gate_up": 0, "down": 1, "norm": None}  # column-, column-, row-parallel, replicated


def engine_sources() -> dict[str, Any]:
    # each TP rank holds whole KV groups of q/k/v, and its own halves of gate and of up
    return {"qkv": dcp_load.Concat(["wq", "wk", "wv"], dim=0, groups=KV_HEADS),
            "gate_up": dcp_load.Concat(["gate", "up"], dim=0, groups=2)}


def fused_truth(name: str, step: int) -> torch.Tensor:
    """The engine's full parameter, built from the trainer's truth by hand."""
    def t(n: str) -> torch.Tensor:
        return truth(n, step, TP_SHAPES[n])

    if name == "qkv":
        parts = [t(n).chunk(KV_HEADS) for n in ("wq", "wk", "wv")]
        return torch.cat([p[g] for g in range(KV_HEADS) for p in parts])
    if name == "gate_up":
        return torch.cat([p[r] for r in range(2) for p in (t("gate").chunk(2), t("up").chunk(2))])
    return t(name)


def _tp_slice(full: torch.Tensor, dim: int | None, rank: int, size: int) -> torch.Tensor:
    return full if dim is None else full.chunk(size, dim=dim)[rank]


def _engine_shards(rank: int, size: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    tensors = {n: torch.empty(_tp_slice(torch.empty(s), TP_DIMS[n], rank, size).shape)
               for n, s in ENGINE_SHAPES.items()}
    shards = {n: (t, dcp_load.tp_offsets(ENGINE_SHAPES[n], TP_DIMS[n], rank, size)) for n, t in tensors.items()}
    shards["norm"] = dcp_load.Chunk(tensors["norm"], ENGINE_SHAPES["norm"], (0,))
    return dcp_load.engine_shards(shards, {n: s for n, s in ENGINE_SHAPES.items() if n != "norm"}), tensors


def engine_tp(rank: int, world: int, side: str, port: int, sizes: tuple[int, int]) -> dict[str, Any]:
    """Trainer FSDP shards into the engine's plain TP shards (fused qkv and gate_up through
    sources=), twice (the plan kept), then a trainer whose "down" changed shape."""
    mesh = init_device_mesh("cpu", (world,))
    group = join(side, rank, port, sizes)
    dst, tensors = _engine_shards(rank, world) if side == "engine" else ({}, {})
    out: dict[str, Any] = {}
    for step in range(3):
        shapes = dict(TP_SHAPES, down=(DIM, FFN - 4)) if step == 2 else TP_SHAPES
        src = ({n: distribute_tensor(truth(n, step, s), mesh, [Shard(0)]) for n, s in shapes.items()}
               if side == "trainer" else {})
        for t in tensors.values():
            poison(t)
        try:
            report = dcp_load.transfer(src, dst, sources=engine_sources(), process_group=group, timeout=60)
        except dcp_load.LoadError as exc:
            out[f"error{step}"] = str(exc)
            out["untouched"] = all(bool((t.view(torch.uint8) == 0x7F).all()) for t in tensors.values())
            continue
        out[f"bad{step}"] = [n for n, t in tensors.items()
                             if not torch.equal(t, _tp_slice(fused_truth(n, step), TP_DIMS[n], rank, world))]
        out[f"report{step}"] = {"reused": report.plan_reused, "received": report.bytes_received,
                                "kept": report.bytes_kept, "composed": report.composed}
    group.close()
    return out


# -- FP8 blockwise destinations, quantized on the trainer -------------------------------------
FP8_SHAPES = {"wq": (512, 256), "wk": (256, 256), "wv": (256, 256), "down": (256, 512), "proj": (200, 136),
              "norm": (256,)}
FP8_ENGINE = {"qkv": ((1024, 256), 0), "down": ((256, 512), 1), "proj": ((200, 136), None)}


def reference_fp8(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block: scale = amax / 448 (1 for an all-zero block), q = x / scale as e4m3fn."""
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-rows // block), -(-cols // block))
    for i in range(0, rows, block):
        for j in range(0, cols, block):
            tile = x[i:i + block, j:j + block].float()
            amax = tile.abs().max()
            scale = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            scales[i // block, j // block] = scale
            q[i:i + block, j:j + block] = (tile / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scales


def _fp8_truth(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's full FP8 parameter and scales, from the trainer's bf16 truth by hand."""
    if name != "qkv":
        return reference_fp8(truth(name, step, FP8_SHAPES[name]).bfloat16())
    parts = [reference_fp8(truth(n, step, FP8_SHAPES[n]).bfloat16()) for n in ("wq", "wk", "wv")]
    fused = []
    for which in (0, 1):  # q data, then scales: 2 KV groups of q, k, v each
        chunks = [p[which].view(torch.uint8).chunk(2) for p in parts] if which == 0 else [p[1].chunk(2) for p in parts]
        fused.append(torch.cat([c[g] for g in range(2) for c in chunks]))
    return fused[0].view(torch.float8_e4m3fn), fused[1]


def _fp8_engine(rank: int, size: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    shards: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, (shape, dim) in FP8_ENGINE.items():
        scale_shape = tuple(-(-s // 128) for s in shape)
        for n, s, dtype in ((name, shape, torch.float8_e4m3fn), (f"{name}_scale_inv", scale_shape, torch.float32)):
            local = list(s)
            if dim is not None:
                local[dim] //= size
            tensors[n] = torch.empty(local, dtype=dtype)
            shards[n], shapes[n] = (tensors[n], dcp_load.tp_offsets(s, dim, rank, size)), s
    tensors["norm"] = torch.empty(FP8_SHAPES["norm"])  # fp32 from bf16: an ordinary cast
    shards["norm"], shapes["norm"] = (tensors["norm"], (0,)), FP8_SHAPES["norm"]
    return dcp_load.engine_shards(shards, shapes), tensors


def _fp8_bad(tensors: dict[str, torch.Tensor], rank: int, size: int, step: int) -> list[str]:
    bad = []
    for name, (_, dim) in FP8_ENGINE.items():
        q, scales = _fp8_truth(name, step)
        for n, full in ((name, q.view(torch.uint8)), (f"{name}_scale_inv", scales)):
            got = tensors[n].view(torch.uint8) if n == name else tensors[n]
            if not torch.equal(got, _tp_slice(full, dim, rank, size)):
                bad.append(n)
    if not torch.equal(tensors["norm"], truth("norm", step, FP8_SHAPES["norm"]).bfloat16().float()):
        bad.append("norm")
    return bad


def fp8_blockwise(rank: int, world: int, side: str, port: int, sizes: tuple[int, int]) -> dict[str, Any]:
    """Trainer bf16 FSDP shards (rows split at multiples of 128; "proj" replicated, with
    partial blocks) into the engine's FP8 TP shards and their ``_scale_inv``, twice."""
    mesh = init_device_mesh("cpu", (world,))
    group = join(side, rank, port, sizes)
    dst, tensors = _fp8_engine(rank, world) if side == "engine" else ({}, {})
    out: dict[str, Any] = {}
    sources = {"qkv": dcp_load.Concat(["wq", "wk", "wv"], dim=0, groups=2)}
    for step in range(2):
        src = ({n: distribute_tensor(truth(n, step, s).bfloat16(), mesh, [Replicate() if n == "proj" else Shard(0)])
                for n, s in FP8_SHAPES.items()} if side == "trainer" else {})
        for t in tensors.values():
            poison(t)
        report = dcp_load.transfer(src, dst, sources=sources, process_group=group, timeout=60)
        out[f"bad{step}"] = _fp8_bad(tensors, rank, world, step) if side == "engine" else []
        out[f"report{step}"] = {"reused": report.plan_reused, "received": report.bytes_received,
                                "sent": report.bytes_sent, "kept": report.bytes_kept}
    group.close()
    return out


def delta_updates(rank: int, world: int, side: str, port: int, sizes: tuple[int, int]) -> dict[str, Any]:
    """``delta=True``: the first transfer sends everything; after one trainer tensor changed
    only its pieces travel (the engine's other destinations, poisoned, stay poisoned: not
    written); with nothing changed nothing travels; one element changed moves one piece.
    Engine rank r holds columns [4r, 4r + 4) of each tensor, as plain shards."""
    mesh = init_device_mesh("cpu", (world,))
    group = join(side, rank, port, sizes)
    names = ("wq", "wk", "wv", "wo")
    src = {n: distribute_tensor(truth(n), mesh, [Shard(0)]) for n in names} if side == "trainer" else {}
    dst = {n: torch.empty(SHAPES[n]).chunk(2, 1)[rank].contiguous() for n in names} if side == "engine" else {}
    shards = dcp_load.engine_shards({n: (t, (0, rank * t.shape[1])) for n, t in dst.items()},
                                    {n: SHAPES[n] for n in dst})
    out: dict[str, Any] = {}
    now = {n: truth(n) for n in names}  # the trainer's values, as the engine should see them

    def run(label: str, poisoned: tuple[str, ...]) -> None:
        for n in poisoned:
            if n in dst:
                poison(dst[n])
        report = dcp_load.transfer(src, shards, process_group=group, delta=True, timeout=60)
        out[label] = {"received": report.bytes_received, "sent": report.bytes_sent,
                      "broadcasts": report.broadcasts, "reused": report.plan_reused,
                      "poisoned": sorted(n for n, t in dst.items() if bool((t.view(torch.uint8) == 0x7F).all())),
                      "exact": sorted(n for n, t in dst.items() if torch.equal(t, now[n].chunk(2, 1)[rank]))}

    run("first", names)
    now["wo"] = truth("wo", 1)
    if side == "trainer":
        with torch.no_grad():
            src["wo"].to_local().copy_(now["wo"].chunk(2)[rank])
    run("one_changed", ("wq", "wk", "wv"))
    run("none_changed", names)
    for n in names:
        if n in dst:
            dst[n].copy_(now[n].chunk(2, 1)[rank])  # the engine's values back, as sent before
    now["wq"][8, 0] += 1  # one element of the trainer's second half of wq
    if side == "trainer" and rank == 1:
        with torch.no_grad():
            src["wq"].to_local()[0, 0] += 1
    run("one_element", ())
    group.close()
    return out


def engine_dies_mid_transfer(rank: int, world: int, side: str, port: int, sizes: tuple[int, int]) -> dict[str, Any]:
    """Engine rank 1 plans with the others, then exits as the data starts to move (its
    ``move`` exits the process): the others are told within the timeout, naming it."""
    from dcp_load.transferring import _transfer

    group = join(side, rank, port, sizes)
    if side == "engine" and rank == 1:
        _transfer.move = lambda *args, **kwargs: os._exit(3)
    mesh = init_device_mesh("cpu", (world,))
    src = {"w": distribute_tensor(truth("wo"), mesh, [Shard(0)])} if side == "trainer" else {}
    dst = {"w": torch.full(SHAPES["wo"], float("nan"))} if side == "engine" else {}
    start = time.monotonic()
    try:
        dcp_load.transfer(src, dst, process_group=group, timeout=5)
    except dcp_load.LoadError as exc:
        out = {"message": str(exc), "seconds": time.monotonic() - start}
        linger(group, side, rank, 3)
        return out
    return {"message": None}


SPARSE_SHAPES = {"a": (128, 64), "b": (128, 64), "c": (128, 64)}  # bf16: trainer rows, engine columns split


def _picks(name: str, step: int, share: float) -> torch.Tensor:
    """``share`` of the flat elements of ``name``, distinct, at random (the same on every rank)."""
    numel = SPARSE_SHAPES[name][0] * SPARSE_SHAPES[name][1]
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 13 + step)
    return torch.randperm(numel, generator=g)[:round(numel * share)]


def sparse_bytes(name: str, step: int, share: float, rank: int) -> int:
    """What engine rank ``rank`` should receive of ``name`` as positions + values: per piece
    (trainer rank h's rows x this rank's columns, 64 x 32) the smaller of the bitmask and the
    int32 indices of the changed elements (each padded to 8 bytes), and 2 bytes per changed
    element."""
    rows, cols = SPARSE_SHAPES[name]
    idx = _picks(name, step, share)
    mine = idx[(idx % cols) // (cols // 2) == rank]
    counts = [int(((mine // cols) // (rows // 2) == h).sum()) for h in range(2)]
    mask = -(-(rows // 2) * (cols // 2) // 64) * 8
    return sum(min(mask, -(-4 * n // 8) * 8) + 2 * n for n in counts)


def delta_sparse(rank: int, world: int, side: str, port: int, sizes: tuple[int, int]) -> dict[str, Any]:
    """``delta=True`` at element level: 2 % of "a" and "b" changed travel as bitmask + values
    and only those elements are written (an unchanged element set to 1000 on the engine stays
    1000; "c", unchanged and poisoned, stays poisoned); 95 % of "b" changed goes whole (its
    destination poisoned, filled); new destination tensors of the same layout get everything."""
    mesh = init_device_mesh("cpu", (world,))
    group = join(side, rank, port, sizes)
    now = {n: truth(n, 0, s).bfloat16() for n, s in SPARSE_SHAPES.items()}
    src = ({n: distribute_tensor(v.clone(), mesh, [Shard(0)]) for n, v in now.items()} if side == "trainer"
           else {})
    out: dict[str, Any] = {}

    def engine(fresh: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        if side != "engine":
            return {}, {}
        tensors = {n: torch.empty(s, dtype=torch.bfloat16).chunk(2, 1)[rank].contiguous()
                   for n, s in SPARSE_SHAPES.items()}
        for t in tensors.values():
            poison(t)
        return dcp_load.engine_shards({n: (t, (0, rank * t.shape[1])) for n, t in tensors.items()},
                                      SPARSE_SHAPES), tensors

    shards, dst = engine()

    def change(step: int, shares: dict[str, float]) -> None:
        for name, share in shares.items():
            now[name].view(-1)[_picks(name, step, share)] += 1
            if side == "trainer":
                src[name].to_local().copy_(now[name].chunk(2)[rank])

    def run(label: str, poisoned: tuple[str, ...] = ()) -> None:
        for n in poisoned:
            if n in dst:
                poison(dst[n])
        report = dcp_load.transfer(src, shards, process_group=group, delta=True, timeout=60)
        out[label] = {"received": report.bytes_received, "kept": report.bytes_kept, "sent": report.bytes_sent,
                      "reused": report.plan_reused,
                      "poisoned": sorted(n for n, t in dst.items() if bool((t.view(torch.uint8) == 0x7F).all())),
                      "exact": sorted(n for n, t in dst.items() if torch.equal(t, now[n].chunk(2, 1)[rank]))}

    run("first", tuple(SPARSE_SHAPES))
    change(1, {"a": 0.02, "b": 0.02})
    # an element of "a" that did not change, set to 1000 here: only changed elements are written
    unchanged = 0
    if side == "engine":
        changed_here = (dst["a"] != now["a"].chunk(2, 1)[rank]).view(-1)
        unchanged = int((~changed_here).nonzero()[0])
        dst["a"].view(-1)[unchanged] = 1000
    run("sparse", ("c",))
    if side == "engine":
        out["sentinel"] = float(dst["a"].view(-1)[unchanged])
        dst["a"].view(-1)[unchanged] = now["a"].chunk(2, 1)[rank].reshape(-1)[unchanged]
        out["a_else_exact"] = torch.equal(dst["a"], now["a"].chunk(2, 1)[rank])
        dst["c"].copy_(now["c"].chunk(2, 1)[rank])  # back to the values the engine was sent
    change(2, {"a": 0.02, "b": 0.95})
    run("dense", ("b",))
    shards, dst = engine()  # new tensors, same layout: they do not hold the previous values
    run("new_destinations")
    group.close()
    return out


def fp8_delta(rank: int, world: int, side: str, port: int, sizes: tuple[int, int]) -> dict[str, Any]:
    """``delta=True`` into FP8 blockwise destinations: after one trainer element changed
    (halved: its block's scale stays), the FP8 piece that holds it travels whole."""
    mesh = init_device_mesh("cpu", (world,))
    group = join(side, rank, port, sizes)
    full = truth("down", 0, FP8_SHAPES["down"]).bfloat16()
    src = {"down": distribute_tensor(full.clone(), mesh, [Shard(0)])} if side == "trainer" else {}
    tensors: dict[str, torch.Tensor] = {}
    shards: dict[str, Any] = {}
    if side == "engine":
        for n, shape, dtype in (("down", (256, 512), torch.float8_e4m3fn), ("down_scale_inv", (2, 4), torch.float32)):
            tensors[n] = torch.empty(shape[0], shape[1] // 2, dtype=dtype)
            poison(tensors[n])
            shards[n] = (tensors[n], dcp_load.tp_offsets(shape, 1, rank, world))
        shards = dcp_load.engine_shards(shards, {"down": (256, 512), "down_scale_inv": (2, 4)})
    out: dict[str, Any] = {}
    for step in range(2):
        if step:
            full[0, 0] *= 0.5
            if side == "trainer" and rank == 0:
                src["down"].to_local()[0, 0] *= 0.5
        report = dcp_load.transfer(src, shards, process_group=group, delta=True, timeout=60)
        q, scales = reference_fp8(full)
        out[f"step{step}"] = {
            "received": report.bytes_received, "reused": report.plan_reused,
            "exact": side != "engine" or (torch.equal(tensors["down"].view(torch.uint8), q.view(torch.uint8)
                                                      .chunk(2, 1)[rank])
                                          and torch.equal(tensors["down_scale_inv"], scales.chunk(2, 1)[rank]))}
    group.close()
    return out


def delta_colocated(rank: int, world: int) -> dict[str, Any]:
    """One job whose ranks are both trainer and engine: each holds half the rows (``Shard(0)``)
    and wants the whole tensor, so it sends its half and copies it into its own destination.
    After 2 % of the elements changed, the half that travels goes as bitmask + values and the
    holder's own copy is made too (its destination poisoned before: the copy is whole)."""
    mesh = init_device_mesh("cpu", (world,))
    shape = (128, 64)
    now = truth("colocated", 0, shape).bfloat16()
    src = {"w": distribute_tensor(now.clone(), mesh, [Shard(0)])}
    dst = {"w": torch.empty(shape, dtype=torch.bfloat16)}
    out: dict[str, Any] = {}
    for step in range(2):
        if step:
            g = torch.Generator().manual_seed(5)
            now.view(-1)[torch.randperm(now.numel(), generator=g)[:now.numel() // 50]] += 1
            src["w"].to_local().copy_(now.chunk(world)[rank])
            dst["w"].chunk(world)[rank].view(torch.uint8).fill_(0x7F)  # the half this rank holds
        report = dcp_load.transfer(src, dst, delta=True, timeout=60)
        out[f"step{step}"] = {"received": report.bytes_received, "copied": report.bytes_copied,
                              "exact": torch.equal(dst["w"], now)}
    return out


def trainer_dies_mid_transfer(rank: int, world: int, side: str, port: int, sizes: tuple[int, int]) -> dict[str, Any]:
    """Trainer rank 1 plans with the others, then exits as the data starts to move: the
    engine ranks wait in a broadcast of a group of three (trainer rank 1 and both engine
    ranks). Each survivor's error, and the release of the failed call (its groups
    destroyed), come within the call's timeout, not the platform's default group bound."""
    from dcp_load.transferring import _transfer

    group = join(side, rank, port, sizes)
    if side == "trainer" and rank == 1:
        _transfer.move = lambda *args, **kwargs: os._exit(3)
    mesh = init_device_mesh("cpu", (world,))
    src = {"w": distribute_tensor(truth("wo"), mesh, [Shard(0)])} if side == "trainer" else {}
    dst = {"w": torch.full(SHAPES["wo"], float("nan"))} if side == "engine" else {}
    start = time.monotonic()
    message = None
    try:
        dcp_load.transfer(src, dst, process_group=group, timeout=5)
    except dcp_load.LoadError as exc:
        message, raised = str(exc), time.monotonic() - start
    out = {"message": message, "raised": raised if message else None, "released": time.monotonic() - start}
    linger(group, side, rank, 3)
    return out


def _sockets() -> int:
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in os.listdir("/proc/self/fd")
               if os.path.islink(f"/proc/self/fd/{fd}"))


def delta_close_cycles(rank: int, world: int, side: str, port: int, sizes: tuple[int, int]) -> dict[str, Any]:
    """Three cycles of join, two ``delta=True`` transfers into new destinations, ``close()``:
    the sockets this process holds after each cycle (a closed group's store and backends
    released) do not grow from cycle to cycle."""
    import gc

    mesh = init_device_mesh("cpu", (world,))
    counts = []
    for _ in range(3):
        group = join(side, rank, port, sizes)
        src = {"w": distribute_tensor(truth("wo"), mesh, [Shard(0)])} if side == "trainer" else {}
        dst = {"w": torch.empty(SHAPES["wo"])} if side == "engine" else {}
        for _ in range(2):
            dcp_load.transfer(src, dst, process_group=group, delta=True, timeout=60)
        group.close()
        del group, src, dst
        gc.collect()
        counts.append(_sockets())
    return {"sockets": counts}

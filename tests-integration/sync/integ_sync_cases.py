"""Functions that run inside ranks for test_integ_sync (not a test module).

Two jobs launched apart, each with its own default gloo group (``run_ranks`` with its own
init file): a "trainer" job and an "engine" job. Their ranks join one transfer group
through a TCPStore on 127.0.0.1 (``dcp_load.transfer_group``) and move weights with
``transfer(..., process_group=group)``. While they do, any collective on a job's default
group raises (``default_group_forbidden``); afterwards each default group still works.
Destinations are poisoned (0x7F bytes) before each transfer.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import dcp_load
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

SHAPES = {"wq": (16, 8), "wk": (8, 8), "wv": (8, 8), "wo": (8, 16), "norm": (8,)}


def truth(name: str, step: int = 0, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + step)
    return torch.randn(*(shape or SHAPES[name]), generator=g)


def poison(t: torch.Tensor) -> None:
    t.view(torch.uint8).fill_(0x7F)


@contextlib.contextmanager
def default_group_forbidden():
    """Every collective that would run on the job's default group raises inside the block."""
    names = ("broadcast", "all_reduce", "all_gather", "all_gather_object", "barrier", "new_group")
    saved = {n: getattr(dist, n) for n in names}

    def guard(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            if name == "new_group" or group is None or group is dist.group.WORLD:
                raise AssertionError(f"torch.distributed.{name} on the default group during a sync transfer")
            return saved[name](*args, **kwargs)
        return call

    for n in names:
        setattr(dist, n, guard(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


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

"""Trainer-to-engine weight updates on 4 local gloo ranks: ``dcp_load.transfer`` against
gathering each tensor and broadcasting it from trainer rank 0, and against torch DCP save
+ load through a RAM-backed directory, side by side in one run.

    .venv/bin/python benchmarks/transfer/bench_transfer.py [--repeats 3] [--large-mib 8] [--large 16] [--small 2000]

Ranks 0-1 are the trainer (FSDP2: ``Shard(0)`` over their 1-D mesh), ranks 2-3 the engine
(tensor parallel over theirs: even tensors column-parallel ``Shard(0)``, odd ones
row-parallel ``Shard(1)``), bf16 on both sides. Two models: ``--large`` tensors of
``--large-mib`` MiB, and ``--small`` tensors of 4 KiB. Per method, the median over
``--repeats`` rounds of the slowest rank's wall time (ranks start together after a
barrier); per engine rank, the bytes it received against the bytes it keeps; per rank, the
peak extra resident memory (VmHWM after the method minus VmRSS before, the high-water mark
reset through /proc/self/clear_refs); collectives per engine rank (torch DCP: not counted).
``transfer (reused)`` is the second transfer between the same layouts (plan kept).

    .venv/bin/python benchmarks/transfer/bench_transfer.py --jobs [--repeats 3] [--bucket-mib 32] ...

``--jobs``: the trainer and the engine as two jobs launched apart (2 ranks each, each job
its own default gloo group), joined by ``dcp_load.transfer_group`` through a TCPStore on
127.0.0.1; the engine holds plain TP shards (``engine_shards``). Against the way RL
frameworks sync today: every trainer rank takes part in ``full_tensor()``, trainer rank 0
broadcasts the full tensors in buckets of ``--bucket-mib`` to a group of itself and the
engine ranks, and each engine rank slices its shard. Per method: the slowest rank's time
(median over the repeats), bytes received per engine rank / bytes it keeps, peak extra and
peak resident memory (VmHWM), and the values checked. Also: into FP8 destinations
(``float8_e4m3fn`` with ``_scale_inv``, quantized blockwise on the trainer), and, for
``--steps`` steps, ``CHANGED`` of every tensor's values changed at random on the trainer
between transfers, moved by ``delta=True`` and by a full transfer; then the goals, MET or
missed.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from dcp_platform.testing import run_ranks

WORLD = 4
SMALL_BYTES = 4096
#: The share of each tensor's values that change between two transfers in ``--jobs``.
CHANGED = 0.02


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _model(count: int, nbytes: int) -> dict[str, tuple[int, int]]:
    """name -> 2-D shape of ``nbytes`` bf16 bytes (rows a multiple of 4, so both meshes cut evenly)."""
    elems = nbytes // 2
    cols = 64 if elems < 1 << 16 else 1024
    return {f"layer.{i:04d}.weight": (elems // cols, cols) for i in range(count)}


def _value(name: str, shape: tuple[int, int], step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 31 + step)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def _layouts(model: dict[str, tuple[int, int]], rank: int, mesh: Any) -> tuple[Any, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    if rank < 2:
        src = {n: distribute_tensor(_value(n, s, 0), mesh, [Shard(0)], src_data_rank=None) for n, s in model.items()}
        return src, None
    dst = {n: distribute_tensor(torch.zeros(s, dtype=torch.bfloat16), mesh, [Shard(i % 2)], src_data_rank=None)
           for i, (n, s) in enumerate(model.items())}
    return None, dst


def _gather_broadcast(src: Any, dst: Any, rank: int, model: dict[str, Any], group: Any) -> dict[str, int]:
    """Each tensor: ``full_tensor()`` on the trainer, one broadcast from rank 0 to the engine."""
    received = collectives = 0
    for i, (name, shape) in enumerate(model.items()):
        if rank < 2:
            full = src[name].full_tensor()
            collectives += 1
            if rank == 0:
                dist.broadcast(full, src=0, group=group)
                collectives += 1
        else:
            full = torch.empty(shape, dtype=torch.bfloat16)
            dist.broadcast(full, src=0, group=group)
            collectives += 1
            received += full.numel() * 2
            local = dst[name].to_local()
            tp = rank - 2
            if i % 2 == 0:
                local.copy_(full.chunk(2, 0)[tp])
            else:
                local.copy_(full.chunk(2, 1)[tp])
        del full
    return {"received": received, "collectives": collectives}


def _dcp_save_load(src: Any, dst: Any, rank: int, path: str, trainer_pg: Any, engine_pg: Any) -> dict[str, int]:
    import torch.distributed.checkpoint as dcp

    if rank < 2:
        dcp.save(src, checkpoint_id=path, process_group=trainer_pg)
    dist.barrier()
    received = 0
    if rank >= 2:
        before = _rchar()
        dcp.load(dst, checkpoint_id=path, process_group=engine_pg)
        received = _rchar() - before
    dist.barrier()
    return {"received": received, "collectives": -1}


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _transfer(src: Any, dst: Any, keep: bool) -> dict[str, int]:
    import dcp_load

    report = dcp_load.transfer(src, dst, keep_plan=keep)
    return {"received": report.bytes_received, "collectives": report.collectives}


def _timed(fn: Any) -> tuple[float, dict[str, int], int]:
    gc_before = _status("VmRSS")
    peak_ok = _reset_peak()
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    extra = _status("VmHWM") - gc_before if peak_ok else -1
    dist.barrier()
    return seconds, out, extra


def _check(dst: Any, model: dict[str, Any], rank: int, step: int) -> bool:
    if dst is None:
        return True
    tp = rank - 2
    for i, (name, shape) in enumerate(model.items()):
        want = _value(name, shape, step).chunk(2, i % 2)[tp]
        if not torch.equal(dst[name].to_local(), want):
            return False
    return True


def _poison(dst: Any) -> None:
    if dst is not None:
        for v in dst.values():
            v.to_local().fill_(float("nan"))


def _methods(rank: int, model: dict[str, Any], mesh: Any, groups: dict[str, Any], root: str) -> dict[str, Any]:
    src, dst = _layouts(model, rank, mesh)
    path = os.path.join(root, "ckpt")
    methods = {
        "gather + broadcast": lambda: _gather_broadcast(src, dst, rank, model, groups["bcast"]),
        "torch DCP via /dev/shm": lambda: _dcp_save_load(src, dst, rank, path, groups["trainer"], groups["engine"]),
        "transfer (first)": lambda: _transfer(src, dst, True),
        # keep_plan=False: reuses the plan the first made, then drops it (and its groups),
        # so that the next round's first transfer plans again
        "transfer (reused)": lambda: _transfer(src, dst, False),
    }
    out = {}
    for label, fn in methods.items():
        _poison(dst)
        seconds, got, extra = _timed(fn)
        if rank == 0 and label.startswith("torch DCP"):
            shutil.rmtree(path, ignore_errors=True)
        kept = sum(v.to_local().numel() * 2 for v in dst.values()) if dst is not None else 0
        out[label] = {"seconds": seconds, "extra": extra, "kept": kept, "ok": _check(dst, model, rank, 0), **got}
    return out


def _bench(rank: int, world: int, specs: dict[str, Any], repeats: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("role", "x"))["x"]
    groups = {"bcast": dist.new_group([0, 2, 3]), "trainer": dist.new_group([0, 1]), "engine": dist.new_group([2, 3])}
    out: dict[str, Any] = {}
    for name, (count, nbytes) in specs.items():
        model = _model(count, nbytes)
        out[name] = [_methods(rank, model, mesh, groups, os.path.join(root, name)) for _ in range(repeats)]
    return out


def _table(per_rank: list[dict[str, Any]], name: str) -> list[str]:
    rounds = [r[name] for r in per_rank]
    labels = list(rounds[0][0])
    lines = [f"== {name} ==", f"{'method':24} {'seconds':>8} {'x gather':>8} {'recv/kept':>9} {'peak extra MiB':>14} "
             f"{'collectives':>11}  values"]
    base = None
    for label in labels:
        secs = statistics.median(max(r[i][label]["seconds"] for r in rounds) for i in range(len(rounds[0])))
        base = base or secs
        last = [r[-1][label] for r in rounds]
        engine = last[2:]
        ratio = max(e["received"] / e["kept"] for e in engine)
        extra = max(x["extra"] for x in last) / 2**20
        coll = max(e["collectives"] for e in engine)
        ok = all(x["ok"] for x in last)
        lines.append(f"{label:24} {secs:8.3f} {secs / base:8.2f} {ratio:9.3f} {extra:14.1f} "
                     f"{coll if coll >= 0 else '-':>11}  {'exact' if ok else 'WRONG'}")
    return lines


# -- two jobs launched apart, joined by dcp_load.transfer_group --------------------------------


def _sync_layouts(model: dict[str, tuple[int, int]], side: str, rank: int, mesh: Any) -> tuple[Any, Any, Any]:
    """Trainer: FSDP2 ``Shard(0)`` DTensors. Engine: plain TP shards (even tensors rows, odd
    ones columns) as ``engine_shards``, and the plain tensors themselves."""
    import dcp_load
    from torch.distributed.tensor import Shard, distribute_tensor

    if side == "trainer":
        return {n: distribute_tensor(_value(n, s, 0), mesh, [Shard(0)], src_data_rank=None)
                for n, s in model.items()}, {}, {}
    plain = {n: torch.zeros(s, dtype=torch.bfloat16).chunk(2, i % 2)[rank].contiguous()
             for i, (n, s) in enumerate(model.items())}
    shards = {n: (t, dcp_load.tp_offsets(model[n], i % 2, rank, 2)) for i, (n, t) in enumerate(plain.items())}
    return {}, dcp_load.engine_shards(shards, model), plain


def _bucketed(src: Any, plain: Any, side: str, rank: int, model: dict[str, Any], group: Any,
              bucket_bytes: int) -> dict[str, int]:
    """How RL frameworks sync today: every trainer rank takes part in ``full_tensor()``, trainer
    rank 0 packs the full tensors into buckets and broadcasts each to a group of itself and
    the engine ranks; each engine rank slices its shard out of every bucket."""
    received = 0
    names = list(model)
    while names:
        batch, size = [], 0
        while names and (not batch or size + math.prod(model[names[0]]) * 2 <= bucket_bytes):
            batch.append(names.pop(0))
            size += math.prod(model[batch[-1]]) * 2
        fulls = [src[n].full_tensor() for n in batch] if side == "trainer" else []
        if group is None:  # trainer ranks other than 0 are not in the broadcast group
            continue
        flat = (torch.cat([f.reshape(-1) for f in fulls]) if fulls else torch.empty(size // 2, dtype=torch.bfloat16))
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        group.broadcast([flat], opts).wait()
        if side == "engine":
            received += flat.numel() * 2
            at = 0
            for n in batch:
                full = flat[at:at + math.prod(model[n])].view(model[n])
                at += full.numel()
                plain[n].copy_(full.chunk(2, _split_dim(n))[rank])
    return {"received": received}


def _split_dim(name: str) -> int:
    """The dimension an engine rank splits ``layer.NNNN.weight`` along: rows for even NNNN."""
    return int(name.split(".")[1]) % 2


def _fp8_ok(model: dict[str, Any]) -> bool:
    """FP8 blockwise needs each trainer shard (half the rows) and each engine shard to cut on
    128 x 128 block edges."""
    return all(r % 256 == 0 and c % 256 == 0 for r, c in model.values())


def _fp8_layouts(model: dict[str, Any], rank: int) -> tuple[Any, Any]:
    """The engine's FP8 TP shards with their ``_scale_inv`` (vLLM's block-quantized layout)."""
    import dcp_load

    shards: dict[str, Any] = {}
    shapes: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in model.items():
        dim = _split_dim(name)
        scale_shape = tuple(-(-s // 128) for s in shape)
        for n, s, dtype in ((name, shape, torch.float8_e4m3fn), (f"{name}_scale_inv", scale_shape, torch.float32)):
            local = list(s)
            local[dim] //= 2
            tensors[n] = torch.empty(local, dtype=dtype)
            shards[n], shapes[n] = (tensors[n], dcp_load.tp_offsets(s, dim, rank, 2)), s
    return dcp_load.engine_shards(shards, shapes), tensors


def _fp8_exact(tensors: dict[str, torch.Tensor], model: dict[str, Any], rank: int) -> bool:
    from dcp_load.transferring._fp8 import quantize_blockwise

    for name, shape in model.items():
        q, scales = quantize_blockwise(_value(name, shape, 0))
        dim = _split_dim(name)
        if not (torch.equal(tensors[name].view(torch.uint8), q.view(torch.uint8).chunk(2, dim)[rank])
                and torch.equal(tensors[f"{name}_scale_inv"], scales.chunk(2, dim)[rank])):
            return False
    return True


def _changes(name: str, numel: int, step: int) -> torch.Tensor:
    """The flat indices of the ``CHANGED`` share of ``name``'s elements that change at ``step``
    (distinct, uniformly at random, the same on every rank)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 31 + 1000 + step)
    return torch.randperm(numel, generator=g)[:max(1, round(numel * CHANGED))]


def _change(src: Any, now: dict[str, torch.Tensor], side: str, rank: int, model: dict[str, Any], step: int) -> None:
    """One optimizer step's worth of change: ``CHANGED`` of each tensor's values, in place on the
    trainer's shards; the engine applies the same to its copy of the truth."""
    for name, shape in model.items():
        idx = _changes(name, math.prod(shape), step)
        if side == "trainer":
            local = src[name].to_local().view(-1)  # Shard(0) of 2: rank r holds flat [r n/2, (r+1) n/2)
            lo = rank * local.numel()
            mine = idx[(idx >= lo) & (idx < lo + local.numel())] - lo
            local[mine] += 1
        else:
            now[name].view(-1)[idx] += 1


def _sync_methods(side: str, rank: int, model: dict[str, Any], mesh: Any, groups: dict[str, Any],
                  bucket_bytes: int, steps: int) -> dict[str, Any]:
    src, dst, plain = _sync_layouts(model, side, rank, mesh)
    # the full transfers after the first delta write destinations of their own: a write into
    # a delta plan's destinations by another transfer (or a poison) makes its next call send all
    _, dst_full, plain_full = _sync_layouts(model, side, rank, mesh) if side == "engine" else ({}, {}, {})
    now = {n: _value(n, s, 0) for n, s in model.items()} if side == "engine" else {}
    exact_in = lambda held: all(torch.equal(t, now[n].chunk(2, _split_dim(n))[rank]) for n, t in held.items())  # noqa: E731
    exact = lambda: exact_in(plain)  # noqa: E731
    kept = sum(t.numel() * 2 for t in plain.values())
    out: dict[str, Any] = {}

    def timed(label: str, fn: Any, check: Any = exact, poison: bool = True, kept: int = kept,
              held: Any = plain) -> None:
        if poison:
            for t in held.values():
                t.fill_(float("nan"))
        _sync_barrier(groups["sync"])
        before, peak_ok = _status("VmRSS"), _reset_peak()
        t0 = time.perf_counter()
        got = fn()
        seconds = time.perf_counter() - t0
        peak = _status("VmHWM")
        extra = peak - before if peak_ok else -1
        out[label] = {"seconds": seconds, "extra": extra, "peak": peak, "ok": side == "trainer" or check(),
                      "side": side, "kept": kept, **got}

    timed("gather + bucket broadcast", lambda: _bucketed(src, plain, side, rank, model, groups["baseline"],
                                                         bucket_bytes))
    timed("transfer (first)", lambda: _sync_transfer(src, dst, groups["sync"], True))
    timed("transfer (reused)", lambda: _sync_transfer(src, dst, groups["sync"], False))
    if _fp8_ok(model):
        fdst, ftensors = _fp8_layouts(model, rank) if side == "engine" else ({}, {})
        for t in ftensors.values():
            t.view(torch.uint8).fill_(0x7F)  # NaN in both float8_e4m3fn and (as 4 bytes) float32
        fcheck = lambda: _fp8_exact(ftensors, model, rank)  # noqa: E731
        fkept = sum(t.numel() * t.element_size() for t in ftensors.values())
        timed("FP8 transfer (first)", lambda: _sync_transfer(src, fdst, groups["sync"], True), fcheck, kept=fkept)
        for t in ftensors.values():
            t.view(torch.uint8).fill_(0x7F)
        timed("FP8 transfer (reused)", lambda: _sync_transfer(src, fdst, groups["sync"], False), fcheck,
              kept=fkept)
        del fdst, ftensors
    timed("delta (first: all)", lambda: _sync_transfer(src, dst, groups["sync"], True, delta=True))
    full = dict(check=lambda: exact_in(plain_full), held=plain_full)
    timed("full, keep plan", lambda: _sync_transfer(src, dst_full, groups["sync"], True), **full)
    for step in range(1, steps + 1):
        last = step == steps  # the last step drops both plans (the next round makes new tensors)
        _change(src, now, side, rank, model, step)
        # delta first: its destinations hold the previous step's values, as a delta needs
        timed(f"delta, {CHANGED:.0%} changed", partial(_sync_transfer, src, dst, groups["sync"], not last, delta=True),
              poison=False)
        timed(f"full, {CHANGED:.0%} changed", partial(_sync_transfer, src, dst_full, groups["sync"], not last), **full)
    return out


def _sync_transfer(src: Any, dst: Any, group: Any, keep: bool, delta: bool = False) -> dict[str, int]:
    import dcp_load

    report = dcp_load.transfer(src, dst, process_group=group, keep_plan=keep, delta=delta)
    return {"received": report.bytes_received}


def _sync_barrier(group: Any) -> None:
    group.allreduce([torch.zeros(1)]).wait()


def _sync_job(rank: int, world: int, side: str, ports: tuple[int, int], specs: dict[str, Any], repeats: int,
              bucket_bytes: int, steps: int) -> dict[str, Any]:
    """One rank of the trainer job or of the engine job (each its own default group)."""
    import dcp_load
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    groups = {"sync": dcp_load.transfer_group("127.0.0.1", ports[0], side=side, rank=rank, world_sizes=(2, 2),
                                              timeout=600)}
    # the baseline's group: trainer rank 0 and the engine ranks, as RL frameworks build it
    groups["baseline"] = None if side == "trainer" and rank else dcp_load.transfer_group(
        "127.0.0.1", ports[1], side=side, rank=rank, world_sizes=(1, 2), timeout=600, name="baseline")
    out = {name: [_sync_methods(side, rank, _model(count, nbytes), mesh, groups, bucket_bytes, steps)
                  for _ in range(repeats)] for name, (count, nbytes) in specs.items()}
    _sync_barrier(groups["sync"])
    return out


def _sync_rows(trainer: list[Any], engine: list[Any], name: str) -> tuple[dict[str, Any], list[str]]:
    """Per method: the slowest rank's seconds (median over the rounds), the largest recv/kept of
    an engine rank, the largest peak extra and peak resident memory of any rank (last round)."""
    ranks = [r[name] for r in [*trainer, *engine]]
    lines = [f"== two jobs (2 trainer + 2 engine ranks, plain TP shards): {name} ==",
             f"{'method':26} {'seconds':>8} {'x bucket':>8} {'recv MiB':>9} {'recv/kept':>9} "
             f"{'peak extra MiB':>14} {'peak RSS MiB':>12}  values"]
    rows: dict[str, Any] = {}
    for label in ranks[0][0]:
        secs = statistics.median(max(r[i][label]["seconds"] for r in ranks) for i in range(len(ranks[0])))
        last = [r[-1][label] for r in ranks]
        recv = max(e["received"] for e in last if e["side"] == "engine")
        row = rows[label] = {
            "seconds": secs, "recv": recv, "ratio": max(e["received"] / e["kept"] for e in last if e["side"] == "engine"),
            "extra": max(x["extra"] for x in last) / 2**20, "peak": max(x["peak"] for x in last) / 2**20,
            "ok": all(x["ok"] for x in last)}
        base = rows["gather + bucket broadcast"]["seconds"]
        lines.append(f"{label:26} {secs:8.3f} {secs / base:8.2f} {recv / 2**20:9.2f} {row['ratio']:9.3f} "
                     f"{row['extra']:14.1f} {row['peak']:12.1f}  {'exact' if row['ok'] else 'WRONG'}")
    return rows, lines


def _goals(rows: dict[str, Any]) -> list[str]:
    """The goals, each MET or missed, from one run's rows."""
    base = rows["gather + bucket broadcast"]["seconds"]
    full, delta = rows["transfer (reused)"], rows[f"delta, {CHANGED:.0%} changed"]
    goals = [("recv/kept, full transfer", full["ratio"], 1.02),
             (f"recv/kept, delta with {CHANGED:.0%} changed", delta["ratio"], 0.1),
             ("time, transfer (reused) / bucket", full["seconds"] / base, 0.5),
             (f"time, delta {CHANGED:.0%} / bucket", delta["seconds"] / base, 0.5)]
    if "FP8 transfer (reused)" in rows:
        goals.append(("recv, FP8 / bf16 transfer", rows["FP8 transfer (reused)"]["recv"] / full["recv"], 0.52))
    lines = [f"{'goal':38} {'measured':>9} {'goal':>6}"]
    lines += [f"{g:38} {v:9.3f} {'<= ' + str(limit):>6}  {'MET' if v <= limit else 'missed'}" for g, v, limit in goals]
    lines.append(f"{'peak extra MiB: bucket / transfer / delta':38} {rows['gather + bucket broadcast']['extra']:.1f}"
                 f" / {full['extra']:.1f} / {delta['extra']:.1f}  (reported)")
    return lines


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_jobs(specs: dict[str, Any], repeats: int, bucket_bytes: int, steps: int) -> tuple[list[Any], list[Any]]:
    from concurrent.futures import ThreadPoolExecutor

    ports = (_free_port(), _free_port())
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(run_ranks, _sync_job, 2, side, ports, specs, repeats, bucket_bytes, steps,
                              timeout=1800)
                for side in ("trainer", "engine")]
        return jobs[0].result(), jobs[1].result()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--large", type=int, default=16, help="tensors of the large model")
    p.add_argument("--large-mib", type=int, default=8, help="MiB per tensor of the large model")
    p.add_argument("--small", type=int, default=2000, help="4 KiB tensors of the small model")
    p.add_argument("--jobs", action="store_true", help="the two-jobs case alone (transfer_group)")
    p.add_argument("--bucket-mib", type=int, default=32, help="the two-jobs baseline's bucket")
    p.add_argument("--steps", type=int, default=2, help="two-jobs: changed steps per round (the last is shown)")
    args = p.parse_args()
    specs = {f"{args.large} x {args.large_mib} MiB": (args.large, args.large_mib << 20),
             f"{args.small} x 4 KiB": (args.small, SMALL_BYTES)}
    if args.jobs:
        trainer, engine = _two_jobs(specs, args.repeats, args.bucket_mib << 20, args.steps)
        for name in specs:
            rows, lines = _sync_rows(trainer, engine, name)
            print("\n".join([*lines, *_goals(rows)]))
            print()
        return
    root = tempfile.mkdtemp(prefix="dcp-bench-transfer-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        per_rank = run_ranks(_bench, WORLD, specs, args.repeats, root, timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for name in specs:
        print("\n".join(_table(per_rank, name)))
        print()


if __name__ == "__main__":
    main()

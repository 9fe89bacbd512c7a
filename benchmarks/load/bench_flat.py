"""ZeRO-4 flat partitions of an AdamW state, loaded from an FSDP2 torch DCP checkpoint.

A ~1 GiB AdamW state (fp32 master weights, ``exp_avg``, ``exp_avg_sq`` of a Llama-like
model of 88 M parameters; ``--quick``: ~10 MiB) is saved by 4 gloo ranks holding it as
FSDP2 does (DTensor ``Shard(0)``) with torch.distributed.checkpoint's ``FileSystemWriter``.
4 ranks then load it into ZeRO-4 partitions: the parameters form one flat fp32 space, cut
into 4 uneven contiguous parts (cuts inside rows), and each rank holds its part of each of
the three states in one flat buffer. Side by side, each in fresh rank processes:

* ``dcp-flat``: ``dcp_load.load`` of ``flat_views`` of the three buffers: every read goes
  straight into a view of a buffer;
* ``torch-boxes``: the usual way: for every tensor a rank's interval touches, a box of the
  rows it spans (the rows ``torch.distributed.checkpoint`` can load: a ShardedTensor whose
  local shard is that box), loaded with one ``torch.distributed.checkpoint.load``, then
  copied into the flat buffers.

Before each load the checkpoint files are evicted from the page cache
(``posix_fadvise(POSIX_FADV_DONTNEED)``), so ``/proc/self/io`` ``read_bytes`` is what each
rank fetched from storage. Printed per method: the slowest rank's time, the largest peak
extra private memory of a rank (flat buffers allocated before the measurement), storage
bytes read per rank against the bytes its partition needs, and the ratios dcp / usual
beside the goals (memory <= 0.25 x, bytes read <= 1.01 x needed). The buffers loaded by
both methods are compared bit for bit. Run from the repository root:

    python benchmarks/load/bench_flat.py [--quick] [--repeats 2]
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness/

from harness.cli import parser, write_json  # noqa: E402
from harness.common import MemorySampler, checkpoint_files, fadvise_dontneed, read_bytes  # noqa: E402
from harness.launch import Launcher  # noqa: E402
from harness.stats import fmt_bytes, median, table  # noqa: E402

WORLD = 4
KINDS = ("model", "exp_avg", "exp_avg_sq")
CUTS = (0.23, 0.51, 0.77)  # where the ZeRO-4 cuts fall in the flat space (uneven, odd: inside rows)
MEMORY_GOAL, READ_GOAL = 0.25, 1.01


def params(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    """The model's parameters in order (the flat space): ~88 M (``quick``: ~0.8 M)."""
    h, kv, i, v, layers = (128, 32, 352, 1024, 2) if quick else (1024, 256, 2816, 32000, 2)
    out = [("embed_tokens.weight", (v, h))]
    for n in range(layers):
        p = f"layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "q_proj.weight", (h, h)), (p + "k_proj.weight", (kv, h)),
                (p + "v_proj.weight", (kv, h)), (p + "o_proj.weight", (h, h)),
                (p + "post_attention_layernorm.weight", (h,)), (p + "gate_proj.weight", (i, h)),
                (p + "up_proj.weight", (i, h)), (p + "down_proj.weight", (h, i))]
    return out + [("norm.weight", (h,)), ("lm_head.weight", (v, h))]


def key(kind: str, name: str) -> str:
    return f"model.{name}" if kind == "model" else f"optim.state.{name}.{kind}"


def partition(space: list[tuple[str, tuple[int, ...]]], rank: int) -> tuple[int, int]:
    """(offset, numel) of ``rank``'s ZeRO-4 part of the flat space."""
    total = sum(math.prod(s) for _, s in space)
    edges = [0, *(int(total * c) | 1 for c in CUTS), total]
    return edges[rank], edges[rank + 1] - edges[rank]


# -- the checkpoint ------------------------------------------------------------------------------
def rank_save(rank: int, world: int, out: str, quick: bool) -> None:
    """One FSDP2 rank: its ``Shard(0)`` rows of every state (random, seeded by name and rank)."""
    import torch
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    sd: dict[str, Any] = {}
    for k, kind in enumerate(KINDS):
        for j, (name, shape) in enumerate(params(quick)):
            rows = -(-shape[0] // world)
            lo, hi = min(rank * rows, shape[0]), min((rank + 1) * rows, shape[0])
            g = torch.Generator().manual_seed(1000 * j + 100 * k + rank)
            local = torch.randn((hi - lo, *shape[1:]), generator=g)
            stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
            sd[key(kind, name)] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                     shape=torch.Size(shape), stride=stride)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(sd, checkpoint_id=out)


def write_checkpoint(launcher: Launcher, out: Path, quick: bool) -> None:
    marker = out / "bench-spec.json"
    want = json.dumps({"params": params(quick), "kinds": KINDS, "ranks": WORLD})
    if marker.exists() and marker.read_text() == want:
        return
    out.mkdir(parents=True, exist_ok=True)
    launcher.run(rank_save, WORLD, str(out), quick)
    os.sync()
    marker.write_text(want)


# -- the loads (inside the ranks) ----------------------------------------------------------------
def _touched(space: list[tuple[str, tuple[int, ...]]], offset: int, numel: int
             ) -> list[tuple[str, tuple[int, ...], int, int, int]]:
    """(name, shape, first element, end element of the tensor's part, its place in the buffer)."""
    out, begin = [], 0
    for name, shape in space:
        end = begin + math.prod(shape)
        lo, hi = max(begin, offset), min(end, offset + numel)
        if hi > lo:
            out.append((name, shape, lo - begin, hi - begin, lo - offset))
        begin = end
    return out


def _row_box_tensor(shape: tuple[int, ...], first: int, end: int, rank: int, world: int) -> tuple[Any, Any]:
    """A ShardedTensor whose local shard is the rows ``[first, end)`` of elements span,
    and that local tensor. The metadata lists the other rows under another rank (torch
    wants the shards to tile the tensor; loading reads only the local shard)."""
    import torch
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    row = math.prod(shape[1:])
    r0, r1 = (first // row, -(-end // row)) if shape else (0, 1)
    rest = list(shape[1:])
    local = torch.empty((r1 - r0, *rest) if shape else ())
    if not shape:
        return local, local
    mine = ShardMetadata([r0] + [0] * len(rest), [r1 - r0, *rest], f"rank:{rank}/cpu")
    other = f"rank:{(rank + 1) % world}/cpu"
    pads = [ShardMetadata([a] + [0] * len(rest), [b - a, *rest], other) for a, b in ((0, r0), (r1, shape[0])) if b > a]
    meta = ShardedTensorMetadata([mine, *pads], torch.Size(shape), TensorProperties(dtype=torch.float32))
    st = ShardedTensor._init_from_local_shards_and_global_metadata([Shard(local, mine)], meta)
    return st, local


def _load_torch_boxes(buffers: dict[str, Any], ckpt: str, rank: int, world: int, quick: bool) -> None:
    import torch.distributed.checkpoint as tdcp

    space = params(quick)
    offset, numel = partition(space, rank)
    state, copies = {}, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShardedTensor is deprecated; it is still how torch DCP loads a box
        for kind in KINDS:
            for name, shape, first, end, at in _touched(space, offset, numel):
                st, local = _row_box_tensor(shape, first, end, rank, world)
                state[key(kind, name)] = st
                row = math.prod(shape[1:]) if shape else 1
                copies.append((buffers[kind][at:at + end - first], local, first - (first // row) * row))
        tdcp.load(state, checkpoint_id=ckpt)
    for dest, local, skip in copies:
        dest.copy_(local.reshape(-1)[skip:skip + dest.numel()])


def _load_dcp_flat(buffers: dict[str, Any], ckpt: str, rank: int, quick: bool) -> int:
    import dcp_load

    space = params(quick)
    offset, _ = partition(space, rank)
    state = {}
    for kind in KINDS:
        views = dcp_load.flat_views([(key(kind, n), s) for n, s in space], buffers[kind], offset)
        state.update(views)
    return dcp_load.load(state, checkpoint_id=ckpt).bytes_read


def rank_load(rank: int, world: int, method: str, ckpt: str, quick: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    space = params(quick)
    _, numel = partition(space, rank)
    buffers = {kind: torch.full((numel,), float("nan")) for kind in KINDS}
    dist.barrier()
    if rank == 0:
        fadvise_dontneed(checkpoint_files(Path(ckpt)))
    dist.barrier()
    before = read_bytes()
    reader = 0
    with MemorySampler() as mem:
        t0 = time.perf_counter()
        if method == "dcp-flat":
            reader = _load_dcp_flat(buffers, ckpt, rank, quick)
        else:
            _load_torch_boxes(buffers, ckpt, rank, world, quick)
        seconds = time.perf_counter() - t0
    fetched = read_bytes() - before
    import xxhash

    digest = xxhash.xxh3_64()
    for kind in KINDS:
        if torch.isnan(buffers[kind]).any():
            raise AssertionError(f"rank {rank}: {method} left NaN poison in {kind}")
        digest.update(buffers[kind].numpy().tobytes())
    return {"seconds": seconds, "fetched": fetched, "reader": reader, "needed": 3 * numel * 4,
            "extra_anon": mem.result["extra_anon"], "extra_rss": mem.result["extra_rss"],
            "digest": digest.hexdigest()}


# -- the parent ----------------------------------------------------------------------------------
def _summary(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        "seconds": median([max(r["seconds"] for r in per_rank) for per_rank in runs]),
        "extra_anon": median([max(r["extra_anon"] for r in per_rank) for per_rank in runs]),
        "read_ratio": median([max(r["fetched"] / r["needed"] for r in per_rank) for per_rank in runs]),
        "job_ratio": median([sum(r["fetched"] for r in per_rank) / sum(r["needed"] for r in per_rank)
                             for per_rank in runs]),
        "per_rank": runs[-1],
    }


def main() -> None:
    args = parser(__doc__, quick="~10 MiB instead of ~1 GiB", repeats=2,
                  repeats_help="runs per method, alternating (median shown)", workdir="/tmp/dcp-flat-bench",
                  json_help="also write the results here").parse_args()

    launcher = Launcher()
    ckpt = Path(args.workdir) / ("adamw-fsdp4-quick" if args.quick else "adamw-fsdp4")
    write_checkpoint(launcher, ckpt, args.quick)
    state_bytes = 3 * 4 * sum(math.prod(s) for _, s in params(args.quick))
    print(f"AdamW state {fmt_bytes(state_bytes)} (3 x fp32, {len(params(args.quick))} tensors), torch DCP "
          f"FSDP2 save over {WORLD} ranks -> ZeRO-{WORLD} flat partitions; load average "
          f"{os.getloadavg()[0]:.1f} at start")
    runs: dict[str, list[list[dict[str, Any]]]] = {"dcp-flat": [], "torch-boxes": []}
    for _ in range(args.repeats):
        for method in runs:
            runs[method].append(launcher.run(rank_load, WORLD, method, str(ckpt), args.quick))
    digests = {m: [r["digest"] for r in rs[-1]] for m, rs in runs.items()}
    if digests["dcp-flat"] != digests["torch-boxes"]:
        raise SystemExit(f"the two methods loaded different buffers: {digests}")
    res = {m: _summary(rs) for m, rs in runs.items()}
    rows = []
    for m, s in res.items():
        rows.append([m, f"{s['seconds']:.2f} s", fmt_bytes(s["extra_anon"]), f"{s['read_ratio']:.4f}",
                     f"{s['job_ratio']:.4f}",
                     " ".join(fmt_bytes(r["fetched"]) for r in s["per_rank"]),
                     " ".join(fmt_bytes(r["needed"]) for r in s["per_rank"])])
    print(table(["method", "time (slowest rank)", "peak extra memory (max rank)", "read / needed (max rank)",
                 "job read / needed", "read per rank", "needed per rank"], rows))
    d, u = res["dcp-flat"], res["torch-boxes"]
    mem = d["extra_anon"] / max(u["extra_anon"], 1)
    print(f"dcp-flat / torch-boxes: time {d['seconds'] / u['seconds']:.2f} x, peak extra memory {mem:.3f} x "
          f"(goal <= {MEMORY_GOAL}), bytes read {d['read_ratio']:.4f} x needed (goal <= {READ_GOAL}); "
          f"reader's own count {max(r['reader'] / r['needed'] for r in d['per_rank']):.4f} x needed; "
          f"buffers identical; load average {os.getloadavg()[0]:.1f} at end")
    write_json(args.json, {"results": res, "state_bytes": state_bytes})


if __name__ == "__main__":
    main()

"""Tensor-parallel loads, side by side with torch DCP on the same files (warm page cache).

Each case is a set of whole tensors saved twice, once as a Hugging Face safetensors file
(``safetensors.torch.save_file``) and once by ``torch.distributed.checkpoint.save`` (one
chunk per tensor), then loaded into TP DTensors on real gloo ranks (one torch thread each)
by ``dcp_load.load`` and by ``torch.distributed.checkpoint.load`` (``HuggingFaceStorageReader``
on the Hugging Face files, ``FileSystemReader`` on its own). In one launch per world size
the two alternate (which goes first swaps every repeat); the time of a load is the slowest
rank's, between two barriers; destinations are poisoned before each load, and the values
of both loaders are compared with each other and with the saved tensors. Printed: the
median over ``--repeats`` of each, their ratio, and dcp's bytes read against the bytes
the ranks hold.

    python benchmarks/load/bench_tp.py [--ranks 2,4] [--repeats 3] [--cases ...] [--model-mib 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 1024 * 1024


def llama_layers(layers: int, dim: int, ffn: int, kv: int) -> dict[str, tuple[tuple[int, ...], int]]:
    """{name: (shape, Shard dim)}: Llama's TP plan, q/k/v/gate/up column-parallel
    (``Shard(0)``), o/down row-parallel (``Shard(1)``)."""
    out: dict[str, tuple[tuple[int, ...], int]] = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = ((dim, dim), 0)
        out[p + "self_attn.k_proj.weight"] = ((kv, dim), 0)
        out[p + "self_attn.v_proj.weight"] = ((kv, dim), 0)
        out[p + "self_attn.o_proj.weight"] = ((dim, dim), 1)
        out[p + "mlp.gate_proj.weight"] = ((ffn, dim), 0)
        out[p + "mlp.up_proj.weight"] = ((ffn, dim), 0)
        out[p + "mlp.down_proj.weight"] = ((dim, ffn), 1)
    return out


def llama_model(mib: int) -> dict[str, tuple[tuple[int, ...], int]]:
    """A Llama-like TP model of about ``mib`` MiB of bf16: vocab-parallel embedding and
    head (``Shard(0)``), replicated norms (``Shard(-1)`` stands for ``Replicate`` here)."""
    dim, ffn, kv, vocab = 2048, 5632, 512, 32000
    per_layer = (2 * dim * dim + 2 * kv * dim + 3 * ffn * dim) * 2
    layers = max(1, (mib * MiB - 2 * vocab * dim * 2) // per_layer)
    out = {"model.embed_tokens.weight": ((vocab, dim), 0), "lm_head.weight": ((vocab, dim), 0),
           "model.norm.weight": ((dim,), -1)}
    out.update(llama_layers(layers, dim, ffn, kv))
    for i in range(layers):
        out[f"model.layers.{i}.input_layernorm.weight"] = ((dim,), -1)
    return out


def cases(model_mib: int) -> dict[str, dict[str, tuple[tuple[int, ...], int]]]:
    return {
        "llama-layers": llama_layers(4, 1024, 2816, 256),
        "rowpar-4096x1024-S1": {"w": ((4096, 1024), 1)},
        "embed-50304x768-S1": {"w": ((50304, 768), 1)},  # a GPT-2 embedding split along the hidden dim
        "narrow-65536x64-S1": {"w": ((65536, 64), 1)},
        "experts-16x512x512-S2": {"w": ((16, 512, 512), 2)},
        "conv-256x256x3x3-S3": {"w": ((256, 256, 3, 3), 3)},
        "llama-model": llama_model(model_mib),
    }


def write_case(root: Path, spec: dict[str, tuple[tuple[int, ...], int]]) -> int:
    """Both checkpoints of one case under ``root`` (kept when already there)."""
    import torch
    import torch.distributed.checkpoint as tdcp
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    sd = {n: torch.randn(shape, generator=g).to(torch.bfloat16) for n, (shape, _) in spec.items()}
    if not (root / "hf" / "model.safetensors").exists():
        (root / "hf").mkdir(parents=True, exist_ok=True)
        save_file(sd, str(root / "hf" / "model.safetensors"))
    if not (root / "dcp" / ".metadata").exists():
        tdcp.save(sd, checkpoint_id=str(root / "dcp"), no_dist=True)
    return sum(t.numel() * t.element_size() for t in sd.values())


def warm(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(16 * MiB):
                    pass


def _targets(spec: dict[str, Any], mesh: Any) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {}
    for name, (shape, dim) in spec.items():
        placement = Replicate() if dim < 0 else Shard(dim)
        out[name] = distribute_tensor(torch.empty(shape, dtype=torch.bfloat16), mesh, [placement],
                                      src_data_rank=None)
    return out


def _poison(sd: dict[str, Any]) -> None:
    import torch

    for t in sd.values():
        t.to_local().view(torch.uint8).fill_(0x7F)


def _load(method: str, fmt: str, sd: dict[str, Any], path: str) -> int:
    import torch.distributed.checkpoint as tdcp

    if method == "dcp":
        import dcp_load

        return dcp_load.load(sd, checkpoint_id=path).bytes_read
    reader = tdcp.HuggingFaceStorageReader(path) if fmt == "hf" else tdcp.FileSystemReader(path)
    tdcp.load(sd, storage_reader=reader)
    return 0


def _timed(method: str, fmt: str, sd: dict[str, Any], path: str) -> tuple[float, int]:
    import torch
    import torch.distributed as dist

    _poison(sd)
    dist.barrier()
    t0 = time.perf_counter()
    nbytes = _load(method, fmt, sd, path)
    dist.barrier()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took), nbytes


def _check(name: str, a: dict[str, Any], b: dict[str, Any], path: str) -> list[str]:
    """Both loaders' values equal each other and the saved tensors (safetensors' own read);
    every rank gathers (``full_tensor`` is a collective)."""
    import torch
    from safetensors import safe_open

    bad = []
    with safe_open(path, framework="pt") as f:
        for key, t in a.items():
            want = f.get_tensor(key)
            if not torch.equal(t.full_tensor(), want) or not torch.equal(b[key].full_tensor(), want):
                bad.append(f"{name}: {key} differs")
    return bad


def rank_main(rank: int, world: int, work: str, names: list[str], specs: dict[str, Any], repeats: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {"errors": []}
    for name in names:
        spec = specs[name]
        for fmt in ("hf", "dcp"):
            path = os.path.join(work, name, fmt)
            sds = {m: _targets(spec, mesh) for m in ("dcp", "torch")}
            for m in ("dcp", "torch"):  # imports, first opens
                _timed(m, fmt, sds[m], path)
            times: dict[str, list[float]] = {"dcp": [], "torch": []}
            read = 0
            for rep in range(repeats):
                for m in ("dcp", "torch") if rep % 2 == 0 else ("torch", "dcp"):
                    s, nbytes = _timed(m, fmt, sds[m], path)
                    times[m].append(s)
                    read = max(read, nbytes)
            out["errors"] += _check(name, sds["dcp"], sds["torch"],
                                    os.path.join(work, name, "hf", "model.safetensors"))
            held = sum(t.to_local().numel() * 2 for t in sds["dcp"].values())
            out[(name, fmt)] = {m: statistics.median(v) for m, v in times.items()} | {"read": read, "held": held}
        dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4", help="comma-separated world sizes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--model-mib", type=int, default=256,
                    help="Llama-like model case: about this size, at least its 250 MiB embedding and head + 1 layer")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "dcp-bench-tp"))
    args = ap.parse_args()
    from dcp_platform.testing import add_preload, run_ranks

    add_preload("dcp_load", "safetensors.torch", "torch.distributed.checkpoint.hf_storage")
    specs = cases(args.model_mib)
    names = [n for n in specs if not args.cases or any(n.startswith(c) for c in args.cases.split(","))]
    sizes = {n: write_case(Path(args.workdir) / n, specs[n]) for n in names}
    rows = []
    for world in (int(w) for w in args.ranks.split(",")):
        for n in names:
            warm(Path(args.workdir) / n)
        res = run_ranks(rank_main, world, args.workdir, names, specs, args.repeats, timeout=3600, pg_timeout=300)
        errors = [e for r in res for e in r["errors"]]
        if errors:
            sys.exit("values differ:\n" + "\n".join(errors))
        for n in names:
            for fmt in ("hf", "dcp"):
                per = [r[(n, fmt)] for r in res]
                d, t = per[0]["dcp"], per[0]["torch"]
                read, held = sum(p["read"] for p in per), sum(p["held"] for p in per)
                rows.append((n, world, fmt, sizes[n], d, t, read / held))
    print(f"{'case':26} {'ranks':>5} {'files':>5} {'MiB':>7} {'dcp s':>8} {'torch s':>8} {'dcp/torch':>9} "
          f"{'read/held':>9}")
    for n, world, fmt, size, d, t, amp in rows:
        print(f"{n:26} {world:>5} {fmt:>5} {size / MiB:7.1f} {d:8.4f} {t:8.4f} {d / t:9.2f} {amp:9.2f}")


if __name__ == "__main__":
    main()

"""A Hugging Face checkpoint loaded into a fused training layout: ``sources=`` against two steps.

The benchmark checkpoint (``harness.common.ModelSpec``: a Llama-like decoder, 1.08 GiB of
bf16, 4 KV heads; ``--quick``: ~34 MiB) is loaded by 4 real gloo ranks, DP2 x TP2 (mesh
("dp", "tp"), two simulated nodes of 2 ranks, TP inside a node, each node reading its own
byte-identical copy of the files with its own ``DCP_HOST_ID``), into a fused layout held as
DTensors (torchtitan-like names): ``wqkv`` = q, k, v interleaved by KV group (Megatron's
layout, ``Shard(0)`` over TP: each TP rank holds whole groups), ``w13`` = gate and up fused
per TP rank, row-parallel ``wo`` / ``w2`` (``Shard(1)``), renamed norms, embedding and
output. Side by side, alternating, in one run:

- ``dcp``: one ``dcp_load.load(fused, sources=...)`` (the default ``"auto"`` mode);
- ``two-step``: torch.distributed.checkpoint loads Hugging Face-named DTensors through its
  ``HuggingFaceStorageReader`` (renamed tensors straight into the fused layout's
  destinations, q/k/v/gate/up into temporaries of their TP shards), then the fused local
  shards are built with ``torch.cat`` (into the destinations, ``out=``) and the temporaries
  freed.

The destinations exist before the measurement in both (the model is built); what is
measured is the load: wall time (first start to last end), peak extra private memory per
rank (``RssAnon`` sampled every 2 ms above its value before the call), and bytes read from
storage per job (``/proc/self/io``, the copies evicted from the page cache before each
load with ``posix_fadvise``; ``--warm``: read into it first) against the unique bytes.
Both methods' fused shards are compared byte for byte on every rank, and layer 0's
against the files. Run from the repository root:

    python benchmarks/load/bench_sources.py [--quick] [--repeats 3] [--warm]
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness/

from harness.cli import parser, write_json  # noqa: E402
from harness.common import (  # noqa: E402
    MemorySampler,
    MiB,
    copy_checkpoint,
    node_copy,
    now,
    read_bytes,
    set_cache,
    warmup_spec,
    write_hf_checkpoint,
    write_warmup_checkpoint,
)
from harness.launch import Launcher  # noqa: E402
from harness.layouts import model_spec  # noqa: E402
from harness.stats import median, summarise  # noqa: E402

DP, TP, NODES = 2, 2, 2
KV_HEADS = 4  # ModelSpec: 4 KV heads (of 128 at full size, of 32 with --quick)


def fused_tensors(spec: Any) -> list[tuple[str, tuple[int, ...], Any, Any]]:
    """(name, shape, tp placement dim or None, source) of the fused layout."""
    from dcp_load import Concat

    h, kv, i, v = spec.hidden, spec.kv_dim, spec.intermediate, spec.vocab
    out: list[tuple[str, tuple[int, ...], Any, Any]] = [
        ("tok_embeddings.weight", (v, h), 0, "model.embed_tokens.weight"),
        ("norm.weight", (h,), None, "model.norm.weight"), ("output.weight", (v, h), 0, "lm_head.weight")]
    for n in range(spec.layers):
        p, q = f"model.layers.{n}.", f"layers.{n}."
        out += [
            (q + "attention_norm.weight", (h,), None, p + "input_layernorm.weight"),
            (q + "attention.wqkv.weight", (h + 2 * kv, h), 0,
             Concat([p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"],
                    dim=0, groups=KV_HEADS)),
            (q + "attention.wo.weight", (h, h), 1, p + "self_attn.o_proj.weight"),
            (q + "ffn_norm.weight", (h,), None, p + "post_attention_layernorm.weight"),
            (q + "feed_forward.w13.weight", (2 * i, h), 0,
             Concat([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], dim=0, groups=TP)),
            (q + "feed_forward.w2.weight", (h, i), 1, p + "mlp.down_proj.weight"),
        ]
    return out


def _dtensor(local: Any, mesh: Any, shape: tuple[int, ...], tp_dim: int | None) -> Any:
    import math

    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    return DTensor.from_local(local, mesh, [Replicate(), Replicate() if tp_dim is None else Shard(tp_dim)],
                              run_check=False, shape=torch.Size(shape), stride=stride)


def _local_shape(shape: tuple[int, ...], tp_dim: int | None) -> tuple[int, ...]:
    return shape if tp_dim is None else tuple(s // TP if d == tp_dim else s for d, s in enumerate(shape))


def _two_step(spec: Any, mesh: Any, fused: dict[str, Any], ckpt: str) -> None:
    """torch DCP into Hugging Face-named DTensors, then torch.cat into the fused shards."""
    import torch
    import torch.distributed.checkpoint as tdcp

    dtype = getattr(torch, spec.dtype)
    hf: dict[str, Any] = {}
    temps: dict[str, Any] = {}
    for name, _, _, source in fused_tensors(spec):
        if isinstance(source, str):
            hf[source] = fused[name]  # a rename: torch DCP loads into the destination itself
            continue
        for part in source.parts:
            pshape = next(s for n, s, _ in spec.tensors() if n == part)
            temps[part] = torch.empty(_local_shape(pshape, 0), dtype=dtype)
            hf[part] = _dtensor(temps[part], mesh, pshape, 0)
    tdcp.load(hf, storage_reader=tdcp.HuggingFaceStorageReader(ckpt))
    del hf
    for name, _, _, source in fused_tensors(spec):
        if isinstance(source, str):
            continue
        # this TP rank's shards of the parts hold groups / TP whole groups each: interleave them
        groups = source.groups // TP if source.groups > 1 else 1
        blocks = [temps.pop(p).chunk(groups) for p in source.parts]
        torch.cat([b[k] for k in range(groups) for b in blocks], out=fused[name].to_local())
        del blocks


def _fused_state(spec: Any, mesh: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fused layout's destinations (poisoned DTensors) and their local tensors."""
    import torch

    dtype = getattr(torch, spec.dtype)
    fused, locals_ = {}, {}
    for name, shape, tp_dim, _ in fused_tensors(spec):
        locals_[name] = torch.full(_local_shape(shape, tp_dim), float("nan"), dtype=dtype)
        fused[name] = _dtensor(locals_[name], mesh, shape, tp_dim)
    return fused, locals_


def _load(method: str, spec: Any, mesh: Any, fused: dict[str, Any], ckpt: str) -> dict[str, Any]:
    import dcp_load

    if method != "dcp":
        _two_step(spec, mesh, fused, ckpt)
        return {}
    sources = {name: source for name, _, _, source in fused_tensors(spec)}
    report = dcp_load.load(fused, checkpoint_id=ckpt, sources=sources)
    return {"report_bytes_read": report.bytes_read, "report_bytes_received": report.bytes_received,
            "report_broadcasts": report.broadcasts, "report_seconds": dict(report.seconds)}


def rank_main(rank: int, world: int, method: str, spec: Any, copies: list[str], check_dir: str,
              warm_dir: str) -> dict[str, Any]:
    import gc
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")  # torch DCP's HF reader warns about details
    node = rank // TP
    os.environ["DCP_HOST_ID"] = f"bench-node-{node}"
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    # A load of a tiny checkpoint of the same structure first, by the same method: first-call
    # costs (lazy imports, group creation) stay out of the measured load, as in harness.common.
    small = warmup_spec(spec)
    _load(method, small, mesh, _fused_state(small, mesh)[0], warm_dir)
    fused, locals_ = _fused_state(spec, mesh)
    gc.collect()
    dist.barrier()
    sampler = MemorySampler()
    io0 = read_bytes()
    sampler.__enter__()
    t0 = now()
    info = _load(method, spec, mesh, fused, copies[node])
    t1 = now()
    sampler.__exit__(None, None, None)
    io1 = read_bytes()
    dist.barrier()
    digest = hashlib.blake2b(b"".join(locals_[n].view(torch.uint8).numpy().tobytes() for n in sorted(locals_)),
                             digest_size=16).hexdigest()
    _check_layer0(spec, locals_, mesh.get_local_rank("tp"), check_dir, method)
    return {"rank": rank, "node": node, "t0": t0, "t1": t1, "read_bytes": io1 - io0, "memory": sampler.result,
            "digest": digest, "data_collectives": 0, "collectives": {}, "dest_bytes": 0, **info}


def _check_layer0(spec: Any, local: dict[str, Any], tp_rank: int, ckpt: str, method: str) -> None:
    """Layer 0's fused shards against the files (the reference: torch.cat of whole tensors)."""
    import torch
    from safetensors import safe_open

    index = json.loads((Path(ckpt) / "model.safetensors.index.json").read_text())["weight_map"]

    def whole(n: str) -> Any:
        with safe_open(str(Path(ckpt) / index[n]), framework="pt") as f:
            return f.get_tensor(n)

    for name, _, _, source in fused_tensors(spec):
        if not name.startswith("layers.0.") or isinstance(source, str):
            continue
        blocks = [whole(p).chunk(source.groups) for p in source.parts]
        full = torch.cat([b[k] for k in range(source.groups) for b in blocks])
        if not torch.equal(local[name], full.chunk(TP)[tp_rank]):
            raise AssertionError(f"{name}: TP rank {tp_rank}'s shard differs from the files ({method})")


def main() -> None:
    ap = parser(__doc__, quick="~34 MiB model instead of 1.08 GiB", repeats=3, workdir="/tmp/dcp-sources-bench",
                rank_timeout=True, json_help="also write the results here")
    ap.add_argument("--warm", action="store_true", help="page cache warm instead of evicted before each load")
    args = ap.parse_args()
    spec = model_spec(args.quick)
    work = Path(args.workdir)
    hf = work / ("hf-model-quick" if args.quick else "hf-model")
    unique = write_hf_checkpoint(hf, spec)
    warm_dir = write_warmup_checkpoint(work, spec)
    copies = [node_copy(hf, k) for k in range(NODES)]
    for c in copies[1:]:
        copy_checkpoint(hf, c)
    launcher = Launcher()
    print(f"unique bytes {unique / MiB:.1f} MiB; {NODES} node copies; load average "
          f"{os.getloadavg()[0]:.1f}; cache {'warm' if args.warm else 'evicted before each load'}", flush=True)
    rows: list[dict[str, Any]] = []
    digests: dict[str, set[tuple[str, ...]]] = {}
    for rep in range(args.repeats):
        for method in ("dcp", "two-step"):
            set_cache(copies, args.warm)
            per_rank = launcher.run(rank_main, DP * TP, method, spec, [str(c) for c in copies], str(hf),
                                    warm_dir, timeout=args.rank_timeout)
            s = summarise(per_rank)
            digests.setdefault(method, set()).add(tuple(r["digest"] for r in per_rank))
            row = {"method": method, "repeat": rep, "wall_s": s["wall_s"],
                   "storage_over_unique": s["read_bytes_total"] / unique,
                   "reader_over_unique": (s["report_bytes_read_total"] / unique
                                          if "report_bytes_read_total" in s else None),
                   "extra_anon_max_mib": s["extra_anon_max"] / MiB, "load_avg": os.getloadavg()[0]}
            rows.append(row)
            reader = "-" if row["reader_over_unique"] is None else f"{row['reader_over_unique']:.3f}"
            phases = per_rank[0].get("report_seconds")
            phases = ("  rank 0 phases " + " ".join(f"{k} {v:.2f}" for k, v in phases.items())) if phases else ""
            print(f"rep {rep} {method:8s} wall {row['wall_s']:6.2f} s  storage/unique "
                  f"{row['storage_over_unique']:.3f}  reader/unique {reader}  peak extra anon per rank "
                  f"{row['extra_anon_max_mib']:7.1f} MiB  load avg {row['load_avg']:.1f}{phases}", flush=True)
            time.sleep(0.5)
    if len(digests["dcp"] | digests["two-step"]) != 1:
        raise SystemExit("the two methods loaded different bytes")
    med = {m: {k: median([r[k] for r in rows if r["method"] == m])
               for k in ("wall_s", "extra_anon_max_mib", "storage_over_unique")} for m in ("dcp", "two-step")}
    pairs = [(a["wall_s"] / b["wall_s"]) for a, b in zip(rows[::2], rows[1::2], strict=True)]
    print(f"median of {args.repeats}: dcp {med['dcp']['wall_s']:.2f} s, two-step {med['two-step']['wall_s']:.2f} s; "
          f"time dcp/two-step {median(pairs):.2f} x (median of the per-repeat ratios; goal <= 0.8), "
          f"peak extra memory {med['dcp']['extra_anon_max_mib'] / med['two-step']['extra_anon_max_mib']:.2f}"
          f" x (goal <= 0.5), storage bytes dcp {med['dcp']['storage_over_unique']:.3f} x unique, two-step "
          f"{med['two-step']['storage_over_unique']:.3f} x; fused shards identical on every rank")
    write_json(args.json, {"unique_bytes": unique, "runs": rows, "median": med})


if __name__ == "__main__":
    main()

"""Functions that run inside ranks for test_integ_sources (not a test module).

4 gloo ranks, DP2 x TP2 (mesh ("dp", "tp"); ranks 0-1 and 2-3 are two simulated nodes,
each reading its own copy of the checkpoint, page cache dropped before each measured load,
as in integ_read_once_cases). A Llama-like Hugging Face checkpoint with experts is loaded
into a training layout through ``sources=``: fused grouped QKV, fused gate/up per TP rank,
stacked experts sharded over both mesh dims, renames; a Phi-3-like fused checkpoint is
split back into q, k, v, gate and up through ``Slice``. The same with ``Chunk`` targets
(which planning cannot derive from a mesh, so the wants are gathered).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from integ_read_once_cases import HOST_ID_ENV, drop_cache, read_bytes

LAYERS, D, H, KV, HD, F, E, FE, V = 2, 512, 8, 2, 32, 512, 4, 128, 1000


def _rand(name: str, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(*shape, generator=g)


def llama() -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": _rand("emb", V, D), "model.norm.weight": _rand("norm", D)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = _rand(p + "q", H * HD, D)
        out[p + "self_attn.k_proj.weight"] = _rand(p + "k", KV * HD, D)
        out[p + "self_attn.v_proj.weight"] = _rand(p + "v", KV * HD, D)
        out[p + "self_attn.o_proj.weight"] = _rand(p + "o", D, H * HD)
        out[p + "mlp.gate_proj.weight"] = _rand(p + "gate", F, D)
        out[p + "mlp.up_proj.weight"] = _rand(p + "up", F, D)
        for e in range(E):
            out[p + f"mlp.experts.{e}.w1.weight"] = _rand(p + f"e{e}", FE, D)
    return out


def phi3() -> dict[str, torch.Tensor]:
    src = llama()
    out = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([src[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([src[p + "mlp.gate_proj.weight"], src[p + "mlp.up_proj.weight"]])
    return out


def write_hf(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Two shards and a ``model.safetensors.index.json``, as Hugging Face writes them."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(path, file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)


def llama_sources() -> dict[str, Any]:
    from dcp_load import Concat, Stack

    p = "model.layers.{i}."
    return {
        "layers.{i}.attention.wqkv.weight": Concat([p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                                    p + "self_attn.v_proj.weight"], dim=0, groups=KV),
        "layers.{i}.attention.wo.weight": p + "self_attn.o_proj.weight",
        "layers.{i}.feed_forward.w13.weight": Concat([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                                                     dim=0, groups=2),
        "layers.{i}.moe.experts.w1": Stack([p + f"mlp.experts.{e}.w1.weight" for e in range(E)], dim=0),
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
    }


def phi3_sources() -> dict[str, Any]:
    from dcp_load import Slice

    qkv, gu = "model.layers.{i}.self_attn.qkv_proj.weight", "model.layers.{i}.mlp.gate_up_proj.weight"
    return {
        "layers.{i}.wq": Slice(qkv, 0, 0, H * HD),
        "layers.{i}.wk": Slice(qkv, 0, H * HD, (H + KV) * HD),
        "layers.{i}.wv": Slice(qkv, 0, (H + KV) * HD, (H + 2 * KV) * HD),
        "layers.{i}.w1": Slice(gu, 0, 0, F),
        "layers.{i}.w3": Slice(gu, 0, F, 2 * F),
    }


def expected_llama() -> dict[str, torch.Tensor]:
    """The training layout computed from whole tensors with torch (the reference)."""
    src = llama()
    out = {"tok_embeddings.weight": src["model.embed_tokens.weight"], "norm.weight": src["model.norm.weight"]}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        q, k, v = (src[p + f"self_attn.{x}_proj.weight"].chunk(KV) for x in "qkv")
        out[f"layers.{i}.attention.wqkv.weight"] = torch.cat([t for g in range(KV) for t in (q[g], k[g], v[g])])
        gate, up = src[p + "mlp.gate_proj.weight"].chunk(2), src[p + "mlp.up_proj.weight"].chunk(2)
        out[f"layers.{i}.feed_forward.w13.weight"] = torch.cat([gate[0], up[0], gate[1], up[1]])
        out[f"layers.{i}.attention.wo.weight"] = src[p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.moe.experts.w1"] = torch.stack([src[p + f"mlp.experts.{e}.w1.weight"] for e in range(E)])
    return out


def expected_phi3() -> dict[str, torch.Tensor]:
    src = llama()
    out = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for new, old in (("wq", "self_attn.q_proj"), ("wk", "self_attn.k_proj"), ("wv", "self_attn.v_proj"),
                         ("w1", "mlp.gate_proj"), ("w3", "mlp.up_proj")):
            out[f"layers.{i}.{new}"] = src[p + old + ".weight"]
    return out


def _placements(name: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    R = Replicate()
    if name.endswith("moe.experts.w1"):
        return [Shard(0), Shard(1)]  # experts over dp, their rows over tp
    if name.endswith("wo.weight"):
        return [R, Shard(1)]
    if name == "norm.weight":
        return [R, R]
    return [R, Shard(0)]


def dtensors(mesh: Any, expected: dict[str, torch.Tensor]) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    return {n: distribute_tensor(torch.full_like(t, float("nan")), mesh, _placements(n), src_data_rank=None)
            for n, t in expected.items()}


def chunks(mesh: Any, expected: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The same local boxes as ``dtensors``, as ``Chunk`` targets."""
    from dcp_load import Chunk
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for n, t in expected.items():
        shape, off = compute_local_shape_and_global_offset(t.shape, mesh, _placements(n))
        out[n] = Chunk(torch.full(shape, float("nan")), tuple(t.shape), tuple(off))
    return out


def wrong(state: dict[str, Any], expected: dict[str, torch.Tensor]) -> list[str]:
    from dcp_load import Chunk

    bad = []
    for n, value in state.items():
        if isinstance(value, Chunk):
            want = expected[n][tuple(slice(o, o + s) for o, s in zip(value.offsets, value.sizes, strict=True))]
            got = value.tensor
        else:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, off = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
            want = expected[n][tuple(slice(o, o + s) for o, s in zip(off, shape, strict=True))]
            got = value.to_local()
        if not torch.equal(got, want):
            bad.append(n)
    return bad


def sources_cases(rank: int, world: int, llama_copies: list[str], phi_copies: list[str]) -> dict[str, Any]:
    import dcp_load
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    node = rank // 2
    os.environ[HOST_ID_ENV] = f"node{node}"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cases = {
        "llama_dtensor": (llama_copies, llama_sources(), expected_llama(), dtensors),
        "llama_chunks": (llama_copies, llama_sources(), expected_llama(), chunks),
        "phi3_dtensor": (phi_copies, phi3_sources(), expected_phi3(), dtensors),
    }
    out: dict[str, Any] = {}
    for copies, sources, expected, make in cases.values():  # warm-up, as in integ_read_once_cases
        dcp_load.load(make(mesh, expected), checkpoint_id=copies[node], sources=sources,
                      broadcast_replicated_tensors=True)
    for case, (copies, sources, expected, make) in cases.items():
        state = make(mesh, expected)
        dist.barrier()
        if rank % 2 == 0:
            drop_cache(copies[node])
        dist.barrier()
        before = read_bytes()
        report = dcp_load.load(state, checkpoint_id=copies[node], sources=sources, broadcast_replicated_tensors=True)
        fetched = read_bytes() - before
        out[case] = {"fetched": fetched, "unique": report.job_unique_bytes, "wrong": wrong(state, expected),
                     "received": report.bytes_received, "reader_bytes": report.bytes_read,
                     "job_read": report.job_bytes_read, "pieces": report.pieces_read,
                     "composed": dict(report.composed),
                     "needed": sum(t.numel() * 4 for t in expected.values())}
    out["errors"] = _failing_cases(rank, mesh, llama_copies[node])
    return out


def _failing_cases(rank: int, mesh: Any, path: str) -> dict[str, Any]:
    """Every rank raises LoadError, destinations untouched: rank 3 passes other sources=
    (a grouped QKV without groups), or only rank 0 holds a destination whose source is
    missing."""
    import dcp_load
    from dcp_load import Concat

    out = {}
    expected = expected_llama()
    other = llama_sources()
    if rank == 3:
        key = "layers.{i}.attention.wqkv.weight"
        other[key] = Concat(list(other[key].parts), dim=0)
    broken = dict(llama_sources())
    extra = {}
    if rank == 0:
        broken["extra.{i}"] = "model.layers.{i}.self_attn.q_proj.weigth"
        extra = {"extra.0": torch.full((H * HD, D), -7.0)}
    for case, sources, more in (("other_sources", other, {}), ("missing_on_rank0", broken, extra)):
        state = dtensors(mesh, expected)
        for v in state.values():
            v.to_local().fill_(-7.0)
        state.update(more)
        try:
            dcp_load.load(state, checkpoint_id=path, sources=sources, broadcast_replicated_tensors=True)
            out[case] = "no error"
        except dcp_load.LoadError as exc:
            untouched = all(bool((v.to_local() if hasattr(v, "to_local") else v).eq(-7.0).all())
                            for v in state.values())
            out[case] = (str(exc), untouched)
    return out


def bad_argument_case(rank: int, world: int, path: str) -> tuple[str, bool, float]:
    """Rank 1 passes a ``sources=`` whose key has a placeholder no source name uses; every
    rank must raise ``LoadError`` naming it at once (not wait out the arrival timeout)."""
    import time

    import dcp_load

    sources = {"w.{i}": "model.norm.weight"} if rank == 1 else {"w": "model.norm.weight"}
    state = {"w": torch.full((D,), -7.0)}
    start = time.monotonic()
    try:
        dcp_load.load(state, checkpoint_id=path, sources=sources, timeout=60)
        message = "no error"
    except dcp_load.LoadError as exc:
        message = str(exc)
    return message, bool(state["w"].eq(-7.0).all()), time.monotonic() - start

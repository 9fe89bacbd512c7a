"""In-rank function and checkpoint of tests-integration/storage/test_integ_s3_columns.py (not a test
module: the ranks import it by name)."""

from __future__ import annotations

import torch

# name -> (shape, dtype); every one is sharded on its last dimension
SPECS = {
    "o_proj": ((1024, 1024), torch.bfloat16),  # a row-parallel weight: 1 KiB runs per rank
    "down": ((512, 2048), torch.float32),
    "conv": ((64, 64, 3, 3), torch.float32),  # runs of one or two elements
    "experts": ((8, 128, 256), torch.bfloat16),
    "embed": ((8192, 64), torch.float32),  # 128-byte runs
}


def full(name: str) -> torch.Tensor:
    shape, dtype = SPECS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(dtype)


def unique() -> int:
    return sum(full(n).numel() * full(n).element_size() for n in SPECS)


def columns(rank: int, world: int, uri: str, rename: bool) -> dict:
    import dcp_load
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    key = (lambda n: f"model.{n}") if rename else (lambda n: n)
    state = {}
    for name, (shape, dtype) in SPECS.items():
        placements = [Replicate(), Shard(len(shape) - 1)]
        state[key(name)] = distribute_tensor(torch.full(shape, float("nan"), dtype=dtype), mesh, placements)
    sources = {key(n): n for n in SPECS} if rename else None
    report = dcp_load.load(state, checkpoint_id=uri, timeout=120, sources=sources)
    wrong = []
    for name in SPECS:
        d = state[key(name)]
        want = distribute_tensor(full(name), mesh, d.placements).to_local()
        if not torch.equal(d.to_local().view(torch.uint8), want.view(torch.uint8)):
            wrong.append(name)
    return {"wrong": wrong, "fetched": report.job_bytes_fetched, "unique": report.job_unique_bytes,
            "sent": report.bytes_sent, "read": report.bytes_read}

"""In-rank function of test_integ_small_objects.py (not a test module: the ranks import it
by name): a Hugging Face checkpoint of small objects (below the 64 KiB a first read takes
whole, so the header read carries the data) loaded from the S3 test server."""

from __future__ import annotations

from typing import Any

import torch


def full(rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    return torch.randn((rows, cols), generator=g)


def load_small(rank: int, world: int, uri: str, rows: int, cols: int, dim: int) -> dict[str, Any]:
    """Load ``w`` sharded on ``dim`` (0: rows, 1: columns, which relay on object storage)
    into a poisoned DTensor; what the report says and whether the values are the saved ones."""
    import dcp_load
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.full((rows, cols), float("nan")), mesh, [Shard(dim)])}
    report = dcp_load.load(state, checkpoint_id=uri, timeout=120)
    want = distribute_tensor(full(rows, cols), mesh, [Shard(dim)]).to_local()
    return {"right": torch.equal(state["w"].to_local(), want), "read": report.bytes_read,
            "fetched": report.bytes_fetched, "job_read": report.job_bytes_read,
            "job_fetched": report.job_bytes_fetched}

"""Functions that run inside ranks for test_integ_metadata_differs (not a test module)."""

from __future__ import annotations

import time
from typing import Any

import torch

SHAPE = (8, 6)


def full() -> torch.Tensor:
    return torch.arange(48, dtype=torch.float32).reshape(SHAPE)


def write(path: str, chunks: int) -> None:
    """The same tensor saved in ``chunks`` row chunks (native format)."""
    from dcp_reader import CheckpointMetadata, ChunkMeta, NativeWriter, TensorMeta, chunk_key

    writer = NativeWriter(path)
    rows = SHAPE[0] // chunks
    metas, data = [], {}
    for i in range(chunks):
        key = chunk_key("w", (i * rows, 0))
        data[key] = full()[i * rows:(i + 1) * rows].contiguous()
        metas.append(ChunkMeta((i * rows, 0), (rows, SHAPE[1]), "data.safetensors", key))
    writer.write_file("data.safetensors", data)
    writer.commit(CheckpointMetadata({"w": TensorMeta("w", SHAPE, "float32", tuple(metas))}, {}, "native"))


def differs_cases(rank: int, world: int, copies: dict[str, str]) -> dict[str, Any]:
    """Rank 1 loads a copy saved in other chunks; every rank must raise LoadError naming it."""
    import dcp_load
    from dcp_load import Chunk, LoadError

    out: dict[str, Any] = {}
    path = copies["two"] if rank == 1 else copies["one"]
    for case in ("plain", "chunk"):
        t = torch.full(SHAPE, float("nan"))
        state = {"w": t if case == "plain" else Chunk(t, SHAPE, (0, 0))}
        start = time.monotonic()
        try:
            dcp_load.load(state, checkpoint_id=path, broadcast_replicated_tensors=True)
            out[case] = {"raised": None}
        except LoadError as exc:
            out[case] = {"raised": str(exc), "phase": exc.phase, "ranks": sorted(exc.failures),
                         "seconds": time.monotonic() - start, "untouched": bool(torch.isnan(t).all())}
    return out

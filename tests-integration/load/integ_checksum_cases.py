"""Functions that run inside ranks for the checksums-once-per-host test (not a test module)."""

from __future__ import annotations

from typing import Any

import torch

ROWS, COLS = 2048, 1024  # 4 MiB of float16 per tensor: one checksum block
NAMES = [f"w{i}" for i in range(4)]


def full(name: str) -> torch.Tensor:
    i = NAMES.index(name)
    return (torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.001 + i).to(torch.float16)


def checksum_cases(rank: int, world: int, root: str, mode: Any) -> dict[str, Any]:
    import dcp_load
    from dcp_load import LoadError
    from dcp_reader import open_checkpoint

    state = {n: torch.full((ROWS, COLS), float("nan"), dtype=torch.float16) for n in NAMES}
    reader = open_checkpoint(root)
    out: dict[str, Any] = {}
    try:
        dcp_load.load(state, storage_reader=reader, broadcast_replicated_tensors=mode)
        out["exact"] = all(torch.equal(state[n], full(n)) for n in NAMES)
        out["error"] = None
    except LoadError as exc:
        out["exact"], out["error"] = False, str(exc)
    out["poisoned"] = all(torch.isnan(state[n]).all().item() for n in NAMES)
    # Blocks this rank's reader hashed (BlockSums.verified: a block is verified once per reader).
    out["verified"] = sum(len(s.verified) for s in reader._sums.values())
    reader.close()
    return out

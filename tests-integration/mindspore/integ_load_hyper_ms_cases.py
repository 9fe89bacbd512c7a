"""The function that runs inside 2 MindSpore CPU workers for the hyper-parallel load test
(not a test module): loads a checkpoint that MindSpore wrote in hyper-parallel's format into
``Chunk``-annotated MindSpore tensors, poisoned first, from the global ``.metadata`` (with
collectives) and from per-rank ``{rank}.metadata`` (each worker alone)."""

from __future__ import annotations

import os
import traceback
from typing import Any

import numpy as np

# name -> (shape, MindSpore dtype name); saved by 2 ranks as 3 row chunks (2 on rank 0: ragged keys)
SPECS = {"w": ((6, 4), "float32"), "h": ((4, 4), "bfloat16"), "ids": ((6, 2), "int64")}


def saved_rows(shape: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(rank, first row, rows) of the 3 saved row chunks: two on rank 0, one on rank 1."""
    n = shape[0]
    a, b = n // 3, 2 * n // 3
    return [(0, 0, a), (0, a, b - a), (1, b, n - b)]


def _load(state: dict[str, Any], path: str, expected: dict[str, Any], boxes: dict[str, Any], rank: int,
          errors: list[str], where: str) -> Any:
    import dcp_load

    report = dcp_load.load(state, checkpoint_id=path, allow_pickle=True)
    for name, (off, size) in boxes.items():
        want = expected[name][off:off + size]
        got = state[name].tensor.asnumpy().astype(np.float64)
        if got.shape != want.shape or not np.array_equal(got, want):
            errors.append(f"rank {rank} {where}: {name!r} holds {got.ravel()[:6]}..., expected {want.ravel()[:6]}...")
    return {"world_size": report.world_size, "broadcasts": report.broadcasts, "bytes_read": report.bytes_read,
            "bytes_needed": report.bytes_needed, "format": report.format, "values": report.values}


def _state(boxes: dict[str, tuple[int, int]]) -> dict[str, Any]:
    import dcp_load
    import mindspore as ms

    state: dict[str, Any] = {}
    for name, (off, size) in boxes.items():
        shape, dtype = SPECS[name]
        poison = np.full((size, *shape[1:]), -123 if "int" in dtype else np.nan, dtype=np.float32)
        state[name] = dcp_load.Chunk(ms.Tensor(poison, dtype=getattr(ms, dtype)), shape, (off,) + (0,) * (len(shape) - 1))
    return state


def ms_hyper_case(rank: int, world: int, paths: dict[str, str], expected: dict[str, Any]) -> dict[str, Any]:
    os.environ["DCP_HOST_ID"] = f"node{rank}"  # a node per worker: replicated boxes broadcast
    out: dict[str, Any] = {"errors": []}
    try:
        # "w" whole on both workers (read once, broadcast on the world group); "h" and "ids"
        # in halves that straddle the saved chunks
        boxes = {"w": (0, 6), "h": (2 * rank, 2), "ids": (3 * rank, 3)}
        state = _state(boxes)
        state["step"] = None
        out["global"] = _load(state, paths["global"], expected, boxes, rank, out["errors"], "global")
        if state["step"] != 11:
            out["errors"].append(f"rank {rank}: step is {state['step']!r}")
        # rank-local: each worker loads (part of) the rows it saved, without collectives
        own = [(o, s) for r, o, s in saved_rows(SPECS["w"][0]) if r == rank]
        local = {"w": (own[0][0], sum(s for _, s in own))}
        out["rank_local"] = _load(_state(local), paths["rank_local"], expected, local, rank, out["errors"],
                                  "rank-local")
    except Exception:  # noqa: BLE001 - returned for the test to show
        out["errors"].append(traceback.format_exc())
    return out

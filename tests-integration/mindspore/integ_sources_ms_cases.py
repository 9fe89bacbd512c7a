"""Functions that run inside MindSpore CPU workers for test_integ_sources_mindspore (not a
test module): a ``Concat`` (grouped) loaded through ``sources=`` into ``Chunk``-annotated
MindSpore tensors on 2 workers."""

from __future__ import annotations

import os
import traceback
from typing import Any

import numpy as np

ROWS = {"q": 8, "k": 4, "v": 4}
COLS, GROUPS = 6, 2


def saved() -> dict[str, np.ndarray]:
    return {f"attn.{n}.weight": (np.arange(r * COLS, dtype=np.float32).reshape(r, COLS) * (i + 1)) % 89
            for i, (n, r) in enumerate(ROWS.items())}


def fused() -> np.ndarray:
    """Block g of q, of k and of v, for each group g (the reference, from whole arrays)."""
    parts = [np.split(saved()[f"attn.{n}.weight"], GROUPS) for n in ROWS]
    return np.concatenate([p[g] for g in range(GROUPS) for p in parts])


def ms_sources_case(rank: int, world: int, path: str) -> dict[str, Any]:
    import dcp_load
    import mindspore as ms
    from dcp_load import Concat

    os.environ["DCP_HOST_ID"] = f"node{rank}"  # each worker a node: replicated boxes are broadcast
    out: dict[str, Any] = {"errors": []}
    try:
        whole = fused()
        half = whole.shape[0] // world
        src = Concat([f"attn.{n}.weight" for n in ROWS], dim=0, groups=GROUPS)
        state = {
            # each worker a row half (what TP gives it), and both the whole tensor (replicated)
            "wqkv": dcp_load.Chunk(ms.Tensor(np.full((half, COLS), np.nan, np.float32)), whole.shape,
                                   (rank * half, 0)),
            "wqkv_rep": dcp_load.Chunk(ms.Tensor(np.full(whole.shape, np.nan, np.float32)), whole.shape,
                                       (0, 0)),
        }
        report = dcp_load.load(state, checkpoint_id=path, sources={"wqkv": src, "wqkv_rep": src})
        got = state["wqkv"].tensor.asnumpy()
        if not np.array_equal(got, whole[rank * half:(rank + 1) * half]):
            out["errors"].append(f"rank {rank}: wqkv holds {got.ravel()[:6]}...")
        if not np.array_equal(state["wqkv_rep"].tensor.asnumpy(), whole):
            out["errors"].append(f"rank {rank}: wqkv_rep holds {state['wqkv_rep'].tensor.asnumpy().ravel()[:6]}...")
        out["report"] = {"bytes_read": report.bytes_read, "job_unique_bytes": report.job_unique_bytes,
                         "composed": dict(report.composed), "bytes_received": report.bytes_received}
    except Exception:  # noqa: BLE001 - returned for the test to show
        out["errors"].append(traceback.format_exc())
    return out

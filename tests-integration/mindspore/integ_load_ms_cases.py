"""Functions that run inside MindSpore CPU workers for the dcp-load tests (not a test module).

``ms_load_case`` loads a native checkpoint that torch saved into a MindSpore state dict of
``Chunk``-annotated tensors on 2 workers (world-group broadcasts for the replicated ones),
after poisoning every target, and returns what it found.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import numpy as np

# name -> (shape, numpy dtype name of the expected values, how the 2 workers hold it)
#   "rep": both hold the whole tensor (read once, broadcast on the world group)
#   "rows": worker r holds rows half r; "skew": worker r holds a box straddling saved chunks
SPECS = {
    "w.rep": ((6, 5), "float32", "rep"),
    "w.rows": ((8, 6), "float32", "rows"),
    "ints.rep": ((4, 3), "int64", "rep"),
    "ints.rows": ((6, 2), "int32", "rows"),
    "b16.rep": ((4, 4), "bfloat16", "rep"),
    "skew": ((9, 4), "float32", "skew"),
    "scalar": ((), "float32", "rep"),
}


def box(name: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape, _, how = SPECS[name]
    if how == "rep":
        return (0,) * len(shape), shape
    if how == "rows":
        half = shape[0] // 2
        return (rank * half, 0), (half, shape[1])
    return ((1, 0), (5, 4)) if rank == 0 else ((4, 0), (5, 4))  # overlapping, straddling boxes


def ms_load_case(rank: int, world: int, path: str, expected: dict[str, Any]) -> dict[str, Any]:
    import dcp_load
    import mindspore as ms

    # Each worker a node of its own, so the default "auto" mode broadcasts replicated boxes
    # as on a multi-node job (on one host it would let each worker re-read them).
    os.environ["DCP_HOST_ID"] = f"node{rank}"
    out: dict[str, Any] = {"errors": []}
    try:
        state: dict[str, Any] = {}
        for name, (shape, dtype, _) in SPECS.items():
            offsets, sizes = box(name, rank)
            ms_dtype = getattr(ms, dtype)
            poison = np.full(sizes, -123 if "int" in dtype else np.nan, dtype=np.float32)
            state[name] = dcp_load.Chunk(ms.Tensor(poison, dtype=ms_dtype), shape, offsets)
        state["meta"] = {"step": None}
        report = dcp_load.load(state, checkpoint_id=path)
        for name in SPECS:
            offsets, sizes = box(name, rank)
            want = expected[name][tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
            got = state[name].tensor.asnumpy().astype(np.float64)
            if got.shape != want.shape or not np.array_equal(got, want):
                out["errors"].append(f"rank {rank}: {name!r} holds {got.ravel()[:6]}..., expected {want.ravel()[:6]}...")
        if state["meta"]["step"] != 11:
            out["errors"].append(f"rank {rank}: meta.step is {state['meta']['step']!r}")
        out["report"] = {"bytes_read": report.bytes_read, "bytes_received": report.bytes_received,
                         "broadcasts": report.broadcasts, "bytes_needed": report.bytes_needed,
                         "job_unique_bytes": report.job_unique_bytes, "world_size": report.world_size}
    except Exception:  # noqa: BLE001 - returned for the test to show
        out["errors"].append(traceback.format_exc())
    return out


def _net(seed: int) -> Any:
    import mindspore as ms
    from mindspore import nn

    ms.set_seed(seed)
    return nn.SequentialCell([nn.Dense(4, 6), nn.ReLU(), nn.Dense(6, 3)])


def ms_net_case(rank: int, world: int, path: str) -> dict[str, Any]:
    """A real ``nn.Cell``'s ``parameters_dict()`` (``Parameter`` objects, whose class reports
    module ``abc``) saved with dcp_load.save on both workers and loaded into a poisoned net;
    one entry is loaded as ``Chunk(Parameter)`` holding a row half."""
    import dcp_load
    import mindspore as ms

    out: dict[str, Any] = {"errors": []}
    try:
        src = _net(seed=1).parameters_dict()
        saved = {k: v.asnumpy().copy() for k, v in src.items()}
        out["types"] = sorted({f"{type(v).__module__}.{type(v).__qualname__}" for v in src.values()})
        dcp_load.save(src, checkpoint_id=path)
        dest = _net(seed=2).parameters_dict()
        for p in dest.values():
            p.asnumpy()[...] = np.nan
        half = ms.Parameter(ms.Tensor(np.full((3, 4), np.nan, np.float32)), name="half")
        state = {**dest, "0.weight": dcp_load.Chunk(half, (6, 4), (3 * rank, 0))}
        report = dcp_load.load(state, checkpoint_id=path)
        for name, p in dest.items():
            if name == "0.weight":
                continue
            if not np.array_equal(p.asnumpy(), saved[name]):
                out["errors"].append(f"rank {rank}: {name!r} holds {p.asnumpy().ravel()[:4]}")
        if not np.array_equal(half.asnumpy(), saved["0.weight"][3 * rank:3 * rank + 3]):
            out["errors"].append(f"rank {rank}: Chunk(Parameter) holds {half.asnumpy().ravel()[:4]}")
        out["tensors"] = report.tensors
    except Exception:  # noqa: BLE001 - returned for the test to show
        out["errors"].append(traceback.format_exc())
    return out

"""Functions run inside gloo ranks for test_platform_store_reduce.py (not a test module)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from dcp_platform import Watch, get_platform
from platform_watch_cases import FAST
from platform_watch_cases import _timed as _outcome


def _lanes(rank: int, n: int) -> list[int]:
    """Lanes that differ per rank: negatives, values past 2**40, zeros."""
    return [(rank + 1) * (k + 1) * (-1) ** k + (k % 3) * (1 << 41) * rank for k in range(n)]


def values_cases(rank: int, world: int) -> dict[str, Any]:
    """Sums and maxima of several reductions in a row, each beside a gloo all-reduce of the
    same lanes; the store keys each reduction made, after every rank has its result."""
    p = get_platform("torch")
    store = p.store()
    out: dict[str, Any] = {"store": [], "gloo": []}
    with Watch(p, "t/values", **FAST) as w:
        w.arrive(30.0)
        near = (1 << 63) - 2
        for n, op in ((1, "sum"), (40, "sum"), (7, "max"), (3, "sum"), (2, "sum")):
            if rank == 1:
                time.sleep(0.05)  # others wait in the polls
            lanes = _lanes(rank, n) if op == "sum" else [v * (rank - 1) for v in _lanes(rank, n)]
            if n == 2:  # sums past int64 wrap around as gloo's do
                lanes = [near, -near]
            reduction = w.start_reduce(lanes, op)
            out["store"].append(w.reduced(reduction))
            t = torch.tensor(lanes, dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
            out["gloo"].append(t.tolist())
        dist.barrier()
        try:
            w.start_reduce([1 << 63], "sum")
            out["past_int64"] = None
        except ValueError as exc:
            out["past_int64"] = str(exc)
        out["left"] = [k for k in (f"t/values/r/{i}/{part}" for i in range(1, 6)
                                   for part in ("in", "out", "read", *range(world))) if store.check([k])]
    return out


def failure_cases(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 publishes a failure instead of joining a reduction; then, with ``stall_s=1``,
    rank 2 joins a reduction 3 s late (alive: its heartbeats go on)."""
    p = get_platform("torch")
    out: dict[str, Any] = {}
    with Watch(p, "t/abort", **FAST) as w:
        w.arrive(30.0)
        if rank == 1:
            time.sleep(0.3)
            w.abort({1: ("boom on rank 1",)})
        else:
            out["abort"] = _outcome(lambda: w.reduced(w.start_reduce([rank], "sum")))
    dist.barrier()
    with Watch(p, "t/stall", stall_s=1.0, **FAST) as w:
        w.arrive(30.0)
        if rank == 2:
            time.sleep(3.0)
            out["stall"] = _outcome(w.check)
        else:
            out["stall"] = _outcome(lambda: w.reduced(w.start_reduce([rank], "max")))
            out["interrupted"] = w.interrupted
    dist.barrier()
    with Watch(p, "t/widths", **FAST) as w:  # ranks that reduce different numbers of lanes
        w.arrive(30.0)
        try:
            reduction = w.start_reduce([0] * (rank + 1), "sum")
        except RuntimeError as exc:  # the last rank in finds it, and fails the operation
            out["widths"] = {"value": None, "error": str(exc), "seconds": 0.0}
            w.abort({rank: (str(exc),)})
        else:
            out["widths"] = _outcome(lambda: w.reduced(reduction))
    dist.barrier()
    return out


def large_world_case(rank: int, world: int) -> dict[str, Any]:
    """More lanes than ``STORE_LANES_MAX``, or with ``STORE_REDUCE_MAX`` below the world:
    ``start_reduce`` declines (None)."""
    import dcp_platform._watch as watch_module

    with Watch(get_platform("torch"), "t/large", **FAST) as w:
        w.arrive(30.0)
        many = w.start_reduce([1] * (watch_module.STORE_LANES_MAX + 1), "sum") is None
        watch_module.STORE_REDUCE_MAX = world - 1
        declined = many and w.start_reduce([1], "sum") is None
        dist.barrier()  # a watch closes once every rank passed its last exchange (its arrival here)
        return {"declined": declined}

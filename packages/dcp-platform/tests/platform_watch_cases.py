"""Functions run inside gloo ranks for test_platform_watch.py (not a test module)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from dcp_platform import PeerFailure, Watch, get_platform
from dcp_platform._torch import TorchPlatform

FAST = {"heartbeat_s": 0.2, "stale_s": 1.0}


class _NcclLike(TorchPlatform):
    """A torch platform on gloo that takes its default group for NCCL's (a code path test)."""

    def __init__(self) -> None:
        super().__init__(device="cpu")
        self._backend = "nccl"


def _timed(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        return {"value": fn(), "error": None, "seconds": time.monotonic() - start}
    except PeerFailure as exc:
        return {"value": None, "error": exc.failures, "seconds": time.monotonic() - start}


def watch_cases(rank: int, world: int) -> dict[str, Any]:
    p = get_platform("torch")
    out: dict[str, Any] = {}

    # Platform.wait: False while the source has not sent yet, True once it has.
    t = torch.full((4,), float(rank))
    if rank == 0:
        time.sleep(1.0)
    handle = p.broadcast(t, 0)
    first = p.wait(handle, 0.2)
    while not p.wait(handle, 0.2):
        pass
    out["wait"] = {"first": first, "data": t.tolist()}

    with Watch(p, "t/ok", **FAST) as w:
        w.arrive(10.0)
        out["gather"] = _timed(lambda: w.gather({"rank": rank}))
        b = torch.full((3,), float(rank))
        out["bounded_broadcast"] = _timed(lambda: (w.wait(p.broadcast(b, world - 1)), b.tolist())[1])

    # The last rank never enters: the others give up after the timeout, naming it.
    if rank != world - 1:
        with Watch(p, "t/late", **FAST) as w:
            out["late"] = _timed(lambda: w.arrive(1.5))
    p.all_gather_object(None)

    # A platform that treats the default group as NCCL: control traffic goes over one gloo
    # group shared by every such platform object, and handles are polled.
    from torch.distributed import distributed_c10d as c10d

    before = len(c10d._world.pg_map)
    gathered = []
    for _ in range(3):
        nccl_like = _NcclLike()
        with Watch(nccl_like, f"t/nccl{_}", **FAST) as w:
            w.arrive(10.0)
            gathered.append(w.gather(rank))
            b = torch.full((2,), float(rank))
            w.wait(nccl_like.broadcast(b, 0))
            gathered.append(b.tolist())
    out["control"] = {"gathered": gathered, "groups_added": len(c10d._world.pg_map) - before,
                      "is_gloo": nccl_like._control_group() is not None}

    # Rank 1 publishes a failure; the others, waiting on a local event, raise it.
    with Watch(p, "t/abort", **FAST) as w:
        w.arrive(10.0)
        if rank == 1:
            w.abort({1: ["boom on rank 1"]})
        out["abort"] = _timed(lambda: w.wait_event(threading.Event()) if rank != 1 else None)
    return out

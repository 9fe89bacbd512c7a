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

    # Rank 1 publishes a failure; the others, waiting on a local event, raise it. A rank
    # still polling for the arrival when the abort lands raises it from ``arrive``: both
    # are the same outcome, so the arrival is inside the timed call.
    with Watch(p, "t/abort", **FAST) as w:
        if rank == 1:
            w.arrive(10.0)
            w.abort({1: ["boom on rank 1"]})
            out["abort"] = _timed(lambda: None)
        else:
            out["abort"] = _timed(lambda: (w.arrive(10.0), w.wait_event(threading.Event())))
    return out


class _TcpStorePlatform(TorchPlatform):
    """A torch platform whose store is a TCPStore (the harness's default store is a FileStore,
    and only a TCPStore's expired waits log torch's ``waitForInput`` warnings)."""

    def __init__(self, store: Any) -> None:
        super().__init__(device="cpu")
        self._tcp = store

    def store(self) -> Any:
        return self._tcp


def _stderr_of(fn: Any) -> tuple[Any, str]:
    """``fn()``'s result (or PeerFailure) and what the process wrote to fd 2 meanwhile."""
    import os
    import tempfile

    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            got = _timed(fn)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        return got, tmp.read().decode(errors="replace")


def quiet_and_stall_cases(rank: int, world: int, port: int) -> dict[str, Any]:
    """Rank 1 arrives 3 s late (rank 0 logs nothing meanwhile); then, with ``stall_s=1``,
    rank 0 waits on a broadcast rank 1 joins 4 s late: rank 0 raises after about 1 s."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    p = _TcpStorePlatform(store)
    out: dict[str, Any] = {}
    with Watch(p, "t/quiet", **FAST) as w:
        if rank == 1:
            time.sleep(3.0)
        out["arrive"], out["stderr"] = _stderr_of(lambda: w.arrive(30.0))
    group = dist.new_group(list(range(world)))  # the pending broadcast stays off the default group
    t = torch.zeros(4)
    with Watch(p, "t/stall", stall_s=1.0, **FAST) as w:
        w.arrive(30.0)
        if rank == 0:
            handle = p.broadcast(t, 0, group)
            out["stall"] = _timed(lambda: w.wait(handle))
            out["interrupted"] = w.interrupted
            handle.wait()  # rank 1 joins later: leave no collective pending
        else:
            time.sleep(4.0)
            out["stall"] = _timed(lambda: w.check())
            p.broadcast(t, 0, group).wait()
    dist.destroy_process_group(group)
    return out

"""Functions that run inside ranks for the failure tests (not a test module).

Each scenario loads a small native checkpoint on 4 gloo ranks (process-group timeout 10
minutes, so that dcp, not the timeout, ends every wait) after poisoning the targets, and
returns per rank: the error raised (type, phase, failing ranks, message) and the seconds
``load`` took to return or raise.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

NAMES = [f"layer{i}.w" for i in range(8)]
SHAPE = (64, 32)


def full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(SHAPE, generator=g)


def write(path: str) -> None:
    """A native checkpoint: each tensor saved as 2 row chunks, spread over 4 data files."""
    import dcp_load

    dcp_load.save({n: full(n) for n in NAMES}, checkpoint_id=path, no_dist=True)


def _state() -> dict[str, torch.Tensor]:
    return {n: torch.full(SHAPE, float("nan")) for n in NAMES}


def dp_tp_state(expected: Callable[[str], torch.Tensor], names: list[str] = NAMES,
                shape: tuple[int, int] = SHAPE) -> tuple[dict[str, Any], Callable[[], bool]]:
    """DP2 x TP2 DTensors [Replicate, Shard(0)] (replica groups (0, 2) and (1, 3)) of
    ``names``, poisoned, and a check that each holds its rows of ``expected(name)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rows = shape[0] // 2
    tp = mesh["tp"].get_local_rank()
    state = {n: DTensor.from_local(torch.full((rows, shape[1]), float("nan")), mesh, [Replicate(), Shard(0)],
                                   run_check=False) for n in names}

    def check() -> bool:
        return all(torch.equal(state[n].to_local(), expected(n)[tp * rows:(tp + 1) * rows]) for n in names)

    return state, check


def outcome(fn: Callable[[], Any], check: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Run ``fn``; the LoadError (or other error) it raised and the seconds it took."""
    from dcp_load import LoadError

    start = time.monotonic()
    out: dict[str, Any] = {"error": None}
    try:
        fn()
        out["ok"] = check() if check is not None else True
    except LoadError as exc:
        out["error"] = {"type": "LoadError", "phase": exc.phase, "ranks": sorted(exc.failures), "message": str(exc)}
    except BaseException as exc:  # noqa: BLE001 - the test asserts on what was raised
        out["error"] = {"type": type(exc).__name__, "message": traceback.format_exc()}
    out["seconds"] = time.monotonic() - start
    return out


def _outcome(fn: Any) -> dict[str, Any]:
    """``outcome`` of ``fn`` on a fresh poisoned state, checked against the saved values."""
    state = _state()
    return outcome(lambda: fn(state), lambda: all(torch.equal(state[n], full(n)) for n in NAMES))


def _load(state: dict[str, Any], path: str, **kw: Any) -> Any:
    import dcp_load

    kw.setdefault("broadcast_replicated_tensors", True)
    return dcp_load.load(state, checkpoint_id=path, **kw)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def shared_cases(rank: int, world: int, ckpts: dict[str, str]) -> dict[str, Any]:
    """Scenarios that leave the process group usable, in one launch (order matters)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    res: dict[str, Any] = {}
    good = ckpts["good"]

    def platform_choice(state: dict[str, Any]) -> None:
        if rank == 1:
            os.environ["DCP_PLATFORM"] = "no-such-backend"
        try:
            _load(state, good)
        finally:
            os.environ.pop("DCP_PLATFORM", None)

    res["platform"] = _outcome(platform_choice)
    dist.barrier()
    # Each rank reads every box itself, so rank 1 meets its own copy's problem.
    res["missing_file"] = _outcome(lambda s: _load(s, ckpts["missing_file"] if rank == 1 else good,
                                                   broadcast_replicated_tensors=False))
    dist.barrier()
    res["truncated"] = _outcome(lambda s: _load(s, ckpts["truncated"] if rank == 1 else good,
                                                broadcast_replicated_tensors=False))
    dist.barrier()

    def late(state: dict[str, Any]) -> None:
        if rank == 2:
            time.sleep(5.0)
        _load(state, good, timeout=2.0)

    res["late"] = _outcome(late)
    dist.barrier()
    # 50 repeated loads: no thread, fd, group or memory growth after a first load.
    _outcome(lambda s: _load(s, good))
    before = (threading.active_count(), len(os.listdir("/proc/self/fd")), len(c10d._world.pg_map), _rss())
    oks = [_outcome(lambda s: _load(s, good)) for _ in range(50)]
    after = (threading.active_count(), len(os.listdir("/proc/self/fd")), len(c10d._world.pg_map), _rss())
    res["repeat"] = {"before": before, "after": after, "ok": all(o.get("ok") for o in oks),
                     "errors": [o["error"] for o in oks if o["error"]]}
    dist.barrier()

    # Last: the rank that never calls load leaves the load counters of the ranks apart.
    def raise_before(state: dict[str, Any]) -> None:
        if rank == 3:
            raise ValueError("rank 3 failed before calling load")
        _load(state, good, timeout=3.0)

    res["raise_before"] = _outcome(raise_before)
    return res


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_broadcast(rank: int, world: int, ckpts: dict[str, str], victim: int) -> dict[str, Any]:
    """``victim`` SIGKILLs itself inside its third broadcast call."""
    from dcp_platform._torch import TorchPlatform

    class Killing(TorchPlatform):
        calls = 0

        def broadcast(self, tensor: Any, src: int, group: Any = None) -> Any:
            Killing.calls += 1
            if rank == victim and Killing.calls == 3:
                _kill_self()
            return super().broadcast(tensor, src, group)

    return _outcome(lambda s: _load(s, ckpts["good"], platform=Killing(), broadcast_batch_bytes=0))


def kill_in_read_ahead(rank: int, world: int, ckpts: dict[str, str], victim: int) -> dict[str, Any]:
    """``victim`` SIGKILLs itself on its read-ahead thread's first read."""
    from dcp_reader import open_checkpoint

    reader = open_checkpoint(ckpts["good"])

    def killing(real: Any) -> Any:
        def read(*args: Any, **kw: Any) -> Any:
            if rank == victim and threading.current_thread().name == "dcp-load-read-ahead":
                _kill_self()
            return real(*args, **kw)
        return read

    # the read-ahead thread reads with read_into (straight into the destination) or read
    reader.read = killing(reader.read)  # type: ignore[method-assign]
    reader.read_into = killing(reader.read_into)  # type: ignore[method-assign]
    try:
        import dcp_load

        return _outcome(lambda s: dcp_load.load(s, storage_reader=reader, broadcast_replicated_tensors=True,
                                                broadcast_batch_bytes=0))
    finally:
        reader.close()


def raise_in_execute(rank: int, world: int, ckpts: dict[str, str], victim: int) -> dict[str, Any]:
    """``victim``'s fused copy (packing or unpacking a batch) raises outside the read thread."""
    from dcp_platform._torch import TorchPlatform

    class Failing(TorchPlatform):
        def fused_copy(self, dsts: Any, srcs: Any) -> None:
            if rank == victim:
                raise RuntimeError(f"injected fused_copy failure on rank {rank}")
            super().fused_copy(dsts, srcs)

    return _outcome(lambda s: _load(s, ckpts["good"], platform=Failing()))

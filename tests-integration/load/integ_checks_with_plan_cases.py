"""Rank side of test_integ_load_checks_with_plan (not a test module): 2 gloo ranks load a
checkpoint into replicated DTensors (read once: each saved chunk read by one rank and
broadcast), counting the exchanges each load makes by phase."""

from __future__ import annotations

import json
import os
from typing import Any

from integ_failure_cases import outcome

SHAPE = (64, 32)


def write(root: str, truncate_b: bool = False) -> None:
    """``a`` in one file and ``b`` in another, with the index; ``truncate_b``: the second
    file loses its last 100 bytes (its header still parses)."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(root, exist_ok=True)
    for i, name in enumerate(("a", "b")):
        save_file({name: torch.full(SHAPE, float(i + 1))}, os.path.join(root, f"model-{i}.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "model-0.safetensors", "b": "model-1.safetensors"}}
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    if truncate_b:
        path = os.path.join(root, "model-1.safetensors")
        os.truncate(path, os.path.getsize(path) - 100)


def _phases() -> tuple[list[str], Any]:
    from dcp_load.run._coordinate import Coordinator

    seen: list[str] = []
    real = Coordinator.check

    def check(self: Any, errors: Any, phase: str, **kw: Any) -> Any:
        seen.append(phase)
        return real(self, errors, phase, **kw)

    Coordinator.check = check  # type: ignore[method-assign]
    return seen, real


def load_counting(rank: int, world: int, root: str) -> dict[str, Any]:
    import dcp_load
    import torch
    from dcp_load.run._coordinate import Coordinator
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {n: distribute_tensor(torch.full(SHAPE, float("nan")), mesh, [Replicate()], src_data_rank=None)
             for n in ("a", "b")}
    seen, real = _phases()
    try:
        out = outcome(lambda: dcp_load.load(state, checkpoint_id=root, broadcast_replicated_tensors=True))
    finally:
        Coordinator.check = real  # type: ignore[method-assign]
    out["phases"] = seen
    out["values"] = {n: (bool(torch.isnan(t.to_local()).all()), float(t.to_local().nan_to_num(0).sum()))
                     for n, t in state.items()}
    return out


def save_torch_dcp(rank: int, world: int, root: str) -> None:
    """``a`` and ``b`` as ``Shard(0)`` DTensors saved by torch DCP: each rank's rows in its
    own data file (``__<rank>_0.distcp``)."""
    import torch
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {n: distribute_tensor(torch.full(SHAPE, float(i + 1)), mesh, [Shard(0)]) for i, n in enumerate("ab")}
    tdcp.save(state, checkpoint_id=root)


def break_blob_directories(path: str) -> int:
    """Overwrite every zip end-of-directory record in ``path`` (torch.save blobs): the
    metadata still names the file and its ranges, but no blob in it can be parsed."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        hits = 0
        at = data.find(b"PK\x05\x06")
        while at >= 0:
            data[at:at + 4] = b"XXXX"
            hits += 1
            at = data.find(b"PK\x05\x06", at + 4)
        f.seek(0)
        f.write(data)
    return hits


def slow_prepare_and_checks(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every wait of the load bounded at 1 s (timeout=1 and a 1 s floor); rank 1 takes 0.7 s
    to prepare and 0.7 s to check its reads. Each step is within the bound, so the load
    succeeds, although the digest all-reduce now waits through both; the next load too."""
    import time

    import dcp_load
    import torch
    from dcp_load.plan import _derived
    from dcp_load.run import _coordinate, _steps
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    _coordinate.MIN_STALL_S = 1.0
    real_digest, real_check = _derived.checkpoint_digest, _steps.check_reads

    def slow(fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            if rank == 1:
                time.sleep(0.7)
            return fn(*a, **k)
        return run

    _derived.checkpoint_digest, _steps.check_reads = slow(real_digest), slow(real_check)
    _steps.checkpoint_digest = _derived.checkpoint_digest
    mesh = init_device_mesh("cpu", (world,))
    state = {n: distribute_tensor(torch.full(SHAPE, float("nan")), mesh, [Replicate()], src_data_rank=None)
             for n in ("a", "b")}
    out = {"first": outcome(lambda: dcp_load.load(state, checkpoint_id=root, timeout=1))}
    _derived.checkpoint_digest = _steps.checkpoint_digest = real_digest
    _steps.check_reads = real_check
    out["next"] = outcome(lambda: dcp_load.load(state, checkpoint_id=root, timeout=1))
    return out


def count_checks(rank: int, world: int, root: str, host_ids: bool) -> dict[str, Any]:
    """Check and value reads per load (native checkpoint with a value; ``host_ids``: each
    rank names its own host in $DCP_HOST_ID, so the guessed one-host plan is not made)."""
    import dcp_load
    import torch
    from dcp_reader import CheckpointReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    if host_ids:
        os.environ["DCP_HOST_ID"] = f"host-{rank}"
    counts = {"check_chunk": 0, "read_value": 0}
    real = {n: getattr(CheckpointReader, n) for n in counts}

    def counted(name: str) -> Any:
        def run(self: Any, *a: Any, **k: Any) -> Any:
            counts[name] += 1
            return real[name](self, *a, **k)
        return run

    for n in counts:
        setattr(CheckpointReader, n, counted(n))
    try:
        mesh = init_device_mesh("cpu", (world,))
        state = {n: distribute_tensor(torch.full(SHAPE, float("nan")), mesh, [Replicate()], src_data_rank=None)
                 for n in ("a", "b")}
        state["step"] = None
        out = outcome(lambda: dcp_load.load(state, checkpoint_id=root, broadcast_replicated_tensors=True))
        out["step"] = state["step"]
    finally:
        for n, fn in real.items():
            setattr(CheckpointReader, n, fn)
        os.environ.pop("DCP_HOST_ID", None)
    out["counts"] = counts
    return out


def save_native(rank: int, world: int, root: str) -> None:
    import dcp_load
    import torch

    dcp_load.save({"a": torch.full(SHAPE, 1.0), "b": torch.full(SHAPE, 2.0), "step": 7}, checkpoint_id=root)

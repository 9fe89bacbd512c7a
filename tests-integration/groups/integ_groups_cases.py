"""Functions that run inside ranks for test_integ_groups (not a test module).

4 gloo ranks. ``process_group=`` gives load, save, async_save and transfer one group to run
within: a sub-group whose ranks are not 0..n-1 ((1, 3)), a separate gloo group over every
rank (as torchtitan makes for checkpoint traffic), and two disjoint groups working at once.
While an operation runs within a group, every torch.distributed collective on the default
group raises (``default_group_forbidden``): nothing of it may reach the training job's group.
Destinations are poisoned (0x7F bytes) before each load and compared with the truth after.
"""

from __future__ import annotations

import os
import time
from typing import Any

import dcp_load
import torch
import torch.distributed as dist
from dcp_load import LoadError
from group_guards import default_group_forbidden, poison
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

SHAPES = {"emb": (64, 16), "w1": (32, 24), "w2": (24, 32), "norm": (32,)}


def truth(name: str, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + step)
    return torch.randn(*SHAPES[name], generator=g)


def _sub_mesh(rank: int) -> Any:
    """A 1-D mesh over (1, 3) on ranks 1 and 3 (every rank builds the 2-D parent)."""
    parent = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("pair", "x"))
    return parent["x"] if rank in (1, 3) else None


def _state(mesh: Any, step: int = 0) -> dict[str, Any]:
    return {"emb": distribute_tensor(truth("emb", step), mesh, [Shard(0)], src_data_rank=None),
            "w1": distribute_tensor(truth("w1", step), mesh, [Shard(1)], src_data_rank=None),
            "w2": distribute_tensor(truth("w2", step), mesh, [Replicate()], src_data_rank=None),
            "norm": truth("norm", step).clone(), "step": step}


def _poisoned(mesh: Any) -> dict[str, Any]:
    out = _state(mesh)
    for v in out.values():
        if isinstance(v, torch.Tensor):
            poison(v.to_local() if hasattr(v, "to_local") else v)
    out["step"] = -1
    return out


def _exact(state: dict[str, Any], step: int) -> list[str]:
    bad = [k for k in SHAPES if not torch.equal(state[k].full_tensor() if hasattr(state[k], "full_tensor")
                                                 else state[k], truth(k, step))]
    return bad + ([] if state["step"] == step else ["step"])


def sub_group(rank: int, world: int, root: str) -> dict[str, Any]:
    """Ranks (1, 3) save with async_save and save, load (DTensors on their own mesh, derived
    planning, read once), transfer, all with process_group=; ranks 0 and 2 meanwhile load
    another checkpoint on their own group; then the world loads, its count unaffected."""
    g13, g02 = dist.new_group([1, 3]), dist.new_group([0, 2])
    mesh = _sub_mesh(rank)
    out: dict[str, Any] = {}
    if rank in (1, 3):
        with default_group_forbidden():
            out.update(_sub_group_work(g13, mesh, root))
    else:
        sd = {"norm": torch.full((32,), 7.0)}
        dcp_load.save(sd, checkpoint_id=os.path.join(root, f"other{rank}"), no_dist=True)
        with default_group_forbidden():
            target = {"norm": torch.zeros(32)}
            dcp_load.load(target, checkpoint_id=os.path.join(root, "other0"), process_group=g02)
            out["other_ok"] = bool((target["norm"] == 7.0).all())
    world_target = {"norm": torch.zeros(32)}
    dcp_load.load(world_target, checkpoint_id=os.path.join(root, "other0"), timeout=60)
    out["world_ok"] = bool((world_target["norm"] == 7.0).all())
    return out


def _sub_group_work(group: Any, mesh: Any, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    path = os.path.join(root, "sub")
    dcp_load.async_save(_state(mesh, 1), checkpoint_id=path, process_group=group).result(timeout=60)
    target = _poisoned(mesh)
    out["first"] = _report(dcp_load.load(target, checkpoint_id=path, process_group=group,
                                         broadcast_replicated_tensors=True))
    out["first_bad"] = _exact(target, 1)
    out["saved"] = _report_save(dcp_load.save(_state(mesh, 2), checkpoint_id=path, process_group=group))
    target = _poisoned(mesh)
    dcp_load.load(target, checkpoint_id=path, process_group=group)
    out["second_bad"] = _exact(target, 2)
    dst = _poisoned(mesh)
    src = {k: v for k, v in _state(mesh, 3).items() if k != "step"}
    rep = dcp_load.transfer(src, {k: v for k, v in dst.items() if k != "step"}, process_group=group)
    out["transfer"] = {"world": rep.world_size, "rank": rep.rank}
    dst["step"] = 3
    out["transfer_bad"] = _exact(dst, 3)
    return out


def _report(rep: Any) -> dict[str, Any]:
    return {"rank": rep.rank, "world": rep.world_size, "read": rep.bytes_read, "received": rep.bytes_received,
            "job_fetched": rep.job_bytes_fetched, "unique": rep.job_unique_bytes}


def _report_save(rep: Any) -> dict[str, Any]:
    return {"rank": rep.rank, "world": rep.world_size, "written": rep.bytes_written, "job": rep.job_bytes}


def checkpoint_group(rank: int, world: int, root: str) -> dict[str, Any]:
    """A separate gloo group over every rank carries save, async_save and load (torchtitan's
    checkpoint group), while nothing runs on the default group; a training all-reduce on the
    default group runs while the async save commits."""
    ckpt = dist.new_group(backend="gloo")
    mesh = DeviceMesh("cpu", list(range(world)))
    path = os.path.join(root, "ckpt")
    with default_group_forbidden():
        future = dcp_load.async_save(_state(mesh, 5), checkpoint_id=path, process_group=ckpt)
    t = torch.ones(4)
    dist.all_reduce(t)  # the job's own collective, on the default group, during the commit
    future.result(timeout=60)
    target = _poisoned(mesh)
    with default_group_forbidden():
        rep = dcp_load.load(target, checkpoint_id=path, process_group=ckpt, broadcast_replicated_tensors=True)
        dcp_load.save(_state(mesh, 6), checkpoint_id=path + "-sync", process_group=ckpt)
    return {"bad": _exact(target, 5), "allreduce": t.tolist(), "rank": rep.rank,
            "fetched": rep.job_bytes_fetched, "unique": rep.job_unique_bytes}


def bad_inputs(rank: int, world: int, root: str) -> dict[str, Any]:
    """A group this rank is not in; a storage_reader dcp cannot serve on one rank; a
    Stateful whose state_dict() raises on one rank: clear errors, on every rank, fast."""
    import torch.distributed.checkpoint as tdcp

    out: dict[str, Any] = {}
    g01 = dist.new_group([0, 1])
    path = os.path.join(root, "bad")
    dcp_load.save({"norm": truth("norm")}, checkpoint_id=path)
    if rank in (2, 3):
        try:
            dcp_load.load({"norm": torch.zeros(32)}, checkpoint_id=path, process_group=g01)
        except ValueError as exc:
            out["not_member"] = str(exc)
    target = torch.zeros(32)
    reader = tdcp.FileSystemReader(path) if rank != 1 else tdcp.QuantizedHuggingFaceStorageReader(path)
    start = time.monotonic()
    try:
        dcp_load.load({"norm": target}, storage_reader=reader, timeout=120)
    except (LoadError, TypeError) as exc:
        out["reader"] = (type(exc).__name__, str(exc), time.monotonic() - start)
    out["reader_untouched"] = bool((target == 0).all())

    class Raises:
        def state_dict(self):
            raise KeyError("lost")

        def load_state_dict(self, state):
            pass

    sd: dict[str, Any] = {"norm": truth("norm"), "extra": Raises() if rank == 2 else {"x": torch.ones(2)}}
    start = time.monotonic()
    try:
        dcp_load.save(sd, checkpoint_id=os.path.join(root, "bad-save"), timeout=120)
    except (LoadError, ValueError) as exc:
        out["stateful"] = (type(exc).__name__, str(exc), time.monotonic() - start)
    out["nothing_written"] = not os.path.exists(os.path.join(root, "bad-save", "dcp-metadata.json"))
    target = torch.zeros(32)
    dcp_load.load({"norm": target}, checkpoint_id=path)  # the next good call works everywhere
    out["next_ok"] = bool(torch.equal(target, truth("norm")))
    return out

"""Functions that run inside ranks for the bounded-waits tests (not a test module).

Each scenario runs on 4 gloo ranks with a 10-minute process-group timeout, so that dcp,
not the timeout, ends every wait. A victim rank SIGKILLs itself at one point of a load or
save: in the derived-planning digest exchange, on its way into group creation, or while
writing its data file. Every other rank returns the error it raised (type, phase, failing
ranks, message) and the seconds the call took. Targets are poisoned (NaN) before a load.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
from integ_failure_cases import NAMES, SHAPE, dp_tp_state, full, outcome

#: names of the store-keys checkpoint: enough that a per-name leftover would show
KEY_NAMES = [f"k.{i}" for i in range(96)]
KEY_SHAPE = (8, 4)


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _plain_state() -> dict[str, torch.Tensor]:
    return {n: torch.full(SHAPE, float("nan")) for n in NAMES}


def kill_in_digest(rank: int, world: int, ckpts: dict[str, str], victim: int) -> dict[str, Any]:
    """``victim`` dies as it enters the derived-planning digest's first all-reduce."""
    import dcp_load
    import dcp_load.plan._digest as digest

    real = digest.all_reduce

    def all_reduce(*args: Any, **kw: Any) -> Any:
        if rank == victim:
            _kill_self()
        return real(*args, **kw)

    digest.all_reduce = all_reduce
    state = _plain_state()
    return outcome(lambda: dcp_load.load(state, checkpoint_id=ckpts["good"], broadcast_replicated_tensors=True))


class _NoMemberGroups:
    """Mixin: a torch platform that says it cannot make groups by their members alone."""

    @property
    def capabilities(self) -> Any:
        return dataclasses.replace(super().capabilities, member_groups=False)  # type: ignore[misc]


def kill_in_group_creation(rank: int, world: int, ckpts: dict[str, str], victim: int,
                           members_only: bool, connecting: bool) -> dict[str, Any]:
    """``victim`` dies on its way into creating its broadcast group (before the members'
    barrier) or, with ``connecting``, as it starts connecting (after the barrier), with
    groups made by their members alone or (``members_only`` False) the all-gathered path."""
    import dcp_load
    from dcp_broadcast import _groups
    from dcp_platform._torch import TorchPlatform

    real = _groups.GroupManager._create

    def create(self: Any, key: tuple[int, ...], *args: Any, **kw: Any) -> Any:
        if rank == victim and not connecting:
            _kill_self()
        return real(self, key, *args, **kw)

    class Killing(TorchPlatform):
        def new_group(self, ranks: Any) -> Any:
            if rank == victim and connecting and rank in ranks:
                _kill_self()
            return super().new_group(ranks)

        def new_member_group(self, ranks: Any, name: str) -> Any:
            if rank == victim and connecting:
                _kill_self()
            return super().new_member_group(ranks, name)

    _groups.GroupManager._create = create  # type: ignore[method-assign]
    platform = Killing() if members_only else type("Gathering", (_NoMemberGroups, Killing), {})()
    state, _ = dp_tp_state(full)
    return outcome(lambda: dcp_load.load(state, checkpoint_id=ckpts["good"], platform=platform,
                                         broadcast_replicated_tensors=True))


def kill_in_save(rank: int, world: int, ckpts: dict[str, str], victim: int) -> dict[str, Any]:
    """``victim`` dies while writing its data file of a collective save."""
    import dcp_load
    from dcp_reader import NativeWriter

    real = NativeWriter.write_file

    def write_file(self: Any, *args: Any, **kw: Any) -> Any:
        if rank == victim:
            _kill_self()
        return real(self, *args, **kw)

    NativeWriter.write_file = write_file  # type: ignore[method-assign]
    state = {n: full(n) for n in NAMES}
    return outcome(lambda: dcp_load.save(state, checkpoint_id=os.path.join(ckpts["root"], "killed_save")))


def write_keys_checkpoint(path: str) -> None:
    import dcp_load

    dcp_load.save({n: _key_full(n) for n in KEY_NAMES}, checkpoint_id=path, no_dist=True)


def _key_full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(KEY_SHAPE, generator=g)


def _stage_state(names: list[str]) -> tuple[dict[str, Any], Callable[[], bool]]:
    """PP2 x TP2: each pipeline stage holds every other name, Shard(0) on its TP pair (so
    each name's holders are 2 of the 4 ranks: the derived digest counts it in the store)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage, tp = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    rows = KEY_SHAPE[0] // 2
    mine = [n for i, n in enumerate(names) if i % 2 == stage]
    state = {n: DTensor.from_local(torch.full((rows, KEY_SHAPE[1]), float("nan")), mesh["tp"], [Shard(0)],
                                   run_check=False) for n in mine}

    def check() -> bool:
        return all(torch.equal(state[n].to_local(), _key_full(n)[tp * rows:(tp + 1) * rows]) for n in mine)

    return state, check


def shared_cases(rank: int, world: int, ckpts: dict[str, str]) -> dict[str, Any]:
    """Scenarios that leave the process group usable, in one launch."""
    import dcp_load
    import dcp_load.plan._digest as digest
    import torch.distributed as dist
    from dcp_platform import Watch
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    res: dict[str, Any] = {}
    counted: list[str] = []
    real_count = digest._count_names

    def count_names(*args: Any, **kw: Any) -> list[str]:
        keys = real_count(*args, **kw)
        counted.extend(keys)
        return keys

    digest._count_names = count_names
    watches: list[str] = []
    real_enter = Watch.__enter__

    def enter(self: Any) -> Any:
        watches.append(self.name)
        return real_enter(self)

    Watch.__enter__ = enter  # type: ignore[method-assign]
    for n in (8, len(KEY_NAMES)):
        state, check = _stage_state(KEY_NAMES[:n])
        del counted[:], watches[:]
        out = outcome(lambda s=state: dcp_load.load(s, checkpoint_id=ckpts["keys"]), check)
        dist.barrier()  # every rank finished its load (and its clean-up)
        out["counted"] = len(counted)
        out["left"] = [k for k in counted if store.check([k])]
        out["watches"] = list(watches)
        out["watch_left"] = [k for w in watches for k in (f"{w}/{x}" for x in (
            "arrived", "all", "abort", "expired", *(f"hb/{r}" for r in range(world)))) if store.check([k])]
        res[f"keys_{n}"] = out
    digest._count_names = real_count
    Watch.__enter__ = real_enter  # type: ignore[method-assign]
    dist.barrier()

    def late_save() -> None:
        if rank == 2:
            time.sleep(5.0)
        dcp_load.save({n: full(n) for n in NAMES}, checkpoint_id=os.path.join(ckpts["root"], "late_save"),
                      timeout=2.0)

    res["late_save"] = outcome(late_save)
    return res

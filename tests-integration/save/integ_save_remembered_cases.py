"""Functions that run inside 4 gloo ranks for test_integ_save_remembered.py (not a test module).

The state is integ_async_save_cases': DP2 x TP2 DTensors, a plain tensor, values. Each
function counts the full exchanges (the gathering of every rank's holdings) and the copies
into the staging pool a rank makes per save.
"""

from __future__ import annotations

import os
from typing import Any

import integ_async_save_cases as base
from integ_failure_cases import outcome

EXTRA_ROWS = 512  # rank 3's own tensor: larger than every box, so the writers of the others move


class Counts:
    """Full exchanges and staging copies of this process, counted by patching."""

    def __init__(self) -> None:
        from dcp_load.saving import _save
        from dcp_load.saving._staging import POOL

        self.exchanges = self.stages = 0
        real_exchange, real_stage = _save.exchange, POOL.stage

        def exchange(*a: Any, **k: Any) -> Any:
            self.exchanges += 1
            return real_exchange(*a, **k)

        def stage(*a: Any, **k: Any) -> Any:
            self.stages += 1
            return real_stage(*a, **k)

        _save.exchange, POOL.stage = exchange, stage  # type: ignore[method-assign]

    def take(self) -> tuple[int, int]:
        out = (self.exchanges, self.stages)
        self.exchanges = self.stages = 0
        return out


def _with_extra(gen: int, rank: int) -> dict[str, Any]:
    import torch

    sd = base.state(gen)
    if rank == 3:
        sd["only3"] = torch.full((EXTRA_ROWS, base.SHAPE[1]), float(gen))
    return sd


def remembered_then_changed(rank: int, world: int, root: str) -> dict[str, Any]:
    """Saves of one state agree without gathering after the first; rank 3 alone adding a
    tensor makes every rank gather again (and a rank whose boxes moved copies again); the
    saves after that agree without gathering again. Every save loads back exactly."""
    import dcp_load

    counts, path, out = Counts(), os.path.join(root, "ckpt"), {}
    dcp_load.save(base.state(1), checkpoint_id=path)
    out["first"] = counts.take()
    rep = dcp_load.async_save(base.state(2), checkpoint_id=path).result(timeout=60)
    out["async_again"], out["written_2"] = counts.take(), rep.bytes_written
    dcp_load.save(base.state(3), checkpoint_id=path)
    out["sync_again"], out["holds_3"] = counts.take(), base.holds(path, 3)
    counts.take()
    rep = dcp_load.async_save(_with_extra(4, rank), checkpoint_id=path).result(timeout=60)
    out["changed"], out["written_4"], out["staged_4"] = counts.take(), rep.bytes_written, rep.staged_bytes
    out["holds_4"] = base.holds(path, 4)
    counts.take()
    dcp_load.async_save(_with_extra(5, rank), checkpoint_id=path).result(timeout=60)
    out["changed_again"], out["holds_5"] = counts.take(), base.holds(path, 5)
    out["extra_5"] = _extra_holds(path, 5)
    return out


def _extra_holds(path: str, gen: int) -> bool:
    """Whether rank 3's own tensor loads back (every rank loads it, poisoned first)."""
    import dcp_load
    import torch

    dst = {"only3": torch.full((EXTRA_ROWS, base.SHAPE[1]), float("nan"))}
    dcp_load.load(dst, checkpoint_id=path)
    return torch.equal(dst["only3"], torch.full_like(dst["only3"], float(gen)))


def refusals_after_remembering(rank: int, world: int, root: str) -> dict[str, Any]:
    """After a save that every rank remembers: ranks naming different directories are
    refused; a directory whose lock another writer holds is refused at the call of
    async_save on every rank (the ranks that copied their boxes early free the pool), and
    the next saves work."""
    import dcp_load
    import torch.distributed as dist
    from dcp_reader import NativeWriter

    path, out = os.path.join(root, "ckpt"), {}
    dcp_load.save(base.state(1), checkpoint_id=path)
    other = os.path.join(root, "other" if rank == 1 else "ckpt")
    out["dirs"] = outcome(lambda: dcp_load.save(base.state(2), checkpoint_id=other))
    held = NativeWriter(path).lock() if rank == 0 else None
    try:
        out["locked"] = outcome(lambda: dcp_load.async_save(base.state(3), checkpoint_id=path))
    finally:
        if held is not None:
            held.release()
    dist.barrier()
    dcp_load.async_save(base.state(4), checkpoint_id=path).result(timeout=60)
    out["holds_4"] = base.holds(path, 4)
    dcp_load.save(base.state(5), checkpoint_id=path)
    out["holds_5"] = base.holds(path, 5)
    return out


def alternating_kinds(rank: int, world: int, root: str) -> dict[str, Any]:
    """A model-only save and a full save (rank 0 alone holds one tensor more) alternate
    into two directories: after the first of each kind, neither gathers again; what a rank
    keeps of a layout is digests, its own items and (rank 0 only) the tensor metadata."""
    import dcp_load
    from dcp_load.saving import _agreed

    counts, per_save, holds = Counts(), [], []
    for i in range(6):
        gen, full = 10 + i, i % 2 == 1
        sd = _with_extra(gen, 3) if full and rank == 0 else base.state(gen)
        path = os.path.join(root, "full" if full else "model")
        (dcp_load.async_save(sd, checkpoint_id=path).result(timeout=60) if i % 3 else
         dcp_load.save(sd, checkpoint_id=path))
        per_save.append(counts.take()[0])
        holds.append(base.holds(path, gen))
    kept = list(_agreed._REMEMBERED.get("world/native", []))  # per group and format
    return {"exchanges": per_save, "holds": holds, "kept": len(kept),
            "metadata_kept": [e.tensors is not None for e in kept],
            "fields": sorted(vars(kept[0])) if kept else []}


def slow_early_copy(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 3 changes what it holds, so it gathers at once, while the others, remembering
    the last layout, start copying their boxes early, each box slowed to 2.5 s: they stop
    once the agreement shows a change, so the save takes seconds, not the 7.5 s or more the
    early copies would take (nor fails the wait of rank 3 in its gathering)."""
    import time

    import dcp_load
    from dcp_load.saving import _async, _staging

    path = os.path.join(root, "ckpt")
    dcp_load.save(base.state(1), checkpoint_id=path)
    real_copy, real_stage = _staging._copy_into, _async._stage
    early = [False]

    def copy_slowly(buf: Any, value: Any, *rest: Any) -> Any:
        if early[0]:
            time.sleep(2.5)
        return real_copy(buf, value, *rest)

    def stage(data: Any, platform: Any, stop: Any = None) -> Any:
        early[0] = stop is not None  # only the early copy is slow; the copy after agreeing is not
        try:
            return real_stage(data, platform, stop)
        finally:
            early[0] = False

    _staging._copy_into, _async._stage = copy_slowly, stage
    try:
        t0 = time.monotonic()
        fut = dcp_load.async_save(_with_extra(2, rank), checkpoint_id=path, timeout=60)
        out = outcome(lambda: fut.result(timeout=120))
        out["took"] = time.monotonic() - t0
    finally:
        _staging._copy_into, _async._stage = real_copy, real_stage
    out["holds_2"], out["extra_2"] = base.holds(path, 2), _extra_holds(path, 2)
    return out

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

"""Only what changed: ``transfer(..., delta=True)``.

A kept plan with ``delta`` remembers, on each sender, a copy of every piece it last sent
(in the source's dtype, on the source's device: as many bytes as the rank sends). On each
call the sender compares its pieces with those copies (``torch.equal``: exact, NaN counts
as changed), one all-reduce (MAX) of a flag per piece tells every rank which pieces move,
and only those are broadcast, in the plan's order; destinations of the others keep what
they hold. Local copies (a rank that holds and wants a piece) are always made. The first
call of a plan sends everything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..layouts._targets import Target
from ..plan._digest import all_reduce
from ._move import lazily, mine
from ._planner import TransferPiece, TransferPlan, _rounds

__all__ = ["Delta"]


def _same(a: Any, b: Any) -> bool:
    import torch

    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # no comparison kernels: compare the bytes
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return bool(torch.equal(a, b))


def _view(target: Target, piece: TransferPiece) -> Any:
    return target.view(piece.src_offsets, piece.src_sizes)


class Delta:
    """What this rank last sent under one kept plan, and the pieces that moved this call."""

    def __init__(self, rank: int, stage_bytes: int):
        self.rank, self.stage_bytes = rank, stage_bytes
        self.sent: dict[int, Any] = {}  # piece index -> the values it last sent
        self.moving: list[int] = []
        self.pieces = self.skipped = 0

    def _flags(self, plan: TransferPlan, src: Mapping[str, Target]) -> list[int]:
        flags = [0] * len(plan.pieces)
        for i, p in enumerate(plan.pieces):
            if p.holder == self.rank and len(p.ranks) > 1:
                last = self.sent.get(i)
                flags[i] = int(last is None or not _same(_view(src[p.src], p), last))
        return flags

    def steps(self, platform: Any, plan: TransferPlan, src: Mapping[str, Target], dst: Mapping[str, Target],
              *, collective: bool, subgroups: bool, batch_bytes: int, watch: Any) -> Iterable[Any]:
        """This call's rounds: the plan's local copies and its changed pieces (one all-reduce)."""
        flags = self._flags(plan, src)
        if collective:
            flags = all_reduce(platform, flags, "max", watch)
        self.moving = [i for i, p in enumerate(plan.pieces) if len(p.ranks) == 1 or flags[i]]
        pieces = [plan.pieces[i] for i in self.moving]
        self.pieces, self.skipped = len(pieces), len(plan.pieces) - len(pieces)
        sub = TransferPlan(pieces=pieces, rounds=_rounds(pieces, batch_bytes, self.stage_bytes))
        return lazily(platform, mine(sub, self.rank, subgroups), src, dst, batch_bytes=batch_bytes)

    def sent_now(self, plan: TransferPlan, src: Mapping[str, Target]) -> None:
        """Remember what this rank sent in this call (after its broadcasts completed)."""
        for i in self.moving:
            p = plan.pieces[i]
            if p.holder != self.rank or len(p.ranks) == 1:
                continue
            view, kept = _view(src[p.src], p), self.sent.get(i)
            if kept is None:
                self.sent[i] = view.clone()
            else:
                kept.copy_(view)

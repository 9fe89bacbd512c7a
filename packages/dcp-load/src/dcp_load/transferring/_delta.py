"""Only what changed: ``transfer(..., delta=True)``.

A kept plan with ``delta`` remembers, on each sender, a copy of every piece it last sent
(in the source's dtype, on the source's device: as many bytes as the rank sends). On each
call the sender compares its pieces with those copies element by element (bit for bit: NaN
counts as changed), and one all-reduce (MAX) of two lanes per piece tells every rank how
many elements of each piece changed and whether a receiver needs the piece whole. A piece
with no change does not move (its destinations keep what they hold); one whose changed
elements' positions and values (``_sparse``) are smaller than the piece travels as those
(the sender's copy then changes only at those positions, at commit), and each
receiver writes the changed values into its destination; any other changed piece is
broadcast whole, in the plan's order. Every rank derives the same choice and size from
the all-reduced counts, so no rank waits on a broadcast of a size it did not expect.

The whole piece travels when: the plan is new (the first call of a plan sends everything;
a changed layout or a new receiver is a new plan), a receiver's destination tensors are not
the ones the previous call filled or another transfer wrote any of their bytes since (``_ledger``: they do
not hold the previous values), a receiver's
destination cannot be written through a view (not a torch tensor, or a box that takes a
broadcast only whole), or the piece travels as float8 (FP8 blockwise destinations: a
changed scale changes the whole block, so these are kept simple and go dense). Local
copies (a rank that holds and wants a piece) are always made.

A call after the first one of its plan writes no destination until every rank agreed that
it succeeded (``_move.Pending``: the pieces arrive in staging, as many bytes as the call
receives; ``_transfer`` applies them after its final check), and the senders' copies are
updated only then: a call that fails part way leaves every destination with the previous
step, bit for bit. The first call of a plan writes in place (the destinations do not hold
a step of this plan yet), unless the caller passed ``atomic=True`` (``_writes``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import chain
from typing import Any

from ..layouts._targets import Target
from ..plan._digest import all_reduce
from . import _ledger
from ._layout import pointers
from ._move import Pending, _numel, lazily, mine
from ._planner import TransferPiece, TransferPlan, _rounds
from ._sparse import (
    SparseRound,
    by_index,
    changed,
    changed_indices,
    comparable,
    pack,
    pack_indices,
    sparse_nbytes,
)

__all__ = ["Delta"]

def _same(a: Any, b: Any) -> bool:
    import torch

    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # no comparison kernels: compare the bytes
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return bool(torch.equal(a, b))


def _view(target: Target, piece: TransferPiece) -> Any:
    return target.view(piece.src_offsets, piece.src_sizes)


def _fp8(wire: str) -> bool:
    return wire.startswith("float8")


def _scatters(target: Target, piece: TransferPiece) -> bool:
    """Whether this receiver can write changed values into its destination box in place."""
    return target.adapter.name == "torch" and target.in_place(piece.offsets, piece.sizes)


class Delta:
    """What this rank last sent under one kept plan, and the pieces that moved this call."""

    def __init__(self, rank: int, stage_bytes: int):
        self.rank, self.stage_bytes = rank, stage_bytes
        self.sent: dict[int, Any] = {}  # piece index -> the values it last sent
        self.where: Any = None  # the destination tensors the previous call filled (``pointers``)
        self.filling: Any = None  # those of this call, until it is committed
        self.spans: dict[str, Any] = {}  # their bytes (``_ledger``), and the commit's sequence number
        self.seq = 0
        self.payloads: dict[int, Any] = {}  # piece index -> this call's positions + values (holder)
        self.updates: dict[int, Any] = {}  # piece index -> (indices, values) that changed this call
        self.moving: list[int] = []
        self.pieces = self.skipped = self.sparse = 0
        self.dtype: Any = None  # the platform's dtype of a dtype name

    def _count(self, i: int, p: TransferPiece, source: Target) -> int:
        """Elements of held piece ``i`` that changed since this rank last sent it (all of
        them for one never sent); packs positions + values when they are smaller than the piece."""
        view, last, numel = _view(source, p), self.sent.get(i), _numel(p.sizes)
        if last is None:
            return numel
        if _fp8(p.wire) or not comparable(view):  # these go whole (module docstring)
            return 0 if _same(view, last) else numel
        indices = changed_indices(view, last)
        if indices is not None and by_index(numel, indices.numel()):
            count = indices.numel()
            if count and sparse_nbytes(numel, count, p.wire) < p.nbytes:
                self._pack(i, p, view, indices)
            return count
        mask = changed(view, last)
        count = int(mask.count_nonzero())
        if not count or sparse_nbytes(numel, count, p.wire) >= p.nbytes:
            return count
        if by_index(numel, count):
            self._pack(i, p, view, mask.reshape(-1).nonzero().squeeze(1))  # the mask has the view's strides
        else:
            self.payloads[i] = pack(mask, view[mask].to(self.dtype(p.wire)))
        return count

    def _pack(self, i: int, p: TransferPiece, view: Any, indices: Any) -> None:
        import torch

        values = torch.take(view, indices)  # row-major positions of a (strided) view
        self.payloads[i] = pack_indices(indices, values.to(self.dtype(p.wire)), _numel(p.sizes))
        self.updates[i] = (indices, values)  # the kept copy changes only there (``sent_now``)

    def _lanes(self, plan: TransferPlan, src: Mapping[str, Target], dst: Mapping[str, Target]) -> list[int]:
        """This rank's lanes: per piece the elements changed (its holder; a receiver whose
        destinations are new asks for all), then per piece whether a receiver needs it whole."""
        n = len(plan.pieces)
        lanes = [0] * (2 * n)
        moved = self._overwritten(dst)
        self.payloads, self.updates = {}, {}
        for i, p in enumerate(plan.pieces):
            if len(p.ranks) == 1:
                continue
            if p.holder == self.rank:
                lanes[i] = self._count(i, p, src[p.src])
            elif self.rank in p.receivers:
                lanes[i] = _numel(p.sizes) if p.dst in moved else 0
                lanes[n + i] = int(not _scatters(dst[p.dst], p))
        return lanes

    def _overwritten(self, dst: Mapping[str, Target]) -> set[str]:
        """The destinations that do not hold this plan's previous step: all when they are other
        tensors than the previous call's, else those another transfer wrote since (any of
        their bytes, through any view: ``_ledger``)."""
        if self.where is None:
            return set()  # the plan's first call: every piece travels anyway
        if pointers(dst) != self.where:
            return set(dst)
        return _ledger.overwritten(self.spans, self, self.seq)

    def _choose(self, plan: TransferPlan, lanes: list[int]) -> tuple[list[int], list[tuple[int, int, int]]]:
        """(dense pieces, (sparse piece, its bytes, its changed elements)) from the all-reduced
        lanes: alike on every rank."""
        n = len(plan.pieces)
        dense: list[int] = []
        sparse: list[tuple[int, int, int]] = []
        for i, p in enumerate(plan.pieces):
            if len(p.ranks) == 1:
                dense.append(i)
            elif lanes[i]:
                nbytes = sparse_nbytes(_numel(p.sizes), lanes[i], p.wire)
                if lanes[n + i] or _fp8(p.wire) or nbytes >= p.nbytes:
                    dense.append(i)
                else:
                    sparse.append((i, nbytes, lanes[i]))
        return dense, sparse

    @property
    def committed(self) -> bool:
        """Whether a call of this plan completed on every rank (the destinations hold its step)."""
        return self.where is not None

    def steps(self, platform: Any, plan: TransferPlan, src: Mapping[str, Target], dst: Mapping[str, Target],
              *, collective: bool, subgroups: bool, batch_bytes: int, watch: Any,
              pending: Pending | None) -> Iterable[Any]:
        """This call's rounds: the plan's local copies and its changed pieces, whole, then the
        sparse ones (one all-reduce); with ``pending``, their writes into ``dst`` wait there."""
        self.dtype = platform.dtype_from_name
        lanes = self._lanes(plan, src, dst)
        self.dtype = None  # the platform (and its group) must not outlive the plan through this Delta
        if collective:
            lanes = all_reduce(platform, lanes, "max", watch)
        dense, sparse = self._choose(plan, lanes)
        self.filling = (pointers(dst), _ledger.spans(dst))
        self.moving = dense + [i for i, _, _ in sparse]
        self.pieces, self.skipped, self.sparse = len(self.moving), len(plan.pieces) - len(self.moving), len(sparse)
        pieces = [plan.pieces[i] for i in dense]
        sub = TransferPlan(pieces=pieces, rounds=_rounds(pieces, batch_bytes, self.stage_bytes))
        tail = SparseRound(platform, self.rank, batch_bytes, pending)
        for i, nbytes, count in sparse:
            p = plan.pieces[i]
            if not subgroups or self.rank in p.ranks:
                tail.add(p, nbytes, count, self.payloads.get(i), src, dst)
        self.payloads = {}
        rounds = lazily(platform, mine(sub, self.rank, subgroups), src, dst, batch_bytes=batch_bytes, pending=pending)
        return chain(rounds, [tail])

    def sent_now(self, plan: TransferPlan, src: Mapping[str, Target]) -> None:
        """Remember what this rank sent in this call, once every rank agreed it succeeded
        (before, a failed call would leave the copies ahead of the destinations)."""
        import torch

        self.where, self.spans = self.filling
        self.seq = _ledger.written(self.spans, self)
        for i in self.moving:
            p = plan.pieces[i]
            if p.holder != self.rank or len(p.ranks) == 1:
                continue
            view, kept, update = _view(src[p.src], p), self.sent.get(i), self.updates.get(i)
            if kept is None:  # row-major, whatever the source's strides (``put_`` and ``take`` index row-major)
                self.sent[i] = view.clone(memory_format=torch.contiguous_format)
            elif update is not None:
                kept.put_(*update)  # only the changed elements (the kept copy is contiguous)
            else:
                kept.copy_(view)
        self.updates = {}


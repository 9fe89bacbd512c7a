"""Running a transfer plan on one rank: local copies, then one ``broadcast_items`` per round.

Sources are only read: a piece sent from a strided source alone (not packed) or in another
dtype is first copied into a staging tensor here, since the platform would otherwise send
it through a temporary that it copies back into the source after the wait. A receiver
whose piece arrives in another dtype, or into a destination that has no aliasing views,
receives into staging and copies into place after its round. The rounds of the plan bound
that staging (``_planner._rounds``).

A staged transfer (``atomic=True``, or a delta transfer after its first call: ``_delta``)
writes no destination while data moves: given a ``Pending``, every piece a receiver gets
arrives in staging, and its copies into the destinations (and a holder's copies of its own
pieces) are held there until every rank agreed that the call succeeded (``_transfer``), so
that a failed call leaves the previous step in place. That staging is as large as the bytes
the rank receives in the call. A transfer that writes in place notes each round's
destinations before the round runs (``move``'s ``touched``: those a failure leaves torn).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..layouts._targets import Target
from ..plan._owners import dtype_itemsize
from ._planner import TransferPiece, TransferPlan

__all__ = ["MoveStats", "Pending", "lazily", "mine", "move", "prepare"]


@dataclass
class MoveStats:
    """What this rank moved in one transfer."""

    broadcasts: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied: int = 0
    pieces: int = 0
    seconds: float = 0.0
    written: set[str] = field(default_factory=set)  # destinations written (in place, or held in a ``Pending``)


class Pending:
    """The writes into this rank's destinations that a staged call holds back until every rank
    agreed that it succeeded (module docstring): ``apply`` makes them. Local only: nothing in
    it waits for a peer."""

    def __init__(self, platform: Any):
        self.platform = platform
        self.writes: list[tuple[Callable[..., None], tuple[Any, ...]]] = []

    def copy(self, target: Target, into: Any, source: Any) -> None:
        self.writes.append((target.adapter.copy, (into, source)))

    def add(self, write: Callable[..., None], *args: Any) -> None:
        self.writes.append((write, args))

    def apply(self) -> None:
        for write, args in self.writes:
            write(*args)
        self.platform.synchronize()
        self.writes = []


def mine(plan: TransferPlan, rank: int, subgroups: bool) -> list[list[TransferPiece]]:
    """Per round, the pieces this rank walks: those it takes part in when the platform
    broadcasts over exact groups (the others' broadcasts do not involve it), else all."""
    return [[p for p in plan.pieces[a:b] if not subgroups or rank in p.ranks] for a, b in plan.rounds]


def _src_view(target: Target, piece: TransferPiece) -> Any:
    view = target.view(piece.src_offsets, piece.src_sizes)
    for d in piece.insert:  # dimensions a Stack added: size 1
        view = view.unsqueeze(d)
    return view


def _contiguous(tensor: Any) -> bool:
    test = getattr(tensor, "is_contiguous", None)
    return test is None or bool(test())


class _Round:
    """One round on this rank, prepared once and runnable again while the tensors stay:
    the copies to make before it (a holder's own pieces, staging of casts and of strided
    sources), its broadcast items, and the copies to make after it (received staging). With
    ``pending``, the copies into destinations go there instead (module docstring)."""

    def __init__(self, platform: Any, rank: int, batch_bytes: int, pending: Pending | None = None):
        self.platform, self.rank, self.batch_bytes, self.pending = platform, rank, batch_bytes, pending
        self.before: list[tuple[Target, Any, Any]] = []  # (target whose adapter copies, into, from)
        self.items: list[Any] = []
        self.after: list[tuple[Target, Any, Any]] = []
        self.pieces = self.copied = 0
        self.names: set[str] = set()  # the destinations this round writes, now or through ``pending``
        self.in_place: set[str] = set()  # those it writes while it runs

    def _staging(self, piece: TransferPiece) -> Any:
        return self.platform.empty(piece.sizes, self.platform.dtype_from_name(piece.wire))

    def add(self, piece: TransferPiece, src: Mapping[str, Target], dst: Mapping[str, Target]) -> None:
        from dcp_broadcast import BroadcastItem

        if self.rank not in piece.ranks:
            self.items.append(BroadcastItem(piece.holder, piece.ranks, piece.nbytes))
            return
        self.pieces += 1
        if self.rank in piece.receivers:
            self.names.add(piece.dst)
            if self.pending is None:
                self.in_place.add(piece.dst)
        if self.rank == piece.holder:
            source = src[piece.src]
            view = _src_view(source, piece)
            if self.rank in piece.receivers:  # a holder that needs the piece copies it
                target = dst[piece.dst]
                into = target.view(piece.offsets, piece.sizes)
                if self.pending is not None:
                    self.pending.copy(target, into, view)
                else:
                    self.before.append((target, into, view))
                self.copied += _numel(piece.sizes) * dtype_itemsize(piece.dst_dtype)
            if len(piece.ranks) == 1:
                return
            tensor = view
            if piece.wire != piece.src_dtype or (piece.nbytes >= self.batch_bytes and not _contiguous(view)):
                tensor = self._staging(piece)
                self.before.append((source, tensor, view))
            self.items.append(BroadcastItem(piece.holder, piece.ranks, piece.nbytes, tensor))
            return
        target = dst[piece.dst]
        view = target.view(piece.offsets, piece.sizes)
        tensor = view
        if self.pending is not None:
            tensor = self._staging(piece)
            self.pending.copy(target, view, tensor)
        elif piece.wire != piece.dst_dtype or not target.in_place(piece.offsets, piece.sizes):
            tensor = self._staging(piece)
            self.after.append((target, view, tensor))
        self.items.append(BroadcastItem(piece.holder, piece.ranks, piece.nbytes, tensor))

    def run(self, groups: Any, max_in_flight: int, watch: Any, stats: MoveStats) -> None:
        for target, into, source in self.before:
            target.adapter.copy(into, source)
        stats.pieces += self.pieces
        stats.bytes_copied += self.copied
        if self.items:
            from dcp_broadcast import broadcast_items

            got = broadcast_items(self.platform, self.items, batch_bytes=self.batch_bytes,
                                  max_in_flight=max_in_flight, groups=groups, watch=watch)
            stats.broadcasts += got.broadcasts
            stats.bytes_sent += got.bytes_sent
            stats.bytes_received += got.bytes_received
        if self.after:
            self.platform.synchronize()
            for target, view, staging in self.after:
                target.adapter.copy(view, staging)


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def prepare(platform: Any, rounds: Sequence[Sequence[TransferPiece]], src: Mapping[str, Target],
            dst: Mapping[str, Target], *, batch_bytes: int, pending: Pending | None = None) -> list[_Round]:
    """This rank's rounds (``rounds``: from ``mine``) over these targets' tensors. Each holds
    views of them and its staging (cast and lone strided pieces only, bounded per round by
    the plan): kept while the tensors stay, so that a reused plan builds nothing."""
    rank = platform.rank()
    out = []
    for pieces in rounds:
        step = _Round(platform, rank, batch_bytes, pending)
        for piece in pieces:
            step.add(piece, src, dst)
        out.append(step)
    return out


def lazily(platform: Any, rounds: Sequence[Sequence[TransferPiece]], src: Mapping[str, Target],
           dst: Mapping[str, Target], *, batch_bytes: int, pending: Pending | None = None) -> Iterator[_Round]:
    """``prepare``, one round at a time: a round's staging is freed before the next's exists
    (unless ``pending`` holds it for later)."""
    for pieces in rounds:
        yield from prepare(platform, [pieces], src, dst, batch_bytes=batch_bytes, pending=pending)


def move(platform: Any, prepared: Iterable[_Round], *, max_in_flight: int, groups: Any, watch: Any,
         touched: set[str] | None = None) -> MoveStats:
    """Copy and broadcast this rank's pieces, round by round (``prepared``: from ``prepare``
    or ``lazily``). ``touched``: gets the destinations each round writes in place, before it
    runs (what a failure from there on leaves torn)."""
    stats = MoveStats()
    start = time.perf_counter()
    for step in prepared:
        if touched is not None:
            touched.update(step.in_place)
        step.run(groups, max_in_flight, watch, stats)
        stats.written.update(step.names)
    platform.synchronize()
    stats.seconds = time.perf_counter() - start
    return stats

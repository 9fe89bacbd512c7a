"""Planning a transfer: every rank's wanted boxes x every rank's held boxes -> pieces.

Pure: each rank calls ``plan_transfer`` with the same gathered layouts and gets the same
plan, so the broadcasts that follow are walked in the same order everywhere.

The held boxes play the part of a checkpoint's saved chunks: for each source tensor the
distinct boxes the ranks hold (replicas hold the same box) are its chunks, each with its
holders. ``sources=`` composes them exactly as ``load`` composes saved chunks
(``layouts._sources.compose``), so a fused ``qkv`` destination sees the ``q``, ``k`` and
``v`` holders' boxes at their offsets. Each destination box that some ranks want alike (the
receivers) is cut along those chunks; every receiver that holds a piece copies it locally,
and the others get it from one holder: a receiver that holds it (it copies and sends), else
the holder with the fewest bytes sent so far, heaviest piece first. A piece moves as one
broadcast over its sender and the receivers that lack it (a two-rank group when one rank
needs it), batched with the other small pieces of the same group by
``dcp_broadcast.broadcast_items``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..layouts._boxes import intersect
from ..layouts._keys import missing_advice
from ..layouts._sources import SourceError, SourceMap, compose, leaves
from ..plan._owners import dtype_itemsize
from ._layout import Entry

__all__ = ["TransferPiece", "TransferPlan", "plan_transfer"]


@dataclass(frozen=True, slots=True)
class TransferPiece:
    """One box of destination ``dst`` (``offsets``/``sizes``), taken from source ``src`` at
    ``src_offsets``/``src_sizes`` (its own coordinates; ``insert``: the destination's
    dimensions a ``Stack`` added, size 1) on rank ``holder``, and sent to ``receivers``.
    ``ranks``: the broadcast's group (holder and receivers). ``wire``: the dtype that travels
    (the narrower of the two: a cast happens on the side that has the wider one)."""

    dst: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    src: str
    src_offsets: tuple[int, ...]
    src_sizes: tuple[int, ...]
    insert: tuple[int, ...]
    holder: int
    receivers: tuple[int, ...]
    ranks: tuple[int, ...]
    src_dtype: str
    dst_dtype: str
    wire: str
    nbytes: int


@dataclass
class TransferPlan:
    """The pieces in the order every rank walks them, cut into rounds (``rounds``: index
    ranges of ``pieces``; each round is one ``broadcast_items`` call, bounding the staging
    a rank holds at once), and the problems found, per rank (empty when the plan is good)."""

    pieces: list[TransferPiece] = field(default_factory=list)
    rounds: list[tuple[int, int]] = field(default_factory=list)
    errors: dict[int, list[str]] = field(default_factory=dict)
    composed: dict[str, int] = field(default_factory=dict)  # dst name -> source tensors, for sources= entries
    cast: set[str] = field(default_factory=set)

    def fail(self, ranks: Sequence[int], message: str) -> None:
        for r in ranks:
            self.errors.setdefault(r, []).append(message)


@dataclass(frozen=True)
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    holders: tuple[int, ...]


@dataclass
class _Held:
    shape: tuple[int, ...]
    dtype: str
    boxes: dict[tuple[Any, Any], list[int]] = field(default_factory=dict)
    chunks: list[_Chunk] = field(default_factory=list)


def _overlaps(boxes: Sequence[tuple[Any, Any]]) -> tuple[Any, Any] | None:
    """Two distinct boxes that overlap (a sweep along dim 0), or None."""
    ordered = sorted(boxes)
    active: list[tuple[Any, Any]] = []
    for box in ordered:
        off, sz = box
        if not off:  # a 0-dim tensor has one box
            continue
        active = [a for a in active if a[0][0] + a[1][0] > off[0]]
        for a in active:
            if intersect([_Chunk(a[0], a[1], ())], off, sz):
                return a, box
        active.append(box)
    return None


def _held(layouts: Sequence[tuple[Sequence[Entry], Sequence[Entry]]], plan: TransferPlan) -> dict[str, _Held]:
    """Source name -> its distinct held boxes (the chunks) with their holders."""
    held: dict[str, _Held] = {}
    for rank, (src, _) in enumerate(layouts):
        for name, shape, dtype, boxes in src:
            h = held.get(name)
            if h is None:
                h = held[name] = _Held(tuple(shape), dtype)
            elif h.shape != tuple(shape) or h.dtype != dtype:
                first = min(r for rs in h.boxes.values() for r in rs) if h.boxes else rank
                plan.fail([rank], f"src {name!r} is {dtype} of shape {tuple(shape)} here but {h.dtype} of shape "
                                  f"{h.shape} on rank {first}; every rank must hold the same global tensor")
                continue
            for box in boxes:
                if math.prod(box[1]) == 0:  # an empty shard holds nothing to send
                    continue
                ranks = h.boxes.setdefault(box, [])
                if not ranks or ranks[-1] != rank:
                    ranks.append(rank)
    for name, h in held.items():
        bad = _overlaps(list(h.boxes))
        if bad is not None:
            a, b = bad
            plan.fail(sorted({*h.boxes[a], *h.boxes[b]}),
                      f"src {name!r}: the box offsets={a[0]} sizes={a[1]} (ranks {h.boxes[a]}) overlaps the box "
                      f"offsets={b[0]} sizes={b[1]} (ranks {h.boxes[b]}) without being equal; the ranks' src "
                      "must hold one consistent sharding of each tensor")
        h.chunks = [_Chunk(off, sz, tuple(h.boxes[(off, sz)])) for off, sz in sorted(h.boxes)]
    return held


def _wanted(layouts: Sequence[tuple[Sequence[Entry], Sequence[Entry]]], plan: TransferPlan
            ) -> dict[str, tuple[tuple[int, ...], dict[tuple[Any, ...], list[int]]]]:
    """Destination name -> (global shape, {(offsets, sizes, dtype): receivers})."""
    wants: dict[str, tuple[tuple[int, ...], dict[tuple[Any, ...], list[int]]]] = {}
    first: dict[str, int] = {}
    for rank, (_, dst) in enumerate(layouts):
        for name, shape, dtype, boxes in dst:
            entry = wants.setdefault(name, (tuple(shape), {}))
            first.setdefault(name, rank)
            if entry[0] != tuple(shape):
                plan.fail([rank], f"dst {name!r} has shape {tuple(shape)} here but {entry[0]} on rank {first[name]}; "
                                  "every rank must fill the same global tensor")
                continue
            for off, sz in boxes:
                if math.prod(sz) == 0:  # an empty shard: nothing to fill
                    continue
                ranks = entry[1].setdefault((off, sz, dtype), [])
                if not ranks or ranks[-1] != rank:
                    ranks.append(rank)
    return wants


def _kind(dtype: str) -> str:
    return "complex" if dtype.startswith("complex") else "real"


def _wire(src_dtype: str, dst_dtype: str) -> str:
    return src_dtype if dtype_itemsize(src_dtype) <= dtype_itemsize(dst_dtype) else dst_dtype


@dataclass
class _Open:
    """A piece before its holder is chosen."""

    dst: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    src: str
    src_offsets: tuple[int, ...]
    src_sizes: tuple[int, ...]
    insert: tuple[int, ...]
    holders: tuple[int, ...]
    receivers: tuple[int, ...]
    src_dtype: str
    dst_dtype: str

    @property
    def wire(self) -> str:
        return _wire(self.src_dtype, self.dst_dtype)

    @functools.cached_property
    def nbytes(self) -> int:  # asked 4 times per piece while planning (sort, assign, rounds)
        return math.prod(self.sizes) * dtype_itemsize(self.wire)


def _source_of(name: str, source_map: SourceMap | None, plan: TransferPlan, ranks: Sequence[int]) -> Any:
    if source_map is None:
        return name
    try:
        found = source_map.match(name)
    except ValueError as exc:
        plan.fail(ranks, str(exc))
        return None
    if found is None:
        return name
    return found[1]


def _composed(name: str, shape: tuple[int, ...], ranks: Sequence[int], source_map: SourceMap | None,
              held: Mapping[str, _Held], plan: TransferPlan) -> list[Any] | None:
    """The virtual chunks of destination ``name`` (``compose`` over the held boxes), or None
    after recording why there are none."""
    source = _source_of(name, source_map, plan, ranks)
    if source is None:
        return None
    missing = [n for n in leaves(source) if n not in held]
    if missing:
        via = "" if source == name else f" (sources= maps it to {source!r:.200})"
        # the advice speaks of a checkpoint; here the names are those the ranks' src hold
        advice = (missing_advice(missing, list(held)).replace("checkpoint keys", "src names")
                  .replace("the checkpoint holds", "the ranks' src hold"))
        plan.fail(ranks, f"dst {name!r}{via}: no rank's src holds {', '.join(repr(m) for m in missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}; pass it in src on the ranks that hold it"
                         f"{', or map it with sources=' if source == name else ''}"
                         + (f" ({advice})" if advice else ""))
        return None
    try:
        got_shape, _, pieces = compose(source, held, f"transfer: dst {name!r}")
    except SourceError as exc:
        plan.fail(ranks, str(exc))
        return None
    if tuple(got_shape) != shape:
        plan.fail(ranks, f"dst {name!r} has shape {shape} but its source {source!r:.200} gives {tuple(got_shape)}; "
                         "give the destination the source's global shape (or fix sources=)")
        return None
    if source != name:
        plan.composed[name] = len(leaves(source))
    return pieces


def _cut(name: str, box: tuple[Any, ...], receivers: tuple[int, ...], pieces: Sequence[Any],
         held: Mapping[str, _Held], allow_cast: bool, plan: TransferPlan) -> list[_Open]:
    """The pieces of one wanted box: its overlaps with the virtual chunks."""
    offsets, sizes, dtype = box
    out: list[_Open] = []
    covered = 0
    for index, off, sz in intersect(pieces, offsets, sizes):
        p = pieces[index]
        src_dtype = held[p.source].dtype
        if src_dtype != dtype and (not allow_cast or _kind(src_dtype) != _kind(dtype)):
            fix = ("allow_dtype_cast=False refuses casts: give dst the src's dtype" if not allow_cast
                   else "complex and real dtypes cannot be cast into each other")
            plan.fail(receivers, f"dst {name!r} is {dtype} but src {p.source!r} is {src_dtype}; {fix}")
            return []
        if src_dtype != dtype:
            plan.cast.add(name)
        src_off = tuple(off[a] + s for a, s in zip(p.axes, p.shift, strict=True))
        src_sz = tuple(sz[a] for a in p.axes)
        insert = tuple(d for d in range(len(sz)) if d not in p.axes)
        out.append(_Open(name, off, sz, p.source, src_off, src_sz, insert, p.real.holders, receivers,
                         src_dtype, dtype))
        covered += math.prod(sz)
    if covered != math.prod(sizes):
        plan.fail(receivers, f"dst {name!r}: the box offsets={offsets} sizes={sizes} is not covered by the ranks' "
                             f"src ({covered} of {math.prod(sizes)} elements are held); every element a dst "
                             "wants must be held by some rank's src")
        return []
    return out


def _slabs(piece: _Open, limit: int) -> list[_Open]:
    """``piece`` cut along its first dimension of more than one element into slabs of at
    most ``limit`` bytes (a row larger than ``limit`` stays whole)."""
    if piece.nbytes <= limit or limit <= 0:
        return [piece]
    dims = [d for d, n in enumerate(piece.sizes) if n > 1 and d not in piece.insert]
    if not dims:
        return [piece]
    d = dims[0]
    real = sum(1 for v in range(d) if v not in piece.insert)  # the source's dimension of d
    rows = max(1, limit // (piece.nbytes // piece.sizes[d]))
    out = []
    for lo in range(0, piece.sizes[d], rows):
        n = min(rows, piece.sizes[d] - lo)
        out.append(_Open(piece.dst, _at(piece.offsets, d, piece.offsets[d] + lo), _at(piece.sizes, d, n),
                         piece.src, _at(piece.src_offsets, real, piece.src_offsets[real] + lo),
                         _at(piece.src_sizes, real, n), piece.insert, piece.holders, piece.receivers,
                         piece.src_dtype, piece.dst_dtype))
    return out


def _at(values: tuple[int, ...], d: int, v: int) -> tuple[int, ...]:
    return (*values[:d], v, *values[d + 1:])


def _assign(opens: Sequence[_Open], world: int) -> list[TransferPiece]:
    """Who sends each piece: every receiver that holds it copies it itself (a piece of its
    own, no collective); the receivers that do not hold it get it in one broadcast from a
    receiver that holds it (it reads the piece for its own copy anyway), else from the
    holder with the fewest bytes sent so far (heaviest piece first, ties to the lower
    rank). Plan order is kept; a piece's local copies follow its broadcast."""
    sent = [0] * world
    sender = [-1] * len(opens)  # -1: every receiver holds it
    for i in sorted(range(len(opens)), key=lambda i: -opens[i].nbytes):
        p = opens[i]
        if all(r in p.holders for r in p.receivers):
            continue
        local = [r for r in p.holders if r in p.receivers]
        sender[i] = min(local or p.holders, key=lambda r: (sent[r], r))
        sent[sender[i]] += p.nbytes
    out = []
    for p, h in zip(opens, sender, strict=True):
        if h >= 0:  # the sender copies too when it wants the piece
            receivers = tuple(r for r in p.receivers if r == h or r not in p.holders)
            out.append(_piece(p, h, receivers))
        out.extend(_piece(p, r, (r,)) for r in p.receivers if r in p.holders and r != h)
    return out


def _piece(p: _Open, holder: int, receivers: tuple[int, ...]) -> TransferPiece:
    return TransferPiece(p.dst, p.offsets, p.sizes, p.src, p.src_offsets, p.src_sizes, p.insert, holder,
                         receivers, tuple(sorted({holder, *receivers})), p.src_dtype, p.dst_dtype, p.wire,
                         p.nbytes)


def _rounds(pieces: Sequence[TransferPiece], batch_bytes: int, stage_bytes: int) -> list[tuple[int, int]]:
    """Consecutive ranges of ``pieces`` whose staging fits ``stage_bytes``: a piece may be
    staged when it is cast or travels alone (a strided source is copied out before it is
    sent), so those count; a packed piece of one dtype goes through the scheduler's own
    bounded buffers and counts nothing."""
    out: list[tuple[int, int]] = []
    start = acc = 0
    for i, p in enumerate(pieces):
        staged = len(p.ranks) > 1 and (p.nbytes >= batch_bytes or p.src_dtype != p.dst_dtype)
        cost = p.nbytes if staged else 0
        if acc and acc + cost > stage_bytes:
            out.append((start, i))
            start, acc = i, 0
        acc += cost
    if start < len(pieces):
        out.append((start, len(pieces)))
    return out


def plan_transfer(layouts: Sequence[tuple[Sequence[Entry], Sequence[Entry]]], *, source_map: SourceMap | None,
                  allow_cast: bool, batch_bytes: int, stage_bytes: int) -> TransferPlan:
    """The plan of a transfer from every rank's gathered (src entries, dst entries)."""
    plan = TransferPlan()
    held = _held(layouts, plan)
    wants = _wanted(layouts, plan)
    opens: list[_Open] = []
    for name in sorted(wants):
        shape, boxes = wants[name]
        all_ranks = sorted({r for rs in boxes.values() for r in rs})
        pieces = _composed(name, shape, all_ranks, source_map, held, plan)
        if pieces is None:
            continue
        for box in sorted(boxes):
            for p in _cut(name, box, tuple(boxes[box]), pieces, held, allow_cast, plan):
                opens.extend(_slabs(p, stage_bytes // 2))
    if plan.errors:
        return plan
    plan.pieces = _assign(opens, len(layouts))
    plan.rounds = _rounds(plan.pieces, batch_bytes, stage_bytes)
    return plan

"""Geometry of read-once planning: where the wanted boxes of one saved chunk share bytes.

A saved chunk is stored row-major, so its rows along dimension 0 are contiguous byte spans
of the data file, and a box that is narrower than the chunk in another dimension (a
row-parallel ``Shard(1)`` half) still touches every page of its rows. Two boxes of one
chunk therefore share storage pages exactly where their dimension-0 ranges overlap.

``intervals`` cuts a chunk's dimension 0 at every wanted box's first and last row: inside
one interval every box either covers all rows or none, so the interval is the unit that
one owner reads for every box that needs it (both halves of a row-parallel weight, the
shared middle of two partially overlapping boxes). ``split_rows`` cuts an interval into
row slabs so that a huge one (an embedding, an lm_head) is read by several owners.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["Piece", "intervals", "row_bytes", "split_rows", "stripe_rows", "sub_box"]

#: (global offsets, sizes, destination dtype, ranks wanting it, all of them broadcastable)
Piece = tuple[tuple[int, ...], tuple[int, ...], str, tuple[int, ...], bool]


def intervals(chunk: Any, pieces: Sequence[Piece]) -> Iterator[tuple[int, int, list[Piece]]]:
    """(first row, end row, pieces covering them) of every cut interval of ``chunk`` that
    some piece covers, in row order. Rows are global dimension-0 indices. A 0-dim chunk is
    one interval ``(0, 1)``. A sweep over the pieces' starts and ends: O(p log p + output).
    """
    if not chunk.sizes:
        yield 0, 1, list(pieces)
        return
    cuts = sorted({p[0][0] for p in pieces} | {p[0][0] + p[1][0] for p in pieces})
    starts = sorted(range(len(pieces)), key=lambda i: pieces[i][0][0])
    active: dict[int, Piece] = {}
    nxt = 0
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        for i in [i for i, p in active.items() if p[0][0] + p[1][0] <= lo]:
            del active[i]
        while nxt < len(starts) and pieces[starts[nxt]][0][0] <= lo:
            i = starts[nxt]
            if pieces[i][0][0] + pieces[i][1][0] > lo:
                active[i] = pieces[i]
            nxt += 1
        if active:
            yield lo, hi, list(active.values())


def row_bytes(chunk: Any, itemsize: int) -> int:
    """Bytes of one dimension-0 row of ``chunk`` (all other dimensions full)."""
    return math.prod(chunk.sizes[1:]) * itemsize


def split_rows(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``parts`` near-equal row ranges (the first ones one row longer)."""
    parts = max(1, min(parts, hi - lo))
    base, extra = divmod(hi - lo, parts)
    out, start = [], lo
    for k in range(parts):
        end = start + base + (1 if k < extra else 0)
        out.append((start, end))
        start = end
    return out


def stripe_rows(start: int, nbytes: int, lo: int, hi: int, rb: int, total: int, stripes: int
                ) -> list[tuple[int, int, int]]:
    """Rows ``[lo, hi)`` (``rb`` bytes each; 0: one indivisible item) at byte ``start`` of a
    stream of ``total`` bytes cut into ``stripes`` equal stripes: (first row, end row,
    stripe) per piece, cut at the row nearest each stripe boundary. A piece belongs to the
    stripe holding its middle byte."""
    if not rb or hi - lo <= 1:
        return [(lo, hi, (start + nbytes // 2) * stripes // total)]
    first, last = start * stripes // total, (start + nbytes - 1) * stripes // total
    cuts = [lo]
    for j in range(first + 1, last + 1):
        boundary = -(-j * total // stripes)  # first byte of stripe j
        row = min(hi, lo + (boundary - start + rb // 2) // rb)
        if row > cuts[-1]:
            cuts.append(row)
    if cuts[-1] < hi:
        cuts.append(hi)
    return [(a, b, (start + (a - lo) * rb + (b - a) * rb // 2) * stripes // total)
            for a, b in zip(cuts, cuts[1:], strict=False)]


def sub_box(piece: Piece, lo: int, hi: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The part of ``piece`` in global rows ``[lo, hi)`` (which it must cover)."""
    offsets, sizes = piece[0], piece[1]
    if not sizes:
        return offsets, sizes
    return (lo, *offsets[1:]), (hi - lo, *sizes[1:])

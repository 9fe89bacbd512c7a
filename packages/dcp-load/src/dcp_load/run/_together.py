"""Boxes of the same rows of one saved chunk, read by one rank one after the other, are
read together: the range covering their bounding box once, each box copied out of it.

On object storage the planner gives every column box of a row slab to one rank
(``plan._owners``, ``ReadItem.relay``): read one by one, each column box would fetch its
rows with the other columns as gaps (one GET instead of one per row), so every slab's rows
would be fetched once per box. Read together, its whole rows are one range of a few GETs,
fetched once. The boxes must tile their bounding box exactly (no byte is fetched that no
box wants), and the bounding box is read through the load's ``StagingPool`` in pieces of
at most one buffer (``plan._read_cost.cover_pieces``), so the memory stays bounded.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from ..plan._items import ReadItem
from ..plan._read_cost import cover_pieces
from ._stage import StagingPool, can_cover, covering_geometry, narrowed, saved_box

__all__ = ["bounding_box", "read_together", "row_groups"]


def _key(item: ReadItem) -> tuple[Any, ...]:
    return (item.name, item.chunk, item.offsets[:1], item.sizes[:1], item.dtype, item.cached)


def row_groups(reads: Sequence[ReadItem]) -> list[list[int]]:
    """Indices of ``reads`` cut into runs of consecutive items to read together: the same
    tensor, chunk, rows, dtype and caching, whose boxes tile their bounding box. Every
    other item (an empty or 0-dim box among them) is a run of its own."""
    out: list[list[int]] = []
    for i, item in enumerate(reads):
        if out and item.sizes and all(item.sizes) and _key(reads[out[-1][0]]) == _key(item) and \
                bounding_box([reads[j] for j in (*out[-1], i)]) is not None:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def bounding_box(items: Sequence[ReadItem]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offsets, sizes) of the box ``items`` tile exactly (disjoint, no gap), else None."""
    lo = tuple(min(i.offsets[d] for i in items) for d in range(len(items[0].offsets)))
    hi = tuple(max(i.offsets[d] + i.sizes[d] for i in items) for d in range(len(items[0].offsets)))
    sizes = tuple(h - low for h, low in zip(hi, lo, strict=True))
    if sum(math.prod(i.sizes) for i in items) != math.prod(sizes):
        return None
    for a, x in enumerate(items):
        for y in items[a + 1:]:
            if all(xo < yo + ys and yo < xo + xs for xo, xs, yo, ys in zip(x.offsets, x.sizes, y.offsets, y.sizes,
                                                                          strict=True)):
                return None
    return lo, sizes


def read_together(reader: Any, items: Sequence[ReadItem], chunk: Any, dests: Sequence[Any], itemsize: int,
                  pool: StagingPool, verify: bool, max_overread: float) -> bool:
    """Read the boxes of ``items`` (``row_groups``) into the torch tensors ``dests`` through
    one covering read of their bounding box, cut into pieces that fit a buffer of ``pool``.
    Boxes read through ``sources=`` are read from the saved tensor behind them
    (``_stage.saved_box``). False, with nothing read, when the reader cannot cover (a
    torch-dcp blob loaded whole), when the boxes lie in different saved chunks, or when the
    range covering the bounding box fetches more than ``max_overread`` x its bytes (the
    boxes do not span whole rows of the chunk)."""
    import torch

    saved = _saved(reader, items, chunk, dests)
    if saved is None:
        return False
    reader, items, chunk, dests = saved
    box = bounding_box(items)
    if box is None or not can_cover(reader):
        return False
    offsets, sizes = box
    g = covering_geometry(chunk, offsets, sizes, itemsize)
    if g.span(0) > max_overread * g.nbytes:
        return False
    for n, (sub, sub_sizes) in enumerate(cover_pieces(g, 0, pool.buffer_bytes)):
        at = tuple(o + c for o, c in zip(sub, chunk.offsets, strict=True))
        need = reader.covering_bytes(items[0].name, chunk, at, sub_sizes, verify=verify)
        if need is None:
            assert n == 0, "a chunk is covered whole or not at all"
            return False
        with pool.take(need) as raw:
            piece = reader.read_covering(items[0].name, chunk, at, sub_sizes, raw, verify=verify)
            with torch.no_grad():
                for item, dest in zip(items, dests, strict=True):
                    common = _overlap(at, sub_sizes, item.offsets, item.sizes)
                    if common is not None:
                        narrowed(dest, item.offsets, *common).copy_(narrowed(piece, at, *common))
    return True


def _saved(reader: Any, items: Sequence[ReadItem], chunk: Any, dests: Sequence[Any]) -> Any:
    """(reader, items, chunk, dests) of the saved bytes behind ``items`` (a renamed or
    composed tensor's: ``saved_box``), or None when they lie in different saved chunks."""
    real = [saved_box(reader, i.name, chunk, i.offsets, i.sizes, d) for i, d in zip(items, dests, strict=True)]
    inner, name, saved = real[0][:3]
    if any(r[0] is not inner or r[1] != name or r[2] is not saved for r in real):
        return None
    return (inner, [dataclasses.replace(i, name=name, offsets=r[3], sizes=r[4]) for i, r in zip(items, real, strict=True)],
            saved, [r[5] for r in real])


def _overlap(a_off: Sequence[int], a_sizes: Sequence[int], b_off: Sequence[int], b_sizes: Sequence[int]
             ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off, strict=True))
    hi = tuple(min(x + xs, y + ys) for x, xs, y, ys in zip(a_off, a_sizes, b_off, b_sizes, strict=True))
    if any(h <= low for h, low in zip(hi, lo, strict=True)):
        return None
    return lo, tuple(h - low for h, low in zip(hi, lo, strict=True))

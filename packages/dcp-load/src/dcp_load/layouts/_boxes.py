"""Box geometry shared by the layers above: the overlap of a box with saved chunks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["intersect"]


def intersect(chunks: Sequence[Any], offsets: tuple[int, ...], sizes: tuple[int, ...]
              ) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(chunk index, offsets, sizes) of every non-empty overlap of the box with a chunk.

    A 0-dim box overlaps every 0-dim chunk (volume 1); a box with a zero size is empty.
    """
    out = []
    if any(s == 0 for s in sizes):
        return out
    for index, chunk in enumerate(chunks):
        if len(chunk.offsets) != len(offsets):
            raise ValueError(f"intersect: box of {len(offsets)} dims against a chunk of {len(chunk.offsets)}")
        lo, sz = [], []
        # plain loops: a rank of a 16k-rank job intersects ~600 boxes while it plans
        for a, n, b, m in zip(offsets, sizes, chunk.offsets, chunk.sizes):  # noqa: B905 - checked above
            start, end = max(a, b), min(a + n, b + m)
            if end <= start:
                break
            lo.append(start)
            sz.append(end - start)
        else:
            out.append((index, tuple(lo), tuple(sz)))
    return out

"""Checks that a tensor's saved chunks tile its shape exactly: inside, no overlap, no gap."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol


class _Chunk(Protocol):
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str


def _overlap(a: _Chunk, b: _Chunk) -> bool:
    return all(ao < bo + bs and bo < ao + as_
               for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=False))


def coverage_problems(name: str, shape: tuple[int, ...], chunks: Sequence[_Chunk], *,
                      allow_gaps: bool = False) -> list[str]:
    """Human-readable problems with ``chunks`` as a tiling of ``shape`` (empty list: exact).

    Chunks inside the shape that do not overlap and whose volumes add up to the shape's
    volume tile it exactly. Overlaps are found with a sweep along dim 0 that compares a
    chunk only with the chunks whose dim-0 range is still open, so row-sharded tensors with
    thousands of chunks cost O(n log n) instead of O(n^2). ``allow_gaps``: only overlaps
    and overhang are problems (a rank-local view of a checkpoint).
    """
    problems: list[str] = []
    for c in chunks:
        if any(o + s > n for o, s, n in zip(c.offsets, c.sizes, shape, strict=False)):
            problems.append(f"{name!r}: chunk offsets={c.offsets} sizes={c.sizes} in {c.file!r} "
                            f"lies outside the shape {shape}")
    if problems:
        return problems
    total = math.prod(shape)
    if not shape:  # 0-dim: exactly one chunk
        if len(chunks) != 1 and not (allow_gaps and not chunks):
            problems.append(f"{name!r}: a 0-dim tensor needs exactly 1 chunk, got {len(chunks)}")
        return problems
    nonempty = sorted((c for c in chunks if math.prod(c.sizes) > 0), key=lambda c: c.offsets)
    active: list[_Chunk] = []
    for c in nonempty:
        start = c.offsets[0]
        active = [a for a in active if a.offsets[0] + a.sizes[0] > start]
        for a in active:
            if _overlap(a, c):
                problems.append(f"{name!r}: chunks offsets={a.offsets} sizes={a.sizes} in {a.file!r} "
                                f"and offsets={c.offsets} sizes={c.sizes} in {c.file!r} overlap")
                if len(problems) >= 5:
                    return problems
        active.append(c)
    if problems or allow_gaps:
        return problems
    covered = sum(math.prod(c.sizes) for c in nonempty)
    if covered != total:
        problems.append(f"{name!r}: chunks cover {covered} of {total} elements of shape {shape}: "
                        "the checkpoint has gaps (a rank's data file or its entry is missing)")
    return problems

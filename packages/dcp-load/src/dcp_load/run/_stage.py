"""Reads that cannot land in place (a cast, or a strided torch destination) go through a
staging buffer; here that buffer is bounded and reused, so a load never holds a tensor- or
box-sized temporary: the box is cut into row-major pieces of at most ``STAGE_BYTES``, each
read into the reading thread's ``Scratch`` and copied (cast) into its destination view.

The scratch is an anonymous mapping, not a malloc'd array: freed, it goes back to the
system at once. Staging arrays of 16 MiB from malloc stayed in glibc's per-thread arenas:
converting 1 GiB of float32 into bfloat16 kept ~120 MiB of anonymous memory that way
against ~35 MiB with one mapped scratch per thread (``test_convert_memory.py``).
"""

from __future__ import annotations

import itertools
import math
import mmap
from typing import Any

__all__ = ["STAGE_BYTES", "Scratch", "read_staged", "stage_pieces"]

#: Largest piece staged at once: the extra memory of a read per reading thread.
STAGE_BYTES = 16 * 1024 * 1024


def stage_pieces(offsets: tuple[int, ...], sizes: tuple[int, ...], nbytes: int,
                 limit: int | None = None) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The box cut into row-major pieces of at most ``limit`` bytes: along the first
    dimension whose trailing block fits, each index of the dimensions before it in turn."""
    limit = STAGE_BYTES if limit is None else limit
    numel = math.prod(sizes)
    if nbytes <= limit or not sizes or not numel:
        return [(offsets, sizes)]
    item = nbytes // numel
    d, inner = 0, nbytes
    for d in range(len(sizes)):
        inner = math.prod(sizes[d + 1:]) * item
        if inner <= limit:
            break
    step = max(1, limit // inner)
    out = []
    for prefix in itertools.product(*(range(s) for s in sizes[:d])):
        head = tuple(o + i for o, i in zip(offsets[:d], prefix, strict=True))
        for start in range(0, sizes[d], step):
            n = min(step, sizes[d] - start)
            out.append(((*head, offsets[d] + start, *offsets[d + 1:]), ((1,) * d + (n,) + sizes[d + 1:])))
    return out


class Scratch:
    """One reading thread's staging buffer of ``STAGE_BYTES``, mapped on first use; call
    ``close`` when the thread is done (no tensor from ``view`` may outlive it)."""

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None
        self._buf: Any = None

    def view(self, dtype: Any, shape: tuple[int, ...]) -> Any:
        import torch

        if self._buf is None:
            self._map = mmap.mmap(-1, STAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._buf = torch.frombuffer(self._map, dtype=torch.uint8)
        n = math.prod(shape) * dtype.itemsize
        assert n <= STAGE_BYTES, (shape, dtype)
        return self._buf[:n].view(dtype).view(shape)

    def close(self) -> None:
        self._buf = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a view is still held (a traceback): the mapping goes with it
            self._map = None


def read_staged(reader: Any, item: Any, chunk: Any, dest: Any, saved_dtype: str, same_dtype: bool,
                scratch: Scratch, verify: bool) -> None:
    """Read ``item``'s box into the torch tensor ``dest`` piece by piece: a contiguous piece
    of the saved dtype straight into place, any other through ``scratch`` and a copy."""
    import torch

    saved = getattr(torch, saved_dtype)
    # pieces sized by the wider of the two dtypes: the scratch holds them in the saved one
    nbytes = math.prod(item.sizes) * max(saved.itemsize, dest.element_size())
    for offsets, sizes in stage_pieces(item.offsets, item.sizes, nbytes):
        part = dest
        for d, (o, s, o0, s0) in enumerate(zip(offsets, sizes, item.offsets, item.sizes, strict=True)):
            if s != s0:
                part = part.narrow(d, o - o0, s)
        if same_dtype and part.is_contiguous():
            reader.read_into(item.name, chunk, offsets, sizes, part, verify=verify)
            continue
        staged = scratch.view(saved, sizes)
        reader.read_into(item.name, chunk, offsets, sizes, staged, verify=verify)
        with torch.no_grad():
            part.copy_(staged)

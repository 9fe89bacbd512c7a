"""Reading a box of the tensor in a torch.save blob straight from the file, and the reader's
cache of parsed blob layouts (``_torch_save_zip`` finds where the tensor lies).

A box of a row-major tensor is read like a safetensors box: one ``preadv`` of its byte span
when that is at most 2x the box, else one read per contiguous run; a box contiguous in the
file goes straight into the caller's buffer. A tensor saved with other strides (a
transposed view) is read as the byte span its box covers and returned as a strided view.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from typing import Any

from .._dtypes import itemsize, numpy_bits_dtype
from ..storage._pread import pread_into
from ._safetensors_file import _Box, read_runs
from ._torch_save_zip import BlobTensor, CannotNarrow, parse_blob

logger = logging.getLogger(__name__)


class BlobLayouts:
    """Parsed blob layouts per (file, (offset, length)), least recently used dropped beyond
    ``capacity`` (a layout is ~200 bytes; a blob that cannot be narrowed is kept as its
    reason). Counts what reads did: ``narrowed`` boxes read from a row-major tensor,
    ``strided`` boxes read as a span of another layout, ``whole`` blobs loaded whole."""

    def __init__(self, capacity: int = 4096):
        self._layouts: OrderedDict[tuple[str, tuple[int, int]], BlobTensor | str] = OrderedDict()
        self._capacity = capacity
        self.counts = {"narrowed": 0, "strided": 0, "whole": 0}

    def clear(self) -> None:
        """Forget every parsed layout (the counts stay)."""
        self._layouts.clear()

    def get(self, fd: int, file: str, storage: tuple[int, int], *, path: str, key: str
            ) -> tuple[BlobTensor | None, int]:
        """(layout, bytes read to parse it); layout None: the blob must be loaded whole."""
        k = (file, storage)
        found = self._layouts.get(k)
        spent = 0
        if found is None:
            try:
                found, spent = parse_blob(fd, storage[0], storage[1], path=path, key=key)
            except CannotNarrow as e:
                found = str(e)
                logger.debug("%s: %r at %s is loaded whole: %s", path, key, storage, found)
            self._layouts[k] = found
            if len(self._layouts) > self._capacity:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(k)
        return (found if isinstance(found, BlobTensor) else None), spent


def _span(t: BlobTensor, slices: tuple[slice, ...], width: int) -> tuple[tuple[int, ...], int, int, bool]:
    """(box sizes, byte span [lo, hi) relative to the tensor's first element, row-major
    contiguous in the file)."""
    sizes = tuple(sl.stop - sl.start for sl in slices)
    lo = sum(sl.start * st for sl, st in zip(slices, t.stride, strict=True)) * width
    if not math.prod(sizes):
        return sizes, lo, lo, True
    hi = sum((sl.stop - 1) * st for sl, st in zip(slices, t.stride, strict=True)) * width + width
    step, contiguous = 1, True
    for size, st in zip(reversed(sizes), reversed(t.stride), strict=True):
        if size != 1 and st != step:
            contiguous = False
        step *= size
    return sizes, lo, hi, contiguous


def read_box(fd: int, blob_offset: int, t: BlobTensor, slices: tuple[slice, ...], *, path: str, key: str,
             counts: dict[str, int]) -> tuple[Any, int]:
    """(numpy array of the box holding its values, or for bfloat16/float8 their bits; the
    box's bytes) in memory of its own, possibly a strided view of a larger buffer. Like
    safetensors boxes, the box's bytes are counted, not the span read around them: the
    span's other bytes share its pages, which storage fetches once."""
    import numpy as np

    np_dtype = numpy_bits_dtype(t.dtype)
    width = itemsize(t.dtype)
    sizes, lo, hi, _ = _span(t, slices, width)
    base = blob_offset + t.start
    if hi == lo:
        return np.empty(sizes, dtype=np_dtype), 0
    if t.c_contiguous:
        counts["narrowed"] += 1
        box = _Box(t.shape, width, slices)
        if not (box.contiguous or box.hi - box.lo <= 2 * box.nbytes):
            out = np.empty(box.nbytes, dtype=np.uint8)  # sparse: a few columns of many rows
            read_runs(fd, out, base, box, path=path, key=key)
            return out.view(np_dtype).reshape(sizes), box.nbytes
        strides = box.strides
    else:
        counts["strided"] += 1
        strides = tuple(st * width for st in t.stride)
    buf = np.empty(hi - lo, dtype=np.uint8)
    pread_into(fd, buf, base + lo, path=path, key=key)
    # dims of size 1 get row-major strides: a (1, 1) box of a transposed tensor then views
    # as contiguous (torch's .view(dtype) refuses a last stride other than 1)
    row_major = [width] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        row_major[d] = row_major[d + 1] * sizes[d + 1]
    strides = tuple(rm if n == 1 else st for n, st, rm in zip(sizes, strides, row_major, strict=True))
    return np.ndarray(sizes, dtype=np_dtype, buffer=buf, offset=0, strides=strides), math.prod(sizes) * width


def read_box_into(fd: int, blob_offset: int, t: BlobTensor, slices: tuple[slice, ...], out: Any, *,
                  path: str, key: str, counts: dict[str, int]) -> int | None:
    """Read a box of a row-major tensor straight into ``out`` (a writable uint8 buffer of its
    size): one read when it is contiguous in the file, else scattering reads of its runs
    (``_scatter``: a dim-1 half goes into place without a span-sized buffer); the bytes
    read, or None (nothing read) for a tensor saved in another layout."""
    width = itemsize(t.dtype)
    _, lo, hi, contiguous = _span(t, slices, width)
    if not contiguous:
        if not t.c_contiguous:
            return None
        box = _Box(t.shape, width, slices)
        if box.nbytes:
            counts["narrowed"] += 1
            read_runs(fd, out, blob_offset + t.start, box, path=path, key=key)
        return box.nbytes
    if hi > lo:
        counts["narrowed"] += 1
        pread_into(fd, out, blob_offset + t.start + lo, path=path, key=key)
    return hi - lo

"""Copying the short runs of a strided box out of a memory map of the file's byte range.

``preadv`` over runs and the gaps between them (``_scatter``) pays for every iovec and
copies the gaps too; a memory map of the range the runs span copies only the runs, with one
strided NumPy copy, straight from the page cache into the caller's buffer. Measured on the
2-core development machine (warm page cache, a 64 MiB file, the other core busy), median
of 7: 200,000 runs of 64 B one 128 B stride apart took 2.5 ms mapped against 25 ms
scattered; 43,690 runs of 768 B (a dim-1 half) 4.6 ms against 18.6 ms; 8,192 runs of
4 KiB took the same both ways; a call of 2 to 32 short runs ~19 us against ~27 us.

A memory map of a file shorter than the range kills the process with SIGBUS when a page
past the end is touched, so the file's size is checked just before the range is mapped,
and a file already too short raises TruncatedFileError naming it. A file truncated by
another process during the copy itself is not caught: checkpoints are not rewritten in
place while they are loaded.

Off unless ``DCP_MAPPED_READS=1``: a map's page faults fetch every page of the range (and
the kernel reads around them), which a plan that counts bytes does not see: on a cold
cache, ranks of a row-parallel pair each fetched the pages their halves share, 3.5 x the
unique bytes where the scattered reads of those halves' owners fetch them once.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

from .._errors import TruncatedFileError

#: Runs longer than this are read with ``preadv``: from 4 KiB on a call's cost is small
#: beside the run's bytes (8,192 runs of 4 KiB: 21.9 ms scattered, 21.9 ms mapped), and one
#: large read lets cold storage fetch in large requests, where page faults would not.
MAPPED_RUN_MAX = 16 * 1024


def map_runs(fd: int | Any, out: Any, base: int, lo: int, hi: int, sizes: tuple[int, ...],
             strides: tuple[int, ...], *, path: str, key: str | None) -> bool:
    """Fill ``out`` (a writable contiguous buffer of ``prod(sizes)`` bytes) with the box
    whose uint8 view starts at file offset ``base + lo`` with ``sizes`` and byte
    ``strides`` (its last dim a run: stride 1), ending before ``base + hi``. False, with
    nothing read, when the box is not read this way: not a descriptor (an object), runs
    longer than ``MAPPED_RUN_MAX``, or a file that cannot be mapped (a pipe, no mmap).
    TruncatedFileError naming ``path`` and ``key`` when the file ends before ``base + hi``.
    Only with ``DCP_MAPPED_READS=1`` (module docstring)."""
    if os.environ.get("DCP_MAPPED_READS") != "1":
        return False
    if not isinstance(fd, int) or not sizes or sizes[-1] > MAPPED_RUN_MAX or strides[-1] != 1 or hi <= lo:
        return False
    try:
        import numpy as np

        size = os.fstat(fd).st_size
    except (ImportError, OSError):
        return False
    if size < base + hi:
        raise TruncatedFileError(
            f"the file has {size} bytes but bytes [{base + lo}, {base + hi}) of {key!r} are wanted; it is "
            "truncated (or was truncated during the load): re-copy or re-save it", path=path, key=key)
    start = (base + lo) // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
    try:
        m = mmap.mmap(fd, base + hi - start, prot=mmap.PROT_READ, offset=start)
    except (OSError, ValueError, AttributeError):
        return False
    dst = np.frombuffer(out, dtype=np.uint8)
    width = _width(sizes[-1], strides[:-1], base + lo - start, dst.ctypes.data)
    shape = (*sizes[:-1], sizes[-1] // width)
    src = None
    try:
        src = np.ndarray(shape, dtype=f"u{width}", buffer=m, offset=base + lo - start,
                         strides=(*strides[:-1], width))
        np.copyto(dst.view(f"u{width}").reshape(shape), src)
    finally:
        del src  # the map cannot close while a view of it lives
        m.close()
    return True


def _width(run: int, strides: tuple[int, ...], offset: int, address: int) -> int:
    """The widest item (8, 4, 2 or 1 bytes) dividing the run, the strides and both ends'
    alignment: NumPy copies runs of one wide item as one strided loop, where runs of 2 bytes
    as uint8 pairs went one Python-free but per-run inner loop (4x slower)."""
    for width in (8, 4, 2):
        if not (run % width or offset % width or address % width or any(st % width for st in strides)):
            return width
    return 1

"""Copying the short runs of a strided box out of a memory map of the file's byte range.

``preadv`` over runs and the gaps between them (``_scatter``) pays for every iovec and
copies the gaps too; a memory map of the range the runs span copies only the runs, with one
strided NumPy copy, straight from the page cache into the caller's buffer. Measured on the
2-core development machine (warm page cache, a 64 MiB file, the other core busy), median
of 7: 200,000 runs of 64 B one 128 B stride apart took 2.5 ms mapped against 25 ms
scattered; 43,690 runs of 768 B (a dim-1 half) 4.6 ms against 18.6 ms; 8,192 runs of
4 KiB took the same both ways; a call of 2 to 32 short runs ~19 us against ~27 us (~27 us
since the map is ``MADV_RANDOM`` and its range asked for: 1.4 x, below).

Only the pages the runs lie on are fetched, as ``preadv`` of the runs would: a page fault
on a map reads the kernel's read-ahead window around it (8 MiB on the development
machine's disk: a cold 4 MiB range fetched 16 MiB, and read-once plans, which count bytes,
fetched 3.5 x the unique bytes), so the map is ``MADV_RANDOM`` (a fault reads its page
only) and, where the runs leave no page between them untouched, the range's missing pages
are asked for up front with ``POSIX_FADV_WILLNEED`` of exactly the range
(``_page_cache``), so a cold range is still read in large requests. Fault-around maps
only pages already cached: it fetches nothing.

A memory map of a file shorter than the range kills the process with SIGBUS when a page
past the end is touched. The file's size is checked just before each slab of the range
(``SLAB``) is copied, so a file found too short raises TruncatedFileError naming it and
the key, and maps live for one box's copy only. What remains: a file truncated by another
process during the copy of one slab still ends the process with SIGBUS (checkpoints are not
rewritten in place while they are loaded); ``DCP_MAPPED_READS=0`` reads with ``preadv``
only, for storage where they may be.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

from .._errors import TruncatedFileError
from ._page_cache import WILLNEED_STEP, resident, willneed

__all__ = ["MAPPED_RUN_MAX", "SLAB", "map_runs", "mapped_reads"]

#: Runs longer than this are read with ``preadv``: from 4 KiB on a call's cost is small
#: beside the run's bytes (8,192 runs of 4 KiB: 21.9 ms scattered, 21.9 ms mapped), and one
#: large read lets cold storage fetch in large requests, where page faults would not.
MAPPED_RUN_MAX = 16 * 1024

#: Bytes of the range copied between two checks of the file's size and of whether its next
#: pages are cached: a check costs ~7 us of CPU (fstat 1.3 us, two ``mincore`` calls through
#: ctypes 5.5 us, 2-core machine under load), ~70 us for a 74 MiB range, under 1 % of its
#: 9 ms copy; while one slab is copied the next one's missing pages are being fetched.
SLAB = 8 * 1024 * 1024

_PAGE = mmap.PAGESIZE


def mapped_reads() -> bool:
    """Whether short runs are copied out of memory maps: yes unless ``DCP_MAPPED_READS=0``."""
    return os.environ.get("DCP_MAPPED_READS") != "0"


def map_runs(fd: int | Any, out: Any, base: int, lo: int, hi: int, sizes: tuple[int, ...],
             strides: tuple[int, ...], *, path: str, key: str | None) -> bool:
    """Fill ``out`` (a writable contiguous buffer of ``prod(sizes)`` bytes) with the box
    whose uint8 view starts at file offset ``base + lo`` with ``sizes`` and byte
    ``strides`` (its last dim a run: stride 1), ending before ``base + hi``. False, with
    nothing read, when the box is not read this way: ``DCP_MAPPED_READS=0``, not a
    descriptor (an object), a single run, runs longer than ``MAPPED_RUN_MAX``, or a file
    that cannot be mapped (a pipe, no mmap). TruncatedFileError naming ``path`` and ``key``
    when the file ends before ``base + hi``."""
    if not mapped_reads():
        return False
    if not isinstance(fd, int) or len(sizes) < 2 or sizes[-1] > MAPPED_RUN_MAX or strides[-1] != 1 or hi <= lo:
        return False
    try:
        import numpy as np  # noqa: F401 (numpy is optional for dcp-reader)

        _check_size(fd, base + hi, base + lo, path=path, key=key)
    except (ImportError, OSError):
        return False
    start = (base + lo) // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
    try:
        m = mmap.mmap(fd, base + hi - start, prot=mmap.PROT_READ, offset=start)
    except (OSError, ValueError, AttributeError):
        return False
    try:
        _copy(m, fd, out, start, base + lo - start, sizes, strides, path=path, key=key)
    finally:
        m.close()
    return True


def _check_size(fd: int, end: int, first: int, *, path: str, key: str | None) -> None:
    size = os.fstat(fd).st_size
    if size < end:
        raise TruncatedFileError(
            f"the file has {size} bytes but bytes [{first}, {end}) of {key!r} are wanted; it is "
            "truncated (or was truncated during the load): re-copy or re-save it", path=path, key=key)


def _copy(m: mmap.mmap, fd: int, out: Any, start: int, offset: int, sizes: tuple[int, ...],
          strides: tuple[int, ...], *, path: str, key: str | None) -> None:
    """Copy the box at ``offset`` of map ``m`` (file offset ``start``) into ``out``, slab by
    slab: each one's size checked, the next one's missing pages asked for first."""
    import numpy as np

    try:
        m.madvise(mmap.MADV_RANDOM)
    except (AttributeError, OSError):
        pass  # no madvise (not Linux): faults read around there, as they always did
    dst = np.frombuffer(out, dtype=np.uint8)
    width = _width(sizes[-1], strides[:-1], offset, dst.__array_interface__["data"][0])
    shape = (*sizes[:-1], sizes[-1] // width)
    src = np.ndarray(shape, dtype=f"u{width}", buffer=m, offset=offset, strides=(*strides[:-1], width))
    dst = dst.view(f"u{width}").reshape(shape)
    try:
        # sparse runs: the faults fetch their own pages, where a request for the range would
        # fetch the pages between them too
        dense = _dense(sizes, strides)
        address = src.__array_interface__["data"][0] - offset
        end = offset + _extent(sizes, strides)
        if end - offset <= SLAB:  # one slab, whose size was checked before the map was made
            if dense:
                _ask(fd, start, address, offset, end)
            np.copyto(dst, src)
            return
        slabs = _slabs(sizes, strides, offset)
        for n, (i, j, _, b) in enumerate(slabs):
            if dense:  # this slab's pages, if not yet asked for, and the next one's
                for k in (n, n + 1) if n == 0 else (n + 1,):
                    if k < len(slabs):
                        _ask(fd, start, address, slabs[k][2], slabs[k][3])
            if n:  # the first slab's end was checked before the map was made
                _check_size(fd, start + b, start + offset, path=path, key=key)
            np.copyto(dst[i:j], src[i:j])
    finally:
        del src  # the map cannot close while a view of it lives


def _ask(fd: int, start: int, address: int, a: int, b: int) -> None:
    """Ask for the pages of map bytes [a, b): at once when they fit one request (a
    ``mincore`` check costs about as much), else when ``mincore`` finds the first or last
    one missing."""
    if b - a <= WILLNEED_STEP or not resident(address, (a, b - 1)):
        willneed(fd, start + a, start + b)


def _extent(sizes: tuple[int, ...], strides: tuple[int, ...]) -> int:
    return sum((s - 1) * st for s, st in zip(sizes, strides, strict=True)) + 1


def _slabs(sizes: tuple[int, ...], strides: tuple[int, ...], offset: int) -> list[tuple[int, int, int, int]]:
    """The box cut along its first dim into pieces of about ``SLAB`` bytes of range: (first
    index, end index, first byte, end byte), bytes relative to the map."""
    rest = _extent(sizes[1:], strides[1:])
    step = max(1, SLAB // max(strides[0], 1))
    out = []
    for i in range(0, sizes[0], step):
        j = min(i + step, sizes[0])
        out.append((i, j, offset + i * strides[0], offset + (j - 1) * strides[0] + rest))
    return out


def _dense(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether the runs touch every page of their range: no gap between two consecutive
    runs holds a whole page (each gap shorter than a page)."""
    extent = 1
    for size, stride in zip(reversed(sizes), reversed(strides), strict=True):
        if size > 1 and stride - extent >= _PAGE:
            return False
        extent += (size - 1) * stride
    return True


def _width(run: int, strides: tuple[int, ...], offset: int, address: int) -> int:
    """The widest item (8, 4, 2 or 1 bytes) dividing the run, the strides and both ends'
    alignment: NumPy copies runs of one wide item as one strided loop, where runs of 2 bytes
    as uint8 pairs went one Python-free but per-run inner loop (4x slower)."""
    for width in (8, 4, 2):
        if not (run % width or offset % width or address % width or any(st % width for st in strides)):
            return width
    return 1

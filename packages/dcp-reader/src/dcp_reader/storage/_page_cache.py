"""Which pages of a mapped range the page cache holds (``mincore``), and asking the kernel
to fetch exactly a file range ahead of the page faults that will need it.

A memory map whose faults may not read around them (``MADV_RANDOM``, storage/_mapped.py)
reads a cold range one 4 KiB page per fault: a 4 MiB range took 157 ms here against 5 ms
when the range was first asked for with ``POSIX_FADV_WILLNEED``, which reads just that
range, in large requests, without waiting. On a warm cache that request still walks every
page of the range (~15 us per MiB: 1 ms of a 9 ms copy of a 74 MiB range), so it is made
only where ``mincore`` finds a sampled page missing.
"""

from __future__ import annotations

import ctypes
import mmap
import os

__all__ = ["WILLNEED_STEP", "resident", "willneed"]

#: Bytes asked for per ``POSIX_FADV_WILLNEED`` call: the kernel reads at most its read-ahead
#: window (or the device's largest request) per call and drops the rest of a longer one, and
#: 128 KiB is Linux's default window, so no page of the range is left to single-page faults
#: on any device. Measured on the 2-core development machine (virtio disk, read_ahead_kb
#: 8192), a cold 74 MiB range of 768 B runs: 79-127 ms in 128 KiB calls, 50-68 ms in 8 MiB
#: ones, 2.1 s by faults alone; ``map_runs`` with them 90-113 ms where scattered ``preadv``
#: took 90-153 ms (and fetched 88 MiB: its read-ahead runs past the range).
WILLNEED_STEP = 128 * 1024

_PAGE = mmap.PAGESIZE


def _load_mincore():
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_MINCORE = _load_mincore()


def resident(address: int, offsets: tuple[int, ...]) -> bool:
    """Whether the pages holding bytes ``offsets`` of the mapping at ``address`` (page
    aligned) are all in the page cache. False when it cannot be told (no ``mincore``)."""
    if _MINCORE is None:
        return False
    vec = ctypes.c_ubyte(0)
    for off in offsets:
        if _MINCORE(address + off // _PAGE * _PAGE, _PAGE, ctypes.byref(vec)) != 0 or not vec.value & 1:
            return False
    return True


def willneed(fd: int, lo: int, hi: int) -> None:
    """Start fetching file bytes [lo, hi) into the page cache, and nothing outside them (a
    no-op where ``posix_fadvise`` is missing)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    for at in range(lo, hi, WILLNEED_STEP):
        try:
            advise(fd, at, min(WILLNEED_STEP, hi - at), os.POSIX_FADV_WILLNEED)
        except OSError:
            return

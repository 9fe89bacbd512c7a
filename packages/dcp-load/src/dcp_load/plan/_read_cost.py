"""How one rank reads a box of a saved chunk: its exact runs, or covering ranges.

A box of a row-major chunk lies in the file as ``runs`` contiguous runs of ``run_bytes``
(one per index of its leading dims): a row-parallel half of a weight is one run per row,
a conv kernel sharded on its last dimension one run of an element or two per kernel row.
Reading them exactly costs a request per run (about 1.6-1.9 us each here, whatever their
length below a few KiB); reading the byte range that covers them into a staging buffer and
copying the box out with one strided copy costs the extra bytes at memory speed. Which
wins depends on the storage: on page cache and local disks a covering read wins for short
runs; on object storage every extra byte is paid for, so covering ranges are bounded by
``max_overread`` (1.05 x the wanted bytes there).

``choose`` prices each way with the storage's ``ReadCost`` and picks the cheapest: exact
runs (today's scattered ``preadv``), or covering ranges at a ``level``: the dims before it
are taken one index at a time and each range covers the box's extent in the dims from it
on (level 0: one range over the whole box, cut only where the staging buffer ends). Only
the bytes inside one rank's box are ever over-read: which rank reads which box is decided
before (read once, byte-range ownership) and does not change.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from dcp_reader.storage._mapped import MAPPED_RUN_MAX, mapped_reads
from dcp_reader.storage._scatter import MAX_GAP

__all__ = ["LOCAL_COST", "MAPPED_COST", "OBJECT_COST", "BoxGeometry", "ReadChoice", "ReadCost", "choose", "cover_pieces",
           "read_cost_of"]


@dataclass(frozen=True)
class ReadCost:
    """What reading costs on one storage: seconds per read call and per scattered run,
    bytes per second fetched, and the strided copy out of a staging buffer; covering
    ranges may fetch at most ``max_overread`` x the box's bytes."""

    request_s: float
    run_s: float
    bytes_per_s: float
    copy_call_s: float
    copy_run_s: float
    copy_bytes_per_s: float
    max_overread: float
    #: seconds per run when the runs are the rows of a 2-D box (one stride: read natively)
    row_run_s: float | None = None
    #: seconds per read of runs copied out of a memory map of their range (local files,
    #: runs up to dcp-reader's ``MAPPED_RUN_MAX``; None: the storage is not mapped), and the
    #: bytes per second of the range's pages mapped (the runs' own bytes cost ``copy_*``)
    map_s: float | None = None
    map_bytes_per_s: float = 75e9


#: A directory (page cache or local disk). Measured on the 2-core development machine,
#: torch 2.13 CPU, warm page cache, best of 7: ``os.preadv`` of 16 MiB into a reused
#: buffer 10.8 GB/s; a 4 KiB ``preadv`` call 1.65 us; ``_scatter.pread_runs`` 1.6 us per run
#: for runs of 4 B, 1.9 us at 128 B, 1.5 us at 1 KiB, 1.35 us at 8 KiB (so a run costs a
#: call's worth, not its bytes); a strided bf16 ``copy_`` of a (R, c) half of a (R, 2c)
#: buffer, 4 MiB box: 2.8 GB/s at 4-byte runs, 9 GB/s at 128 B, 36 GB/s at 1 KiB (fitted:
#: 1.2 ns per run + 9 GB/s); a tiny ``copy_`` of a fresh view 7 us. ``max_overread`` 8: the
#: ranks of a TP group on one host share the page cache, so a covering range fetches each
#: page once per host; 8 lets a TP8 row-parallel half and a conv kernel's 1-of-3 column
#: cover, while a 1-of-64 column never does.
#: ``row_run_s``: runs one stride apart are read by ``preadv`` on iovecs built outside Python
#: (dcp-reader ``storage/_scatter.py``): 65,536 runs of 64 B took 4.3 ms, 0.84 ms of it the
#: bytes, so about 0.05 us a run (the other core busy).
#: ``map_s``, ``map_bytes_per_s``: short runs are copied out of a memory map (dcp-reader
#: ``storage/_mapped.py``): a call of 2 to 32 short runs took ~19 us, ~1.4 x that since the
#: map is ``MADV_RANDOM`` and its range asked for with ``WILLNEED`` (32 runs of 64 B: 43-45 us
#: of CPU against 28-32 us before, alternating, on the 2-core machine under load); mapping a 64 MiB
#: range and touching a byte of each page 0.85 ms (~75 GB/s); a dim-1 half of a (50304,
#: 768) bf16 embedding 12.5 ms through ``dcp_load.load`` against 16.7 ms scattered.
LOCAL_COST = ReadCost(request_s=1.7e-6, run_s=1.7e-6, bytes_per_s=10e9, copy_call_s=7e-6, copy_run_s=1.2e-9,
                      copy_bytes_per_s=9e9, max_overread=8.0, row_run_s=0.05e-6)

#: ``LOCAL_COST`` with short runs copied out of a memory map: the default for local files
#: (``LOCAL_COST`` with ``DCP_MAPPED_READS=0``). The map fetches the pages the runs lie on,
#: as their ``preadv`` would (it is ``MADV_RANDOM``: no read-ahead around its faults), so
#: ``fetched`` is the box's bytes either way (tests-integration/load/test_integ_read_once.py
#: holds a cold load to 1.02 x the unique bytes). On a warm page cache it is the fastest path
#: for short runs (benchmarks/results/tp.md).
MAPPED_COST = dataclasses.replace(LOCAL_COST, map_s=27e-6, map_bytes_per_s=75e9)

#: An object store: a GET's 20-50 ms of latency (dcp-reader README, "Object storage") and
#: ~100 MB/s per stream; extra bytes are fetched over the network and billed, so covering
#: ranges stay within 1.05 x the wanted bytes.
OBJECT_COST = ReadCost(request_s=0.03, run_s=0.0, bytes_per_s=100e6, copy_call_s=7e-6, copy_run_s=1.2e-9,
                       copy_bytes_per_s=9e9, max_overread=1.05)


def read_cost_of(reader: object) -> ReadCost:
    """The ``ReadCost`` of ``reader``'s storage: its own ``read_cost`` when it declares one,
    else ``MAPPED_COST`` for a local one (``LOCAL_COST`` with ``DCP_MAPPED_READS=0``, when
    dcp-reader maps nothing) and ``OBJECT_COST`` for any other."""
    storage = getattr(reader, "storage", None)
    declared = getattr(storage, "read_cost", None)
    if isinstance(declared, ReadCost):
        return declared
    if not getattr(storage, "local", True):
        return OBJECT_COST
    return MAPPED_COST if mapped_reads() else LOCAL_COST


@dataclass(frozen=True)
class BoxGeometry:
    """Where a box (``offsets``/``sizes`` relative to the chunk) of a row-major chunk of
    shape ``chunk`` and ``itemsize``-byte items lies in the chunk's bytes."""

    chunk: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    itemsize: int

    @property
    def strides(self) -> tuple[int, ...]:
        out, step = [], self.itemsize
        for size in reversed(self.chunk):
            out.append(step)
            step *= size
        return tuple(reversed(out))

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.itemsize

    @property
    def outer(self) -> int:
        """How many leading dims enumerate the runs (the dims before the first one that,
        with every dim after it whole, makes one contiguous run)."""
        k = len(self.chunk)
        while k > 0 and self.sizes[k - 1] == self.chunk[k - 1]:
            k -= 1
        k = max(0, k - 1)
        while k > 0 and self.sizes[k - 1] == 1:  # dims of one index add no runs
            k -= 1
        return k

    @property
    def runs(self) -> int:
        return math.prod(self.sizes[:self.outer])

    def span(self, level: int) -> int:
        """Bytes of one range covering the box's extent in the dims from ``level`` on."""
        if not self.nbytes:
            return 0
        return sum((s - 1) * st for s, st in zip(self.sizes[level:], self.strides[level:], strict=True)) + \
            self.itemsize


@dataclass(frozen=True)
class ReadChoice:
    """``covering``: read ranges at ``level`` into staging (else the exact runs); the
    bytes fetched, the read calls and the model's seconds."""

    covering: bool
    level: int
    fetched: int
    calls: int
    seconds: float


def _exact(g: BoxGeometry, cost: ReadCost) -> ReadChoice:
    runs = g.runs
    if cost.map_s is not None and runs > 1 and g.span(g.outer) <= MAPPED_RUN_MAX:
        # dcp-reader copies short runs out of a memory map of the box's range: one call
        seconds = (cost.map_s + g.span(0) / cost.map_bytes_per_s + runs * cost.copy_run_s
                   + g.nbytes / cost.copy_bytes_per_s)
        return ReadChoice(False, g.outer, g.nbytes, 1, seconds)
    calls = max(1, -(-runs // 512)) if runs > 1 else 1  # preadv takes up to 1024 iovecs: a run and a gap each
    # dcp-reader scatters rows natively while the gap between them is within its MAX_GAP
    native = cost.row_run_s is not None and g.outer == 1 and g.strides[0] - g.span(1) <= MAX_GAP
    per_run = cost.row_run_s if native else cost.run_s
    seconds = calls * cost.request_s + (runs if runs > 1 else 0) * per_run + g.nbytes / cost.bytes_per_s
    return ReadChoice(False, g.outer, g.nbytes, calls if runs > 1 else 1, seconds)


def _covering(g: BoxGeometry, cost: ReadCost, level: int, limit: int) -> ReadChoice | None:
    segments = math.prod(g.sizes[:level])
    span = g.span(level)
    if g.span(g.outer) > limit:
        return None  # a single run does not fit the staging buffer: it is read in place
    fetched = segments * span
    calls = segments * max(1, -(-span // limit))
    seconds = (calls * (cost.request_s + cost.copy_call_s) + fetched / cost.bytes_per_s
               + g.runs * cost.copy_run_s + g.nbytes / cost.copy_bytes_per_s)
    return ReadChoice(True, level, fetched, calls, seconds)


def choose(g: BoxGeometry, cost: ReadCost, limit: int) -> ReadChoice:
    """The cheapest way to read box ``g`` under ``cost`` with staging buffers of ``limit``
    bytes: exact runs, or covering ranges at the level whose price is lowest among those
    fetching at most ``cost.max_overread`` x the box. A contiguous box is always exact."""
    best = _exact(g, cost)
    if g.runs <= 1:
        return best
    for level in range(g.outer):
        c = _covering(g, cost, level, limit)
        if c is not None and c.fetched <= cost.max_overread * g.nbytes and c.seconds < best.seconds:
            best = c
    return best


def cover_pieces(g: BoxGeometry, level: int, limit: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The covering ranges of ``choose``'s ``level`` as sub-boxes (chunk-relative offsets,
    sizes): each index of the dims before the first dim ``d >= level`` whose single index
    spans at most ``limit`` bytes, and along ``d`` as many indices as fit in ``limit``."""
    strides = g.strides
    d = level
    while d < len(g.sizes) and g.span(d + 1) > limit:
        d += 1
    if d >= len(g.sizes):
        return [(g.offsets, g.sizes)]
    step = max(1, min(g.sizes[d], 1 + (limit - g.span(d + 1)) // strides[d]))
    out = []
    for prefix in itertools.product(*(range(s) for s in g.sizes[:d])):
        head = tuple(o + i for o, i in zip(g.offsets[:d], prefix, strict=True))
        for start in range(0, g.sizes[d], step):
            n = min(step, g.sizes[d] - start)
            out.append(((*head, g.offsets[d] + start, *g.offsets[d + 1:]), ((1,) * d + (n,) + g.sizes[d + 1:])))
    return out

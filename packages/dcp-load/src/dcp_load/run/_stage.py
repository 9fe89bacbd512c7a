"""Reads that cannot land in place (a cast, or a strided torch destination) go through a
staging buffer; here that buffer is bounded and reused, so a load never holds a tensor- or
box-sized temporary: the box is cut into row-major pieces of at most ``STAGE_BYTES``, each
read into a buffer of the load's ``StagingPool`` and copied (cast) into its destination view.

The buffers are anonymous mappings, not malloc'd arrays: freed, they go back to the
system at once. Staging arrays of 16 MiB from malloc stayed in glibc's per-thread arenas:
converting 1 GiB of float32 into bfloat16 kept ~120 MiB of anonymous memory that way
against ~35 MiB with one mapped scratch per thread (``test_convert_memory.py``).

Covering reads (``read_covering``, chosen per box by ``plan._read_cost.choose``) use the same
staging: the byte range covering a box lands in a buffer of the load's ``StagingPool`` and
the box is copied out of it with one strided ``copy_`` of a view (cast included), so a
row-parallel half costs a few large reads instead of one request per row. The pool is the
one seam for staging memory: a bounded set of reused buffers handed out by size, allocated
by a function a backend may replace (pinned host memory for an accelerator).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..plan._read_cost import BoxGeometry, ReadChoice, cover_pieces

__all__ = ["STAGE_BYTES", "StagingPool", "can_cover", "covering_geometry", "narrowed", "read_covering", "read_staged",
           "saved_box", "stage_pieces"]

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


#: Staging mappings ask for transparent huge pages (where the kernel offers them: Linux with
#: THP "madvise" or "always"). Each load maps its buffers afresh, and with 4 KiB pages the
#: first read into a buffer pays a fault per page: one ``preadv`` of 8 MiB from the page
#: cache into a fresh 16 MiB mapping took 4.8-5.5 ms with 4 KiB pages and 0.5-0.6 ms with
#: ``MADV_HUGEPAGE`` (this machine, THP "madvise", median of 30, the other core busy).
_HUGE = getattr(mmap, "MADV_HUGEPAGE", None)


def _mapped(nbytes: int) -> tuple[Any, Callable[[], None]]:
    """A CPU uint8 tensor over a fresh anonymous mapping, and the call that unmaps it."""
    import torch

    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _HUGE is not None:
        with contextlib.suppress(OSError):  # THP off ("never") or not built in: 4 KiB pages
            region.madvise(_HUGE)

    def release() -> None:
        try:
            region.close()
        except BufferError:
            pass  # a view is still held (a traceback): the mapping goes with it

    return torch.frombuffer(region, dtype=torch.uint8), release


class StagingPool:
    """At most ``buffers`` reused staging buffers of ``buffer_bytes``, handed out by size
    (``take``) to the reading threads of a load and kept until ``close``.

    ``allocate(nbytes) -> (uint8 tensor, release)`` makes one buffer: by default an
    anonymous mapping (returned to the system at ``close``); an accelerator backend gives
    pinned host memory instead. A request above ``buffer_bytes`` gets a buffer of its own,
    released when handed back (checksum blocks can widen a range past the buffer). While
    every buffer is out, ``take`` waits for one: memory stays bounded by
    ``buffers x buffer_bytes`` whatever the number of threads."""

    def __init__(self, buffers: int = 4, buffer_bytes: int | None = None,
                 allocate: Callable[[int], tuple[Any, Callable[[], None]]] | None = None):
        if buffers < 1:
            raise ValueError(f"buffers must be >= 1, got {buffers}")
        self.buffers, self.buffer_bytes = buffers, STAGE_BYTES if buffer_bytes is None else buffer_bytes
        self._allocate = allocate or _mapped
        self._free: list[tuple[Any, Callable[[], None]]] = []
        self._made = 0
        self._ready = threading.Condition()

    @contextmanager
    def take(self, nbytes: int) -> Iterator[Any]:
        """A uint8 tensor of ``nbytes`` (the front of a pooled buffer) for the ``with`` block."""
        if nbytes > self.buffer_bytes:
            buf, release = self._allocate(nbytes)
            try:
                yield buf[:nbytes]
            finally:
                del buf
                release()
            return
        entry = self._get()
        try:
            yield entry[0][:nbytes]
        finally:
            with self._ready:
                self._free.append(entry)
                self._ready.notify()

    def _get(self) -> tuple[Any, Callable[[], None]]:
        with self._ready:
            while not self._free and self._made >= self.buffers:
                self._ready.wait()
            if self._free:
                return self._free.pop()
            self._made += 1
        return self._allocate(self.buffer_bytes)

    def close(self) -> None:
        """Release every buffer handed back (none may be in use)."""
        with self._ready:
            free, self._free, self._made = self._free, [], 0
        for _, release in free:
            release()


def read_staged(reader: Any, item: Any, chunk: Any, dest: Any, saved_dtype: str, same_dtype: bool,
                pool: StagingPool, verify: bool) -> None:
    """Read ``item``'s box into the torch tensor ``dest`` piece by piece: a contiguous piece
    of the saved dtype straight into place, any other through a buffer of ``pool`` and a
    copy."""
    import torch

    saved = getattr(torch, saved_dtype)
    # pieces sized by the wider of the two dtypes: the buffer holds them in the saved one
    nbytes = math.prod(item.sizes) * max(saved.itemsize, dest.element_size())
    for offsets, sizes in stage_pieces(item.offsets, item.sizes, nbytes, pool.buffer_bytes):
        part = narrowed(dest, item.offsets, offsets, sizes)
        if same_dtype and part.is_contiguous():
            reader.read_into(item.name, chunk, offsets, sizes, part, verify=verify)
            continue
        with pool.take(math.prod(sizes) * saved.itemsize) as raw:
            staged = raw.view(saved).view(sizes)
            reader.read_into(item.name, chunk, offsets, sizes, staged, verify=verify)
            with torch.no_grad():
                part.copy_(staged)


def narrowed(dest: Any, origin: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
    """The part of ``dest`` (the box at ``origin``) holding the sub-box ``offsets``/``sizes``."""
    part = dest
    for d, (o, s, o0) in enumerate(zip(offsets, sizes, origin, strict=True)):
        if s != part.shape[d]:
            part = part.narrow(d, o - o0, s)
    return part


def saved_box(reader: Any, name: str, chunk: Any, offsets: tuple[int, ...], sizes: tuple[int, ...], dest: Any
              ) -> tuple[Any, str, Any, tuple[int, ...], tuple[int, ...], Any]:
    """(reader, name, chunk, offsets, sizes, dest) of the saved bytes behind a box read
    through a ``SourcedReader`` (``sources=``): for a part of a composed tensor the saved
    tensor's own, and ``dest`` without the dims ``Stack`` added; for any other chunk the
    reader it wraps. Other readers: the arguments as given."""
    from ..layouts._sourced_reader import SourcedReader, VirtualChunk

    if not isinstance(reader, SourcedReader):
        return reader, name, chunk, offsets, sizes, dest
    if not isinstance(chunk, VirtualChunk):
        return reader.inner, name, chunk, offsets, sizes, dest
    real_offsets, real_sizes = chunk.real_box(offsets, sizes)
    if chunk.added:
        dest = dest.squeeze(chunk.added)
    return reader.inner, chunk.source, chunk.real, real_offsets, real_sizes, dest


def can_cover(reader: Any) -> bool:
    """Whether ``reader`` reads covering ranges itself: a method of its class, not one a
    wrapper forwards from the reader inside it (the wrapper's own reads would be bypassed)."""
    return callable(getattr(type(reader), "read_covering", None))


def covering_geometry(chunk: Any, offsets: tuple[int, ...], sizes: tuple[int, ...], itemsize: int) -> BoxGeometry:
    """Where the box lies in its saved chunk's bytes, for ``plan._read_cost.choose``."""
    rel = tuple(o - c for o, c in zip(offsets, chunk.offsets, strict=True))
    return BoxGeometry(tuple(chunk.sizes), rel, tuple(sizes), itemsize)


def read_covering(reader: Any, name: str, chunk: Any, offsets: tuple[int, ...], sizes: tuple[int, ...], dest: Any,
                  choice: ReadChoice, itemsize: int, pool: StagingPool, verify: bool) -> bool:
    """Read the box into the torch tensor ``dest`` (arguments as ``saved_box`` gives them)
    as ``choice`` says: the range covering each piece of ``cover_pieces`` lands in a buffer
    of ``pool`` and the piece is copied out of it with one strided ``copy_`` (cast when
    ``dest`` has another dtype). False, with nothing read, when the reader cannot read the
    box that way (a torch-dcp blob loaded whole)."""
    import torch

    g = covering_geometry(chunk, offsets, sizes, itemsize)
    for n, (sub, sub_sizes) in enumerate(cover_pieces(g, choice.level, pool.buffer_bytes)):
        at = tuple(o + c for o, c in zip(sub, chunk.offsets, strict=True))
        need = reader.covering_bytes(name, chunk, at, sub_sizes, verify=verify)
        if need is None:
            assert n == 0, "a chunk is covered whole or not at all"
            return False
        with pool.take(need) as raw:
            box = reader.read_covering(name, chunk, at, sub_sizes, raw, verify=verify)
            with torch.no_grad():
                narrowed(dest, offsets, at, sub_sizes).copy_(box)
    return True

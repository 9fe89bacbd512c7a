"""Changed elements of one piece, as their positions and values (``delta=True``).

A piece whose values changed in a few places travels as one ``uint8`` buffer: the changed
elements' positions, then their values, packed, in the dtype that travels
(``TransferPiece.wire``). The positions are, whichever is smaller: the elements' indices in
row-major order (``int32``, ``int64`` for a piece of 2**31 elements or more), or a bitmask
of all the piece's elements (bit ``i % 8`` of byte ``i // 8``: element ``i`` changed); either
padded to a multiple of 8 bytes so that the values after it are aligned. Indices are the
smaller below 1 change in 32 elements (at 2 %: 0.08 against 0.125 bytes per element of the
piece), and cheaper on both sides: the sender gathers the changed values by index, and the
receiver writes them with one ``put_`` instead of spreading a bitmask over every element and
a masked scatter (measured: ``benchmarks/results/transfer.md``). The receiver writes those
values into its destination; the rest of it keeps what the previous transfer wrote. Every
rank derives the form and the buffer's size from the piece's element count and the
all-reduced count of changed elements (``sparse_nbytes``), so all agree on every broadcast.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ..layouts._targets import Target
from ..plan._owners import dtype_itemsize
from ._move import MoveStats, Pending, _src_view
from ._planner import TransferPiece

__all__ = ["SparseRound", "by_index", "changed", "changed_indices", "comparable", "pack", "pack_indices",
           "sparse_nbytes"]

_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _mask_bytes(numel: int) -> int:
    return -(-numel // 64) * 8


def _index_size(numel: int) -> int:
    return 4 if numel < 1 << 31 else 8


def _index_bytes(numel: int, count: int) -> int:
    return -(-count * _index_size(numel) // 8) * 8


def by_index(numel: int, count: int) -> bool:
    """Whether a piece of ``numel`` elements with ``count`` changed sends indices (not a bitmask)."""
    return _index_bytes(numel, count) < _mask_bytes(numel)


def sparse_nbytes(numel: int, count: int, wire: str) -> int:
    """Bytes of a piece of ``numel`` elements with ``count`` changed, as positions + values."""
    return min(_mask_bytes(numel), _index_bytes(numel, count)) + count * dtype_itemsize(wire)


def comparable(tensor: Any) -> bool:
    """Whether ``changed`` can compare ``tensor``'s elements (an integer type of its width)."""
    return tensor.element_size() in _INT_OF_SIZE


def changed(now: Any, last: Any) -> Any:
    """Element-wise whether ``now`` differs from ``last`` bit for bit (NaN counts as changed
    when its bits change; float8 has no comparison kernels), as a contiguous mask of their
    shape (row-major order, as ``pack`` takes it); strided views are compared in place."""
    import torch

    kind = getattr(torch, _INT_OF_SIZE[now.element_size()])
    return now.view(kind) != last.view(kind)


def _words(now: Any, last: Any) -> tuple[Any, Any] | None:
    """``now`` and ``last`` as int64 words of 8 // itemsize elements each, or None when
    ``now``'s rows do not cut into whole aligned words."""
    import torch

    k = 8 // now.element_size()
    if (now.dim() == 0 or now.stride(-1) != 1 or now.shape[-1] % k or now.storage_offset() % k
            or any(s % k for s in now.stride()[:-1]) or not last.is_contiguous()):
        return None
    kind = getattr(torch, _INT_OF_SIZE[now.element_size()])
    return now.view(kind).view(torch.int64), last.view(kind).view(torch.int64)


#: Pieces below this many elements are compared element-wise: the word path's extra steps
#: cost more than they save there (one thread, bf16 at 2 % changed, median of 50-300 on the
#: shared 2-core machine: 1 Ki elements 35 against 166 us, 16 Ki 47 / 112, 64 Ki 148 / 179,
#: 256 Ki 545 / 471, 1 Mi 2205 / 1713).
WORDS_FROM = 1 << 17


def changed_indices(now: Any, last: Any) -> Any | None:
    """The row-major indices (int64) of the elements of ``now`` that differ from ``last``
    bit for bit, found by comparing 8 bytes at a time and then the elements of the words that
    differ; None (``changed`` then) for a piece below ``WORDS_FROM`` elements, rows that do
    not cut into aligned words, or so many differing words that the piece will not travel as
    indices (``by_index``).

    Measured on the 2-core development machine shared with other work (load 8), one thread,
    1 Mi bf16 elements (a strided half of 2048 x 1024) with 2 % changed, median of 20: 1.7-1.9
    ms, against 2.2-2.5 ms for the element-wise compare (0.6-1.0), its count (0.3) and its
    indices (1.3); most of what is left is ``nonzero`` over the words (0.6 ms)."""
    import torch

    words = _words(now, last) if now.numel() >= WORDS_FROM else None
    if words is None:
        return None
    wide_now, wide_last = words
    groups = (wide_now != wide_last).view(-1).nonzero().squeeze(1)
    if not by_index(now.numel(), groups.numel()):
        return None
    k, bits = 8 // now.element_size(), 8 * now.element_size()
    if k == 1:
        return groups
    # which elements of each differing word differ: their bits of the words' XOR (element j
    # of a word holds its bits [j * bits, (j + 1) * bits) on a little-endian machine)
    shifts = torch.arange(0, 64, bits, device=groups.device)
    if sys.byteorder == "big":
        shifts = shifts.flip(0)
    xor = (torch.take(wide_now, groups) ^ torch.take(wide_last, groups)).unsqueeze(1)
    which = (((xor >> shifts) & ((1 << bits) - 1)) != 0).view(-1).nonzero().squeeze(1)  # word i, element j: i*k + j
    return torch.take(groups, which // k) * k + which % k


#: Packing 8 flags (bytes 0/1 of an int64, little-endian) into the top byte of their product
#: with ``_GATHER`` (each flag lands on its own bit, no carries), and spreading a byte's 8
#: bits over 8 bytes (``_SPREAD`` copies it into each, ``_PICK`` keeps bit k of byte k): one
#: int64 operation per 8 elements. Measured on a 2-core development machine, one thread, 1 Mi
#: elements: packing 1.9 -> 0.34 ms, unpacking 2.8 -> 2.1 ms (against bytes times bit weights).
_GATHER = 0x0102040810204080
_SPREAD = 0x0101010101010101
_PICK = 0x8040201008040201 - (1 << 64)  # as a signed int64


def pack(mask: Any, values: Any) -> Any:
    """The ``uint8`` buffer of ``mask`` (bools, row-major) and ``values`` (the changed
    elements, in the dtype that travels)."""
    import torch

    flags = mask.reshape(-1)
    mbytes = _mask_bytes(flags.numel())
    bits = torch.zeros(mbytes * 8, dtype=torch.uint8, device=flags.device)
    bits[:flags.numel()] = flags.view(torch.uint8)
    out = torch.empty(mbytes + values.numel() * values.element_size(), dtype=torch.uint8, device=flags.device)
    out[:mbytes] = (((bits.view(torch.int64) * _GATHER) >> 56) & 0xFF).to(torch.uint8)
    out[mbytes:].view(values.dtype).copy_(values)
    return out


def pack_indices(indices: Any, values: Any, numel: int) -> Any:
    """The ``uint8`` buffer of ``indices`` (the changed elements' row-major positions in a
    piece of ``numel`` elements, int64) and ``values`` (theirs, in the dtype that travels)."""
    import torch

    ibytes = _index_bytes(numel, indices.numel())
    out = torch.empty(ibytes + values.numel() * values.element_size(), dtype=torch.uint8, device=values.device)
    kind = torch.int32 if _index_size(numel) == 4 else torch.int64
    out[:indices.numel() * _index_size(numel)].view(kind).copy_(indices)
    out[ibytes:].view(values.dtype).copy_(values)
    return out


def _unpack(buf: Any, numel: int, wire: Any) -> tuple[Any, Any]:
    """(flat bool mask, changed values) of a buffer made by ``pack``."""
    import torch

    mbytes = _mask_bytes(numel)
    spread = (buf[:mbytes].to(torch.int64) * _SPREAD) & _PICK
    return spread.view(torch.uint8).ne(0)[:numel], buf[mbytes:].view(wire)


class SparseRound:
    """The sparse pieces of one delta transfer on this rank: one ``broadcast_items`` call of
    their buffers (the holder's packed ones, the receivers' empty ones), then each receiver
    writes the changed values into its destination. Runs after the dense rounds (``move``).
    With ``pending``, those writes and the holder's own copies wait there (``_move.Pending``)."""

    def __init__(self, platform: Any, rank: int, batch_bytes: int, pending: Pending | None = None):
        self.platform, self.rank, self.batch_bytes, self.pending = platform, rank, batch_bytes, pending
        self.items: list[Any] = []
        self.scatter: list[tuple[Any, Any, Any, int, int]] = []  # (view, buffer, wire dtype, numel, count)
        self.local: list[tuple[Target, Any, Any]] = []  # (target, into, from): the holder's own copies
        self.pieces = self.copied = 0
        self.names: set[str] = set()  # the destinations it writes, now or through ``pending`` (``_move.move``)
        self.in_place: set[str] = set()  # those it writes while it runs

    def add(self, piece: TransferPiece, nbytes: int, count: int, payload: Any, src: Mapping[str, Target],
            dst: Mapping[str, Target]) -> None:
        import torch
        from dcp_broadcast import BroadcastItem

        if self.rank not in piece.ranks:
            self.items.append(BroadcastItem(piece.holder, piece.ranks, nbytes))
            return
        self.pieces += 1
        if self.rank in piece.receivers:
            self.names.add(piece.dst)
            if self.pending is None:
                self.in_place.add(piece.dst)
        if self.rank == piece.holder:
            if self.rank in piece.receivers:  # a holder that needs the piece copies it whole, locally
                copy = (dst[piece.dst], dst[piece.dst].view(piece.offsets, piece.sizes), _src_view(src[piece.src], piece))
                if self.pending is not None:
                    self.pending.copy(*copy)
                else:
                    self.local.append(copy)
                self.copied += _numel(piece.sizes) * dtype_itemsize(piece.dst_dtype)
            self.items.append(BroadcastItem(piece.holder, piece.ranks, nbytes, payload))
            return
        buf = self.platform.empty((nbytes,), torch.uint8)  # on the platform's device, as broadcasts need
        view = dst[piece.dst].view(piece.offsets, piece.sizes)
        self.scatter.append((view, buf, self.platform.dtype_from_name(piece.wire), _numel(piece.sizes), count))
        self.items.append(BroadcastItem(piece.holder, piece.ranks, nbytes, buf))

    def run(self, groups: Any, max_in_flight: int, watch: Any, stats: MoveStats) -> None:
        from dcp_broadcast import broadcast_items

        for target, into, source in self.local:
            target.adapter.copy(into, source)
        stats.pieces += self.pieces
        stats.bytes_copied += self.copied
        if not self.items:
            return
        got = broadcast_items(self.platform, self.items, batch_bytes=self.batch_bytes,
                              max_in_flight=max_in_flight, groups=groups, watch=watch)
        stats.broadcasts += got.broadcasts
        stats.bytes_sent += got.bytes_sent
        stats.bytes_received += got.bytes_received
        self.platform.synchronize()
        for args in self.scatter:
            if self.pending is not None:
                self.pending.add(_scatter, *args)
            else:
                _scatter(*args)


def _scatter(view: Any, buf: Any, wire: Any, numel: int, count: int) -> None:
    """Write the changed values of ``buf`` (``pack``'s or ``pack_indices``') into ``view``."""
    import torch

    if by_index(numel, count):
        kind = torch.int32 if _index_size(numel) == 4 else torch.int64
        indices = buf[:count * _index_size(numel)].view(kind).to(torch.int64)
        values = buf[_index_bytes(numel, count):].view(wire)
        view.put_(indices, values.to(view.dtype))  # row-major positions of a view: written in place
        return
    mask, values = _unpack(buf, numel, wire)
    view.masked_scatter_(mask.view(view.shape), values.to(view.dtype))  # a view: in place


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n

"""Turning the shared item sequence into an ordered list of transfers (one per broadcast).

The plan depends only on what every rank has identically (each item's ``src``, ``ranks``
and ``nbytes``, and ``batch_bytes``), never on local tensors, so every rank derives the
same transfers in the same order and enters the same collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dcp_platform import Platform

from ._items import BroadcastItem

#: Each packed item starts at a multiple of this, so typed views of the staging buffer are
#: aligned for every dtype (the widest element, complex128, is 16 bytes).
ALIGN = 16


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Transfer:
    """One broadcast: a single item sent as it is, or several items packed at ``offsets``.

    ``nbytes`` is the size of what travels: the item's size, or the staging buffer's
    (the packed items with their alignment padding).
    """

    src: int
    ranks: tuple[int, ...]
    indices: tuple[int, ...]
    nbytes: int
    offsets: tuple[int, ...] | None = None

    @property
    def batched(self) -> bool:
        return self.offsets is not None


class _OpenBatch:
    __slots__ = ("indices", "offsets", "end")

    def __init__(self) -> None:
        self.indices: list[int] = []
        self.offsets: list[int] = []
        self.end = 0


def build_plan(items: Sequence[BroadcastItem], batch_bytes: int) -> list[Transfer]:
    """Transfers in the order every rank issues them.

    Items with ``0 < nbytes < batch_bytes`` join the open batch of their (ranks, src); a
    batch is emitted when the next item would overflow it, and the batches still open at
    the end are emitted in the order they were opened. Other items are emitted alone at
    their place in the sequence. Items with no bytes, or with no receiver, need no transfer.
    """
    plan: list[Transfer] = []
    open_batches: dict[tuple[tuple[int, ...], int], _OpenBatch] = {}

    def emit(key: tuple[tuple[int, ...], int], batch: _OpenBatch) -> None:
        ranks, src = key
        plan.append(Transfer(src, ranks, tuple(batch.indices), batch.end, tuple(batch.offsets)))

    for index, item in enumerate(items):
        if item.nbytes == 0 or len(item.ranks) == 1:
            continue
        if item.nbytes >= batch_bytes:  # batch_bytes == 0 turns batching off
            plan.append(Transfer(item.src, item.ranks, (index,), item.nbytes))
            continue
        key = (item.ranks, item.src)
        batch = open_batches.get(key)
        if batch is not None and _align(batch.end) + item.nbytes > batch_bytes:
            emit(key, open_batches.pop(key))
            batch = None
        if batch is None:
            batch = open_batches[key] = _OpenBatch()
        offset = _align(batch.end)
        batch.indices.append(index)
        batch.offsets.append(offset)
        batch.end = offset + item.nbytes
    # dicts keep insertion order: a batch re-opened after a send goes after older ones.
    for key, batch in open_batches.items():
        emit(key, batch)
    return plan


def supports_byte_ranges(platform: Platform) -> bool:
    """Whether ``platform.from_bytes`` accepts a slice of a byte buffer (and writes to it).

    Batching needs typed views at offsets of one staging buffer. MindSpore on the CPU does
    not write through views, and its ``from_bytes``/``fused_copy`` refuse them with
    ``ValueError``: there the answer is False and items go alone. The probe is 32 bytes and
    two calls (microseconds on torch).
    """
    uint8 = platform.dtype_from_name("uint8")
    base = platform.empty((2 * ALIGN,), uint8)
    src = platform.empty((ALIGN,), uint8)
    try:
        platform.fused_copy([platform.from_bytes(base[ALIGN:], uint8, (ALIGN,))], [src])
    except (ValueError, TypeError, NotImplementedError):
        return False
    return True

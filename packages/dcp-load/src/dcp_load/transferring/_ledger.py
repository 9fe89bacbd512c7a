"""Which transfer last wrote which bytes of this process's destination tensors.

A delta plan's receiver sends a destination whole when another transfer wrote any of its
bytes since the plan's last commit (``_delta``): the destination no longer holds the plan's
previous step. Writes are kept by storage and byte range, not by a tensor's start address, so
a write through a view that starts inside a destination (rows ``D[n:2n]`` of a fused ``D``)
is seen as well as one through ``D`` itself. Each storage keeps its writes in order; a write
covering older ones drops them. Past ``MAX_WRITES`` entries the ledger is cleared, and a
plan whose own commit is no longer found counts its destination as overwritten (it is then
sent whole once: never wrong, only larger).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from ..layouts._targets import Target

__all__ = ["MAX_WRITES", "Span", "forget", "overwritten", "span", "spans", "written"]

#: Entries kept over every storage before the ledger is cleared (each is a few Python objects).
MAX_WRITES = 1 << 16

#: (storage key, first byte, end byte): the bytes a destination's tensor may touch
Span = tuple[Any, int, int]

#: storage key -> [(first byte, end byte, writer, sequence number)], oldest first
_LEDGER: dict[Any, list[tuple[int, int, Any, int]]] = {}
_SEQ = itertools.count(1)
_OTHER = object()


def span(tensor: Any) -> Span:
    """The bytes ``tensor`` may touch in its storage (every element between its first and
    last; a tensor that is not torch's counts as its own storage)."""
    storage = getattr(tensor, "untyped_storage", None)
    if storage is None:
        return (("id", id(tensor)), 0, 1)
    size = tensor.element_size()
    first = tensor.storage_offset() * size
    if tensor.numel() == 0:
        return (storage().data_ptr(), first, first)
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return (storage().data_ptr(), first, first + extent * size)


def spans(targets: Mapping[str, Target]) -> dict[str, Span]:
    """Each destination's bytes, by name."""
    return {name: span(t.local) for name, t in targets.items()}


def written(where: Mapping[str, Span] | Any, by: Any = None) -> int:
    """Record that ``by`` (a ``Delta`` at its commit; None: any other transfer, before it
    writes) wrote the bytes ``where``; returns the write's sequence number."""
    seq = next(_SEQ)
    items = where.values() if isinstance(where, Mapping) else where
    if sum(map(len, _LEDGER.values())) > MAX_WRITES:
        _LEDGER.clear()
    for key, lo, hi in items:
        kept = [e for e in _LEDGER.get(key, []) if e[3] == seq or not (lo <= e[0] and e[1] <= hi)]
        kept.append((lo, hi, _OTHER if by is None else by, seq))
        _LEDGER[key] = kept
    return seq


def overwritten(where: Mapping[str, Span], by: Any, since: int) -> set[str]:
    """The destinations in ``where`` whose bytes another writer than ``by`` wrote after
    sequence number ``since`` (``by``'s own commit), or whose commit the ledger lost."""
    out = set()
    for name, (key, lo, hi) in where.items():
        entries = _LEDGER.get(key, [])
        mine = any(e[2] is by and e[3] == since and e[0] <= lo and hi <= e[1] for e in entries)
        if not mine or any(e[3] > since and e[2] is not by and e[0] < hi and lo < e[1] for e in entries):
            out.add(name)
    return out


def forget(by: Any) -> None:
    """Drop ``by``'s entries (its plan is gone): the ledger must not keep it alive."""
    for key in list(_LEDGER):
        _LEDGER[key] = [e for e in _LEDGER[key] if e[2] is not by]
        if not _LEDGER[key]:
            del _LEDGER[key]

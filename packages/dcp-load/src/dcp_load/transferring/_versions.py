"""Which version of the trainer's weights each destination holds (``transfer(..., version=)``).

Every transfer that succeeds records, on each rank, its version for the bytes of every
destination of that rank, by storage and byte range as ``_ledger`` keeps writes: the same
memory passed again through another object (``p.data``, a ``Chunk`` of it, the DTensor
whose local shard it is) finds its record. A transfer that fails after it began writing in
place records the destinations it wrote as torn (``_writes``). ``synced_version`` reads the
records: a destination reads the version of the newest record that covers it whole, None
when it was never filled, is torn, or a newer record covers only part of it.

A call's version is the one its caller passes, or, when omitted, the last version its process
group committed plus one (``resolve``): every rank of a group takes part in every call and
commits it at the same point, so the count is the same on every rank. The plan check's
all-reduce carries each rank's version and its negation (``_kept.agree``): when they differ,
``refuse`` gathers them and raises on every rank before anything is written.

Memory that is freed and reused keeps the record of the tensor that held it, as the ledger
does; past ``MAX_RECORDS`` records they are all dropped (each destination then reads None
until a transfer fills it again: never a wrong version, only an unknown one).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping
from typing import Any

from .._errors import LoadError, format_ranks
from ..layouts._state import flatten_state_dict, is_tensor
from ..layouts._targets import in_mesh
from ..run._validate import exchange
from ._layout import _local_of
from ._ledger import Span, span

__all__ = ["MAX_RECORDS", "MAX_VERSION", "check_version", "committed", "forget_group", "record", "refuse",
           "resolve", "synced_version", "tear"]

#: The largest version (the all-reduce that compares them carries int64 and their negations).
MAX_VERSION = (1 << 62) - 1

#: Records kept over every storage before they are dropped.
MAX_RECORDS = 1 << 16

_TORN = -1

#: storage key -> [(first byte, end byte, version or _TORN)], oldest first
_RECORDS: dict[Any, list[tuple[int, int, int]]] = {}

#: process group key -> the last version a transfer over it committed
_LAST: dict[str, int] = {}


def check_version(version: Any) -> None:
    """Refuse a ``version`` that is not None or an int in [0, ``MAX_VERSION``]."""
    if version is None:
        return
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"transfer: version must be an int >= 0 (the trainer's step) or None (count the "
                         f"transfers of the process group), got {version!r}")


def resolve(version: int | None, scope: str) -> int:
    """This call's version: ``version``, or the group's last committed version plus one."""
    return version if version is not None else _LAST.get(scope, 0) + 1


def committed(scope: str, version: int) -> None:
    """Every rank agreed that the call of ``version`` over group ``scope`` succeeded."""
    _LAST[scope] = version


def forget_group(scope: str) -> None:
    """The group ``scope`` is closed: its count goes with it."""
    _LAST.pop(scope, None)


def _covered(starts: list[int], reach: list[int], first: int, end: int) -> bool:
    """Whether one of the sorted spans (``starts``, and ``reach``: the furthest end among the
    spans up to each) covers [first, end) whole."""
    i = bisect.bisect_right(starts, first) - 1  # the spans that start at or before ``first``
    return i >= 0 and reach[i] >= end


def _put(spans: Iterable[Span], value: int) -> None:
    """Record ``value`` over each span; older records a new one covers whole are dropped. Per
    storage at once (one pass over its records, whatever the number of spans: a model whose
    parameters are views of one buffer has thousands)."""
    if sum(map(len, _RECORDS.values())) > MAX_RECORDS:
        _RECORDS.clear()
    by_key: dict[Any, list[tuple[int, int]]] = {}
    for key, lo, hi in spans:
        by_key.setdefault(key, []).append((lo, hi))
    for key, new in by_key.items():
        new.sort()
        starts, reach = [lo for lo, _ in new], list(itertools.accumulate((hi for _, hi in new), max))
        old = [e for e in _RECORDS.get(key, []) if not _covered(starts, reach, e[0], e[1])]
        _RECORDS[key] = old + [(lo, hi, value) for lo, hi in new]


def record(spans: Mapping[str, Span], version: int) -> None:
    """The destinations at ``spans`` hold ``version`` whole (a call that succeeded)."""
    _put(spans.values(), version)


def tear(spans: Iterable[Span]) -> None:
    """The destinations at ``spans`` were written part way by a call that failed."""
    _put(spans, _TORN)


def _lookup(where: Span) -> int | None:
    key, lo, hi = where
    for first, end, value in reversed(_RECORDS.get(key, [])):
        if (first < hi and lo < end) or (first, end) == (lo, hi):  # the newest record over these bytes
            return value if first <= lo and hi <= end and value != _TORN else None
    return None


def synced_version(dst: Any) -> int | None:
    """The version of the trainer's weights that ``dst`` holds on this rank, as the last
    ``transfer`` that filled it recorded (its ``version=``, or its group's count).

    ``dst``: a destination (a tensor, DTensor, ``Chunk`` or ``Flat``; any object over the same
    memory as the one passed to ``transfer``), or a mapping of them as passed as ``dst`` (nested
    mappings allowed). Returns the version every one of them holds whole; None when any was
    never filled by a transfer, is torn (a transfer that wrote it failed: ``LoadError.torn``
    names it, until a transfer fills it again), or they hold different versions. Per name:
    ``{n: synced_version(t) for n, t in dst.items()}``. Local: no collective. Writes that are
    not a transfer's (``load``, the caller's own) are not seen.
    """
    if isinstance(dst, Mapping):
        values = [(leaf.name, leaf.value) for leaf in flatten_state_dict(dst)]
    else:
        values = [("dst", dst)]
    found: set[int | None] = set()
    for name, value in values:
        if not is_tensor(value):
            raise TypeError(f"synced_version: {name!r} is a {type(value).__name__}, not a tensor, DTensor, Chunk "
                            "or Flat")
        if in_mesh(value):
            found.add(_lookup(span(_local_of(value))))
    return found.pop() if len(found) == 1 else None


def refuse(coord: Any, errors: list[str], version: int, given: bool) -> None:
    """The ranks' versions differ (the plan check's all-reduce told every rank): gather them
    and raise ``LoadError`` on every rank, naming each rank that differs from the most
    common version, and its value, before anything is written."""
    gathered = coord.exchange(exchange, errors, "validate", collective=True, payload=(version, given))
    by_value: dict[int, list[int]] = {}
    for rank, (value, _) in enumerate(gathered):
        by_value.setdefault(value, []).append(rank)
    common = max(by_value, key=lambda v: (len(by_value[v]), -by_value[v][0]))
    have = f"{format_ranks(by_value[common])} {'has' if len(by_value[common]) == 1 else 'have'} version={common}"
    raise LoadError({rank: [f"transfer: version={value}{'' if passed else ' (counted: no version passed)'}, where "
                            f"{have}; every rank must pass the same version (the trainer's step)"]
                     for rank, (value, passed) in enumerate(gathered) if value != common}, "validate")

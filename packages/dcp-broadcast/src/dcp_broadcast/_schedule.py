"""Checking, before any broadcast, that every rank walks the same schedule.

A rank whose item list differs from the others' would enter different collectives and hang
until the process-group timeout. One all-gather of a hash (plus any local validation
errors) turns that into an error raised on every rank; only when the hashes disagree is the
full schedule gathered, to name the first item that differs.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from dcp_platform import Platform

from ._items import BroadcastItem

logger = logging.getLogger(__name__)


class ScheduleMismatchError(Exception):
    """Ranks passed different item sequences or settings to ``broadcast_items``.

    Raised on every rank. ``index`` is the first item index that differs (``None`` when
    only the settings differ), ``values`` maps rank to what that rank has there, and
    ``errors`` maps rank to local validation errors when that is why the ranks disagree.
    """

    def __init__(self, message: str, index: int | None = None,
                 values: dict[int, Any] | None = None, errors: dict[int, list[str]] | None = None):
        super().__init__(message)
        self.index = index
        self.values = dict(values or {})
        self.errors = dict(errors or {})


def _signature(items: Sequence[BroadcastItem]) -> list[tuple[int, tuple[int, ...], int]]:
    return [(it.src, it.ranks, it.nbytes) for it in items]


def _digest(sig: list[Any], settings: tuple[int, int]) -> str:
    return hashlib.blake2b(repr((settings, sig)).encode(), digest_size=16).hexdigest()


def check_schedule(platform: Platform, items: Sequence[BroadcastItem], batch_bytes: int,
                   max_in_flight: int, local_errors: list[str]) -> None:
    """Collective: raise ``ScheduleMismatchError`` on every rank unless all ranks agree.

    Also fails every rank together when any rank found local validation errors.
    """
    start = time.perf_counter()
    rank = platform.rank()
    sig = _signature(items)
    settings = (batch_bytes, max_in_flight)
    mine = (_digest(sig, settings), len(sig), settings, local_errors)
    gathered = platform.all_gather_object(mine)
    errors = {r: g[3] for r, g in enumerate(gathered) if g[3]}
    if errors:
        lines = [f"rank {r}: {msg}" for r, msgs in errors.items() for msg in msgs]
        raise ScheduleMismatchError(
            "broadcast_items: invalid items on rank(s) " + ", ".join(map(str, errors)) + ":\n  "
            + "\n  ".join(lines), errors=errors)
    if len({g[0] for g in gathered}) > 1:
        _raise_mismatch(platform, sig, gathered)
    logger.debug("rank %d: schedule of %d items checked in %.4f s", rank, len(sig),
                 time.perf_counter() - start)


def _raise_mismatch(platform: Platform, sig: list[Any], gathered: list[Any]) -> None:
    # Error path only: gather every rank's full schedule to name the first difference.
    sigs = platform.all_gather_object(sig)
    ref = 0
    settings = {r: g[2] for r, g in enumerate(gathered)}
    for r, g in enumerate(gathered):
        if g[2] != settings[ref]:
            raise ScheduleMismatchError(
                f"broadcast_items: ranks disagree on settings (batch_bytes, max_in_flight): "
                f"rank {ref} has {settings[ref]}, rank {r} has {g[2]}; pass the same values on "
                "every rank",
                values=settings,
            )
    length = max(len(s) for s in sigs)
    for index in range(length):
        here = {r: (s[index] if index < len(s) else None) for r, s in enumerate(sigs)}
        if len(set(here.values())) > 1:
            other = next(r for r, v in here.items() if v != here[ref])
            raise ScheduleMismatchError(
                f"broadcast_items: ranks disagree on item {index}: rank {ref} has "
                f"{_describe(here[ref])}, rank {other} has {_describe(here[other])} "
                f"(item counts per rank: {[len(s) for s in sigs]}); every rank must pass the "
                "same items (src, ranks, nbytes) in the same order",
                index=index, values=here,
            )
    raise AssertionError("schedule hashes differ but the schedules are equal")  # pragma: no cover


def _describe(value: Any) -> str:
    if value is None:
        return "no item (its list is shorter)"
    src, ranks, nbytes = value
    return f"(src={src}, ranks={ranks}, nbytes={nbytes})"

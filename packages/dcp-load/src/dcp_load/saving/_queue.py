"""The one queue of a process's saves: at most one ``async_save`` writes at a time.

``save`` and ``async_save`` first wait here for the process's previous ``async_save`` to
finish (committed or failed), so saves run in call order, a directory never receives two
saves at once from one process (the second would find its own lock held), and the staging
pool never holds more than one save's copy (the bound ``StagingPool`` states).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

__all__ = ["InFlight", "begin", "wait_for_previous"]

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """The save still writing: where to, since when, and the event set once it finished."""

    path: str
    started: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)


_LOCK = threading.Lock()
_PENDING: InFlight | None = None


def wait_for_previous(what: str, path: str) -> float:
    """Wait until no ``async_save`` of this process is writing; the seconds waited."""
    start = time.perf_counter()
    with _LOCK:
        pending = _PENDING
    if pending is None or pending.done.is_set():
        return 0.0
    logger.info("%s into %s waits for this process's async_save into %s (writing for %.1f s) to finish",
                what, path, pending.path, time.monotonic() - pending.started)
    pending.done.wait()
    return time.perf_counter() - start


def begin(path: str) -> tuple[InFlight, float]:
    """Wait for the previous save, then register one into ``path`` as writing; returns it
    (set its ``done`` when it finished) and the seconds waited."""
    global _PENDING
    waited = 0.0
    while True:
        waited += wait_for_previous("async_save", path)
        with _LOCK:
            if _PENDING is None or _PENDING.done.is_set():
                _PENDING = InFlight(path)
                return _PENDING, waited

"""Failing together within bounded time: one ``Coordinator`` per ``load``.

It wraps a ``dcp_platform.Watch`` named ``dcp-load/<n>`` (``dcp-save/<n>`` for ``save``),
where ``n`` counts this process's collective loads and saves (every rank calls them the
same number of times, so the n-th of every rank shares one name). Every wait of the load goes through it:

* ``arrive()`` bounds the wait for the other ranks to enter ``load`` by ``timeout``;
* ``check`` (the error check: one fixed-size all-reduce), ``exchange`` (an all-gather,
  where payloads differ per rank) and the broadcasts wait in slices, checking for a
  failure another rank published, and name a dead rank from the heartbeats;
* leaving on any exception publishes this rank's cause, so that the others raise
  ``LoadError`` within a few seconds instead of waiting in their next collective.

``PeerFailure`` from the watch becomes ``LoadError`` with the phase this rank was in.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ._digest import all_reduce
from ._errors import LoadError
from ._validate import exchange

__all__ = ["DEFAULT_TIMEOUT", "Coordinator", "timeout_seconds"]

logger = logging.getLogger(__name__)

#: Default bound on how long the first rank to enter ``load`` waits for the last one.
DEFAULT_TIMEOUT = timedelta(minutes=10)

# Process-wide count of collective loads: the per-load store key prefix. Every rank counts
# its own loads; a module-level counter is what lets separate Platform objects agree.
_LOADS = itertools.count()


def timeout_seconds(timeout: Any, what: str = "load") -> float:
    """``timeout=`` of ``what`` (``load``/``save``) as seconds (a ``timedelta`` or a positive number)."""
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ValueError(f"{what}: timeout must be a datetime.timedelta or a number of seconds > 0, "
                         f"got {timeout!r}")
    return float(seconds)


class Coordinator:
    """Arrival barrier, bounded waits and failure publication for one load (or ``save``,
    ``operation="save"``: watch ``dcp-save/<n>``, phase ``"save"``) on one rank."""

    def __init__(self, platform: Any, *, collective: bool, timeout: float, operation: str = "load"):
        self.platform, self.timeout = platform, timeout
        self.phase = "validate" if operation == "load" else operation
        self.watch: Any = None
        self._shared = False  # the error being raised is already known to every rank
        if collective:
            from dcp_platform import Watch

            self.watch = Watch(platform, f"dcp-{operation}/{next(_LOADS)}")

    def __enter__(self) -> Coordinator:
        if self.watch is not None:
            self.watch.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if self.watch is None:
            return False
        try:
            if exc is not None and not self._shared and not self._is_peer(exc):
                failures = exc.failures if isinstance(exc, LoadError) else {
                    self.watch.rank: [f"{type(exc).__name__}: {exc}"]}
                self.watch.abort(failures)
        finally:
            self.watch.close(success=exc is None)
        if exc is not None and self._is_peer(exc):
            raise self._load_error(exc) from exc
        return False

    @staticmethod
    def _is_peer(exc: BaseException) -> bool:
        from dcp_platform import PeerFailure

        return isinstance(exc, PeerFailure)

    def _load_error(self, exc: Any) -> LoadError:
        return LoadError(exc.failures, self.phase)

    def arrive(self) -> None:
        """Wait (at most ``timeout``) until every rank entered ``load``."""
        if self.watch is not None:
            self.watch.arrive(self.timeout)

    @property
    def waiter(self) -> Any:
        """What to pass as ``waiter=`` / ``watch=``: the watch, or None without collectives."""
        return self.watch

    def exchange(self, exchange: Any, errors: Sequence[str], phase: str, **kwargs: Any) -> list[Any]:
        """Run ``_validate.exchange`` bounded by the watch; its ``LoadError`` is shared."""
        self.phase = phase
        try:
            gather = self.watch.gather if self.watch is not None else None
            return exchange(self.platform, errors, phase, gather=gather, **kwargs)
        except LoadError:
            self._shared = True
            raise

    def check(self, errors: Sequence[str], phase: str, *, collective: bool, sums: Sequence[int] = ()) -> list[int]:
        """Raise ``LoadError`` on every rank when any rank has ``errors``; else return the
        job-wide sums of ``sums``. One fixed-size all-reduce (bounded by the watch) carries a
        failure count and the sums: each rank receives a few bytes whatever the world size,
        where gathering every rank's (empty) error list grew with it. Messages are gathered
        only after a failure, to name every failing rank."""
        if not collective:
            self.exchange(exchange, errors, phase, collective=False)
            return [int(v) for v in sums]
        self.phase = phase
        lanes = all_reduce(self.platform, [int(bool(errors)), *(int(v) for v in sums)], "sum", self.watch)
        if lanes[0]:
            self.exchange(exchange, errors, phase, collective=True)  # some rank failed: raises
        return lanes[1:]

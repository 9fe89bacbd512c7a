"""Failing together within bounded time: one ``Coordinator`` per ``load``.

It wraps a ``dcp_platform.Watch`` named ``dcp-load/<n>`` (``dcp-save/<n>`` for ``save``).
For ``load``, ``n`` counts every call of ``load`` this process made (``next_load_slot``),
whatever its arguments: calls that raise on their arguments, ``no_dist=True`` and
``use_collectives=False`` count too, so the n-th call of every rank shares one name even
after a call that some ranks made without collectives. Such a call, on a process with a
default process group, publishes why it takes no part (``skip_slot``): ranks that made the
same call with collectives raise ``LoadError`` naming it at once instead of waiting for
``timeout``. For ``save``, ``n`` counts the process's collective saves (a save on some ranks
only, ``no_dist=True``, is a common way to write from rank 0 and must not shift it).
Every wait of the load goes through the watch:

* ``arrive()`` bounds the wait for the other ranks to enter ``load`` by ``timeout``;
* ``check`` (the error check: one fixed-size all-reduce), ``exchange`` (an all-gather,
  where payloads differ per rank) and the broadcasts wait in slices, checking for a
  failure another rank published, and name a dead rank from the heartbeats; a single
  collective that does not complete within ``timeout`` (at least ``MIN_STALL_S``) while
  every rank is alive (ranks in different collectives) is published and raised too;
* leaving on any exception publishes this rank's cause, so that the others raise
  ``LoadError`` within a few seconds instead of waiting in their next collective.

``PeerFailure`` from the watch becomes ``LoadError`` with the phase this rank was in.

A failure that leaves a collective unfinished (a wait interrupted, or the broadcast
schedule left mid-way) makes the default process group unusable: its next collective would
pair with the unfinished one and block. The process remembers that group; every later
``load`` or ``save`` on it raises ``LoadError`` at once, saying to re-create the group,
and publishes that, so the other ranks raise at once too.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from .._errors import LoadError
from ..plan._digest import all_reduce
from ._validate import exchange

__all__ = ["DEFAULT_TIMEOUT", "Coordinator", "next_load_slot", "skip_slot", "timeout_seconds", "unusable_cause"]

logger = logging.getLogger(__name__)

#: Default bound on how long the first rank to enter ``load`` waits for the last one,
#: when there is no default process group to take the timeout from.
DEFAULT_TIMEOUT = timedelta(minutes=10)

#: The shortest bound on one collective's wait: a bound meant to end a hang (ranks in
#: different collectives) must not end a slow but healthy collective when ``timeout=`` is
#: small (a few seconds of arrival wait), since that leaves the process group unusable.
MIN_STALL_S = 30.0

# Process-wide counts: every load call, and every collective save (module docstring). Every
# rank counts its own calls; a module-level counter is what lets separate Platform objects
# (one per call) agree.
_LOADS = itertools.count()
_SAVES = itertools.count()

# Default process groups left with an unfinished collective by a failed load or save:
# id(group) -> (group, cause). An entry counts only while that group is still the default
# (a re-created default group is a new object).
_UNUSABLE: dict[int, tuple[Any, str]] = {}


def next_load_slot() -> int:
    """The number of this ``load`` call in this process (counted for every call)."""
    return next(_LOADS)


def timeout_seconds(timeout: Any, what: str = "load", platform: Any = None) -> float:
    """``timeout=`` of ``what`` (``load``/``save``) as seconds (a ``timedelta`` or a positive
    number). ``None``: the default process group's timeout (``platform.group_timeout()``),
    else ``DEFAULT_TIMEOUT``: a rank that never arrives is then named when the job's own
    collectives would have timed out, not after a fixed 10 minutes."""
    if timeout is None:
        group = platform.group_timeout() if platform is not None and hasattr(platform, "group_timeout") else None
        return float(group) if group else DEFAULT_TIMEOUT.total_seconds()
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ValueError(f"{what}: timeout must be a datetime.timedelta or a number of seconds > 0, "
                         f"got {timeout!r} (or None, the default: the process group's timeout)")
    return float(seconds)


def _default_group() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_group()


def unusable_cause() -> str | None:
    """Why the current default process group cannot run another load, or None."""
    group = _default_group()
    entry = _UNUSABLE.get(id(group)) if group is not None else None
    return entry[1] if entry is not None and entry[0] is group else None


def _mark_unusable(cause: str) -> None:
    group = _default_group()
    if group is not None and unusable_cause() is None:
        _UNUSABLE[id(group)] = (group, cause)


def skip_slot(slot: int, cause: str) -> None:
    """Tell the ranks that make ``load`` call ``slot`` with collectives that this rank takes
    no part in it (``cause`` says why). Without a default process group of more than one
    rank, nothing. Store traffic: two operations; when every rank skips the call (a
    ``no_dist`` load on every rank), the last one removes both keys."""
    group = _default_group()
    if group is None:
        return
    import torch.distributed as dist
    from dcp_platform import Watch, get_platform

    world = dist.get_world_size()
    if world < 2:
        return
    name = f"dcp-load/{slot}"
    try:
        watch = Watch(get_platform("torch"), name)
        watch.abort({watch.rank: [f"{cause} (load call {slot} of this process)"]})
        store = watch.platform.store()
        if store.add(f"{name}/skipped", 1) >= world:
            store.delete_key(f"{name}/abort")
            store.delete_key(f"{name}/skipped")
    except Exception as exc:  # noqa: BLE001 - the others still name this rank after their timeout
        logger.warning("could not tell the other ranks that load call %d is skipped here: %r", slot, exc)


class Coordinator:
    """Arrival barrier, bounded waits and failure publication for one load (or ``save``,
    ``operation="save"``: watch ``dcp-save/<n>``, phase ``"save"``) on one rank."""

    def __init__(self, platform: Any, *, collective: bool, timeout: float, operation: str = "load",
                 slot: int | None = None):
        self.platform, self.timeout = platform, timeout
        self.operation = operation
        self.phase = "validate" if operation == "load" else operation
        self.watch: Any = None
        self._shared = False  # the error being raised is already known to every rank
        if collective:
            from dcp_platform import Watch

            if slot is None:
                slot = next(_SAVES) if operation == "save" else next_load_slot()
            self.watch = Watch(platform, f"dcp-{operation}/{slot}", stall_s=max(timeout, MIN_STALL_S))

    def __enter__(self) -> Coordinator:
        if self.watch is not None:
            self.watch.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if self.watch is None:
            return False
        if exc is not None and (self.watch.interrupted or (self.phase == "execute" and not self._shared)):
            # A collective may be left unfinished (module docstring).
            _mark_unusable(f"{self.watch.name} failed in phase {self.phase!r} with a collective unfinished "
                           f"({type(exc).__name__}: {str(exc)[:200]})")
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
        """Wait (at most ``timeout``) until every rank entered ``load``; raise at once when
        an earlier failure left the process group unusable (module docstring)."""
        if self.watch is None:
            return
        cause = unusable_cause()
        if cause is not None:
            raise LoadError({self.watch.rank: [
                f"the default process group may hold an unfinished collective: {cause}; destroy it and "
                "create a new one (torch.distributed.destroy_process_group(), then "
                f"init_process_group(...)) on every rank, or restart the job, before calling {self.operation} "
                "again"]}, self.phase)
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

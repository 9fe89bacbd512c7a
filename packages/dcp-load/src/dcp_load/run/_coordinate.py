"""Failing together within bounded time: one ``Coordinator`` per ``load``.

It wraps a ``dcp_platform.Watch`` named ``dcp-load/<n>`` (``dcp-save/<n>`` for ``save``).
``n`` counts this process's calls of the operation that take part with collectives
(``next_slot``): a call without collectives (``no_dist=True``, ``use_collectives=False``,
and so ``read_state_dict``, ``convert`` and the ``dcp`` command) takes no number, so calls
that one rank makes alone never shift the others' pairing. A collective call counts even
when it raises on its arguments: it publishes why it takes no part (``skip_slot``), and
the ranks that made the same call raise ``LoadError`` naming it at once. A rank that comes
to call ``n`` after the others gave up on it fails alone, and its next call is their next
one. Each call records what it is (``_calls.py``), so that a call left waiting names what
the missing rank calls now, and a late one what the others moved on to.
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

import logging
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from .._errors import LoadError
from ..plan._digest import all_reduce
from ._calls import note_call, others_moved_past, with_calls
from ._validate import exchange

__all__ = ["DEFAULT_TIMEOUT", "WORLD", "Coordinator", "next_load_slot", "next_slot", "note_one_process_call", "peek_slot",
           "refused_together", "scope_of", "skip_slot", "timeout_seconds", "unusable_cause"]

logger = logging.getLogger(__name__)

#: Default bound on how long the first rank to enter ``load`` waits for the last one,
#: when there is no default process group to take the timeout from.
DEFAULT_TIMEOUT = timedelta(minutes=10)

#: The shortest bound on one collective's wait: a bound meant to end a hang (ranks in
#: different collectives) must not end a slow but healthy collective when ``timeout=`` is
#: small (a few seconds of arrival wait), since that leaves the process group unusable.
MIN_STALL_S = 30.0

# Process-wide counts per process group (``Platform.group_key``: ``"world"`` for the
# default group): every collective load, save and transfer. Every rank counts
# its own calls; a module-level counter is what lets separate Platform objects (one per
# call) agree, and one per group lets loads on a sub-group leave the world's count alone.
_COUNTS: dict[tuple[str, str], int] = {}
_COUNTS_LOCK = threading.Lock()

# Process groups left with an unfinished collective by a failed load or save, by group key:
# key -> (group, cause). An entry counts only while that group object is still the one the
# key names (a re-created default group is a new object).
_UNUSABLE: dict[str, tuple[Any, str]] = {}

WORLD = "world"

def next_slot(operation: str, scope: str = WORLD) -> int:
    """The number of this ``operation`` call (``load``, ``save``, ``transfer``) of this process
    on the group ``scope`` names."""
    with _COUNTS_LOCK:
        slot = _COUNTS.get((operation, scope), 0)
        _COUNTS[(operation, scope)] = slot + 1
    return slot


def peek_slot(operation: str, scope: str = WORLD) -> int:
    """The number the next ``operation`` call on ``scope`` will take (nothing is taken)."""
    return _COUNTS.get((operation, scope), 0)


def next_load_slot(scope: str = WORLD) -> int:
    """The number of this collective ``load`` call in this process."""
    return next_slot("load", scope)


def scope_of(process_group: Any) -> str:
    """The counting scope of a ``process_group=`` argument (``WORLD`` for None)."""
    if process_group is None:
        return WORLD
    from dcp_platform import group_key

    return group_key(process_group)


def timeout_seconds(timeout: Any, what: str = "load", platform: Any = None) -> float:
    """``timeout=`` of ``what`` (``load``/``save``) as seconds (a ``timedelta`` or a positive
    number). ``None``: the process group's timeout (``platform.group_timeout()``),
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


def _group_of(platform: Any) -> tuple[str, Any] | None:
    """(key, group object) of the group ``platform`` works within, or None without one."""
    if platform is None or not platform.is_distributed() or not hasattr(platform, "world_group"):
        return None
    try:
        return getattr(platform, "group_key", WORLD), platform.world_group()
    except (RuntimeError, NotImplementedError):
        return None


def unusable_cause(platform: Any) -> str | None:
    """Why the group ``platform`` works within cannot run another load, or None."""
    group = _group_of(platform)
    entry = _UNUSABLE.get(group[0]) if group is not None else None
    return entry[1] if entry is not None and entry[0] is group[1] else None


def _mark_unusable(platform: Any, cause: str) -> None:
    group = _group_of(platform)
    if group is not None and unusable_cause(platform) is None:
        _UNUSABLE[group[0]] = (group[1], cause)


def _torch_platform(process_group: Any) -> Any:
    """The torch platform of ``process_group`` (None: the default group), or None when
    there is no group of more than one rank to tell."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    from dcp_platform import get_platform

    try:
        platform = get_platform("torch", group=process_group)
    except ValueError:  # not a group of this rank: its members are not waiting for this one
        return None
    return platform if platform.world_size() > 1 else None


def skip_slot(slot: int, cause: str, process_group: Any = None, operation: str = "load") -> None:
    """Tell the ranks that make ``operation`` call ``slot`` with collectives that this rank
    takes no part in it (``cause`` says why), within ``process_group`` (None: the default
    group). Without a group of more than one rank, nothing. Store traffic: two operations;
    when every rank skips the call (a ``no_dist`` load on every rank), the last one removes
    both keys."""
    from dcp_platform import Watch

    try:
        platform = _torch_platform(process_group)
        if platform is None:
            return
        name = f"dcp-{operation}/{slot}"
        watch = Watch(platform, name)
        watch.abort({watch.rank: [f"{cause} ({operation} call {slot} of this process)"]})
        store = platform.store()
        if store.add(f"{name}/skipped", 1) >= platform.world_size():
            store.delete_key(f"{name}/abort")
            store.delete_key(f"{name}/skipped")
    except Exception as exc:  # noqa: BLE001 - the others still name this rank after their timeout
        logger.warning("could not tell the other ranks that %s call %d is skipped here: %r", operation, slot, exc)


def note_one_process_call(process_group: Any, what: str) -> None:
    """Record a call made without collectives by a rank of ``process_group`` (None: the
    default group), when there is a group of more than one rank: it takes no call number,
    so a rank waiting for it in a collective call can name it only from this record."""
    try:
        platform = _torch_platform(process_group)
        if platform is not None:
            note_call(platform.store(), scope_of(process_group), platform.rank(), what)
    except Exception as exc:  # noqa: BLE001 - a call without collectives never fails on the store
        logger.debug("could not record call %r: %r", what, exc)


def refused_together(operation: str, slot: int | None, process_group: Any, step: Any) -> Any:
    """``step()``, the checks a rank makes alone before ``operation`` call ``slot`` (None: a
    call without collectives); when it raises, the other ranks learn it at once
    (``skip_slot``) and this rank's count stays theirs: the call counted."""
    try:
        return step()
    except BaseException as exc:
        if slot is not None:
            skip_slot(slot, f"raised before taking part: {type(exc).__name__}: {exc}", process_group, operation)
        raise


class Coordinator:
    """Arrival barrier, bounded waits and failure publication for one load (or ``save``,
    ``operation="save"``: watch ``dcp-save/<n>``, phase ``"save"``) on one rank."""

    def __init__(self, platform: Any, *, collective: bool, timeout: float, operation: str = "load",
                 slot: int | None = None, target: str = ""):
        self.platform, self.timeout = platform, timeout
        self.operation, self.target = operation, target  # target: the checkpoint, named in errors
        self.phase = "validate" if operation == "load" else operation
        self.watch: Any = None
        self._shared = False  # the error being raised is already known to every rank
        self.scope = getattr(platform, "group_key", WORLD)
        if collective:
            self.slot = next_slot(operation, self.scope) if slot is None else slot
            self.watch = self._watch(self.slot)

    def _watch(self, slot: int) -> Any:
        from dcp_platform import Watch

        return Watch(self.platform, f"dcp-{self.operation}/{slot}", stall_s=max(self.timeout, MIN_STALL_S))

    def __enter__(self) -> Coordinator:
        if self.watch is not None:
            self.watch.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if self.watch is None:
            return False
        if exc is not None and (self.watch.interrupted or (self.phase == "execute" and not self._shared
                                                            and not self._foreign(exc))):
            # A collective may be left unfinished (module docstring).
            _mark_unusable(self.platform, f"{self.watch.name} failed in phase {self.phase!r} with a collective unfinished "
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
    def _foreign(exc: BaseException) -> bool:
        """A store value another process wrote: raised between collectives, by a store
        read that leaves none pending (``Watch.reduced``, the abort and outcome keys)."""
        from dcp_platform import ControlMessageError

        return isinstance(exc, ControlMessageError)

    @staticmethod
    def _is_peer(exc: BaseException) -> bool:
        from dcp_platform import PeerFailure

        return isinstance(exc, PeerFailure)

    def _load_error(self, exc: Any) -> LoadError:
        return LoadError(exc.failures, self.phase)

    def arrive(self) -> None:
        """Wait (at most ``timeout``) until every rank entered ``load``; raise at once when
        an earlier failure left the process group unusable (module docstring). A rank that
        comes after the others gave up on this call fails alone, naming the call they are in,
        unless the call they gave up is one this rank made without collectives meanwhile and
        the one they wait in now is this call (``_calls.others_moved_past``): it joins that."""
        from dcp_platform import PeerFailure

        if self.watch is None:
            return
        cause = unusable_cause(self.platform)
        if cause is not None:
            raise LoadError({self.watch.rank: [
                f"the process group may hold an unfinished collective: {cause}; destroy it and "
                "create a new one (torch.distributed.destroy_process_group(), then "
                f"init_process_group(...)) on every rank, or restart the job, before calling {self.operation} "
                "again"]}, self.phase)
        store, me, world = self.platform.store(), self.watch.rank, self.platform.world_size()
        for attempt in (0, 1):
            note_call(store, self.scope, me, self.describe(), self.slot)
            try:
                self.watch.arrive(self.timeout)
                return
            except PeerFailure as exc:
                others = [r for r in range(world) if r != me][:8]  # any one that gave up is enough
                if attempt or not self._left_behind(exc) or not any(others_moved_past(
                        store, self.scope, r, self.slot, self.describe()) for r in others):
                    raise PeerFailure(with_calls(exc.failures, me, self.describe(), store, self.scope, world)) from exc
            # This rank made the others' call without collectives, and they now wait in this
            # one: take its number (_calls.others_moved_past).
            logger.info("rank %d: %s was given up by the other ranks for another call; they wait in the next, "
                        "which is this one", me, self.watch.name)
            self.watch.close(success=False)
            self.slot = next_slot(self.operation, self.scope)
            self.watch = self._watch(self.slot)
            self.watch.__enter__()

    def _left_behind(self, exc: Any) -> bool:
        """``Watch.left_behind``; a foreign value under its key is one more cause of ``exc``
        (a ``PeerFailure``, raised with it: the caller's error stays a ``LoadError``)."""
        from dcp_platform import ControlMessageError, PeerFailure

        try:
            return self.watch.left_behind()
        except ControlMessageError as bad:
            causes = {**exc.failures, self.watch.rank: (*exc.failures.get(self.watch.rank, ()), str(bad))}
            raise PeerFailure(causes) from exc

    def describe(self) -> str:
        """This call as the other ranks' errors name it: operation, number and checkpoint."""
        return f"{self.operation} call {self.slot}" + (f" of {self.target}" if self.target else "")

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

"""``transfer``: move live tensors from the ranks that hold them into other ranks' layouts.

A trainer's shards are a checkpoint whose chunks sit in other ranks' memory: the ranks
gather what each holds and wants once (``_layout``), plan who sends each piece
(``_planner``), and move the pieces with batched broadcasts (``_move``). The plan, the
targets' shardings and the broadcast groups are kept per layout: a later transfer between
the same layouts (the reinforcement-learning loop's case) costs one all-reduce of a digest
before the data moves, and a changed layout on any rank is planned anew on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from dcp_platform import PeerFailure

from .._errors import LoadError
from .._load import DEFAULT_BATCH_BYTES, fallback_platform, resolve_platform
from ..layouts._sources import SourceMap, sources_text
from ..layouts._targets import Target
from ..plan._digest import digest
from ..run._coordinate import (
    Coordinator,
    next_slot,
    refused_together,
    scope_of,
    timeout_seconds,
    unusable_cause,
)
from ..run._validate import exchange
from . import _ledger
from ._delta import Delta
from ._fp8 import plan_layouts
from ._kept import agree, forget, group_object, keep
from ._layout import Side, build_targets, entries, pointers, side_of, signature, with_locals
from ._move import MoveStats, Pending, lazily, mine, move, prepare
from ._planner import TransferPlan
from ._sync_group import sides_named

__all__ = ["TransferReport", "transfer"]

logger = logging.getLogger(__name__)

#: Broadcasts in flight per rank (dcp-broadcast's default: its README measures it).
MAX_IN_FLIGHT = 8


@dataclass(frozen=True)
class TransferReport:
    """One rank's account of one ``transfer``.

    ``bytes_kept``: bytes of the boxes this rank's ``dst`` holds (what it was filled with).
    ``bytes_received`` / ``bytes_sent``: bytes that reached this rank by broadcast / that it
    sent (in the dtype that travelled: the narrower of source and destination).
    ``bytes_copied``: bytes this rank copied from its own ``src`` into its own ``dst``.
    ``broadcasts``: broadcasts this rank took part in; ``collectives``: those and the
    control collectives (the plan check, the planning exchange of a new layout, the final
    check). ``plan_reused``: the plan of an earlier transfer between the same layouts was
    used (no planning exchange). ``cast``: destinations filled from another dtype;
    ``composed``: (destination, source tensors) of each destination ``sources=`` mapped.
    ``skipped_not_in_mesh``: DTensor entries whose mesh leaves this rank out.
    ``seconds``: ``plan`` (from entry to the plan agreed), ``execute``, ``total``.
    """

    rank: int
    world_size: int
    tensors_held: int
    tensors_filled: int
    bytes_kept: int
    bytes_received: int
    bytes_sent: int
    bytes_copied: int
    broadcasts: int
    collectives: int
    pieces: int
    plan_reused: bool
    job_bytes_sent: int
    seconds: Mapping[str, float] = field(default_factory=dict)
    cast: tuple[str, ...] = ()
    composed: tuple[tuple[str, int], ...] = ()
    skipped_not_in_mesh: tuple[str, ...] = ()


@dataclass
class _Entry:
    """A plan kept for reuse, with the targets it was made from and its groups. ``job``:
    the plan's name on every rank (a digest of every rank's ``key``); ``key``: this rank's
    layout and settings when it was made."""

    job: int
    key: int
    plan: TransferPlan
    src: dict[str, Target]
    dst: dict[str, Target]
    rounds: list[Any]
    groups: Any
    world: Any
    outside: tuple[str, ...]
    sets: list[tuple[int, ...]]
    prepared: Any = None  # this rank's prepared rounds (one round only), for the tensors at ``pointers``
    pointers: Any = None
    fp8: Any = None  # this rank's ``_fp8.Quantizer`` when the plan has FP8 blockwise destinations
    delta: Any = None  # ``_delta.Delta`` of a plan made with delta=True


def _check_arguments(batch_bytes: Any, max_in_flight: Any, timeout: Any) -> None:
    for what, value, low in (("batch_bytes", batch_bytes, 0), ("max_in_flight", max_in_flight, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"transfer: {what} must be an int >= {low}, got {value!r}")
    if timeout is not None:
        timeout_seconds(timeout, "transfer")


#: Staging a rank holds at once for cast and lone strided pieces, per round of the plan
#: (``_planner._rounds``), as a multiple of ``batch_bytes``: the scheduler's own bound is
#: ``batch_bytes`` x ``max_in_flight``; this keeps the transfer's staging at that size.
STAGE_BATCHES = 8


def transfer(
    src: Mapping[Any, Any] | None,
    dst: Mapping[Any, Any] | None,
    *,
    sources: Mapping[str, Any] | None = None,
    allow_dtype_cast: bool = True,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    max_in_flight: int = MAX_IN_FLIGHT,
    platform: Any = None,
    timeout: Any = None,
    keep_plan: bool = True,
    process_group: Any = None,
    delta: bool = False,
) -> TransferReport:
    """Fill ``dst`` in place with the values that the ranks' ``src`` hold; call on every rank.

    ``src``: what this rank holds (DTensors on any mesh, plain tensors standing for the
    whole tensor, ``Chunk``s, ``Flat`` buffers; nested mappings allowed), or None. ``dst``:
    what this rank must fill, of the same kinds, or None. A rank may pass both (a trainer
    and an engine on the same ranks). ``src`` is never written. Each destination box is
    cut along the boxes the ranks hold; each piece is sent by one holder (a receiver that
    holds it copies locally), to every rank that wants it, in broadcasts over the holder
    and its receivers, small pieces packed below ``batch_bytes`` (0: none), at most
    ``max_in_flight`` in flight.

    ``sources``: ``{destination key: source}`` as in ``load`` (a name of a ``src`` tensor,
    ``Concat``, ``Stack`` or ``Slice``; ``{name}`` placeholders). ``allow_dtype_cast``:
    destinations of another dtype are cast (the narrower dtype travels); ``False`` refuses.
    ``timeout``: how long the ranks wait for each other (as ``load``'s). ``keep_plan``:
    keep the plan, the shardings and the broadcast groups for the next transfer between the
    same layouts (checked by one all-reduce of a digest on every call; a change on any rank
    plans again everywhere; up to ``_kept.MAX_PLANS`` per process group, the same on every
    rank); ``False`` forgets them after this call (a plan is kept only when every rank
    keeps it).

    Every problem (a destination no rank holds, shapes that differ, a cast refused, ranks
    passing different settings) raises ``LoadError`` on every rank before any destination
    is written. A failure while data moves (a rank raises or dies) raises ``LoadError`` on
    every rank and forgets the plan (the next transfer sends everything); the destinations
    may then hold a mix of two steps, except after a ``delta`` call (below) past its first.
    ``process_group``: the group to transfer within (default: the default group; plans and
    groups are kept per group). A rank whose arguments are refused tells the others at once.
    ``delta``: send only what changed since this plan's last transfer (``_delta``; the first
    sends all); later calls stage what arrives and write it once every rank succeeded, so a
    failed one leaves the previous step. Returns this rank's ``TransferReport``.
    """
    slot = next_slot("transfer", scope_of(process_group))
    refused_together("transfer", slot, process_group, lambda: _check_arguments(batch_bytes, max_in_flight, timeout))
    start = time.perf_counter()
    src_side, dst_side, errors = side_of("src", src), side_of("dst", dst), []
    bound = None if timeout is None else timeout_seconds(timeout, "transfer")
    source_map, platform = _resolve(sources, platform, [*src_side.leaves, *dst_side.leaves], process_group, errors,
                                    bound)
    coord = Coordinator(platform, collective=platform.is_distributed(), operation="transfer", slot=slot,
                        timeout=timeout_seconds(timeout, "transfer", platform=platform))
    settings = (batch_bytes, max_in_flight, bool(allow_dtype_cast), sources_text(sources), STAGE_BATCHES, bool(delta))
    writes = _Writes()
    with writes.noted(), sides_named(process_group), coord:  # within a TransferGroup, errors say which job is which
        return _transfer(coord, platform, platform.is_distributed(), src_side, dst_side, errors, settings,
                         source_map, keep_plan=keep_plan, start=start, writes=writes)


class _Writes:
    """How this call writes the destinations, known once the plan is: in place as pieces
    arrive, or (``staged``: a delta call after its plan's first) only after every rank
    succeeded. A ``LoadError`` after that point says what the destinations hold."""

    IN_PLACE = ("transfer: the destinations may hold a mix of two steps (pieces written before the failure "
                "hold the new values, the others the previous ones); this call's plan was forgotten, so the "
                "next transfer plans again and sends everything (with delta=True too)")
    STAGED = ("transfer(delta=True): no destination was written (the pieces were staged, to be written only "
              "after every rank succeeded): every destination holds the previous transfer's values; this "
              "call's plan was forgotten, so the next transfer plans again and sends everything")

    def __init__(self) -> None:
        self.known = self.staged = False

    @contextlib.contextmanager
    def noted(self) -> Iterator[None]:
        try:
            yield
        except LoadError as exc:
            if self.known and exc.phase != "validate":  # in place of the line written for ``load``
                exc.advise(self.STAGED if self.staged else self.IN_PLACE)
            raise


def _resolve(sources: Mapping[str, Any] | None, platform: Any, leaves: list[Any], process_group: Any,
             errors: list[str], bound: float | None) -> tuple[SourceMap | None, Any]:
    """(the parsed ``sources``, the platform) of a transfer; a problem with either is appended to
    ``errors`` (reported through the exchange, so that no rank waits for this one). ``bound``:
    the call's timeout, which also bounds every group the platform creates for it."""
    source_map = None
    if sources is not None:
        try:
            source_map = SourceMap(sources, owner="transfer")
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    try:
        platform = resolve_platform(platform, leaves, process_group, group_timeout=bound)
    except Exception as exc:  # noqa: BLE001 - reported through the exchange
        platform = fallback_platform(exc, process_group)
        errors.append(f"choosing the platform failed: {type(exc).__name__}: {exc}")
    return source_map, platform


_SETTINGS = ("batch_bytes", "max_in_flight", "allow_dtype_cast", "sources", "staging", "delta")


def _settings_differ(mine: tuple[Any, ...], first: tuple[Any, ...]) -> str:
    """The transfer settings in which a rank differs from rank 0, named, for the refusal."""
    shown = [f"{name}={a!s:.300} (rank 0: {b!s:.300})" for name, a, b in zip(_SETTINGS, mine, first, strict=True)
             if a != b]
    return f"transfer settings differ from rank 0's: {'; '.join(shown)}; every rank must pass the same settings"


def _new_plan(coord: Coordinator, platform: Any, collective: bool, src: Side, dst: Side, errors: list[str],
              key: int, settings: tuple[Any, ...], source_map: SourceMap | None) -> _Entry:
    """Gather every rank's layout (one all-gather), check it and plan; every problem raises
    ``LoadError`` on every rank before anything is written."""
    from dcp_broadcast import GroupManager

    caps = platform.capabilities
    build_targets(src, caps)
    build_targets(dst, caps)
    errors = [*errors, *src.errors, *dst.errors]
    gathered = coord.exchange(exchange, errors, "validate", collective=collective,
                              payload=(entries(src), entries(dst), key, settings))
    if len({g[3] for g in gathered}) > 1:
        raise LoadError({r: [_settings_differ(g[3], gathered[0][3])] for r, g in enumerate(gathered)
                         if g[3] != gathered[0][3]}, "validate")
    batch_bytes = settings[0]
    plan, fp8 = plan_layouts([(g[0], g[1]) for g in gathered], source_map, allow_cast=settings[2],
                             batch_bytes=batch_bytes, stage_bytes=max(batch_bytes, 1 << 20) * STAGE_BATCHES)
    me = platform.rank() if collective else 0
    if plan.errors:  # the same on every rank: the exchange raises it everywhere, naming each rank
        coord.exchange(exchange, plan.errors.get(me, []), "validate", collective=collective)
        raise LoadError(plan.errors, "validate")  # not reached: every rank has the same errors
    return _Entry(job=digest(tuple(g[2] for g in gathered)), key=key, plan=plan,
                  src=src.targets, dst=dst.targets,
                  rounds=mine(plan, me, caps.subgroups), groups=GroupManager(platform, watch=coord.waiter),
                  world=group_object(platform), outside=(*src.outside, *dst.outside), fp8=fp8,
                  delta=Delta(me, max(batch_bytes, 1 << 20) * STAGE_BATCHES) if settings[5] else None,
                  sets=sorted({p.ranks for p in plan.pieces if len(p.ranks) > 1 and me in p.ranks}))


def _execute(coord: Coordinator, platform: Any, entry: _Entry, src: Mapping[str, Target],
             dst: Mapping[str, Target], *, fresh: bool, batch_bytes: int,
             max_in_flight: int) -> tuple[MoveStats, Pending | None]:
    """This rank's copies and broadcasts (phase ``execute``), and the writes a delta call
    holds back (``_delta``: applied by ``_commit``); a failure here is named to every rank
    by the coordinator."""
    coord.phase = "execute"
    try:
        if fresh:  # each rank names the groups it is in; later transfers find them made
            entry.groups.ensure(entry.sets, own=True)
        if entry.delta is None or not entry.delta.committed:  # written in place: other delta plans see it
            _ledger.written(_ledger.spans(dst))
        if entry.delta is None:
            return move(platform, _prepared(platform, entry, src, dst, batch_bytes), max_in_flight=max_in_flight,
                        groups=entry.groups, watch=coord.waiter), None
        pending = Pending(platform) if entry.delta.committed else None
        steps = entry.delta.steps(platform, entry.plan, src, dst, collective=platform.is_distributed(),
                                  subgroups=platform.capabilities.subgroups, batch_bytes=batch_bytes,
                                  watch=coord.waiter, pending=pending)
        stats = move(platform, steps, max_in_flight=max_in_flight, groups=entry.groups, watch=coord.waiter)
        return stats, pending
    except PeerFailure:
        raise  # another rank's failure: the coordinator names it
    except Exception as exc:
        raise LoadError({platform.rank(): [f"{type(exc).__name__}: {exc}"]}, "execute") from exc


def _commit(entry: _Entry, src: Mapping[str, Target], pending: Pending | None) -> None:
    """After every rank passed the final check: a delta call's held-back writes, then the
    senders' record of what they sent. Local only: no peer can fail it from here."""
    if entry.delta is None:
        return
    if pending is not None:
        pending.apply()
    entry.delta.sent_now(entry.plan, src)


def _prepared(platform: Any, entry: _Entry, src: Mapping[str, Target], dst: Mapping[str, Target],
              batch_bytes: int) -> Any:
    """The rounds to run. A plan of one round keeps its items (views, staging) while the
    tensors stay where they were: building 3,000 broadcast items took ~0.6 s of a reused
    transfer of 2,000 small tensors (profiled, 2-core development machine). Several rounds
    are built one at a time, so that only one round's staging exists at once."""
    if len(entry.rounds) != 1:
        return lazily(platform, entry.rounds, src, dst, batch_bytes=batch_bytes)
    where = (pointers(src), pointers(dst))
    if entry.prepared is None or entry.pointers != where:
        entry.prepared, entry.pointers = prepare(platform, entry.rounds, src, dst, batch_bytes=batch_bytes), where
    return entry.prepared


def _transfer(coord: Coordinator, platform: Any, collective: bool, src: Side, dst: Side, errors: list[str],
              settings: tuple[Any, ...], source_map: SourceMap | None, *, keep_plan: bool,
              start: float, writes: _Writes) -> TransferReport:
    """``transfer``: wait for every rank, agree on a kept plan or plan anew, move, check, write."""
    coord.phase = "validate"
    coord.arrive()
    # the call's timeout in the key: a kept plan's groups were made with its call's bound
    key = digest(signature(src), signature(dst), settings, getattr(platform, "group_key", "world"), coord.timeout)
    entry, kept_after = agree(platform, collective, key, failed=bool(errors) or unusable_cause(platform) is not None,
                              keep_plan=keep_plan, watch=coord.waiter)
    reused = entry is not None
    control = int(collective)
    if entry is None:
        entry = _new_plan(coord, platform, collective, src, dst, errors, key, settings, source_map)
        control += int(collective)
        src_t, dst_t = entry.src, entry.dst
    else:
        src_t, dst_t = with_locals(src, entry.src), with_locals(dst, entry.dst)
    writes.known, writes.staged = True, entry.delta is not None and entry.delta.committed
    if entry.fp8 is not None:  # this rank's sources of FP8 blockwise destinations, quantized now
        src_t = entry.fp8.quantized(src_t)
    planned = time.perf_counter()
    done = False
    try:
        stats, pending = _execute(coord, platform, entry, src_t, dst_t, fresh=not reused, batch_bytes=settings[0],
                                  max_in_flight=settings[1])
        (job_sent,) = coord.check([], "execute", collective=collective, sums=(stats.bytes_sent,))
        _commit(entry, src_t, pending)
        done = True
    finally:
        if not done:
            forget(platform, entry)
    keep(platform, entry, kept_after)  # or forget it: decided alike on every rank (``agree``)
    control += int(collective)
    return _report(platform, collective, entry, dst_t, stats, reused=reused, control=control, job_sent=job_sent,
                   seconds={"plan": planned - start, "execute": stats.seconds,
                            "total": time.perf_counter() - start})


def _report(platform: Any, collective: bool, entry: _Entry, dst: Mapping[str, Target], stats: MoveStats, *,
            reused: bool, control: int, job_sent: int, seconds: dict[str, float]) -> TransferReport:
    from ..plan._owners import dtype_itemsize

    rank = platform.rank() if collective else 0
    report = TransferReport(
        rank=rank, world_size=platform.world_size() if collective else 1, tensors_held=len(entry.src),
        tensors_filled=len(entry.dst), bytes_kept=sum(t.numel * dtype_itemsize(t.dtype) for t in dst.values()),
        bytes_received=stats.bytes_received, bytes_sent=stats.bytes_sent, bytes_copied=stats.bytes_copied,
        broadcasts=stats.broadcasts, collectives=stats.broadcasts + control, pieces=stats.pieces,
        plan_reused=reused, job_bytes_sent=job_sent, seconds=seconds,
        cast=tuple(sorted(n for n in entry.plan.cast if n in dst)),
        composed=tuple((n, c) for n, c in entry.plan.composed.items() if n in dst),
        skipped_not_in_mesh=entry.outside)
    logger.debug("rank %d: transfer filled %d tensor(s) in %.4f s (plan %s): received %d, sent %d, copied %d "
                 "bytes in %d broadcast(s)", rank, report.tensors_filled, seconds["total"],
                 "reused" if reused else "made", report.bytes_received, report.bytes_sent, report.bytes_copied,
                 report.broadcasts)
    return report

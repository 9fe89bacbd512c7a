"""``transfer``: move live tensors from the ranks that hold them into other ranks' layouts.

A trainer's shards are a checkpoint whose chunks sit in other ranks' memory: the ranks
gather what each holds and wants once (``_layout``), plan who sends each piece
(``_planner``), and move the pieces with batched broadcasts (``_move``). The plan, the
targets' shardings and the broadcast groups are kept per layout: a later transfer between
the same layouts (the reinforcement-learning loop's case) costs one all-reduce of a digest
before the data moves, and a changed layout on any rank is planned anew on every rank.
That all-reduce also compares the call's version (``_versions``); how the call writes the
destinations (in place or staged) and what a failure leaves is ``_writes``; the caller's
hook runs once every rank succeeded (``_hook``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
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
from . import _ledger, _versions
from ._delta import Delta
from ._fp8 import plan_layouts
from ._hook import call_hook, check_hook
from ._kept import agree, forget, group_object, keep
from ._layout import Side, build_targets, entries, pointers, side_of, signature, with_locals
from ._move import MoveStats, Pending, lazily, mine, move, prepare
from ._planner import TransferPlan
from ._sync_group import sides_named
from ._writes import Writes

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
    ``version``: the version this transfer synced (``version=``, or the group's count), which
    this rank's destinations now hold (``synced_version``). ``changed``: the destinations
    this rank wrote (all it fills; with ``delta=True`` those that received changed values,
    and those copied from its own ``src``), as ``on_synced`` gets them.
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
    version: int | None = None
    changed: tuple[str, ...] = ()


@dataclass
class _Call:
    """One call's settings (compared between ranks), parsed ``sources``, caller's choices and writes."""

    settings: tuple[Any, ...]
    source_map: SourceMap | None
    keep_plan: bool
    start: float
    version: int | None
    writes: Writes


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


def _check_arguments(batch_bytes: Any, max_in_flight: Any, timeout: Any, version: Any, on_synced: Any) -> None:
    for what, value, low in (("batch_bytes", batch_bytes, 0), ("max_in_flight", max_in_flight, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"transfer: {what} must be an int >= {low}, got {value!r}")
    if timeout is not None:
        timeout_seconds(timeout, "transfer")
    _versions.check_version(version)
    check_hook(on_synced)


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
    version: int | None = None,
    atomic: bool = False,
    on_synced: Callable[[tuple[str, ...]], Any] | None = None,
) -> TransferReport:
    """Fill ``dst`` in place with the values that the ranks' ``src`` hold; call on every rank.

    ``src``: what this rank holds (DTensors on any mesh, plain tensors standing for the
    whole tensor, ``Chunk``s, ``Flat`` buffers; nested mappings allowed), or None. ``dst``:
    what this rank must fill, of the same kinds, or None; ``src`` is never written. Each
    destination box is cut along the boxes the ranks hold and each piece sent by one holder,
    in broadcasts over it and its receivers, packed below ``batch_bytes`` (0: none), at most
    ``max_in_flight`` in flight. ``sources``: ``{destination key: source}`` as in ``load``.
    ``allow_dtype_cast``: cast to the destinations' dtypes (the narrower travels). ``timeout``:
    how long the ranks wait for each other. ``keep_plan``: keep the plan and its groups for the
    next transfer between the same layouts (``_kept``; a plan is kept only when every rank
    keeps it). ``process_group``: the group to transfer within (default: the default group).
    ``delta``: send only what changed since this plan's last transfer (``_delta``).

    ``version``: the trainer's step this call syncs (every rank the same; None: the group's
    last version plus one); ``synced_version(dst)`` reads it afterwards. ``atomic``: stage
    what this rank receives and write its destinations only once every rank succeeded (a
    ``delta`` call after its plan's first does so anyway). ``on_synced(names)``: called on
    this rank after the call succeeded on every rank, with the destinations it wrote.

    Every problem (a destination no rank holds, shapes that differ, a cast refused, ranks
    passing different settings or versions) raises ``LoadError`` on every rank before any
    destination is written. A failure while data moves raises ``LoadError`` on every rank
    and forgets the plan; a call that wrote in place names this rank's torn destinations
    (``LoadError.torn``), a staged one wrote none. Returns this rank's ``TransferReport``
    (docs/transfer.md has the rules in full).
    """
    slot = next_slot("transfer", scope_of(process_group))
    refused_together("transfer", slot, process_group,
                     lambda: _check_arguments(batch_bytes, max_in_flight, timeout, version, on_synced))
    start = time.perf_counter()
    src_side, dst_side, errors = side_of("src", src), side_of("dst", dst), []
    bound = None if timeout is None else timeout_seconds(timeout, "transfer")
    source_map, platform = _resolve(sources, platform, [*src_side.leaves, *dst_side.leaves], process_group, errors,
                                    bound)
    coord = Coordinator(platform, collective=platform.is_distributed(), operation="transfer", slot=slot,
                        timeout=timeout_seconds(timeout, "transfer", platform=platform))
    settings = (batch_bytes, max_in_flight, bool(allow_dtype_cast), sources_text(sources), STAGE_BATCHES, bool(delta))
    call = _Call(settings, source_map, keep_plan, start, version, Writes(bool(atomic)))
    with call.writes.noted(), sides_named(process_group), coord:  # within a TransferGroup, errors say which job is which
        report = _transfer(coord, platform, platform.is_distributed(), src_side, dst_side, errors, call)
    call_hook(on_synced, report)  # after the coordinator: nothing the hook does involves the other ranks
    return report


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


def _steps(platform: Any, entry: _Entry, src: Mapping[str, Target], dst: Mapping[str, Target], *,
           batch_bytes: int, pending: Pending | None, watch: Any) -> Any:
    """The rounds this call runs: a delta plan's changed pieces, a staged call's rounds built
    for its ``pending``, or the plan's prepared rounds (kept for the next call)."""
    if entry.delta is not None:
        return entry.delta.steps(platform, entry.plan, src, dst, collective=platform.is_distributed(),
                                 subgroups=platform.capabilities.subgroups, batch_bytes=batch_bytes,
                                 watch=watch, pending=pending)
    if pending is not None:
        return lazily(platform, entry.rounds, src, dst, batch_bytes=batch_bytes, pending=pending)
    return _prepared(platform, entry, src, dst, batch_bytes)


def _execute(coord: Coordinator, platform: Any, entry: _Entry, src: Mapping[str, Target],
             dst: Mapping[str, Target], *, fresh: bool, call: _Call) -> tuple[MoveStats, Pending | None]:
    """This rank's copies and broadcasts (phase ``execute``), and the writes a staged call
    holds back (applied by ``_commit``); a failure here is named to every rank by the
    coordinator."""
    coord.phase = "execute"
    writes = call.writes
    try:
        if fresh:  # each rank names the groups it is in; later transfers find them made
            entry.groups.ensure(entry.sets, own=True)
        if entry.delta is None or not entry.delta.committed:  # written by this call: other delta plans see it
            _ledger.written(writes.spans)
        pending = Pending(platform) if writes.staged else None
        steps = _steps(platform, entry, src, dst, batch_bytes=call.settings[0], pending=pending, watch=coord.waiter)
        stats = move(platform, steps, max_in_flight=call.settings[1], groups=entry.groups, watch=coord.waiter,
                     touched=writes.torn)
        return stats, pending
    except PeerFailure:
        raise  # another rank's failure: the coordinator names it
    except Exception as exc:
        raise LoadError({platform.rank(): [f"{type(exc).__name__}: {exc}"]}, "execute") from exc


def _commit(entry: _Entry, src: Mapping[str, Target], pending: Pending | None, stats: MoveStats,
            writes: Writes, version: int, scope: str) -> None:
    """After every rank passed the final check: a staged call's held-back writes, the senders'
    record of what they sent (delta), and the version this rank's destinations now hold.
    Local only: no peer can fail it from here."""
    if pending is not None:
        writes.torn.update(stats.written)  # should applying them fail part way, these are torn
        pending.apply()
    if entry.delta is not None:
        entry.delta.sent_now(entry.plan, src)
    _versions.record(writes.spans, version)
    _versions.committed(scope, version)
    writes.finished()


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


def _run(coord: Coordinator, platform: Any, entry: _Entry, src: Mapping[str, Target], dst: Mapping[str, Target],
         *, fresh: bool, call: _Call, version: int) -> tuple[MoveStats, int]:
    """Move, check on every rank, commit: (this rank's stats, the bytes the job sent). A
    failure forgets the plan (its groups may hold unfinished broadcasts)."""
    collective = platform.is_distributed()
    done = False
    try:
        stats, pending = _execute(coord, platform, entry, src, dst, fresh=fresh, call=call)
        (job_sent,) = coord.check([], "execute", collective=collective, sums=(stats.bytes_sent,))
        _commit(entry, src, pending, stats, call.writes, version, getattr(platform, "group_key", "world"))
        done = True
    finally:
        if not done:
            forget(platform, entry)
    return stats, job_sent


def _transfer(coord: Coordinator, platform: Any, collective: bool, src: Side, dst: Side, errors: list[str],
              call: _Call) -> TransferReport:
    """``transfer``: wait for every rank, agree on a kept plan (or plan anew) and on the
    version, move, check, write."""
    coord.phase = "validate"
    coord.arrive()
    scope = getattr(platform, "group_key", "world")
    # the call's timeout in the key: a kept plan's groups were made with its call's bound
    key = digest(signature(src), signature(dst), call.settings, scope, coord.timeout)
    version = _versions.resolve(call.version, scope)
    entry, kept_after, versions = agree(platform, collective, key, keep_plan=call.keep_plan, watch=coord.waiter,
                                        failed=bool(errors) or unusable_cause(platform) is not None,
                                        extra=(version, -version))
    if versions[0] != -versions[1]:  # MAX of the versions and of their negations: they differ
        _versions.refuse(coord, errors, version, call.version is not None)
    reused = entry is not None
    control = int(collective)
    if entry is None:
        entry = _new_plan(coord, platform, collective, src, dst, errors, key, call.settings, call.source_map)
        control += int(collective)
        src_t, dst_t = entry.src, entry.dst
    else:
        src_t, dst_t = with_locals(src, entry.src), with_locals(dst, entry.dst)
    call.writes.decide(entry.delta, _ledger.spans(dst_t))
    if entry.fp8 is not None:  # this rank's sources of FP8 blockwise destinations, quantized now
        src_t = entry.fp8.quantized(src_t)
    planned = time.perf_counter()
    stats, job_sent = _run(coord, platform, entry, src_t, dst_t, fresh=not reused, call=call, version=version)
    keep(platform, entry, kept_after)  # or forget it: decided alike on every rank (``agree``)
    control += int(collective)
    return _report(platform, collective, entry, dst_t, stats, reused=reused, control=control, job_sent=job_sent,
                   version=version, seconds={"plan": planned - call.start, "execute": stats.seconds,
                                             "total": time.perf_counter() - call.start})


def _report(platform: Any, collective: bool, entry: _Entry, dst: Mapping[str, Target], stats: MoveStats, *,
            reused: bool, control: int, job_sent: int, version: int, seconds: dict[str, float]) -> TransferReport:
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
        skipped_not_in_mesh=entry.outside, version=version, changed=tuple(n for n in dst if n in stats.written))
    logger.debug("rank %d: transfer filled %d tensor(s) in %.4f s (plan %s): received %d, sent %d, copied %d "
                 "bytes in %d broadcast(s)", rank, report.tensors_filled, seconds["total"],
                 "reused" if reused else "made", report.bytes_received, report.bytes_sent, report.bytes_copied,
                 report.broadcasts)
    return report

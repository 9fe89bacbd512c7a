"""The steps of ``load`` (``dcp_load._load``): entering the call, preparing this rank's
targets, planning, executing and reporting. Each step is one function; ``load`` calls them
in order, and every failure before ``execute`` reaches the other ranks through an exchange.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from dcp_platform import PeerFailure

from .._errors import LoadError
from ..layouts._aliases import resolve_aliases
from ..layouts._flat_target import check_overlaps
from ..layouts._sources import SourceMap
from ..layouts._state import Chunk, Flat, flatten_state_dict, is_tensor, unsupported_values
from ..layouts._stateful import Resolved, hand_back
from ..layouts._stateful import resolve as resolve_statefuls
from ..layouts._target_for import target_for
from ..layouts._targets import Target, in_mesh
from ..plan._derived import checkpoint_digest, derived_plan, ensure_groups, settings_text
from ..plan._digest import checkpoint_causes
from ..plan._hosts import HOST_ID_ENV, host_id
from ..plan._plan import BROADCASTABLE, VIEWS, Want, build_global_plan
from ._calls import describe_target
from ._coordinate import Coordinator, note_one_process_call, scope_of, skip_slot, timeout_seconds
from ._execute import execute, fetched
from ._progress import Progress
from ._report import LoadReport
from ._shared_open import local_storage, open_shared
from ._validate import ReadChecks, check_dtypes, check_launch, check_reads, check_targets, exchange

__all__ = ["AUTO", "Phases", "Prepared", "enter", "fallback_platform", "make_plan", "make_report", "prepare",
           "resolve_platform", "run_plan", "validate_reads", "effective_mode", "open_reader", "finish", "close",
           "check_arguments", "gather_wants", "want_flags"]

logger = logging.getLogger(__name__)

#: ``broadcast_replicated_tensors`` mode: broadcast a replicated box only when its ranks
#: span hosts; ranks of one host each read it, since they share one page cache. On one
#: 2-core host with 4 gloo ranks, re-reading from the page cache beat broadcasting over
#: loopback gloo (BENCHMARKS.md, "broadcast or re-read on one host").
AUTO = "auto"


def check_arguments(checkpoint_id: Any, storage_reader: Any, broadcast: Any, groups: Any,
                     batch_bytes: Any, no_dist: bool, use_collectives: bool) -> None:
    if not (isinstance(broadcast, bool) or broadcast == AUTO):
        raise ValueError(f"load: broadcast_replicated_tensors must be True, False or {AUTO!r}, "
                         f"got {broadcast!r}")
    if checkpoint_id is None and storage_reader is None:
        raise ValueError("load: give checkpoint_id= (the checkpoint directory) or "
                         "storage_reader= (an open dcp_reader.CheckpointReader)")
    if checkpoint_id is not None and storage_reader is not None:
        raise ValueError("load: give either checkpoint_id= or storage_reader=, not both "
                         f"(got checkpoint_id={checkpoint_id!r} and a storage_reader)")
    if groups is not None and not broadcast:
        raise ValueError("load: broadcast_groups= was given with broadcast_replicated_tensors=False; "
                         "drop broadcast_groups or set broadcast_replicated_tensors=True")
    if groups is not None and (no_dist or not use_collectives):
        raise ValueError("load: broadcast_groups= has no effect with no_dist=True or "
                         "use_collectives=False (nothing is broadcast); drop it")
    if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or batch_bytes < 0:
        raise ValueError(f"load: broadcast_batch_bytes must be an int >= 0 (0 disables packing), "
                         f"got {batch_bytes!r}")


def resolve_platform(platform: Any, leaves: Any, process_group: Any = None, group_timeout: float | None = None) -> Any:
    """The platform given (object or name), else chosen from $DCP_PLATFORM or the first
    tensor; with ``process_group``, the torch (or Ascend) platform over that group.
    ``group_timeout`` (seconds): the bound of every group the platform creates (a call's own
    timeout), so that a broadcast left behind by a failed call ends within it, and releasing
    its group does not wait for the platform's default of minutes."""
    from dcp_platform import Platform, get_platform, platform_name

    if isinstance(platform, Platform):
        if process_group is not None and getattr(platform, "group_key", None) != scope_of(process_group):
            raise ValueError(f"process_group= and platform={platform!r} name different groups; give "
                             "process_group= alone (or a platform made with get_platform(..., group=that group))")
        return platform
    if platform is None:
        platform = os.environ.get("DCP_PLATFORM") or None
    if platform is None:
        for leaf in leaves:
            if is_tensor(leaf.value):
                value = leaf.value.tensor if isinstance(leaf.value, (Chunk, Flat)) else leaf.value
                try:
                    platform = platform_name(tensor=value)
                except ValueError:
                    pass  # an unsupported tensor type: target_for reports it through the exchange
                break
    name = platform or "torch"
    options = ({"group_timeout": timedelta(seconds=group_timeout)}
               if group_timeout is not None and name in ("torch", "ascend") else {})
    if process_group is None:
        return get_platform(name, **options)
    if name not in ("torch", "ascend"):
        raise ValueError(f"process_group= is a torch.distributed process group, which the {name!r} platform "
                         "cannot use; drop process_group= (MindSpore: its communication groups are not supported)")
    return get_platform(name, group=process_group, **options)


def want_flags(target: Target, caps: Any, broadcast: bool) -> int:
    flags = 0
    if broadcast:
        device = target.adapter.device_type(target.local)
        if (caps.host_collectives if device == "cpu" else device == caps.device_type):
            flags |= BROADCASTABLE
    if target.adapter.views:
        flags |= VIEWS
    return flags


class Phases:
    """Per-phase wall times, logged at DEBUG with the rank as each phase ends."""

    def __init__(self, rank: int):
        self.rank, self.seconds = rank, {}
        self.progress = Progress(rank)  # INFO lines and a terminal bar, on rank 0 only
        self.start = self._mark = time.perf_counter()

    def end(self, phase: str, nbytes: int = 0) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._mark
        logger.debug("rank %d: load phase %s took %.4f s", self.rank, phase, now - self._mark)
        self.progress.phase(phase, now - self._mark, nbytes)
        self._mark = now

    def credit(self, phase: str, seconds: float) -> None:
        """Count ``seconds`` just spent inside the running phase as ``phase``'s instead."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        self._mark += seconds


def enter(slot: int | None, state_dict: Any, sources: Any, *, checkpoint_id: Any, storage_reader: Any, no_dist: bool,
           use_collectives: bool, broadcast_replicated_tensors: Any, broadcast_groups: Any,
           broadcast_batch_bytes: Any, platform: Any, timeout: Any,
           process_group: Any = None) -> tuple[Coordinator, Any, list[Any], list[str], Any, Resolved]:
    """Check the arguments, choose the platform and decide whether this call is collective:
    the call's ``Coordinator`` (not entered), the platform, the state dict's leaves, the
    problems to report through the first exchange, the parsed ``sources=`` and the state dict
    with its Stateful objects resolved (``layouts/_stateful.py``). ``slot``: the call's number, None for a
    call without collectives by its arguments (it takes none and only records itself); one that turns out
    without collectives otherwise (rank-local metadata) tells the ranks that wait for it (``skip_slot``)."""
    check_arguments(checkpoint_id, storage_reader, broadcast_replicated_tensors, broadcast_groups,
                     broadcast_batch_bytes, no_dist, use_collectives)
    if timeout is not None:
        timeout_seconds(timeout)  # refuse a bad value before anything else
    errors: list[str] = []
    source_map = None
    try:
        source_map = SourceMap(sources) if sources is not None else None
    except (TypeError, ValueError) as exc:  # through the exchange: a stage's own sources= may be bad alone
        errors.append(f"{type(exc).__name__}: {exc}")
    resolved = resolve_statefuls(state_dict, errors)
    try:
        leaves = flatten_state_dict(resolved.state)
    except (TypeError, ValueError) as exc:  # reported through the exchange, so no rank waits for this one
        leaves = []
        errors.append(f"{type(exc).__name__}: {exc}")
    try:
        platform = resolve_platform(platform, leaves, process_group)
    except Exception as exc:
        # Reported through the exchange over torch.distributed when it runs, so that the
        # other ranks raise too instead of waiting for this one.
        platform = fallback_platform(exc, process_group)
        errors.append(f"choosing the platform failed: {type(exc).__name__}: {exc}")
    check_launch(platform, no_dist, "load")
    # A hyper-parallel save without collectives left one {rank}.metadata per rank: each rank
    # loads what it saved, alone. Decided from the directory listing, which all ranks share.
    from dcp_reader import is_rank_local

    rank_local = checkpoint_id is not None and is_rank_local(checkpoint_id)
    collective = not no_dist and use_collectives and platform.is_distributed() and not rank_local
    target = describe_target(checkpoint_id, storage_reader)
    if not collective:
        why = ("no_dist=True" if no_dist else "use_collectives=False" if not use_collectives
               else "a checkpoint saved per rank (rank-local metadata)" if rank_local else "no process group")
        if slot is None:  # takes no call number: recorded for a rank that waits for this one to name it
            note_one_process_call(process_group, f"load of {target} without collectives ({why})")
        else:
            skip_slot(slot, f"called load without collectives ({why}) while other ranks made this call with "
                            "collectives; every rank must pass the same no_dist and use_collectives", process_group)
    coord = Coordinator(platform, collective=collective, timeout=timeout_seconds(timeout, platform=platform),
                        slot=slot, target=target)
    return coord, platform, leaves, errors, source_map, resolved


def gather_wants(coord: Coordinator, errors: list[str], collective: bool, wants: list[Want],
                  settings: tuple[Any, ...], broadcast: bool, digest: tuple[Any, Any]) -> tuple[list[Any], Any]:
    """Every rank's wants and hosts (the gathered path), after checking that every rank
    passed the same broadcast settings and planned from the same checkpoint metadata (a
    checkpoint re-saved during the load, or nodes with different copies, would make the
    ranks walk different broadcast schedules: gloo aborted the process on the size
    mismatch). Either difference raises LoadError on every rank, naming the ranks.
    ``digest``: the checkpoint's ``checkpoint_digest`` (None without a reader) and the path opened."""
    host = host_id() if broadcast else None
    gathered_all = coord.exchange(exchange, errors, "validate", collective=collective,
                                  payload=(wants, settings, host, digest))
    if len({s for _, s, _, _ in gathered_all}) > 1:
        per_rank = {r: [settings_text(s)] for r, (_, s, _, _) in enumerate(gathered_all)}
        raise LoadError({r: [*c, "every rank must pass the same broadcast settings"]
                         for r, c in per_rank.items()}, "validate")
    differ = checkpoint_causes([d for _, _, _, d in gathered_all])
    if differ:
        raise LoadError(differ, "validate")
    return [w for w, _, _, _ in gathered_all], ([h for _, _, h, _ in gathered_all] if host is not None else None)


def fallback_platform(exc: Exception, process_group: Any = None) -> Any:
    """The torch platform (over ``process_group``, else the default group) when
    torch.distributed runs (peers may wait on us), else re-raise ``exc``."""
    try:
        import torch.distributed as dist
    except ImportError:
        raise exc from None
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        raise exc
    from dcp_platform import get_platform

    try:
        return get_platform("torch", group=process_group)
    except Exception:  # noqa: BLE001 - not a group of this rank either: the original error stands
        raise exc from None


@dataclass
class Prepared:
    """What the preparation found on this rank (each list empty after a reported error)."""

    reader: Any
    owned: bool = False
    targets: list[Target] = field(default_factory=list)
    values: list[Any] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)
    tied: list[tuple[str, str]] = field(default_factory=list)
    cast: list[str] = field(default_factory=list)
    wants: list[Want] = field(default_factory=list)
    by_value: dict[str, Any] = field(default_factory=dict)
    composed: list[tuple[str, int]] = field(default_factory=list)
    #: broadcast groups the load made and closes once every rank finished (``finish``)
    groups: Any = None
    #: what the read checks found so far (a guessed plan's, then the plan run's)
    read_checks: ReadChecks = field(default_factory=ReadChecks)


def prepare(prep: Prepared, leaves: list[Any], errors: list[str], platform: Any, broadcast: bool, *,
             checkpoint_id: Any, allow_pickle: bool, tied_weights: Mapping[str, str] | None, strict: bool,
             allow_dtype_cast: bool, source_map: SourceMap | None = None) -> None:
    """Targets, the reader, and every check that needs no other rank; a problem is added
    to ``errors`` (never raised: it must reach the exchange so that other ranks raise too)."""
    if errors:
        return
    try:
        tensor_leaves = [leaf for leaf in leaves if is_tensor(leaf.value)]
        prep.by_value = {leaf.name: leaf.value for leaf in tensor_leaves}
        errs, prep.values = unsupported_values([leaf for leaf in leaves if not is_tensor(leaf.value)])
        errors.extend(errs)  # named before the missing keys, which they are not
        prep.outside = [leaf.name for leaf in tensor_leaves if not in_mesh(leaf.value)]
        targets = [target_for(leaf) for leaf in tensor_leaves if in_mesh(leaf.value)]
        errors.extend(check_overlaps(targets))  # a Flat sharing bytes with another entry
        if prep.reader is None:
            from dcp_reader import open_checkpoint

            prep.reader = open_checkpoint(checkpoint_id, allow_pickle=allow_pickle, rank=platform.rank())
            prep.owned = True
        cast: list[str] = []
        skipped: list[str] = []
        through: list[tuple[str, str]] = []  # skipped by strict=False, filled through a tied key
        if source_map is not None:  # composed destinations become virtual tensors of the reader
            from ..layouts._sourced_reader import apply_sources

            applied = apply_sources(prep.reader, targets, source_map, allow_dtype_cast, strict,
                                    values=[leaf.name for leaf in prep.values], whole=not platform.is_distributed())
            errors.extend(applied.errors)
            prep.reader, targets, prep.composed = applied.reader, applied.targets, applied.composed
            cast, skipped, through = applied.cast, applied.missing, applied.tied
        metadata = prep.reader.metadata
        errs, targets, prep.tied = resolve_aliases(targets, prep.reader, tied_weights)
        prep.tied += through
        errors.extend(errs)
        errs, targets, prep.values, prep.missing = check_targets(targets, prep.values, metadata, strict)
        prep.missing += skipped
        errors.extend(errs)
        errs, prep.cast = check_dtypes(targets, metadata, allow_dtype_cast)
        prep.cast += [n for n in cast if n not in prep.cast]
        errors.extend(errs)
        prep.targets = targets
        caps = platform.capabilities
        prep.wants = [(t.name, b.offsets, b.sizes, want_flags(t, caps, broadcast), t.dtype)
                      for t in targets for b in t.boxes]
    except Exception as exc:  # noqa: BLE001 - must reach the exchange so other ranks raise too
        errors.append(f"{type(exc).__name__}: {exc}")


def make_plan(coord: Coordinator, platform: Any, collective: bool, prep: Prepared, errors: list[str],
               phases: Phases, *, mode: Any, broadcast: bool, batch_bytes: int, planner: Any,
               groups: Any) -> tuple[Any, bool, Any]:
    """(the plan, whether it was derived, its reads' checks when they were made with the
    derivation: ``(errors, any rank failed, values read)``, else None). Ends the
    ``prepare`` and ``plan`` phases."""
    reader = prep.reader
    # The settings that shape the collectives travel with the wants: ranks that differ
    # would walk different broadcast schedules and hang, so they fail together instead.
    # Supplied groups change how groups are made (gathered, not by their members alone).
    # So does the planner (by class): ranks with different planners make different plans.
    # So does where the checkpoint lies: on an object store the plan relays columns.
    relay = reader is not None and not local_storage(getattr(reader, "path", None))
    settings = (mode if broadcast else False, batch_bytes, groups is not None,
                None if planner is None else f"{type(planner).__module__}.{type(planner).__qualname__}", relay)
    # Derived planning (``_derived_plan``): when every rank's wants follow from meshes and
    # plain tensors, ranks exchange a fixed-size digest instead of their wants.
    meta_hash = checkpoint_digest(reader) if reader is not None else None  # hashes every chunk: once
    path = getattr(reader, "path", None)  # shown when ranks opened checkpoints that differ
    got: dict[str, Any] = {}

    def check(plan: Any) -> list[str]:  # validate_reads' checks, made before the digest exchange
        t0 = time.perf_counter()
        errs, got["values"] = check_reads(reader, plan.reads_for(platform.rank()), prep.values, prep.read_checks)
        phases.credit("validate", time.perf_counter() - t0)
        return errs

    # With $DCP_HOST_ID the hosts are most likely several: the guessed plan (one host) would
    # be planned and checked for nothing.
    check_first = check if not (broadcast and os.environ.get(HOST_ID_ENV)) else None
    derived = derived_plan(platform, reader.metadata.tensors if reader is not None else {}, prep.wants,
                           prep.by_value, failed=bool(errors), settings=settings, broadcast=broadcast,
                           same_host_reads=mode == AUTO, custom_planner=planner is not None, watch=coord.waiter,
                           meta_hash=meta_hash, checkpoint=path, check=check_first, relay=relay) if collective else None
    if derived is not None:
        phases.end("prepare")
        phases.end("plan")
        checked = (derived.errors, derived.checks_failed, got.get("values", {})) if derived.checked else None
        return derived.plan, True, checked
    gathered, hosts = gather_wants(coord, errors, collective, prep.wants, settings, broadcast, (meta_hash, path))
    phases.end("prepare")
    plan = build_global_plan(reader.metadata.tensors, gathered, broadcast=broadcast, planner=planner,
                             hosts=hosts, same_host_reads=mode == AUTO, relay=relay)
    phases.end("plan")
    return plan, False, None


def run_plan(coord: Coordinator, platform: Any, plan: Any, me: int, prep: Prepared, phases: Phases, *,
         derived: bool, groups: Any, batch_bytes: int) -> Any:
    """Read and broadcast this rank's part of ``plan`` (the ``execute`` phase)."""
    rank = platform.rank()
    coord.phase = "execute"
    groups, close_groups = (ensure_groups(platform, plan, groups, coord.waiter) if derived else (groups, False))
    if close_groups:
        prep.groups = groups  # closed by finish, or by close on every other path
    # From an object store, a reader this load opened fetched its files' first bytes before
    # execute (the parse, the checks): the headers and, for a small object, all of its data
    # (``CheckpointReader.bytes_fetched``). They are this load's GETs.
    remote = prep.owned and not local_storage(getattr(prep.reader, "path", None))
    opening = fetched(prep.reader) if remote else 0
    try:
        stats = execute(platform, prep.reader, plan, me, {t.name: t for t in prep.targets}, batch_bytes=batch_bytes,
                        groups=groups, watch=coord.waiter, on_read=phases.progress.advance)
        stats = replace(stats, bytes_fetched=stats.bytes_fetched + opening)
    except PeerFailure:
        raise  # another rank's failure: the coordinator names it
    except Exception as exc:
        raise LoadError({rank: [f"{type(exc).__name__}: {exc}"]}, "execute") from exc
    phases.end("execute", stats.bytes_read + stats.bytes_received)
    return stats


def make_report(platform: Any, collective: bool, prep: Prepared, plan: Any, stats: Any, phases: Phases, *,
            job_read: int, job_unique: int, job_fetched: int) -> LoadReport:
    seconds = dict(phases.seconds)
    seconds["total"] = time.perf_counter() - phases.start
    reader, rank = prep.reader, platform.rank()
    report = LoadReport(
        rank=rank, world_size=platform.world_size() if collective else 1, format=reader.format,
        tensors=len(prep.targets), values=len(prep.values),
        bytes_needed=sum(t.numel * reader.metadata.tensors[t.name].itemsize for t in prep.targets),
        bytes_read=stats.bytes_read, bytes_received=stats.bytes_received, bytes_sent=stats.bytes_sent,
        broadcasts=stats.broadcasts, pieces_read=stats.pieces_read, job_bytes_read=job_read,
        job_unique_bytes=job_unique, seconds=seconds, missing=tuple(prep.missing), cast=tuple(prep.cast),
        skipped_not_in_mesh=tuple(prep.outside), tied=tuple(prep.tied), composed=tuple(prep.composed),
        bytes_fetched=stats.bytes_fetched, job_bytes_fetched=job_fetched,
    )
    phases.progress.phase("total", seconds["total"], report.bytes_read + report.bytes_received)
    logger.debug("rank %d: loaded %d tensor(s) and %d value(s) in %.4f s: read %d of %d needed bytes, "
                 "received %d in %d broadcast(s)", rank, report.tensors, report.values, seconds["total"],
                 report.bytes_read, report.bytes_needed, report.bytes_received, report.broadcasts)
    return report


def effective_mode(mode: Any, checkpoint_id: Any) -> Any:
    """The broadcast mode a load runs: ``"auto"`` broadcasts everything on object storage."""
    if mode == AUTO and not local_storage(checkpoint_id):
        # An object store has no page cache that a host's ranks share: "auto"'s same-host
        # reads would fetch each replicated byte once per rank (measured: 4.01 x the unique
        # bytes on DP4, benchmarks/storage/bench_s3.py). Every byte is fetched once per job instead.
        return True
    return mode


def open_reader(coord: Coordinator, platform: Any, collective: bool, checkpoint_id: Any, storage_reader: Any,
                errors: list[str], allow_pickle: bool) -> Prepared:
    """This rank's ``Prepared``: the caller's reader, or on object storage one that rank 0
    listed for every rank (a problem goes to ``errors``); local checkpoints open in ``prepare``."""
    prep = Prepared(reader=storage_reader)
    if collective and storage_reader is None and not local_storage(checkpoint_id):  # one rank lists the bucket
        prep.reader, prep.owned = open_shared(coord, platform, checkpoint_id, errors, allow_pickle=allow_pickle), True
    return prep


def validate_reads(coord: Coordinator, prep: Prepared, plan: Any, me: int, collective: bool,
                   phases: Phases, checked: Any = None) -> dict[str, Any]:
    """Check every read of this rank's part of the plan on every rank (the ``validate``
    phase); the non-tensor values read, by name. ``checked``: ``make_plan``'s checks made
    with the derivation, whose exchange said whether any rank failed: then only a failure
    makes the exchange here (every rank makes it alike), which names it."""
    phases.progress.plan(plan, me, len(prep.targets))
    if checked is not None:
        errs, failed, got = checked
        if failed:
            coord.check(errs, "validate", collective=collective)
        phases.end("validate")
        return got
    errs, got = check_reads(prep.reader, plan.reads_for(me), prep.values, prep.read_checks)
    coord.check(errs, "validate", collective=collective)
    phases.end("validate")
    return got


def finish(coord: Coordinator, prep: Prepared, plan: Any, stats: Any, got: Mapping[str, Any],
           collective: bool, phases: Phases, resolved: Resolved | None = None) -> tuple[int, int, int]:
    """Agree that every rank's execute succeeded, then put the values in place (the
    ``finish`` phase); (bytes the job read, its unique bytes, bytes it fetched). Stateful
    objects get their filled state before that agreement, once this rank's values are all
    in place, so that a ``load_state_dict`` that raises fails every rank."""
    errors = list(stats.errors)
    early = resolved is not None and bool(resolved.objects) and not errors
    if early:
        for leaf in prep.values:
            leaf.replace(got[leaf.name])
        hand_back(resolved, errors)
    job_read, job_unique, job_fetched = coord.check(errors, "execute", collective=collective,
                                                    sums=(stats.bytes_read, plan.unique_bytes, stats.bytes_fetched))
    # Every rank has finished its broadcasts once it joined that exchange, so the groups
    # close without the all-gather that GroupManager.close would otherwise make first.
    groups, prep.groups = prep.groups, None
    if groups is not None:
        groups.close(wait_for_peers=False)
    if not early:
        for leaf in prep.values:
            leaf.replace(got[leaf.name])
    phases.end("finish")
    return job_read, job_unique, job_fetched


def close(prep: Prepared, phases: Phases) -> None:
    """End the progress bar, close the groups (after a failure: ``finish`` closes them
    otherwise) and a reader the load opened (on every path)."""
    phases.progress.close()
    if prep.groups is not None:
        # On every path (KeyboardInterrupt and a peer's failure too): a group left open
        # leaks. After a failure, no rank waits for the others to close.
        prep.groups.close(wait_for_peers=False, raise_errors=False)
        prep.groups = None
    if prep.owned and prep.reader is not None:
        prep.reader.close()

"""``load``: fill a state dict in place from a checkpoint, reading every needed byte once.

The front door: ``load`` reads as its phases (enter, prepare, plan, validate, execute,
finish, report); each phase is a step of ``run/_steps.py``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .plan._plan import Planner
from .run._coordinate import next_load_slot, scope_of, skip_slot
from .run._report import LoadReport
from .run._steps import (
    AUTO,
    Phases,
    close,
    effective_mode,
    enter,
    fallback_platform,
    finish,
    make_plan,
    make_report,
    open_reader,
    prepare,
    resolve_platform,
    run_plan,
    validate_reads,
)
from .run._torch_args import load_arguments

__all__ = ["AUTO", "DEFAULT_BATCH_BYTES", "fallback_platform", "load", "resolve_platform"]

DEFAULT_BATCH_BYTES = 6 * 1024 * 1024
_fallback_platform = fallback_platform  # the name callers of the 0.5 tree import


def load(
    state_dict: Mapping[Any, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_reader: Any = None,
    planner: Planner | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    broadcast_replicated_tensors: bool | str = AUTO,
    broadcast_groups: Any = None,
    broadcast_batch_bytes: int = DEFAULT_BATCH_BYTES,
    strict: bool = True,
    platform: Any = None,
    allow_pickle: bool = False,
    tied_weights: Mapping[str, str] | None = None,
    allow_dtype_cast: bool = True,
    timeout: Any = None,
    sources: Mapping[str, Any] | None = None,
    process_group: Any = None,
) -> LoadReport:
    """Fill ``state_dict`` in place from ``checkpoint_id`` (a directory or ``s3://`` URI) or an open
    ``storage_reader`` (torch DCP's too, docs/from-torch-dcp.md); call on every rank: the n-th collective
    calls of all ranks pair up (``no_dist``/``use_collectives=False`` calls take no part). Default ``planner``:
    the byte-level owner rule (docs/planning.md). ``broadcast_replicated_tensors``: ``"auto"`` re-reads on
    one host and broadcasts across hosts and on object storage; ``True`` always, ``False`` never. ``sources``:
    renames and ``Concat``/``Stack``/``Slice`` compositions; docs/loading.md describes every argument. Every
    problem is found before any destination is written; a failure on any rank raises ``LoadError`` on every
    rank within ``timeout``. ``process_group``: the group to load within (default: the default group)."""
    slot = None if no_dist or not use_collectives else next_load_slot(scope_of(process_group))
    try:
        checkpoint_id, storage_reader, planner, strict = load_arguments(checkpoint_id, storage_reader, planner, strict)
        coord, platform, leaves, errors, source_map, resolved = enter(
            slot, state_dict, sources, checkpoint_id=checkpoint_id, storage_reader=storage_reader, no_dist=no_dist,
            use_collectives=use_collectives, broadcast_replicated_tensors=broadcast_replicated_tensors,
            broadcast_groups=broadcast_groups, broadcast_batch_bytes=broadcast_batch_bytes, platform=platform,
            timeout=timeout, process_group=process_group)
    except BaseException as exc:
        if slot is not None:
            skip_slot(slot, f"raised before taking part: {type(exc).__name__}: {exc}", process_group)
        raise
    with coord:
        coord.arrive()
        collective, mode = coord.watch is not None, effective_mode(broadcast_replicated_tensors, checkpoint_id)
        broadcast, phases = collective and bool(mode), Phases(platform.rank())
        prep = open_reader(coord, platform, collective, checkpoint_id, storage_reader, errors, allow_pickle)
        try:
            prepare(prep, leaves, errors, platform, broadcast, checkpoint_id=checkpoint_id, allow_pickle=allow_pickle,
                    tied_weights=tied_weights, strict=strict, allow_dtype_cast=allow_dtype_cast, source_map=source_map)
            plan, derived, checked = make_plan(coord, platform, collective, prep, errors, phases, mode=mode,
                                               broadcast=broadcast, batch_bytes=broadcast_batch_bytes,
                                               planner=planner, groups=broadcast_groups)
            me = platform.rank() if collective else 0
            got = validate_reads(coord, prep, plan, me, collective, phases, checked)
            stats = run_plan(coord, platform, plan, me, prep, phases, derived=derived, groups=broadcast_groups,
                             batch_bytes=broadcast_batch_bytes)
            job_read, job_unique, job_fetched = finish(coord, prep, plan, stats, got, collective, phases, resolved)
        finally:
            close(prep, phases)
        return make_report(platform, collective, prep, plan, stats, phases, job_read=job_read,
                           job_unique=job_unique if derived else plan.unique_bytes, job_fetched=job_fetched)

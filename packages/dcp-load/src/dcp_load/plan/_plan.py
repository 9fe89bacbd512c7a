"""Planning a load: wanted boxes x saved chunks -> read pieces -> one global plan.

Every function here is pure: each rank calls ``build_global_plan`` with the same gathered
wants and the same checkpoint metadata and gets the same plan, which is what keeps the
collectives that follow in step (ARCHITECTURE "Rules").

Reads are planned by the bytes they fetch, not only by boxes: storage is read by pages, and
boxes of one saved chunk that share rows share pages (``_segments``). Each such interval of
rows (split into slabs when large) has one owner, and every box that needs its rows is read
by the owner's side (``_owners``): so each stored byte is fetched once per job even when
ranks hold different column halves of a row-parallel weight or partially overlapping rows.
Planning one tensor depends only on the ranks holding it, never on other tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..layouts._boxes import intersect
from ._items import (
    BROADCASTABLE,
    SPLIT_BYTES,
    VIEWS,
    GlobalPlan,
    GreedyPlanner,
    HostBlocks,
    Planner,
    ReadItem,
    Want,
)
from ._owners import PlanBuilder

__all__ = [
    "BROADCASTABLE",
    "SPLIT_BYTES",
    "VIEWS",
    "GlobalPlan",
    "GreedyPlanner",
    "HostBlocks",
    "Planner",
    "ReadItem",
    "Want",
    "build_global_plan",
    "collect_boxes",
    "intersect",
]


def build_global_plan(
    tensors: Mapping[str, Any],
    wants: Sequence[Sequence[Want]],
    *,
    broadcast: bool = True,
    planner: Planner | None = None,
    split_bytes: int = SPLIT_BYTES,
    hosts: Sequence[str] | None = None,
    same_host_reads: bool | None = None,
    relay: bool = False,
) -> GlobalPlan:
    """The plan every rank derives from the gathered ``wants`` (index = rank).

    ``tensors`` maps names to checkpoint tensor metadata (``.chunks`` with ``.offsets``,
    ``.sizes``, ``.file``; ``.itemsize``). Boxes several ranks want identically (same
    name, offsets, sizes and destination dtype, cut to the saved chunks and the owners'
    row intervals) form a replica group when ``broadcast`` is set and every member flagged
    its destination ``BROADCASTABLE``: one member reads it and broadcasts it. Names missing
    from ``tensors`` are skipped (validation reports them).

    ``hosts`` (index = rank): which ranks share a page cache. Each shared row interval is
    owned by one host (``same_host_reads``, the ``"auto"`` mode of ``load``; the default
    when ``hosts`` is given) or one rank (otherwise), and its boxes are read by the
    owner's ranks; with ``same_host_reads`` the other ranks of the reader's host read the
    box themselves (from the page cache the reader filled) and only other hosts receive
    the broadcast. ``planner``: chooses the reader of each replica group instead of the
    owner rule (which then no longer keeps page-sharing boxes on one host). ``relay``: the
    checkpoint is in an object store: a row slab of a column-sharded chunk is read whole by
    one rank, which relays the columns it does not hold (``ReadItem.relay``).
    """
    world = len(wants)
    if hosts is not None and len(hosts) != world:
        raise ValueError(f"build_global_plan: {len(hosts)} hosts for {world} ranks")
    auto = hosts is not None if same_host_reads is None else bool(same_host_reads)
    builder = PlanBuilder(world, broadcast=broadcast, hosts=hosts, same_host_reads=auto,
                          split_bytes=split_bytes, custom=planner is not None, relay=relay)
    for name, held in collect_boxes(tensors, wants).items():
        builder.add_tensor(name, tensors[name], held)
    builder.settle()
    if planner is not None:
        builder.assign_with(planner)
    return builder.finish(tensors)


def collect_boxes(tensors: Mapping[str, Any], wants: Sequence[Sequence[Want]]
                  ) -> dict[str, dict[tuple[Any, ...], list[Any]]]:
    """name -> {(offsets, sizes, dtype): [ranks, all broadcastable]} over every rank's wants."""
    out: dict[str, dict[tuple[Any, ...], list[Any]]] = {}
    for rank, rank_wants in enumerate(wants):
        for want in rank_wants:
            name = want[0]
            if name not in tensors:
                continue
            key = (want[1], want[2], want[4] if len(want) > 4 else "")
            held = out.setdefault(name, {})
            entry = held.get(key)
            if entry is None:
                entry = held[key] = [[], True]
            if not entry[0] or entry[0][-1] != rank:
                entry[0].append(rank)
            if not want[3] & BROADCASTABLE:
                entry[1] = False
    return out

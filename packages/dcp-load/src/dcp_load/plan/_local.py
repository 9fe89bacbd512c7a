"""Each rank plans only what concerns it, from derived wants (``_derive``).

Owners are chosen per holder set from that set's slabs alone (``_owners``), and every
member of a holder set holds every tensor that feeds it, so a rank that knows the boxes of
the tensors it holds computes the same owners, reads and broadcasts for itself as the
global plan does: ``plan_for_rank`` feeds ``PlanBuilder`` only this rank's tensors, skips
the row intervals it does not want and keeps the items it reads, sends or receives. Its
cost grows with the size of this rank's holder sets, not with the world.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._derive import Derived
from ._items import BROADCASTABLE, SPLIT_BYTES, GlobalPlan

__all__ = ["held_by", "plan_for_rank", "restrict"]


def plan_for_rank(tensors: Mapping[str, Any], entries: Sequence[Derived], rank: int, world: int, *,
                  broadcast: bool = True, hosts: Sequence[Any] | None = None,
                  same_host_reads: bool | None = None, split_bytes: int = SPLIT_BYTES,
                  relay: bool = False) -> GlobalPlan:
    """``rank``'s part of the plan ``build_global_plan`` makes from every rank's wants.

    ``entries``: this rank's derived entries (names missing from ``tensors`` are skipped).
    ``broadcasts`` and ``local`` hold only items whose ranks include ``rank``;
    ``unique_bytes`` counts the row intervals this rank leads (their lowest wanting rank),
    so the job's unique bytes are the sum over ranks; ``loads`` is partial.
    """
    from ._owners import PlanBuilder

    if hosts is not None and len(hosts) != world:
        raise ValueError(f"plan_for_rank: {len(hosts)} hosts for {world} ranks")
    auto = hosts is not None if same_host_reads is None else bool(same_host_reads)
    builder = PlanBuilder(world, broadcast=broadcast, hosts=hosts, same_host_reads=auto,
                          split_bytes=split_bytes, custom=False, only=rank, relay=relay)
    for e in entries:
        if e.name in tensors:
            builder.add_tensor(e.name, tensors[e.name], held_by(e))
    return builder.finish(tensors)


def held_by(entry: Derived) -> dict[tuple[Any, ...], tuple[tuple[int, ...], bool]]:
    """``PlanBuilder.add_tensor``'s input for one derived entry. The holder tuples are the
    entry's own (shared by every tensor of one layout), which the builder interns by id."""
    ok = bool(entry.flags & BROADCASTABLE)
    return {(o, s, entry.dtype): (h, ok) for o, s, h in entry.boxes}


def restrict(plan: GlobalPlan, rank: int) -> tuple[list[Any], list[Any]]:
    """(reads, broadcasts) of ``rank`` in a global plan: what ``plan_for_rank`` must match."""
    return plan.reads_for(rank), [i for i in plan.broadcasts if rank in i.ranks]

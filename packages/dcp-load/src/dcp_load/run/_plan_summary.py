"""A plan's numbers, as ``dcp plan`` prints them and ``load`` logs them on rank 0.

``plan_numbers`` reads them off a built ``GlobalPlan`` without any collective: for the
whole job's plan (the gathered path) they are the job's; for one rank's part of a derived
plan they are that rank's broadcasts and the amplification of the replica groups it
planned (its holder sets), which is all a rank knows without asking the others: bytes
read per rank are left out there, since the part charges other ranks only for its rows. ``summary_text`` formats them; ``dcp plan`` computes the job's numbers for any
world size in one process (``_simulate``) and prints them through the same function.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ._units import human_bytes

__all__ = ["SUMMARY_KEYS", "plan_numbers", "summary_text"]

#: The fields ``summary_text`` shows (``dcp plan --json`` has them all).
SUMMARY_KEYS = ("world_size", "read_bytes_per_rank_max", "read_bytes_per_rank_mean", "broadcasts_per_rank_max",
                "amplification")


def plan_numbers(plan: Any) -> dict[str, Any]:
    """``SUMMARY_KEYS`` of ``plan`` and ``scope``: "job", or "rank R's replica groups" for
    rank R's part of a derived plan (``GlobalPlan.rank``). Such a part charges other ranks
    only the rows it planned (their reads for replica groups without rank R are not in
    it), so the bytes read per rank are known for rank R alone: the max and mean are None
    there, and ``broadcasts_per_rank_max`` counts rank R's broadcasts."""
    if plan.rank is None:
        loads = list(plan.loads)
        per_rank = Counter(r for item in plan.broadcasts for r in item.ranks)
        scope = "job"
        top, mean = max(loads, default=0), (sum(loads) / len(loads) if loads else 0.0)
    else:
        per_rank = Counter({plan.rank: len(plan.broadcasts)})
        scope = f"rank {plan.rank}'s replica groups"
        top = mean = None
    return {
        "world_size": plan.world_size, "scope": scope,
        "read_bytes_per_rank_max": top, "read_bytes_per_rank_mean": mean,
        "broadcasts_per_rank_max": max(per_rank.values(), default=0),
        "amplification": plan.fetched_bytes / plan.unique_bytes if plan.unique_bytes else 0.0,
    }


def summary_text(numbers: dict[str, Any]) -> str:
    """``"read per rank: max 9.4 MB, mean 8.6 MB (max/mean 1.096); broadcasts per rank:
    max 1625; storage amplification: 1.0000"`` (``dcp plan``'s numbers also say how many
    plan items those broadcasts pack: ``"max 212 (of 1625 items, those below 6.3 MB
    packed)"``); for one rank's part of a derived plan
    (``scope`` names the rank), ``"broadcasts of rank 0: 7; storage amplification: 1.0000"``."""
    top, mean = numbers["read_bytes_per_rank_max"], numbers["read_bytes_per_rank_mean"]
    tail = f"storage amplification: {numbers['amplification']:.4f}"
    if top is None:
        rank = numbers["scope"].split("'", 1)[0]
        return f"broadcasts of {rank}: {numbers['broadcasts_per_rank_max']}; {tail}"
    bcasts = f"broadcasts per rank: max {numbers['broadcasts_per_rank_max']}"
    if "broadcast_items_per_rank_max" in numbers:  # dcp plan: the collectives, and the plan items they pack
        bcasts = (f"{bcasts} (of {numbers['broadcast_items_per_rank_max']} items, those below "
                  f"{human_bytes(numbers['broadcast_batch_bytes'])} packed)")
    return (f"read per rank: max {human_bytes(top)}, mean {human_bytes(mean)} (max/mean "
            f"{top / mean if mean else 0.0:.3f}); {bcasts}; {tail}")

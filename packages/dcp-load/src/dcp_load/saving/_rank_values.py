"""Non-tensor values that only ranks other than rank 0 hold, sent to rank 0 for a save with
torch DCP's meaning (``torch_compat``).

dcp stores non-tensor values from rank 0, in its metadata; torch DCP stores each key from a
rank that holds it, and torchtitan's dataloader keeps its state under a key of each
data-parallel rank's own (``dp_rank_<r>``). ``with_other_ranks_values`` gathers to rank 0
of the save's group the values it lacks, each from the lowest rank holding it (torch's
dedup also keeps one holder's), and returns rank 0's state dict with them added under
their flattened names as top-level keys, which save under the same names; a load on the
holding rank finds them there. Stateful objects come back resolved (their
``state_dict()``), so that the save does not call them twice.

Costs two collectives of the save's group on the caller's thread (the names, all-gathered;
the values rank 0 lacks, gathered to it; bounded by the group's timeout), and nothing
without a process group or with ``no_dist``. Every rank takes part even when its state
dict is refused below: the save then names the problem on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..layouts._state import flatten_state_dict, is_tensor
from ..layouts._stateful import resolve as resolve_statefuls

__all__ = ["with_other_ranks_values"]


def with_other_ranks_values(state_dict: Mapping[Any, Any], process_group: Any, no_dist: bool) -> Mapping[Any, Any]:
    """``state_dict``, on rank 0 of the group with the values only other ranks hold (module
    docstring)."""
    import torch.distributed as dist

    if no_dist or not (dist.is_available() and dist.is_initialized()) or not isinstance(state_dict, Mapping):
        return state_dict
    me, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    if me < 0:  # not a member: the save refuses it, naming the group
        return state_dict
    state, values = _own_values(state_dict)
    names: list[Any] = [None] * world
    dist.all_gather_object(names, sorted(values), group=process_group)
    holder = _lowest_holders(names)
    if not holder:
        return state
    mine = {name: values[name] for name, rank in holder.items() if rank == me}
    gathered: list[Any] | None = [None] * world if me == 0 else None
    dist.gather_object(mine, gathered, group=process_group, group_dst=0)
    if me != 0 or gathered is None:
        return state
    extra = {name: value for part in gathered for name, value in (part or {}).items()}
    return {**state, **extra}


def _own_values(state_dict: Mapping[Any, Any]) -> tuple[Mapping[Any, Any], dict[str, Any]]:
    """(the state dict with Statefuls resolved, its non-tensor values by flattened name);
    the state dict as given and no values when it is refused (the save says why)."""
    refused: list[str] = []
    resolved = resolve_statefuls(state_dict, refused)
    if refused:
        return state_dict, {}
    try:
        leaves = flatten_state_dict(resolved.state)
    except (TypeError, ValueError):
        return state_dict, {}
    return resolved.state, {leaf.name: leaf.value for leaf in leaves if not is_tensor(leaf.value)}


def _lowest_holders(names: list[Any]) -> dict[str, int]:
    """{name: the lowest rank holding it} of the names rank 0 does not hold."""
    at_zero = set(names[0] or ())
    holder: dict[str, int] = {}
    for rank, held in enumerate(names[1:], start=1):
        for name in held or ():
            if name not in at_zero:
                holder.setdefault(name, rank)
    return holder

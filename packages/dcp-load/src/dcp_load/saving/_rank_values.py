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

Costs two collectives of the save's group on the caller's thread, bounded by the group's
timeout: rank 0's value names, broadcast (each rank receives one list, whatever the world
size: an all-gather of every rank's names would grow with it), and the values each rank
holds that rank 0 lacks (usually none), gathered to rank 0. Nothing without a process
group or with ``no_dist``. Every rank takes part even when its state dict is refused
below: the save then names the problem on every rank.

Each rank pickles its own values before the gather, so that one it cannot pickle (a
``__reduce__`` or ``__getstate__`` that raises) still sends rank 0 a note of the failure
instead of raising alone on that rank while rank 0 waits for the group's timeout; rank 0
puts the note in the value's place, and the save's own pickling check refuses it on every
rank, naming the key, the holding rank and the cause (as for a value that rank 0 cannot
unpickle).
"""

from __future__ import annotations

import pickle
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
    at_zero: list[Any] = [sorted(values) if me == 0 else None]
    dist.broadcast_object_list(at_zero, group=process_group, group_src=0)
    known = set(at_zero[0])
    lacking = {name: _pickled(value, me) for name, value in values.items() if name not in known}
    gathered: list[Any] | None = [None] * world if me == 0 else None
    dist.gather_object(lacking, gathered, group=process_group, group_dst=0)
    if me != 0 or gathered is None:
        return state
    extra: dict[str, Any] = {}
    for rank, part in enumerate(gathered[1:], start=1):  # in rank order: the lowest holder's value is kept
        for name, value in (part or {}).items():
            if name not in extra:
                extra[name] = _unpickled(value, rank)
    return {**state, **extra} if extra else state


class _Unsaveable:
    """In place of a value another rank holds that rank 0 cannot save: pickling it raises
    ``PicklingError`` with ``reason``, which the save reports on every rank."""

    def __init__(self, reason: str):
        self.reason = reason

    def __reduce__(self) -> Any:
        raise pickle.PicklingError(self.reason)


def _pickled(value: Any, rank: int) -> bytes | str:
    """``value`` pickled here (bytes), or why it cannot be (text, sent instead of raising)."""
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - pickling runs arbitrary __reduce__ code; every rank is told
        return f"rank {rank} cannot pickle it: {type(exc).__name__}: {exc}"


def _unpickled(value: Any, rank: int) -> Any:
    """A value ``_pickled`` sent from ``rank``, read back on rank 0 (or an ``_Unsaveable``)."""
    if not isinstance(value, bytes):
        return _Unsaveable(str(value))
    try:
        return pickle.loads(value)  # noqa: S301 - the job's own ranks' values, as gather_object unpickles
    except Exception as exc:  # noqa: BLE001 - a class rank 0 cannot import, say; every rank is told
        return _Unsaveable(f"rank 0 cannot unpickle rank {rank}'s value: {type(exc).__name__}: {exc}")


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


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

Costs two all-gathers of the save's group (the platform's, over its host-memory control
group) on the caller's thread, bounded by the group's timeout: rank 0's value names (the
other ranks send nothing), and the values each rank holds that rank 0 lacks (usually
none). Nothing without a process group or with ``no_dist``. Every rank takes part even
when its state dict is refused below: the save then names the problem on every rank.

Nothing is pickled between processes (``dcp_platform.codec``): a plain-data value travels
as itself; any other value is serialised by its holder with ``torch.save``, and rank 0
writes those bytes unread (``dcp_reader.write.TorchSavedValue``), as torch DCP would have
written them on the holder. A value its holder cannot serialise (a ``__reduce__`` or
``__getstate__`` that raises) sends rank 0 a note instead of raising alone on that rank
while the others wait; rank 0 puts the note in the value's place, and the save's own
check refuses it on every rank, naming the key, the holding rank and the cause.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

from ..layouts._state import flatten_state_dict, is_tensor
from ..layouts._stateful import resolve as resolve_statefuls

__all__ = ["with_other_ranks_values"]

_PLAIN, _SAVED, _REFUSED = "plain", "torch.save", "refused"


def with_other_ranks_values(state_dict: Mapping[Any, Any], process_group: Any, no_dist: bool) -> Mapping[Any, Any]:
    """``state_dict``, on rank 0 of the group with the values only other ranks hold (module
    docstring)."""
    import torch.distributed as dist
    from dcp_platform import get_platform

    if no_dist or not (dist.is_available() and dist.is_initialized()) or not isinstance(state_dict, Mapping):
        return state_dict
    me = dist.get_rank(process_group)
    if me < 0:  # not a member: the save refuses it, naming the group
        return state_dict
    platform = get_platform("torch") if process_group is None else get_platform("torch", group=process_group)
    state, values = _own_values(state_dict)
    known = set(platform.all_gather_object(sorted(values) if me == 0 else None)[0] or ())
    lacking = {name: (_plain_keys(leaf.keys), *_sent(leaf.value, me)) for name, leaf in values.items()
               if name not in known}
    gathered = platform.all_gather_object(lacking if me != 0 else {})
    if me != 0:
        return state
    taken: set[str] = set()
    for rank, part in enumerate(gathered[1:], start=1):  # in rank order: the lowest holder's value is kept
        for name, (keys, *sent) in part.items():
            if name not in taken:
                taken.add(name)
                state = _placed(state, name, keys, _received(tuple(sent), rank))
    return state


def _plain_keys(keys: tuple[Any, ...]) -> list[Any]:
    """The value's keys from the top, as sent (each a str or an int; others as their str)."""
    return [k if type(k) in (str, int) else str(k) for k in keys]


def _placed(state: Mapping[Any, Any], name: str, keys: Any, value: Any) -> Mapping[Any, Any]:
    """``state`` with ``value`` where its holder keeps it (``keys`` from the top, the mappings
    on the way copied, never changed), so that torch's ``planner_data`` names the same keys as
    the holder's; at the top level under its flattened ``name`` when that place is taken."""
    nested = _nested(state, list(keys) if isinstance(keys, list) else [], value)
    return nested if nested is not None else {**state, name: value}


def _nested(node: Any, keys: list[Any], value: Any) -> Mapping[Any, Any] | None:
    if not keys or not isinstance(node, Mapping):
        return None
    head, rest = keys[0], keys[1:]
    if not rest:
        return None if head in node else {**node, head: value}
    inner = _nested(node.get(head, {}), rest, value)
    return None if inner is None else {**node, head: inner}


class _Unsaveable:
    """In place of a value another rank holds that rank 0 cannot save: pickling it raises
    ``PicklingError`` with ``reason``, which the save reports on every rank."""

    def __init__(self, reason: str):
        self.reason = reason

    def __reduce__(self) -> Any:
        raise pickle.PicklingError(self.reason)


def _sent(value: Any, rank: int) -> tuple[str, Any]:
    """``value`` as this rank sends it: (``"plain"``, the value), (``"torch.save"``, its bytes)
    or (``"refused"``, why it cannot be serialised; sent instead of raising)."""
    from dcp_platform.codec import pack

    try:
        pack({"": ([], _PLAIN, value)})  # as deep as it travels
        return (_PLAIN, value)
    except Exception:  # noqa: BLE001 - not plain data (or its checks raise): torch.save it below
        pass
    import torch

    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as exc:  # noqa: BLE001 - serialising runs arbitrary __reduce__ code; every rank is told
        return (_REFUSED, f"rank {rank} cannot serialise it: {type(exc).__name__}: {exc}")
    return (_SAVED, buf.getvalue())


def _received(sent: Any, rank: int) -> Any:
    """What rank 0 saves for a value ``_sent`` from ``rank``: never unpickled here."""
    from dcp_reader.write import TorchSavedValue

    kind, body = sent if isinstance(sent, tuple) and len(sent) == 2 else (None, None)
    if kind == _PLAIN:
        return body
    if kind == _SAVED and isinstance(body, bytes):
        return TorchSavedValue(body, rank)
    if kind == _REFUSED and isinstance(body, str):
        return _Unsaveable(body)
    return _Unsaveable(f"rank {rank} sent a value rank 0 does not read ({type(sent).__name__})")


def _own_values(state_dict: Mapping[Any, Any]) -> tuple[Mapping[Any, Any], dict[str, Any]]:
    """(the state dict with Statefuls resolved, its non-tensor leaves by flattened name);
    the state dict as given and no values when it is refused (the save says why)."""
    refused: list[str] = []
    resolved = resolve_statefuls(state_dict, refused)
    if refused:
        return state_dict, {}
    try:
        leaves = flatten_state_dict(resolved.state)
    except (TypeError, ValueError):
        return state_dict, {}
    return resolved.state, {leaf.name: leaf for leaf in leaves if not is_tensor(leaf.value)}


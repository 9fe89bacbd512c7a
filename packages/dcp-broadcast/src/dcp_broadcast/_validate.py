"""Local checks of the arguments and items, done before any collective."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dcp_platform import Platform

from ._groups import GroupManager
from ._items import BroadcastItem, _is_int

_MAX_LISTED = 10  # offenders listed in one message; the rest are counted


def validate_arguments(items: Any, batch_bytes: Any, max_in_flight: Any, groups: Any,
                       prepare: Callable[[int], Any] | None) -> None:
    """Raise ``TypeError``/``ValueError`` for arguments no rank could run with."""
    if not isinstance(items, Sequence):
        raise TypeError(f"broadcast_items: items must be a sequence of BroadcastItem, got {type(items).__name__}")
    if not _is_int(batch_bytes) or batch_bytes < 0:
        raise ValueError(f"broadcast_items: batch_bytes must be an int >= 0 (0 turns batching off), got {batch_bytes!r}")
    if not _is_int(max_in_flight) or max_in_flight < 1:
        raise ValueError(f"broadcast_items: max_in_flight must be an int >= 1, got {max_in_flight!r}")
    if groups is not None and not isinstance(groups, (GroupManager, Mapping)):
        raise TypeError(
            "broadcast_items: groups must be None, a GroupManager or a mapping from rank tuple to "
            f"group, got {type(groups).__name__}"
        )
    if prepare is not None and not callable(prepare):
        raise TypeError(f"broadcast_items: prepare must be callable(index) or None, got {type(prepare).__name__}")


def item_errors(platform: Platform, items: Sequence[Any]) -> list[str]:
    """Every problem with this rank's items (empty when all are usable), each naming the item."""
    rank, world = platform.rank(), platform.world_size()
    errors: list[str] = []
    for index, item in enumerate(items):
        if not isinstance(item, BroadcastItem):
            errors.append(f"item {index} is a {type(item).__name__}, not a BroadcastItem")
            continue
        if item.ranks[-1] >= world:
            errors.append(f"item {index}: ranks {item.ranks} exceed world size {world}")
        if rank not in item.ranks:
            if item.tensor is not None:
                errors.append(f"item {index}: rank {rank} is not in ranks {item.ranks} but passed a "
                              "tensor; non-members pass tensor=None")
            continue
        if item.tensor is None:
            role = "source" if rank == item.src else "receiver"
            errors.append(f"item {index}: rank {rank} is the {role} (ranks {item.ranks}) but passed "
                          "tensor=None; pass the tensor to send or fill")
            continue
        actual = platform.nbytes(item.tensor)
        if actual != item.nbytes:
            errors.append(f"item {index}: tensor on rank {rank} has {actual} bytes (shape "
                          f"{tuple(item.tensor.shape)}, {item.tensor.dtype}) but the item says "
                          f"nbytes={item.nbytes}; every rank must agree on nbytes")
    if len(errors) > _MAX_LISTED:
        errors = errors[:_MAX_LISTED] + [f"... and {len(errors) - _MAX_LISTED} more"]
    return errors

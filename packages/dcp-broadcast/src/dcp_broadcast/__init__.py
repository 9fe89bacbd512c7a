"""dcp-broadcast: move many tensors from chosen source ranks to groups of ranks, batched."""

from ._broadcast import broadcast_items
from ._groups import GroupManager
from ._items import DEFAULT_BATCH_BYTES, DEFAULT_MAX_IN_FLIGHT, BroadcastItem, BroadcastStats
from ._schedule import ScheduleMismatchError
from ._version import __version__

__all__ = [
    "DEFAULT_BATCH_BYTES",
    "DEFAULT_MAX_IN_FLIGHT",
    "BroadcastItem",
    "BroadcastStats",
    "GroupManager",
    "ScheduleMismatchError",
    "__version__",
    "broadcast_items",
]

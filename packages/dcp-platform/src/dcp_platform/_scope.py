"""Naming a process group alike on every member (no torch import until a group is given)."""

from __future__ import annotations

from typing import Any

__all__ = ["WORLD", "group_key", "registered"]

#: ``group_key`` of the default group (the world).
WORLD = "world"


def registered(pg: Any) -> bool:
    """Whether ``pg`` is a group torch.distributed made and keeps in its registry."""
    from torch.distributed import distributed_c10d as c10d

    return pg in getattr(c10d._world, "pg_map", {})


def group_key(group: Any) -> str:
    """A name of ``group`` that every member gives alike: ``WORLD`` for None or the default
    group, the name a joined group carries (``dcp_group_key``), else the registered group's
    name. dcp-load counts its calls per key, and keeps per key what it remembers."""
    if group is None:
        return WORLD
    key = getattr(group, "dcp_group_key", None)
    if key is not None:
        return str(key)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and group is dist.group.WORLD:
        return WORLD
    if registered(group):
        return f"pg:{group.group_name}"
    return f"pg:{id(group)}"

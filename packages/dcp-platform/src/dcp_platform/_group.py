"""A torch platform's view of one process group that is not the default world.

``TorchPlatform(group=pg)`` works within ``pg`` alone: its ranks are ``pg``'s ranks
(0..n-1), its world is ``pg``'s size, its store is ``pg``'s own (keys under a prefix that
names the group), and every collective runs on ``pg`` or on groups made from its store by
their members only. Ranks outside ``pg`` take no part in anything: no world-wide
``new_group`` and no use of the default group.

``pg`` may be a group registered with ``torch.distributed`` (from ``new_group``: a
sub-group of the world, a separate gloo group for checkpoint traffic, ranks not 0..n-1), or
one that is not (a ``ProcessGroupGloo`` made from a ``TCPStore``, joining two separately
launched jobs): collectives go through the group object's own methods
(``pg.broadcast([t], opts)``, ``pg.allgather``, ``pg.allreduce``), which both kinds have, so
nothing looks ``pg`` up in torch's registry of groups.

Groups made here (``new_group``, ``new_member_group``) are ``SubGroup``s: a gloo (or NCCL)
backend object connected through a ``PrefixStore`` over ``pg``'s store, with the rank list
it was made for, so that a broadcast's root is mapped to the sub-group's own numbering.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._scope import group_key
from ._scope import registered as _registered

__all__ = ["GroupView", "SubGroup"]

# Per parent group (by its key), the count of ``new_group`` calls made on it in this
# process: every member of the parent calls ``new_group`` in one order (the Platform
# contract), so the n-th call of every rank names the same sub-group's rendezvous keys.
_NEW_GROUPS: dict[str, Any] = {}


@dataclass(eq=False)
class SubGroup:
    """A group made within a ``GroupView``: the backend object and its ranks in the parent's numbering."""

    pg: Any
    ranks: tuple[int, ...]
    name: str

    def rank(self) -> int:
        return int(self.pg.rank())

    def size(self) -> int:
        return len(self.ranks)


def _backend_name(pg: Any) -> str:
    if _registered(pg):
        return str(dist.get_backend(pg))
    name = getattr(pg, "name", None)
    return str(name() if callable(name) else name or "gloo").lower()


class GroupView:
    """What a platform needs of ``pg`` (module docstring).

    ``store``: the store the group's helpers rendezvous through (default: ``pg``'s own
    group store). ``key``: a name for the group, unique in the job (default: the registered
    group's name); dcp-load counts its calls per key. ``global_ranks``: for each rank of
    ``pg``, its rank in this process's default world, or None where it is outside it
    (default: ``torch.distributed.get_process_group_ranks`` for a registered group);
    DTensor meshes are mapped through it.
    """

    def __init__(self, pg: Any, timeout: timedelta, *, store: Any = None, key: str | None = None,
                 global_ranks: Sequence[int | None] | None = None):
        if pg is dist.GroupMember.NON_GROUP_MEMBER:
            me = dist.get_rank() if dist.is_initialized() else "?"
            raise ValueError(f"process_group: this process (global rank {me}) is not a member of the group "
                             "(torch.distributed.new_group returned GroupMember.NON_GROUP_MEMBER here); only the "
                             "group's members call with process_group=")
        if pg is None or not callable(getattr(pg, "rank", None)):
            raise ValueError(f"process_group={pg!r} is not a process group: pass the group object "
                             "torch.distributed.new_group returned on a member, or None for the default group")
        self.pg, self.timeout = pg, timeout
        registered = _registered(pg)
        self.registered = registered
        if int(pg.rank()) < 0:
            ranks = dist.get_process_group_ranks(pg) if registered else "?"
            raise ValueError(f"process_group: this process (global rank {dist.get_rank()}) is not a member of "
                             f"the group of ranks {ranks}; call with process_group= only on its members")
        self.backend = _backend_name(pg)
        if store is None:
            getter = getattr(pg, "get_group_store", None)
            if getter is None:
                raise ValueError(f"process_group={pg!r} has no store of its own (get_group_store); pass store=")
            store = getter()
        self.raw_store = store
        self.store = dist.PrefixStore("dcp/", store)
        self.key = group_key(pg) if key is None else key
        if global_ranks is None and registered:
            global_ranks = dist.get_process_group_ranks(pg)
        self.global_ranks = tuple(global_ranks) if global_ranks is not None else None
        self._control: Any = None

    def rank(self) -> int:
        return int(self.pg.rank())

    def size(self) -> int:
        return int(self.pg.size())

    def __repr__(self) -> str:
        return f"group {self.key} ({self.backend}, {self.size()} ranks)"

    # -- groups made within the view -----------------------------------------------------------
    def _backend_for(self, store: Any, rank: int, size: int) -> Any:
        if "nccl" in self.backend:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            return dist.ProcessGroupNCCL(store, rank, size, opts)
        return dist.ProcessGroupGloo(store, rank, size, self.timeout)

    def make(self, ranks: Sequence[int], name: str) -> SubGroup | Any:
        """A group of ``ranks`` (this view's numbering) made by its members through the
        view's store under ``name``; a non-member gets ``GroupMember.NON_GROUP_MEMBER``."""
        key = tuple(int(r) for r in ranks)
        me = self.rank()
        if me not in key:
            return dist.GroupMember.NON_GROUP_MEMBER
        store = dist.PrefixStore(f"dcp-groups/{name}/", self.raw_store)
        return SubGroup(self._backend_for(store, key.index(me), len(key)), key, name)

    def next_name(self, ranks: Sequence[int]) -> str:
        """The name of the next ``new_group`` of this view's group (module-level count)."""
        count = _NEW_GROUPS.setdefault(self.key, itertools.count())
        return f"n{next(count)}-{'.'.join(map(str, ranks))}"

    def control(self) -> Any:
        """A gloo group over the view's ranks for control traffic (the group itself when it is gloo)."""
        if "gloo" in self.backend:
            return self.pg
        if self._control is None:
            cached = _CONTROL.get(self.key)
            if cached is None or cached[0] is not self.pg:
                store = dist.PrefixStore("dcp-control/", self.raw_store)
                cached = _CONTROL[self.key] = (self.pg, dist.ProcessGroupGloo(store, self.rank(), self.size(),
                                                                              self.timeout))
            self._control = cached[1]
        return self._control

    # -- collectives on the group object ------------------------------------------------------
    def broadcast(self, wire: torch.Tensor, src: int, group: Any) -> Any:
        if group is None or group is self.pg:
            target, root = self.pg, src
        elif isinstance(group, SubGroup):
            if src not in group.ranks:
                raise ValueError(f"broadcast: source rank {src} is not in the group of ranks {list(group.ranks)}")
            target, root = group.pg, group.ranks.index(src)
        else:  # a registered group the caller supplied: its ranks are global ranks
            if self.global_ranks is None or self.global_ranks[src] is None:
                raise ValueError(f"broadcast: group {group!r} is not a group made within {self!r}")
            target, root = group, dist.get_group_rank(group, self.global_ranks[src])
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        return target.broadcast([wire], opts)

    def all_gather(self, outs: list[torch.Tensor], tensor: torch.Tensor) -> Any:
        return self.control().allgather([outs], [tensor])

    def all_reduce(self, tensor: torch.Tensor, op: str) -> Any:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        return self.control().allreduce([tensor], opts)

    def destroy(self, group: Any) -> None:
        if isinstance(group, SubGroup):
            group.pg.shutdown()
        elif group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)

    def timeout_seconds(self) -> float | None:
        """The group's own collective timeout: its backend's options, else the view's."""
        try:
            backend = self.pg._get_backend(torch.device("cpu")) if hasattr(self.pg, "_get_backend") else self.pg
            timeout = backend.options._timeout
        except Exception:  # noqa: BLE001 - a backend without options: the timeout the view was made with
            timeout = self.timeout
        return timeout.total_seconds() if isinstance(timeout, timedelta) else None


# The gloo control group of each non-gloo group, by the group's key (one per group and
# process, as ``_torch._CONTROL_GROUPS`` for the default group): platforms are made per call.
_CONTROL: dict[str, tuple[Any, Any]] = {}

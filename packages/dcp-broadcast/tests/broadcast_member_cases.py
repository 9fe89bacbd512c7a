"""Functions that run inside ranks for the member-groups tests (not a test module).

Each rank passes ``GroupManager.ensure(own=True)`` only the overlapping rank sets it
belongs to; the manager must make each group with its members alone (no all-gather, no
world ``new_group``), in one sorted order, and every group must then carry a broadcast.
"""

from __future__ import annotations

from typing import Any

import torch

SETS = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3), (0, 1, 2), (0, 2, 3), (1, 2, 3)]


def member_cases(rank: int, world: int, with_watch: bool) -> dict[str, Any]:
    from dcp_broadcast import GroupManager
    from dcp_platform import Watch
    from dcp_platform._torch import TorchPlatform

    calls: dict[str, int] = {"gather": 0, "new_group": 0, "new_member_group": 0}

    class Counting(TorchPlatform):
        def all_gather_object(self, obj: Any, **kw: Any) -> list[Any]:
            calls["gather"] += 1
            return super().all_gather_object(obj, **kw)

        def new_group(self, ranks: Any) -> Any:
            calls["new_group"] += 1
            return super().new_group(ranks)

        def new_member_group(self, ranks: Any, name: str) -> Any:
            calls["new_member_group"] += 1
            return super().new_member_group(ranks, name)

    platform = Counting()
    mine = [s for s in SETS if rank in s]
    got: dict[str, int] = {}
    watch = Watch(platform, "member-groups-test") if with_watch else None
    if watch is not None:
        watch.__enter__()
        watch.arrive(30.0)
    with GroupManager(platform, watch=watch) as manager:
        manager.ensure(list(reversed(mine)), own=True)  # any order given: created sorted
        ensured = dict(calls)
        for s in mine:
            t = torch.tensor([rank * 10 + len(s)])
            platform.broadcast(t, src=s[-1], group=manager.get(s)).wait()
            got[repr(s)] = int(t)
        created = sorted(manager.created)
    if watch is not None:
        watch.close(success=True)
    return {"ensured": ensured, "closed": dict(calls), "got": got, "created": [list(c) for c in created],
            "capable": platform.capabilities.member_groups}

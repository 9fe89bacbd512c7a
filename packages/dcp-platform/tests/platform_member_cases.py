"""Functions that run inside ranks for the member-group tests (not a test module)."""

from __future__ import annotations

from typing import Any

import torch


def member_cases(rank: int, world: int) -> dict[str, Any]:
    """Overlapping groups made by their members alone (sorted order), a broadcast on each,
    the same rank set made twice under two names, and the argument checks."""
    from dcp_platform import get_platform

    p = get_platform("torch")
    out: dict[str, Any] = {"capable": p.capabilities.member_groups, "got": {}, "errors": []}
    sets = [(0, 1), (0, 2), (1, 2), (0, 1, 2)]
    for round_ in range(2):  # the second round re-creates every set under new names
        groups = {s: p.new_member_group(list(s), f"member-test/{round_}/{s}") for s in sets if rank in s}
        for s, g in groups.items():
            t = torch.tensor([-123])
            if rank == s[-1]:
                t.fill_(100 * round_ + sum(s))
            p.broadcast(t, src=s[-1], group=g).wait()
            out["got"][f"{round_}{s}"] = int(t)
        for g in groups.values():
            p.destroy_group(g)
    for bad in ([1, 0], [0, 0], [0, world], [r for r in range(world) if r != rank][:1]):
        try:
            p.new_member_group(bad, "member-test/bad")
            out["errors"].append(f"no ValueError for {bad}")
        except ValueError as exc:
            out.setdefault("messages", []).append(str(exc))
    return out

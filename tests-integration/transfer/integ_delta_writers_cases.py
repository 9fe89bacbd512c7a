"""Functions that run inside ranks for test_integ_delta_writers (not a test module).

Rank 1 is an engine whose destination tensors other transfers also write (another kept plan,
a ``delta=False`` refresh), and sources whose strides are not row-major (a transposed matrix,
a channels_last kernel). Destinations are poisoned (NaN) before the first transfer; every
check compares bits (int views) with the values the last transfer sent.
"""

from __future__ import annotations

from typing import Any

import dcp_load
import torch

N = 4096


def _seeded(seed: int, shape: tuple[int, ...] = (N,)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _wrong(dst: torch.Tensor, value: torch.Tensor) -> int:
    return int((dst.contiguous().view(torch.int32) != value.contiguous().view(torch.int32)).sum())


def _step(rank: int, dst: Any, value: torch.Tensor, holders: tuple[int, ...], delta: bool) -> dict[str, Any]:
    report = dcp_load.transfer({"w": value.clone()} if rank in holders else None, dst, delta=delta, timeout=60)
    return {"reused": report.plan_reused, "received": report.bytes_received, "kept": report.bytes_kept,
            "wrong": _wrong(dst["w"], value) if dst else 0}


def two_plans_one_destination(rank: int, world: int) -> list[dict[str, Any]]:
    """The policy (held by rank 0: plan A), a reference model into the same tensor (held by
    both ranks: plan B), the policy again with 3 elements changed since step 1 (plan A kept)."""
    dst = {"w": torch.full((N,), float("nan"))} if rank == 1 else None
    policy1, policy3 = _seeded(1), _seeded(1)
    policy3[:3] += 1
    steps = [(policy1, (0,)), (_seeded(2), (0, 1)), (policy3, (0,))]
    return [_step(rank, dst, value, holders, True) for value, holders in steps]


def refresh_between_deltas(rank: int, world: int) -> list[dict[str, Any]]:
    """A delta call, a delta=False refresh of other values (its own plan), then a delta call
    of the first values again (the trainer rolled back): nothing changed since the delta
    plan's own last call, but the destination holds the refresh."""
    dst = {"w": torch.full((N,), float("nan"))} if rank == 1 else None
    first, refresh = _seeded(1), _seeded(1)
    refresh[:100] -= 1
    steps = [(first, True), (refresh, False), (first, True)]
    return [_step(rank, dst, value, (0,), delta) for value, delta in steps]


def _strided(kind: str, changes: int) -> torch.Tensor:
    if kind == "transposed":
        t = _seeded(5, (64, 48)).t()
    else:
        t = _seeded(5, (2, 8, 6, 6)).contiguous(memory_format=torch.channels_last)
    picks = torch.randperm(t.numel(), generator=torch.Generator().manual_seed(7))[:changes]
    for i in picks.tolist():
        t[torch.unravel_index(torch.tensor(i), t.shape)] += 1
    return t


def strided_sources(rank: int, world: int, kind: str, changes: int) -> list[dict[str, Any]]:
    """Rank 0's source is ``kind`` (not row-major); step 2 changes ``changes`` elements."""
    shape = _strided(kind, 0).shape
    dst = {"w": torch.full(shape, float("nan"))} if rank == 1 else None
    return [_step(rank, dst, _strided(kind, c), (0,), True) for c in (0, changes, 2 * changes)]


def view_overlaps_destination(rank: int, world: int) -> list[dict[str, Any]]:
    """Plan A fills rank 1's fused tensor ``D`` (2N elements) whole with delta=True; plan B
    (another source, ``delta=False``) writes ``D[N:2N]`` through a view that starts inside
    ``D``; plan A again with one element changed: ``D`` must hold plan A's values again."""
    fused = torch.full((2 * N,), float("nan")) if rank == 1 else None
    first, again, other = _seeded(1, (2 * N,)), _seeded(1, (2 * N,)), _seeded(3)
    again[0] += 1
    out = []
    for name, value, into, delta in (("a", first, fused, True), ("b", other, None, False), ("a", again, fused, True)):
        dst = None
        if rank == 1:
            dst = {name: into if into is not None else fused[N:]}
        report = dcp_load.transfer({name: value.clone()} if rank == 0 else None, dst, delta=delta, timeout=60)
        out.append({"reused": report.plan_reused, "received": report.bytes_received, "kept": report.bytes_kept,
                    "wrong": _wrong(dst[name], value) if dst else 0})
    return out

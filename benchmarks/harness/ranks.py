"""Timing inside gloo ranks, for the benchmarks that time collectives themselves.

``slowest`` is the slowest rank's seconds for one call started together after a barrier
(what a job waits for); ``rounds`` runs every case once per round, so that load changes
on a shared machine hit every case alike, and gives the median over rounds of each case.
Call both on every rank (they run collectives).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from harness.stats import median


def slowest(fn: Callable[[], Any]) -> float:
    """The slowest rank's seconds for one call of ``fn`` (ranks start after a barrier)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    mine = time.perf_counter() - start
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return max(everyone)


def rounds(cases: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Each case's median over ``repeats`` rounds of its slowest-rank time, every case once per
    round in the order given."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            times[name].append(slowest(fn))
    return {name: median(ts) for name, ts in times.items()}

"""Functions that run inside ranks for test_integ_calls (not a test module).

The n-th call of an operation on every rank pairs with the n-th of the others. A call that
one rank refuses on its arguments, or that one rank makes once more than the others, must
not shift the pairing for the rest of the job: after either, the next good call succeeds
on every rank. ``run_sequence`` plays one sequence of good and bad calls, the same on every
rank, and reports what each call did and whether a good call of each operation works after.
"""

from __future__ import annotations

import os
import time
from typing import Any

import dcp_load
import torch
import torch.distributed as dist
from dcp_load import LoadError

#: how long a rank waits for the others in these tests: an extra call ends within it
WAIT_S = 3.0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _transfer(step: int, bad: bool) -> Any:
    rank, world = dist.get_rank(), dist.get_world_size()
    src = {"w": torch.full((8,), float(step))} if rank == 0 else {}
    dst = {"w": torch.full((8,), -1.0)}
    kwargs = {"max_in_flight": 0} if bad else {}
    rep = dcp_load.transfer(src, dst, timeout=WAIT_S * 10, **kwargs)
    assert torch.equal(dst["w"], torch.full((8,), float(step))), (rank, world, dst)
    return rep


def _save(root: str, step: int, bad: bool, kind: str) -> Any:
    t = torch.full((8,), float(step))
    sd: dict[str, Any] = {"a.b": t, "a": {"b": t}} if bad else {"a": {"b": t}}
    path = os.path.join(root, kind)
    if kind == "async":
        return dcp_load.async_save(sd, checkpoint_id=path, timeout=WAIT_S * 10).result(timeout=60)
    return dcp_load.save(sd, checkpoint_id=path, timeout=WAIT_S * 10)


def _call(op: str, who: int, root: str, step: int) -> tuple[str, float]:
    """One call of ``op`` ("transfer", "save", "async"), bad on rank ``who`` (-1: good on
    every rank); "extra": rank ``who`` alone calls transfer once more. (outcome, seconds)."""
    rank = dist.get_rank()
    start = time.monotonic()
    try:
        if op == "extra":
            if rank != who:  # comes to its next call after the extra one gave up waiting
                time.sleep(WAIT_S * 1.5)
                return "not called", 0.0
            dcp_load.transfer({"w": torch.zeros(8)}, {"w": torch.zeros(8)}, timeout=WAIT_S)
        elif op == "transfer":
            _transfer(step, bad=rank == who)
        else:
            _save(root, step, rank == who, op)
    except (LoadError, ValueError) as exc:
        return f"{type(exc).__name__}: {str(exc)[:400]}", time.monotonic() - start
    return "ok", time.monotonic() - start


def run_sequence(rank: int, world: int, root: str, calls: list[tuple[str, int]]) -> dict[str, Any]:
    """Play ``calls`` ((op, rank), the same list on every rank), then one good call of each
    operation; groups and fds counted after a first good transfer and at the end."""
    _transfer(0, bad=False)
    before = (_groups(), _fds())
    outcomes = [_call(op, who, root, step + 1) for step, (op, who) in enumerate(calls)]
    after = [_call(op, -1, root, 100 + k) for k, op in enumerate(("transfer", "save", "async", "transfer"))]
    return {"outcomes": outcomes, "after": after, "before": before, "end": (_groups(), _fds())}

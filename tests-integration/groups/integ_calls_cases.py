"""Functions that run inside ranks for test_integ_calls (not a test module).

The n-th call of an operation on every rank pairs with the n-th of the others. A call that
one rank refuses on its arguments, or that one rank makes after the others gave up waiting
for it, must not shift the pairing for the rest of the job: after either, the next good
call succeeds on every rank. ``run_sequence`` plays one sequence of good and bad calls, the same on every
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

#: how long a rank waits for the others in these tests: a late rank comes after it
WAIT_S = 3.0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _transfer(step: int, bad: bool, timeout: float = WAIT_S * 10) -> Any:
    rank, world = dist.get_rank(), dist.get_world_size()
    src = {"w": torch.full((8,), float(step))} if rank == 0 else {}
    dst = {"w": torch.full((8,), -1.0)}
    kwargs = {"max_in_flight": 0} if bad else {}
    rep = dcp_load.transfer(src, dst, timeout=timeout, **kwargs)
    assert torch.equal(dst["w"], torch.full((8,), float(step))), (rank, world, dst)
    return rep


def _save(root: str, step: int, bad: bool, kind: str) -> Any:
    t = torch.full((8,), float(step))
    sd: dict[str, Any] = {"a.b": t, "a": {"b": t}} if bad else {"a": {"b": t}}
    path = os.path.join(root, kind)
    if kind == "async":
        return dcp_load.async_save(sd, checkpoint_id=path, timeout=WAIT_S * 10).result(timeout=60)
    return dcp_load.save(sd, checkpoint_id=path, timeout=WAIT_S * 10)


def _alone(root: str, step: int) -> None:
    """A save, an async_save, a read and a load without collectives, as a rank inspecting or
    copying a checkpoint makes."""
    path = os.path.join(root, f"alone-{dist.get_rank()}")
    dcp_load.async_save({"w": torch.full((8,), -2.0)}, checkpoint_id=path + "-async", no_dist=True).result(timeout=60)
    dcp_load.save({"w": torch.full((8,), float(step))}, checkpoint_id=path, no_dist=True)
    assert torch.equal(dcp_load.read_state_dict(path)["w"], torch.full((8,), float(step)))
    back = {"w": torch.full((8,), -1.0)}
    dcp_load.load(back, checkpoint_id=path, no_dist=True)
    assert torch.equal(back["w"], torch.full((8,), float(step)))


def _call(op: str, who: int, root: str, step: int) -> tuple[str, float]:
    """One call of ``op`` ("transfer", "save", "async"), bad on rank ``who`` (-1: good on
    every rank); "late": a transfer that rank ``who`` comes to after the others gave up
    waiting for it; "alone": rank ``who`` saves, reads and loads without collectives. (outcome, seconds), counted from when the rank calls."""
    rank = dist.get_rank()
    if op == "late" and rank == who:
        time.sleep(WAIT_S * 1.5)
    start = time.monotonic()
    try:
        if op == "alone":  # calls without collectives, on one rank: they take part in nothing
            if rank != who:
                return "not called", 0.0
            _alone(root, step)
        elif op == "late":
            _transfer(step, bad=False, timeout=WAIT_S)
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

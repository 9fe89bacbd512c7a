"""In-rank functions of test_integ_compat_order: Statefuls whose methods run a collective, in
dict orders that differ per rank, and a per-rank value one rank cannot pickle, through
``dcp_load.torch_compat`` on real gloo ranks."""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import dcp_load.torch_compat as compat
import torch
import torch.distributed as dist
from dcp_load import LoadError

POISON = -4242.0


class Collective:
    """A Stateful whose ``state_dict`` and ``load_state_dict`` all-gather its name (as a
    sharded optimizer's gather state), recording the names every rank was at."""

    def __init__(self, name: str, value: float, seen: list) -> None:
        self.name, self.t, self.seen = name, torch.full((4,), value), seen

    def _agree(self, call: str) -> None:
        names: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(names, self.name)
        self.seen.append((call, self.name, names))

    def state_dict(self):
        self._agree("state_dict")
        return {"t": self.t}

    def load_state_dict(self, state):
        self._agree("load_state_dict")
        self.t = state["t"]


def _ordered(rank: int, value: float, seen: list) -> dict[str, Any]:
    names = ["model", "optim", "sched"]
    if rank % 2:
        names.reverse()  # each rank builds its dict in its own order
    return {n: Collective(n, value, seen) for n in names}


def different_orders(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save and load the Statefuls through torch_compat; every collective must pair a name
    with the same name on every rank."""
    seen: list = []
    compat.save(_ordered(rank, 1.0, seen), checkpoint_id=os.path.join(root, "ck"))
    got = _ordered(rank, POISON, seen)
    compat.load(got, checkpoint_id=os.path.join(root, "ck"))
    mismatched = [s for s in seen if set(s[2]) != {s[1]}]
    return {"mismatched": mismatched, "calls": [s[:2] for s in seen],
            "values": {n: o.t.tolist() for n, o in got.items()}}


class Unpicklable:
    def __init__(self, how: str) -> None:
        self.how = how

    def __reduce__(self):
        if self.how == "reduce":
            raise TypeError("this object refuses pickling")
        return super().__reduce__()

    def __getstate__(self):
        raise RuntimeError("this object's state cannot be read")


def unpicklable_value(rank: int, world: int, root: str, how: str, mode: str) -> dict[str, Any]:
    """Rank 1 holds a value it cannot pickle; every rank saves, then waits for the others
    through the store (so that a rank that raised alone stays up while the rest wait)."""
    state = {"w": torch.ones(3), "loader": {f"dp_rank_{rank}": Unpicklable(how) if rank == 1 else {"seen": 1}}}
    start = time.perf_counter()
    try:
        if mode == "async":
            compat.async_save(state, checkpoint_id=os.path.join(root, how)).result(timeout=60)
        else:
            compat.save(state, checkpoint_id=os.path.join(root, how))
        out: dict[str, Any] = {"raised": None}
    except Exception as exc:  # noqa: BLE001 - the test inspects what each rank raised
        out = {"raised": type(exc).__name__, "load_error": isinstance(exc, LoadError), "message": str(exc)}
    out["seconds"] = time.perf_counter() - start
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{how}-{mode}-done-{rank}", "1")
    store.wait([f"{how}-{mode}-done-{r}" for r in range(world)], datetime.timedelta(seconds=90))
    return out

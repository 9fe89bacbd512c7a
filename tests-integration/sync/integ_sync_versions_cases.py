"""Functions that run inside ranks for test_integ_sync_versions (not a test module).

Two jobs launched apart (a "trainer" job of 2 ranks, an "engine" job of 2), joined by
``dcp_load.transfer_group`` as in integ_sync_cases. Trainer rank h holds rows
[R/2 h, R/2 (h + 1)) of each bf16 tensor (``Shard(0)``); engine rank r the columns
[C/2 r, C/2 (r + 1)), as plain tensors passed through ``engine_shards``. Destinations are
poisoned (0x7F bytes) before each transfer that writes them whole; a ``delta=True`` call
needs what the previous one wrote, so they are not poisoned before it.

``versions_and_hook``: versions passed and counted, read back with ``synced_version``; a rank
passing another version refused on every rank before any write; the ``on_synced`` hook, with
the names written (only the changed ones under ``delta=True``), never after a failed call; a
hook that raises on one engine rank. ``plain_fails_midway``: a ``delta=False`` call fails on
trainer rank 1 as its second round starts (one tensor per round: ``BIG`` and ``BATCH``), with
``atomic`` True or False; the engine's destinations, errors and versions are reported, then
a transfer over a new group (on a second port) repairs everything.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import dcp_load
import torch
from group_guards import poison
from integ_sync_cases import join, linger, truth
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

SMALL = {"a": (16, 32), "b": (16, 32), "c": (16, 32)}
#: Each tensor's 4 pieces (2 trainer row halves x 2 engine column halves) are 2 MiB of bf16:
#: with ``BATCH`` they count for staging and the plan's rounds (8 MiB each) hold one tensor.
BIG = {"a": (1024, 4096), "b": (1024, 4096), "c": (1024, 4096)}
BATCH = 1 << 16
#: The share of each tensor's values that change at each step ("c" never changes).
SHARES = {"a": 0.5, "b": 0.02}


def full(shapes: dict[str, tuple[int, int]], step: int) -> dict[str, torch.Tensor]:
    """Every tensor's whole value at ``step`` (the same on every rank): step 0's values, then
    about ``SHARES`` of "a" and "b" changed at each step after it. Read only: kept per step."""
    return _full(tuple(shapes.items()), step)


@functools.lru_cache(maxsize=4)
def _full(shapes: tuple[tuple[str, tuple[int, int]], ...], step: int) -> dict[str, torch.Tensor]:
    now = {n: truth(n, 0, s).bfloat16() for n, s in shapes} if step == 0 else \
        {n: t.clone() for n, t in _full(shapes, step - 1).items()}
    for name, share in SHARES.items() if step else ():
        g = torch.Generator().manual_seed(sum(map(ord, name)) * 131 + step)
        picks = torch.randint(now[name].numel(), (round(now[name].numel() * share),), generator=g)
        now[name].view(-1)[picks] += step
    return now


def _src(mesh: Any, shapes: dict[str, Any], step: int, side: str) -> dict[str, Any]:
    if side != "trainer":
        return {}
    return {n: distribute_tensor(v, mesh, [Shard(0)]) for n, v in full(shapes, step).items()}


def _engine(shapes: dict[str, Any], rank: int, side: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if side != "engine":
        return {}, {}
    tensors = {n: torch.empty(s, dtype=torch.bfloat16).chunk(2, 1)[rank].contiguous() for n, s in shapes.items()}
    for t in tensors.values():
        poison(t)
    return dcp_load.engine_shards({n: (t, (0, rank * t.shape[1])) for n, t in tensors.items()}, shapes), tensors


def _holding(tensors: dict[str, torch.Tensor], shapes: dict[str, Any], step: int, rank: int) -> list[str]:
    """The names whose destination holds ``step``'s values (this engine rank's columns), bit for bit."""
    values = full(shapes, step)
    return sorted(n for n, t in tensors.items()
                  if torch.equal(t.view(torch.int16), values[n].chunk(2, 1)[rank].contiguous().view(torch.int16)))


def _versions(shards: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``synced_version`` of the whole ``dst``, and per name of the plain tensors themselves."""
    return {"all": dcp_load.synced_version(shards), **{n: dcp_load.synced_version(t) for n, t in tensors.items()}}


def _step(out: dict[str, Any], label: str, src: dict[str, Any], shards: dict[str, Any], group: Any,
          **kwargs: Any) -> None:
    """One transfer; its report's version and names written, or its error, under ``label``."""
    try:
        report = dcp_load.transfer(src, shards, process_group=group, timeout=30, **kwargs)
        out[label] = {"version": report.version, "changed": list(report.changed)}
    except dcp_load.LoadError as exc:
        out[label] = {"error": str(exc), "phase": exc.phase, "torn": list(exc.torn)}
    except RuntimeError as exc:  # a hook's own exception
        out[label] = {"raised": str(exc), "notes": list(getattr(exc, "__notes__", []))}


def versions_and_hook(rank: int, world: int, side: str, port: int, sizes: tuple[int, int]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    group = join(side, rank, port, sizes)
    shards, tensors = _engine(SMALL, rank, side)
    calls: list[tuple[str, list[str], Any]] = []

    def hook(label: str) -> Any:
        def on_synced(names: tuple[str, ...]) -> None:
            calls.append((label, list(names), dcp_load.synced_version(shards)))
            if label == "raises" and side == "engine" and rank == 1:
                raise RuntimeError("injected: the engine's post-processing failed")
        return on_synced

    out: dict[str, Any] = {}
    _step(out, "passed", _src(mesh, SMALL, 1, side), shards, group, version=7, on_synced=hook("passed"))
    out["held_passed"], out["versions_passed"] = _holding(tensors, SMALL, 1, rank), _versions(shards, tensors)
    for t in tensors.values():
        poison(t)
    mine = 9 if side == "engine" and rank == 1 else 8  # group rank 3 passes another version
    _step(out, "mismatch", _src(mesh, SMALL, 2, side), shards, group, version=mine, on_synced=hook("mismatch"))
    out["poisoned"] = all(bool((t.view(torch.uint8) == 0x7F).all()) for t in tensors.values())
    out["versions_mismatch"] = _versions(shards, tensors)
    for label, step in (("counted_first", 2), ("counted_delta", 3)):  # no version: the group's count
        _step(out, label, _src(mesh, SMALL, step, side), shards, group, delta=True, on_synced=hook(label))
        out[f"held_{label}"], out[f"versions_{label}"] = _holding(tensors, SMALL, step, rank), _versions(shards, tensors)
    for label, step in (("raises", 4), ("after_raise", 5)):
        for t in tensors.values():
            poison(t)
        _step(out, label, _src(mesh, SMALL, step, side), shards, group, version=10 * step, on_synced=hook(label))
        out[f"held_{label}"] = _holding(tensors, SMALL, step, rank)
    out["calls"] = calls
    group.close()
    return out


@contextlib.contextmanager
def _second_round_fails() -> Iterator[None]:
    """Inside, this rank raises as its second round of the plan starts (its first ran whole)."""
    from dcp_load.transferring import _move

    saved, runs = _move._Round.run, []

    def run(self: Any, *args: Any, **kwargs: Any) -> None:
        runs.append(1)
        if len(runs) == 2:
            raise RuntimeError("injected: trainer rank 1 fails as its second round starts")
        saved(self, *args, **kwargs)

    _move._Round.run = run
    try:
        yield
    finally:
        _move._Round.run = saved


def plain_fails_midway(rank: int, world: int, side: str, port: int, sizes: tuple[int, int], port2: int,
                       atomic: bool) -> dict[str, Any]:
    """Step 1 (version 1), step 2 (version 2, ``atomic``) failing on trainer rank 1 at its
    second round, then step 3 (version 3, ``delta=True``) over a new group."""
    mesh = init_device_mesh("cpu", (world,))
    group = join(side, rank, port, sizes)
    shards, tensors = _engine(BIG, rank, side)
    hooked: list[Any] = []
    out: dict[str, Any] = {}
    for step in (1, 2):
        src = _src(mesh, BIG, step, side)
        fails = step == 2 and side == "trainer" and rank == 1
        with _second_round_fails() if fails else contextlib.nullcontext():
            _step(out, f"step{step}", src, shards, group, version=step, atomic=atomic and step == 2,
                  batch_bytes=BATCH, on_synced=hooked.append)
        out[f"held{step}"] = _holding(tensors, BIG, 1, rank)  # what still holds step 1
        out[f"new{step}"] = _holding(tensors, BIG, 2, rank)  # what holds step 2
        out[f"versions{step}"] = _versions(shards, tensors)
    out["hooked"] = [list(names) for names in hooked]
    linger(group, side, rank, 4)
    group.close(timeout=5)
    group3 = join(side, rank, port2, sizes)
    _step(out, "step3", _src(mesh, BIG, 3, side), shards, group3, version=3, delta=True, batch_bytes=BATCH)
    out["held3"], out["versions3"] = _holding(tensors, BIG, 3, rank), _versions(shards, tensors)
    group3.close()
    return out

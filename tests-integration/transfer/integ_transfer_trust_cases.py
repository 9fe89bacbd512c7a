"""Functions that run inside ranks for test_integ_transfer_trust (not a test module).

Kept plans and their broadcast groups over sequences of layouts that change from call to
call on some ranks, and replicated pieces a rank both holds and wants. Every destination
is poisoned (0x7F bytes) before each transfer and compared exactly with the truth after
it. Process groups are counted in torch.distributed's registry, file descriptors in
/proc/self/fd.
"""

from __future__ import annotations

import os
from typing import Any

import dcp_load
import torch
import torch.distributed as dist
from dcp_load import Chunk
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

#: "a" is held in quarters of rows, one per rank; "b{r}" by rank r alone; "c" by every rank
A, B, C = (16, 8), (8, 8), (8, 8)


def groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def truth(name: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + step)
    return torch.randn(*shape, generator=g)


def poison(t: torch.Tensor) -> None:
    t.view(torch.uint8).fill_(0x7F)


def _poisoned_chunk(shape: tuple[int, ...], rows: tuple[int, int]) -> Chunk:
    local = torch.empty(rows[1] - rows[0], *shape[1:])
    poison(local)
    return Chunk(local, shape, (rows[0], *([0] * (len(shape) - 1))))


def _poisoned(shape: tuple[int, ...]) -> torch.Tensor:
    t = torch.empty(shape)
    poison(t)
    return t


def _local(value: Any) -> torch.Tensor:
    if isinstance(value, Chunk):
        return value.tensor
    return value.to_local() if isinstance(value, DTensor) else value


def _expected(name: str, value: Any, step: int) -> torch.Tensor:
    full = truth(name, (B if name.startswith("b") else A if name == "a" else C), step)
    if isinstance(value, Chunk):
        return full[value.offsets[0]:value.offsets[0] + value.tensor.shape[0]]
    return full


def wrong(dst: dict[str, Any], step: int) -> list[str]:
    """Names of the destinations that do not hold exactly the truth of ``step``."""
    return [n for n, v in dst.items() if not torch.equal(_local(v), _expected(n, v, step))]


def alternating(rank: int, world: int, calls: int) -> list[dict[str, Any]]:
    """Rank 3 holds "b" whole on even calls and as a Chunk of its first rows on odd calls;
    ranks 0-2 keep one layout (a quarter of "a" each, wanting all of "a"; ranks 0-1 want
    those rows of "b"). Per call: groups, fds, the report's plan_reused and the wrong destinations."""
    out = []
    for step in range(calls):
        lo = 4 * rank
        src: dict[str, Any] = {"a": Chunk(truth("a", A, step)[lo:lo + 4].clone(), A, (lo, 0))}
        dst: dict[str, Any] = {"a": _poisoned(A)}
        if rank == 3:
            b = truth("b", B, step)
            src["b"] = b if step % 2 == 0 else Chunk(b[:4].clone(), B, (0, 0))
        elif rank < 2:  # "b" moves over a group of ranks 0, 1 and 3, made for each plan
            dst["b"] = _poisoned_chunk(B, (0, 4))
        report = dcp_load.transfer(src, dst, timeout=60)
        out.append({"groups": groups(), "fds": fds(), "reused": report.plan_reused, "wrong": wrong(dst, step)})
    return out


def replicated_both_sides(rank: int, world: int, holders: int) -> list[dict[str, Any]]:
    """Ranks below ``holders`` pass a Replicate DTensor "r" and a plain tensor "p" (1 MiB
    each) as both src and dst; the other ranks want them only. Two transfers (the second
    reuses the plan); per call the report's byte and broadcast counts and wrong destinations."""
    mesh = init_device_mesh("cpu", (world,))
    shape = (512, 512)  # float32: 1 MiB
    out = []
    for step in range(2):
        src = None
        if rank < holders:
            src = {"r": DTensor.from_local(truth("r", shape, step), mesh, [Replicate()], run_check=False),
                   "p": truth("p", shape, step)}
        dst = {"r": DTensor.from_local(_poisoned(shape), mesh, [Replicate()], run_check=False),
               "p": _poisoned(shape)}
        report = dcp_load.transfer(src, dst, timeout=60)
        bad = [n for n, v in dst.items() if not torch.equal(_local(v), truth(n, shape, step))]
        out.append({"received": report.bytes_received, "sent": report.bytes_sent, "copied": report.bytes_copied,
                    "broadcasts": report.broadcasts, "reused": report.plan_reused, "wrong": bad})
    return out


def _layout(rank: int, world: int, code: int, mesh: Any, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One rank's (src, dst) of layout ``code`` (0..143): how it holds its quarter of "a"
    (Chunk or Shard(0) DTensor), its "b{rank}" (whole or the first rows), "c" (plain or
    Replicate DTensor), and what it wants: all of "a", a quarter or a half of it; the first
    rows of the previous rank's "b" or nothing; all of "c", its last rows or nothing."""
    a_src, b_src, c_src, a_dst, b_dst, c_dst = (code % 2, code // 2 % 2, code // 4 % 2, code // 8 % 3,
                                                code // 24 % 2, code // 48 % 3)
    lo = 4 * rank
    quarter = truth("a", A, step)[lo:lo + 4].clone()
    src: dict[str, Any] = {"a": Chunk(quarter, A, (lo, 0)) if a_src == 0 else DTensor.from_local(
        quarter, mesh, [Shard(0)], run_check=False, shape=torch.Size(A), stride=(A[1], 1))}
    b = truth(f"b{rank}", B, step)
    src[f"b{rank}"] = b if b_src == 0 else Chunk(b[:4].clone(), B, (0, 0))
    c = truth("c", C, step)
    src["c"] = c if c_src == 0 else DTensor.from_local(c, mesh, [Replicate()], run_check=False)
    dst: dict[str, Any] = {}
    other = 4 * ((rank + 1) % world)
    dst["a"] = [_poisoned(A), _poisoned_chunk(A, (other, other + 4)),
                _poisoned_chunk(A, (8 * (rank % 2), 8 * (rank % 2) + 8))][a_dst]
    if b_dst:
        dst[f"b{(rank - 1) % world}"] = _poisoned_chunk(B, (0, 4))
    if c_dst < 2:
        dst["c"] = _poisoned(C) if c_dst == 0 else _poisoned_chunk(C, (4, 8))
    return src, dst


#: layouts per rank in ``_layout``
LAYOUTS = 144


def sequence(rank: int, world: int, codes: list[list[int]], flush: int) -> dict[str, Any]:
    """Transfer once per step of ``codes`` (per step, each rank's layout code), then
    ``flush`` transfers of distinct layouts that every rank holds whole and wants whole (no
    subgroup: local copies). Groups and fds at the start, after each step and at the end."""
    mesh = init_device_mesh("cpu", (world,))
    base = (groups(), fds())
    steps = []
    for step, per_rank in enumerate(codes):
        src, dst = _layout(rank, world, per_rank[rank], mesh, step)
        report = dcp_load.transfer(src, dst, timeout=60)
        steps.append({"groups": groups(), "fds": fds(), "reused": report.plan_reused, "wrong": wrong(dst, step)})
    for k in range(flush):
        name = f"z{k}"
        dst = {name: _poisoned(C)}
        dcp_load.transfer({name: truth(name, C, 0)}, dst, timeout=60)
        assert torch.equal(dst[name], truth(name, C, 0)), (rank, name)
    return {"base": base, "steps": steps, "end": (groups(), fds())}

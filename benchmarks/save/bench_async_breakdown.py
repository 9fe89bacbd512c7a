"""Where ``async_save``'s blocked time goes: the copy into the staging pool against the rest,
and the copy itself against copies of the same bytes outside ``async_save``.

4 gloo ranks (``--world 2``: 2) hold the state of ``bench_save.py`` (fp32 model + AdamW as
DTensors, DP2xTP2 and FSDP4; DP2xTP1 and FSDP2 on 2 ranks). Per layout, after one round
that is not counted, ``--saves`` rounds each run, in an order that rotates from one round
to the next and between the same barriers on every rank:

* ``flat``: one ``copy_`` of the bytes this rank stages, between two warm torch buffers
  (``bench_save.py``'s memcpy, the goal's baseline);
* ``boxes``: the boxes this rank writes (captured from the first save), each copied into a
  warm torch buffer (what the per-box copies cost over one flat copy);
* ``pool``: ``StagingPool.stage`` of those boxes outside ``async_save`` (what the pool's
  arena costs over a torch buffer);
* ``async_save`` (``result()`` before the barrier): the call, ``SaveReport.staging_seconds``
  (the copy inside the call) and the rest, and the page faults the caller's thread took
  during the call (a staging copy into memory never touched before pays one per 4 KiB page:
  65,536 for 256 MiB).

Printed per layout, slowest rank, medians over the rounds, with each time over ``flat``,
and the time the process's first ``async_save`` blocked (the first layout's: it takes the
arena's pages for the first time). ``--numpy-arena`` stages into ``np.empty`` memory, which
NumPy advises for transparent huge pages, as the pool did before it took ordinary pages.

    python benchmarks/save/bench_async_breakdown.py [--size 1024] [--saves 9] [--world 4] [--numpy-arena]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from typing import Any

from dcp_platform.testing import run_ranks

COLUMNS = ("flat", "boxes", "pool", "call", "staging", "rest", "faults")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _copies(sd: Any, path: str) -> dict[str, Any]:
    """name -> fn() returning {column: value} for one round (module docstring)."""
    import dcp_load
    import torch
    from dcp_load.saving._staging import POOL

    seen: list[dict[str, Any]] = []
    real = POOL.stage

    def capture(data: dict[str, Any], *args: Any, **kw: Any) -> Any:
        seen.append(dict(data))
        return real(data, *args, **kw)

    POOL.stage = capture  # the boxes of the first save: its layout's, the same every save
    try:
        t0 = time.perf_counter()
        future = dcp_load.async_save(sd, checkpoint_id=path)
        first = time.perf_counter() - t0
        future.result()
    finally:
        del POOL.stage
    boxes = [b for b in seen[-1].values() if isinstance(b, torch.Tensor) and b.numel()]
    nbytes = sum(b.nbytes for b in boxes)
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    into = torch.zeros(nbytes, dtype=torch.uint8)

    def flat() -> dict[str, Any]:
        t0 = time.perf_counter()
        dst.copy_(src)
        return {"flat": time.perf_counter() - t0}

    def per_box() -> dict[str, Any]:
        t0, pos = time.perf_counter(), 0
        for b in boxes:
            into[pos:pos + b.nbytes].view(b.dtype).view(b.shape).copy_(b)
            pos += b.nbytes
        return {"boxes": time.perf_counter() - t0}

    def pool() -> dict[str, Any]:
        t0 = time.perf_counter()
        POOL.stage(seen[-1])
        took = time.perf_counter() - t0
        POOL.done()
        return {"pool": took}

    def save() -> dict[str, Any]:
        f0, t0 = _faults(), time.perf_counter()
        future = dcp_load.async_save(sd, checkpoint_id=path)
        call, faults = time.perf_counter() - t0, _faults() - f0
        report = future.result()
        return {"call": call, "staging": report.staging_seconds,
                "rest": report.blocked_seconds - report.staging_seconds, "faults": faults, "bytes": nbytes}

    return {"flat": flat, "boxes": per_box, "pool": pool, "async_save": save}, first


def rank_main(rank: int, world: int, size: int, saves: int, root: str, numpy_arena: bool) -> dict[str, Any]:
    import bench_save
    import numpy as np
    import torch
    import torch.distributed as dist
    from dcp_load.saving import _staging

    torch.set_num_threads(1)
    if numpy_arena:
        _staging._plain_buffer = lambda n: np.empty(n, dtype=np.uint8)
    out: dict[str, Any] = {}
    for layout in bench_save.layouts(world):
        sd = bench_save._state(layout, size)
        runs, first = _copies(sd, os.path.join(root, layout))
        out.setdefault("first", first)
        names = list(runs)
        rounds: list[dict[str, Any]] = []
        for i in range(-1, saves):  # -1: not counted
            row: dict[str, Any] = {}
            for name in names[i % len(names):] + names[:i % len(names)]:
                dist.barrier()
                row.update(runs[name]())
                dist.barrier()
            if i >= 0:
                rounds.append(row)
        out[layout] = rounds
    return out


def main() -> None:
    import bench_save

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=1024, help="MiB of fp32 state in all (default 1024)")
    ap.add_argument("--saves", type=int, default=9)
    ap.add_argument("--world", type=int, default=4, choices=(2, 4))
    ap.add_argument("--numpy-arena", action="store_true", help="stage into np.empty memory (huge-page advised)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_ranks(rank_main, args.world, args.size, args.saves, root, args.numpy_arena, timeout=1800)
    print(f"bench_async_breakdown: {args.world} gloo ranks, {args.size} MiB, {args.saves} rounds; slowest rank, "
          f"medians (x flat); {'np.empty' if args.numpy_arena else 'ordinary-page'} arena; the first async_save "
          f"blocked {max(r['first'] for r in per_rank):.2f} s")
    for layout in bench_save.layouts(args.world):
        worst = {c: statistics.median(max(r[layout][i][c] for r in per_rank) for i in range(args.saves))
                 for c in COLUMNS}
        staged = per_rank[0][layout][0]["bytes"] / 2**20
        cells = [f"{c} {worst[c] * 1e3:6.1f} ms ({worst[c] / worst['flat']:.2f})" for c in COLUMNS[:-1]]
        print(f"{layout}: {staged:.0f} MiB staged per rank; " + ", ".join(cells)
              + f"; caller's page faults {worst['faults']:.0f}")


if __name__ == "__main__":
    main()

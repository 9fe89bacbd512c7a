"""Where ``async_save``'s blocked time goes: the copy into the staging pool against the rest.

4 gloo ranks save the state of ``bench_save.py`` (fp32 model + AdamW as DTensors, DP2xTP2
and FSDP4) with ``dcp_load.async_save`` ``--saves`` times in a row (``result()`` after each),
then time one flat ``copy_`` of the same bytes on every rank at once. Printed per layout,
slowest rank, medians: the flat copy, the call, ``SaveReport.staging_seconds`` (the copy
into the pool) and ``blocked_seconds - staging_seconds`` (everything else on the caller's
path: arrival, agreement, lock).

    python benchmarks/bench_async_breakdown.py [--size 1024] [--saves 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

from dcp_platform.testing import run_ranks

LAYOUTS = ("dp2tp2", "fsdp4")


def rank_main(rank: int, world: int, size: int, saves: int, root: str) -> dict[str, Any]:
    import bench_save
    import dcp_load
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        sd = bench_save._state(layout, size)
        rows = []
        for _ in range(saves):
            dist.barrier()
            t0 = time.perf_counter()
            future = dcp_load.async_save(sd, checkpoint_id=os.path.join(root, layout))
            called = time.perf_counter() - t0
            report = future.result()
            dist.barrier()
            rows.append((called, report.blocked_seconds, report.staging_seconds, report.staged_bytes))
        src = torch.ones(rows[-1][3] // 4)
        dst = torch.zeros_like(src)
        flat = []
        for _ in range(saves):
            dist.barrier()
            t0 = time.perf_counter()
            dst.copy_(src)
            flat.append(time.perf_counter() - t0)
        out[layout] = {"rows": rows, "flat": statistics.median(flat)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=1024, help="MiB of fp32 state in all (default 1024)")
    ap.add_argument("--saves", type=int, default=9)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_ranks(rank_main, 4, args.size, args.saves, root, timeout=1200)
    med = statistics.median
    for layout in LAYOUTS:
        rows = [r[layout]["rows"] for r in per_rank]
        worst = [max(rank_rows[i] for rank_rows in rows) for i in range(args.saves)]
        call = med(w[0] for w in worst)
        staging = med(max(r[i][2] for r in rows) for i in range(args.saves))
        rest = med(max(r[i][1] - r[i][2] for r in rows) for i in range(args.saves))
        flat = max(r[layout]["flat"] for r in per_rank)
        print(f"{layout}: {rows[0][0][3] / 2**20:.0f} MiB staged per rank; flat copy {flat * 1e3:.1f} ms, "
              f"call {call * 1e3:.1f} ms ({call / flat:.2f} x), staging {staging * 1e3:.1f} ms, "
              f"rest {rest * 1e3:.1f} ms")


if __name__ == "__main__":
    main()

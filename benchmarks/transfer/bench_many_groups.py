"""Cost of a load against the number of process groups the job has made, dcp beside torch DCP.

Two gloo ranks load one small checkpoint (8 float32 64 x 64 tensors, page cache warm) with
dcp and with torch.distributed.checkpoint, alternating, after the job has created 0, then
more, process groups (``torch.distributed.new_group`` over both ranks, as meshes do). It
prints the median seconds per call of each, their ratio, and dcp's phases (its own
``LoadReport.seconds``), so a step whose cost grows with the groups shows up beside one
that does not.

    python benchmarks/transfer/bench_many_groups.py [--groups 0,300,1200] [--repeat 15]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness/

from harness.cli import ints, parser  # noqa: E402
from harness.stats import median  # noqa: E402

NAMES = [f"w{i}" for i in range(8)]


def _ranks(rank: int, world: int, dcp_path: str, torch_path: str, steps: list[int], repeat: int) -> list[Any]:
    import dcp_load
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp

    made, rows = 0, []
    for target in steps:
        while made < target:
            dist.new_group([0, 1])
            made += 1
        dcp_s, torch_s, phases = [], [], []
        for _ in range(repeat):
            state = {n: torch.zeros(64, 64) for n in NAMES}
            dist.barrier()
            t = time.perf_counter()
            report = dcp_load.load(state, checkpoint_id=dcp_path, broadcast_replicated_tensors=True)
            dcp_s.append(time.perf_counter() - t)
            phases.append(report.seconds)
            dist.barrier()
            t = time.perf_counter()
            tdcp.load(state, checkpoint_id=torch_path)
            torch_s.append(time.perf_counter() - t)
        phase = {k: median([p.get(k, 0.0) for p in phases]) for k in phases[0]}
        rows.append((made, median(dcp_s), median(torch_s), phase))
    return rows


def main() -> None:
    import dcp_load
    import torch
    import torch.distributed.checkpoint as tdcp
    from dcp_platform.testing import run_ranks

    ap = parser(__doc__)
    ap.add_argument("--groups", default="0,300,1200", help="group counts to measure at, ascending")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    steps = sorted(ints(args.groups))
    with tempfile.TemporaryDirectory() as root:
        state = {n: torch.randn(64, 64) for n in NAMES}
        dcp_load.save(state, checkpoint_id=f"{root}/dcp", no_dist=True)
        tdcp.save(state, checkpoint_id=f"{root}/torch", no_dist=True)
        rows = run_ranks(_ranks, 2, f"{root}/dcp", f"{root}/torch", steps, args.repeat, timeout=3600)[0]
    print(f"{'groups':>7} {'dcp s':>8} {'torch s':>8} {'dcp/torch':>9}  dcp phases (s)")
    for made, d, t, phase in rows:
        shown = " ".join(f"{k}={v:.4f}" for k, v in phase.items() if k != "total")
        print(f"{made:>7} {d:>8.4f} {t:>8.4f} {d / t:>9.2f}  {shown}")


if __name__ == "__main__":
    main()

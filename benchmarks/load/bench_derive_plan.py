"""Derived planning at scale, one process simulating every rank role (``dcp plan``'s engine).

70B-like model (Llama 3.1 70B shapes, bf16, HF files of ~5 GB, one chunk per tensor) on
TP8 x PP8 x DP for 1,024 / 4,096 / 16,384 / 65,536 ranks, 8 ranks per host, "auto" mode.
For each world size:

* planning s: the slowest rank role's own planning (wall and CPU time, each role's fastest
  of ``--repeats`` passes over all roles; a warm-up role first) (derive its entries from the meshes
  with a cold cache, the digest lanes, ``plan_for_rank``), over all 64 (pp, tp) roles;
* exchanged: what a rank sends to agree on the plan (the digest's all-reduce lanes);
  group sets: what it sends when dcp_broadcast creates its broadcast groups (the same in
  the gathered path);
* read max/mean: bytes read per rank, max over mean, for the derived plan and (up to
  ``--greedy-up-to`` ranks) for the global plan with ``GreedyPlanner`` (the gathered,
  greedy-era assignment, over the same slabs);
* broadcasts per rank (max) and storage amplification (bytes fetched, once per host, over
  the unique bytes).

Run: ``python benchmarks/load/bench_derive_plan.py [--worlds 1024 4096 ...] [--json OUT]``;
the plot goes to ``benchmarks/plots/derived_plan_scaling.png``. The header line names the
git commit and the load average, since the machine may be shared.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness/

from harness.cli import parser, write_json  # noqa: E402


def greedy_balance(tensors: dict[str, Any], layout: Any) -> float:
    """max/mean bytes read per rank of the gathered global plan with GreedyPlanner."""
    from dcp_load import GreedyPlanner
    from dcp_load.plan._plan import build_global_plan
    from dcp_load.plan._simulate import gathered_wants

    wants, hosts = gathered_wants(tensors, layout)
    plan = build_global_plan(tensors, wants, hosts=hosts, planner=GreedyPlanner())
    return max(plan.loads) / (sum(plan.loads) / layout.world)


def run(worlds: list[int], greedy_up_to: int, repeats: int) -> list[dict[str, Any]]:
    from dcp_load.plan._simulate import Layout, model_metadata, simulate

    tensors = model_metadata("llama-70b")
    rows = []
    for world in worlds:
        layout = Layout(8, 8, world // 64)
        t0 = time.perf_counter()
        r = simulate(tensors, layout, repeats=repeats)
        r.pop("read_bytes_per_rank")
        r.pop("broadcasts_per_rank")
        r["simulate_seconds"] = time.perf_counter() - t0
        r["load_average"] = os.getloadavg()[0]
        r["balance"] = r["read_bytes_per_rank_max"] / r["read_bytes_per_rank_mean"]
        r["greedy_balance"] = greedy_balance(tensors, layout) if world <= greedy_up_to else None
        rows.append(r)
        g = f"{r['greedy_balance']:.3f}" if r["greedy_balance"] else "-"
        print(f"{world:>6} ranks: planning max {r['planning_seconds_max'] * 1e3:7.1f} ms (median "
              f"{r['planning_seconds_median'] * 1e3:6.1f}; CPU max {r['planning_cpu_seconds_max'] * 1e3:6.1f}, median "
              f"{r['planning_cpu_seconds_median'] * 1e3:6.1f}), exchanged {r['exchanged_bytes_per_rank_max']} B, "
              f"group sets {r['group_set_bytes_per_rank_max']} B, read max/mean {r['balance']:.3f} "
              f"(greedy {g}), broadcast items/rank {r['broadcast_items_per_rank_max']} "
              f"({r['broadcasts_per_rank_max']} broadcasts), amplification "
              f"{r['amplification']:.4f} (load average {r['load_average']:.1f})", flush=True)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = [r["world_size"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(worlds, [r["planning_seconds_max"] * 1e3 for r in rows], "o-", label="slowest rank (derived)")
    a.plot(worlds, [r["planning_seconds_median"] * 1e3 for r in rows], "s--", label="median role")
    a.plot(worlds, [r["planning_cpu_seconds_max"] * 1e3 for r in rows], "^-", label="slowest rank, CPU time")
    a.axhline(50, color="gray", linestyle=":", label="goal 50 ms")
    a.set_xscale("log", base=2)
    a.set_xlabel("ranks (TP8 x PP8 x DP)")
    a.set_ylabel("planning per rank, ms")
    a.legend(fontsize=8)
    b.plot(worlds, [r["balance"] for r in rows], "o-", label="derived (owner rule)")
    gw = [(r["world_size"], r["greedy_balance"]) for r in rows if r["greedy_balance"]]
    if gw:
        b.plot([w for w, _ in gw], [g for _, g in gw], "s--", label="gathered GreedyPlanner")
    b.set_xscale("log", base=2)
    b.set_xlabel("ranks")
    b.set_ylabel("bytes read per rank, max / mean")
    b.legend(fontsize=8)
    fig.suptitle("70B-like model: derived planning, one process simulating every rank role")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip() + ("+changes" if dirty else "")


def main() -> None:
    p = parser(__doc__, repeats=5, repeats_help="time every rank role in this many passes, keep each role's "
               "fastest (a shared machine's other jobs only ever add time)", json_help="write the rows here")
    p.add_argument("--worlds", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    p.add_argument("--greedy-up-to", type=int, default=4096, help="largest world for the gathered comparison")
    args = p.parse_args()
    print(f"git {_commit()}; load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    rows = run(args.worlds, args.greedy_up_to, args.repeats)
    plot(rows, Path(__file__).resolve().parents[1] / "plots" / "derived_plan_scaling.png")
    write_json(args.json, rows)


if __name__ == "__main__":
    main()

"""A load's control reduction, side by side: a gloo all-reduce of int64 lanes against the
store reduction ``dcp_platform.Watch`` makes for small worlds (``_store_reduce.py``).

    python benchmarks/transfer/bench_control.py [--worlds 2,4,8] [--lanes 1,4,40] [--repeats 100]

In one launch per world, the two alternate lane count by lane count; each time is one
rank's, from a barrier to its result (the median over ``--repeats`` of the slowest rank's
medians is printed). 40 lanes is a derived load's digest, 4 its closing check.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness/

from harness.cli import ints, parser  # noqa: E402
from harness.stats import median  # noqa: E402


def rank_main(rank: int, world: int, lanes: list[int], repeats: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from dcp_platform import Watch, get_platform

    p = get_platform("torch")
    out: dict[str, float] = {}
    with Watch(p, f"bench-control/{world}") as w:
        w.arrive(60.0)
        for n in lanes:
            t = torch.arange(n, dtype=torch.int64)
            times: dict[str, list[float]] = {"gloo": [], "store": []}
            for _ in range(repeats):
                for how in ("gloo", "store"):
                    dist.barrier()
                    start = time.perf_counter()
                    if how == "gloo":
                        dist.all_reduce(t)
                    else:
                        w.reduced(w.start_reduce(list(range(n)), "sum"))
                    times[how].append(time.perf_counter() - start)
            for how, ts in times.items():
                out[f"{how}/{n}"] = median(ts[repeats // 10:])
        dist.barrier()
    return out


def main() -> None:
    ap = parser(__doc__, repeats=100)
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--lanes", default="1,4,40")
    args = ap.parse_args()
    from dcp_platform._store_reduce import STORE_REDUCE_MAX
    from dcp_platform.testing import run_ranks

    lanes = ints(args.lanes)
    print(f"{'ranks':>5} {'lanes':>5} {'gloo ms':>8} {'store ms':>8} {'store/gloo':>10}")
    for world in ints(args.worlds):
        if world > STORE_REDUCE_MAX:
            print(f"{world:>5}: above STORE_REDUCE_MAX ({STORE_REDUCE_MAX}), loads all-reduce on gloo")
            continue
        res = run_ranks(rank_main, world, lanes, args.repeats, timeout=900)
        for n in lanes:
            g = max(r[f"gloo/{n}"] for r in res) * 1e3
            s = max(r[f"store/{n}"] for r in res) * 1e3
            print(f"{world:>5} {n:>5} {g:8.3f} {s:8.3f} {s / g:10.2f}")


if __name__ == "__main__":
    main()

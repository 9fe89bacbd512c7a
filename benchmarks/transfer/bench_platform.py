"""dcp-platform on local gloo ranks: broadcast fixed cost and bandwidth by message size, and
fused copy against a copy loop. A benchmark, not a test: it prints a table.

    .venv/bin/python benchmarks/transfer/bench_platform.py [--world 4] [--max-mib 256] [--reps 5]

Each broadcast is timed from a barrier until every rank has waited on it; the figure is
the slowest rank's time (median over --reps). "fixed cost" is a 4-byte broadcast.
Bandwidth is the message size over that time (what one broadcast delivers per receiver).
The fused copy is platform.fused_copy(dsts, srcs) against `for d, s: d.copy_(s)` for
500 pairs of 64 KiB, side by side in the same process (median of --reps x 20 runs).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from dcp_platform import get_platform
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness/

from harness.cli import parser  # noqa: E402
from harness.ranks import slowest  # noqa: E402
from harness.stats import median  # noqa: E402


def _timed_broadcast(p, buf: torch.Tensor, reps: int) -> float:
    """Median over reps of the slowest rank's barrier-to-completion time, in seconds."""
    def once() -> None:
        h = p.broadcast(buf, 0)
        if h is not None:
            h.wait()

    return median([slowest(once) for _ in range(reps)])


def _fused_vs_loop(p, pairs: int, nbytes: int, reps: int) -> tuple[float, float]:
    srcs = [torch.randn(nbytes // 4) for _ in range(pairs)]
    dsts = [torch.empty_like(s) for s in srcs]
    fused, loop = [], []
    for _ in range(reps * 20):
        t0 = time.perf_counter()
        p.fused_copy(dsts, srcs)
        t1 = time.perf_counter()
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s)
        t2 = time.perf_counter()
        fused.append(t1 - t0)
        loop.append(t2 - t1)
    return median(fused), median(loop)


def _bench(rank: int, world: int, sizes: list[int], reps: int) -> dict:
    torch.set_num_threads(1)
    p = get_platform("torch")
    tiny = torch.zeros(1, dtype=torch.int32)
    for _ in range(20):  # warm the connections
        p.broadcast(tiny, 0).wait()
    fixed = _timed_broadcast(p, tiny, reps * 20)
    by_size = {}
    for size in sizes:
        buf = torch.zeros(size // 4, dtype=torch.float32)
        by_size[size] = _timed_broadcast(p, buf, reps)
        del buf
    out = {"fixed_s": fixed, "by_size": by_size}
    if rank == 0:
        out["fused_s"], out["loop_s"] = _fused_vs_loop(p, 500, 64 << 10, reps)
    return out


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--max-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    sizes = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
    sizes += [s for s in (64 << 20, 256 << 20) if s <= args.max_mib << 20]
    t0 = time.perf_counter()
    results = run_ranks(_bench, args.world, sizes, args.reps, timeout=900)
    r0 = results[0]
    print(f"dcp-platform torch/gloo, {args.world} ranks, torch {torch.__version__}, "
          f"median of {args.reps} (fixed cost: {args.reps * 20})")
    print(f"broadcast fixed cost (4 bytes): {r0['fixed_s'] * 1e6:8.0f} us")
    print(f"{'message':>10} {'time':>12} {'GB/s':>8}")
    for size in sizes:
        s = r0["by_size"][size]
        print(f"{_fmt_size(size):>10} {s * 1e3:9.2f} ms {size / s / 1e9:8.3f}")
    fused, loop = r0["fused_s"], r0["loop_s"]
    print(f"fused_copy 500 x 64 KiB: {fused * 1e3:.2f} ms; copy loop: {loop * 1e3:.2f} ms; "
          f"loop / fused = {loop / fused:.2f}x")
    print(f"(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()

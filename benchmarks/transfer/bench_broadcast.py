"""dcp-broadcast on 4 local gloo ranks: batched against one broadcast per item, and large
tensors against a plain torch.distributed.broadcast loop, side by side in one run.

    .venv/bin/python benchmarks/transfer/bench_broadcast.py [--repeats 3]

Each figure is the median over ``--repeats`` rounds of the slowest rank's wall time (ranks
start together after a barrier; each round runs every mode once). Replicated items are spread over the 4 ranks as sources
(item i comes from rank i % 4), as dcp-load spreads the reading of replicated shards.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from dcp_broadcast import BroadcastItem, broadcast_items
from dcp_platform import get_platform
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness/

from harness.cli import parser  # noqa: E402
from harness.ranks import rounds  # noqa: E402

WORLD = 4
SMALL = [(1000, 4 * 1024), (500, 64 * 1024)]
LARGE = (4, 64 * 1024 * 1024)  # 4 x 64 MiB


def _bench(rank: int, world: int, repeats: int) -> dict[str, float]:
    platform = get_platform("torch")
    everyone = tuple(range(world))
    cases: dict[str, object] = {}

    def plain_loop(tensors):
        def run() -> None:
            for i, t in enumerate(tensors):
                dist.broadcast(t, src=i % world)
        return run

    for count, size in SMALL:
        tensors = [torch.full((size // 4,), float(i)) for i in range(count)]
        items = [BroadcastItem(i % world, everyone, size, t) for i, t in enumerate(tensors)]
        label = f"{count} x {size // 1024} KiB"
        cases[f"{label} batched"] = lambda items=items: broadcast_items(platform, items)
        cases[f"{label} one per item"] = lambda items=items: broadcast_items(platform, items, batch_bytes=0)
        cases[f"{label} torch loop"] = plain_loop(tensors)
    count, size = LARGE
    big = [torch.full((size // 4,), float(i)) for i in range(count)]
    items = [BroadcastItem(i % world, everyone, size, t) for i, t in enumerate(big)]
    cases["large broadcast_items"] = lambda: broadcast_items(platform, items)
    cases["large broadcast_items K=1"] = lambda: broadcast_items(platform, items, max_in_flight=1)
    cases["large torch loop"] = plain_loop(big)
    # Round robin: every mode runs once per round, so load changes on a shared machine hit
    # all modes alike; the figure is the median over rounds.
    return rounds(cases, repeats)


def main() -> None:
    args = parser(__doc__, repeats=3).parse_args()
    t = run_ranks(_bench, WORLD, args.repeats, timeout=600)[0]
    print(f"dcp-broadcast, {WORLD} gloo ranks, median of {args.repeats}, torch {torch.__version__}")
    print(f"{'items':<16} {'batched':>10} {'one/item':>10} {'torch loop':>11} {'one/item : batched':>19}")
    for count, size in SMALL:
        label = f"{count} x {size // 1024} KiB"
        b, o, p = (t[f"{label} {k}"] for k in ("batched", "one per item", "torch loop"))
        print(f"{label:<16} {b * 1e3:>8.1f}ms {o * 1e3:>8.1f}ms {p * 1e3:>9.1f}ms {o / b:>18.1f}x")
    count, size = LARGE
    total = count * size
    a, a1, p = t["large broadcast_items"], t["large broadcast_items K=1"], t["large torch loop"]
    print(f"large: {count} x {size >> 20} MiB   broadcast_items {total / a / 1e9:.2f} GB/s   "
          f"(max_in_flight=1: {total / a1 / 1e9:.2f} GB/s)   torch loop {total / p / 1e9:.2f} GB/s   "
          f"broadcast_items : torch loop {p / a:.2f}x")


if __name__ == "__main__":
    main()

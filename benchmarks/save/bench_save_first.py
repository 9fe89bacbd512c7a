"""The first ``async_save`` of a run, side by side (not a test): dcp's against torch DCP's
(``AsyncCheckpointerType.THREAD``), each the first save of freshly started gloo ranks.

Per world (``--worlds``, default 2 and 4 ranks) and size (``--sizes``, MiB held per rank,
default 64 and 256), ``--repeats`` rounds; each round starts the ranks once per saver (the
savers' order rotates from one round to the next), builds ``bench_save.py``'s FSDP state
(fp32 model + AdamW as DTensors sharded over every rank: each rank holds and writes its
size) and times that process's first save between two barriers: the time the call blocked
and the time to its result, the slowest rank's. For dcp also its report's staging time (the
copy into the staging pool) and, with ``--prepare``, the case where the ranks called
``dcp_load.prepare_staging(state)`` right after building the state (untimed: the call a
training script makes once, before its loop). The ranks import what a script imports at its
top (torch DCP, ``dcp_load.saving._async``) before they start, and cache bytecode as an
installed package does (``--no-bytecode``: compile at every import). Printed: medians over the rounds, and dcp's
blocked time over torch's.

    python benchmarks/save/bench_save_first.py [--worlds 2,4] [--sizes 64,256] [--repeats 3] [--prepare]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import bench_save
from bench_save import _launch, _state

MiB = 2**20


def _first_save(rank: int, world: int, root: str, saver: str, per_rank_mib: int) -> dict[str, Any]:
    """One saver's first save in this process (module docstring)."""
    import warnings

    import dcp_load
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    warnings.filterwarnings("ignore")
    sd = _state(f"fsdp{world}", per_rank_mib * world)
    if saver == "dcp async, prepared":
        dcp_load.prepare_staging(sd)
    # Both functions looked up before the clock starts: a script imports them at its top.
    save = dcp_load.async_save if saver.startswith("dcp") else dcp.async_save
    out: dict[str, Any] = {}
    d = os.path.join(root, "ck")
    dist.barrier()
    t0 = time.perf_counter()
    if saver.startswith("dcp"):
        fut = save(sd, checkpoint_id=d)
        out["blocked"] = time.perf_counter() - t0
        out["staging"] = fut.result().staging_seconds
    else:
        fut = save(sd, checkpoint_id=d, async_checkpointer_type=AsyncCheckpointerType.THREAD)
        out["blocked"] = time.perf_counter() - t0
        getattr(fut, "upload_completion", fut).result()
    out["done"] = time.perf_counter() - t0
    dist.barrier()
    return out


def _round(world: int, per_rank_mib: int, savers: list[str]) -> dict[str, dict[str, float]]:
    """Each saver's first save on ``world`` freshly started ranks: {saver: {column: slowest rank's}}."""
    out = {}
    for saver in savers:
        with tempfile.TemporaryDirectory(prefix="bench-save-first-") as root:
            per_rank = _launch(_first_save, root, saver, per_rank_mib, world=world)
        out[saver] = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4", help="gloo ranks, comma-separated (default 2,4)")
    ap.add_argument("--sizes", default="64,256", help="MiB held (and written) per rank, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--prepare", action="store_true", help="also dcp after prepare_staging(state)")
    ap.add_argument("--no-bytecode", action="store_true", help="let the ranks compile every module they import "
                    "(by default they cache bytecode in a temporary folder, as an installed package has it)")
    args = ap.parse_args(argv)
    # What ``from dcp_load import async_save`` imports at a script's top, as torch DCP's is.
    bench_save.PRELOAD.append("dcp_load.saving._async")
    if not args.no_bytecode:
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["PYTHONPYCACHEPREFIX"] = os.path.join(tempfile.gettempdir(), "bench-save-first-pycache")
    savers = ["dcp async", "torch async thread"] + (["dcp async, prepared"] if args.prepare else [])
    print(f"bench_save_first: the first async_save of freshly started gloo ranks, FSDP state, slowest rank, "
          f"median of {args.repeats} rounds (savers rotated), {os.cpu_count()} CPUs")
    for world in map(int, args.worlds.split(",")):
        for size in map(int, args.sizes.split(",")):
            rounds = []
            for rep in range(args.repeats):
                order = savers[rep % len(savers):] + savers[:rep % len(savers)]
                rounds.append(_round(world, size, order))
            med = {s: {k: statistics.median(r[s][k] for r in rounds) for k in rounds[0][s]} for s in savers}
            print(f"{world} ranks, {size} MiB per rank:")
            for s in savers:
                cols = "   ".join(f"{k} {v:6.3f} s" for k, v in med[s].items())
                print(f"  {s:22s} {cols}")
            torch_blocked = med["torch async thread"]["blocked"]
            for s in savers:
                if s.startswith("dcp"):
                    print(f"  {s} / torch, blocked: {med[s]['blocked'] / torch_blocked:.2f} x (goal <= 1.0); "
                          f"rounds {[round(r[s]['blocked'], 3) for r in rounds]} against "
                          f"{[round(r['torch async thread']['blocked'], 3) for r in rounds]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Scenario 2: many small replicated tensors (2000 x 16 KiB float32) on DP4 gloo ranks.

Counts collectives and time for dcp with batched broadcasts (broadcast_batch_bytes = 6 MiB),
dcp with batching off (broadcast_batch_bytes=0: one broadcast per tensor), dcp with every
rank reading (no broadcasts) and torch.distributed.checkpoint.load (HF reader). Warm cache.
Collectives are counted by wrapping the torch.distributed functions inside each rank
(top-level calls only; plan exchange and barriers included); dcp's own report gives its
broadcasts.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness/

from harness.common import (  # noqa: E402
    MiB,
    Run,
    SmallSpec,
    rank_load,
    warm_files,
    write_hf_checkpoint,
    write_warmup_checkpoint,
)
from harness.stats import by_repeat, fmt_bytes, median, ratio_by_repeat, summarise, table

VARIANTS = {  # name -> (Run.method, broadcast_batch_bytes)
    "dcp batched (6 MiB)": ("dcp", 6 * MiB),
    "dcp batching off (0)": ("dcp", 0),
    "dcp every rank reads": ("dcp-reread", 6 * MiB),
    "torch DCP (HF reader)": ("torch", 6 * MiB),
}
DP = 4


def spec(quick: bool) -> SmallSpec:
    return SmallSpec(count=200) if quick else SmallSpec()


def run(args: Any, log: Any) -> dict[str, Any]:
    sp = spec(args.quick)
    path = Path(args.workdir) / "hf-small"
    t = time.perf_counter()
    nbytes = write_hf_checkpoint(path, sp)
    log(f"small: checkpoint {path} {sp.count} x {fmt_bytes(sp.nbytes)} ready in "
        f"{time.perf_counter() - t:.1f} s")
    warm_dir = write_warmup_checkpoint(Path(args.workdir), sp)
    runs = []
    names = list(VARIANTS)
    for rep in range(args.repeats):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            method, batch = VARIANTS[name]
            warm_files(path)
            r = Run(method=method, spec=sp, dp=DP, tp=1, ckpt_dirs=(str(path),), ranks_per_node=DP,
                    batch_bytes=batch, verify=rep == 0 or args.verify_all, sample_memory=False, warmup_dir=warm_dir)
            per_rank = args.launcher.run(rank_load, DP, r, timeout=args.rank_timeout)
            s = summarise(per_rank)
            runs.append({"variant": name, "repeat": rep, "summary": s, "per_rank": per_rank})
            log(f"  rep {rep} {name:24s} {s['wall_s']:7.3f} s collectives/rank "
                f"{s['data_collectives_max']} broadcasts {s.get('report_broadcasts_max', '-')}")
    return {"spec": sp.__dict__, "unique_bytes": nbytes, "runs": runs, "dp": DP}


def _med(res: dict[str, Any], name: str, key: str) -> float:
    return median([r["summary"][key] for r in res["runs"] if r["variant"] == name and key in r["summary"]])


def tables(res: dict[str, Any]) -> list[str]:
    names = list(dict.fromkeys(r["variant"] for r in res["runs"]))
    torch_name = "torch DCP (HF reader)"
    by_rep = {n: by_repeat([r for r in res["runs"] if r["variant"] == n]) for n in names}
    rows = []
    for n in names:
        ratio = "-"
        if torch_name in by_rep:
            ratio = f"{ratio_by_repeat(by_rep[n], by_rep[torch_name]):.2f}"
        bc = _med(res, n, "report_broadcasts_max")
        rows.append([n, f"{_med(res, n, 'wall_s'):.3f}", ratio,
                     f"{_med(res, n, 'data_collectives_max'):.0f}",
                     "-" if bc != bc else f"{bc:.0f}",
                     fmt_bytes(_med(res, n, "read_bytes_total"))])
    reps = len({r["repeat"] for r in res["runs"]})
    sp = res["spec"]
    return [f"### 2. Many small tensors: {sp['count']} x {fmt_bytes(sp['nbytes'])}, DP{res['dp']}, "
            f"warm cache\n\nMedian of {reps} runs; x torch = ratio to torch DCP in the same repeat "
            "(median of per-repeat ratios). collectives/rank = every torch.distributed call a rank "
            "made during the load (plan exchange and barriers included); broadcasts = dcp's report.\n\n"
            + table(["variant", "load s", "x torch", "collectives/rank", "dcp broadcasts/rank",
                     "storage read (all ranks)"], rows)]

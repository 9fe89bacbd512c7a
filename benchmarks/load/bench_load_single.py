"""Scenario 3: one process loads a 1 GiB HF checkpoint into preallocated tensors.

dcp (no_dist=True) against safetensors ``load_file`` plus a copy into the destination and
torch.distributed.checkpoint.load(no_dist=True) with its HuggingFaceStorageReader; warm
page cache and cold (page cache dropped before the load). Each measurement is a fresh
process started by the same launcher as the multi-rank scenarios (world size 1).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness/

from harness.common import Run, rank_load, warm_files, write_hf_checkpoint, write_warmup_checkpoint  # noqa: E402
from harness.layouts import model_dir, model_spec  # noqa: E402
from harness.stats import by_repeat, fmt_bytes, median, ratio_by_repeat, summarise, table  # noqa: E402

METHODS = {"dcp": "dcp (no_dist)", "safetensors": "safetensors load_file + copy",
           "torch": "torch DCP HF reader (no_dist)"}


def run(args: Any, log: Any) -> dict[str, Any]:
    spec = model_spec(args.quick)
    path = model_dir(args)  # the same files as the replicated scenario
    nbytes = write_hf_checkpoint(path, spec)
    warm_dir = write_warmup_checkpoint(Path(args.workdir), spec)
    runs = []
    names = list(METHODS)
    for rep in range(args.repeats):
        k = rep % len(names)
        for mode in ("warm", "cold"):
            for m in names[k:] + names[:k]:
                if mode == "warm":
                    warm_files(path)
                r = Run(method=m, spec=spec, dp=1, tp=1, ckpt_dirs=(str(path),), ranks_per_node=1,
                        cold=mode == "cold", verify=rep == 0 or args.verify_all, warmup_dir=warm_dir)
                per_rank = args.launcher.run(rank_load, 1, r, timeout=args.rank_timeout)
                s = summarise(per_rank)
                runs.append({"method": m, "mode": mode, "repeat": rep, "summary": s,
                             "per_rank": per_rank})
                log(f"  rep {rep} {mode} {m:12s} {s['wall_s']:7.3f} s read "
                    f"{fmt_bytes(s['read_bytes_total'])} extra anon {fmt_bytes(s['extra_anon_max'])}")
    return {"spec": spec.__dict__, "unique_bytes": nbytes, "runs": runs}


def _rs(res: dict[str, Any], m: str, mode: str) -> list[dict[str, Any]]:
    return [r for r in res["runs"] if r["method"] == m and r["mode"] == mode]


def tables(res: dict[str, Any]) -> list[str]:
    rows = []
    for mode in ("warm", "cold"):
        base = by_repeat(_rs(res, "torch", mode))
        for m, label in METHODS.items():
            rs = _rs(res, m, mode)
            if not rs:
                continue
            walls = [r["summary"]["wall_s"] for r in rs]
            ratio = ratio_by_repeat(by_repeat(rs), base)
            rows.append([mode, label, f"{median(walls):.3f}", f"{ratio:.2f}",
                         f"{res['unique_bytes'] / median(walls) / 1e9:.2f}",
                         fmt_bytes(median([r["summary"]["read_bytes_total"] for r in rs])),
                         fmt_bytes(median([r["summary"]["extra_anon_max"] for r in rs]))])
    reps = len({r["repeat"] for r in res["runs"]})
    return [f"### 3. One process, {fmt_bytes(res['unique_bytes'])} HF checkpoint\n\nMedian of {reps} "
            "runs; x torch = ratio to torch DCP's HF reader in the same repeat; extra private = peak "
            "RssAnon minus RssAnon before the load (destinations preallocated).\n\n"
            + table(["cache", "method", "load s", "x torch", "GB/s", "storage read", "extra private"], rows)]

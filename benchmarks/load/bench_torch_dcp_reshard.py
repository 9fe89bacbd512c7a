"""The resharding case alone, without root: FSDP4 -> DP2xTP2 from torch DCP's own files.

The benchmark checkpoint (``harness.common.ModelSpec``, 1.08 GiB of bf16; ``--quick``: ~34 MiB)
is saved FSDP-style by torch.distributed.checkpoint's ``FileSystemWriter`` (``harness.fsdp``:
``Shard(0)`` over 4 ranks) and loaded into DP2xTP2 DTensors by 4 real gloo ranks, as
``bench_load_replicated``'s "fsdp4-dp2tp2" layout does. Two simulated nodes of 2 ranks (TP
inside a node), each reading its own byte-identical copy of the files, each with its own
``DCP_HOST_ID``. Before every load the parent evicts the checkpoint copies from the page
cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (what a non-root user may do; the full
harness drops every cache as root), so ``/proc/self/io`` ``read_bytes`` is what each rank
fetched from storage. ``--warm``: every copy is read into the page cache first instead.

Printed per method: wall time, storage bytes / unique (job and per node), the reader's
own byte count / unique, and the peak extra private memory per rank beside the goal
``batch x in-flight + 64 MiB`` (6 MiB x 8 + 64 MiB). Every loaded value is checked
against the HF files. Run from the repository root:

    python benchmarks/load/bench_torch_dcp_reshard.py [--quick] [--methods dcp-auto,dcp,torch]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness/

from harness.cli import names, parser, write_json  # noqa: E402
from harness.common import (  # noqa: E402
    MiB,
    Run,
    copy_checkpoint,
    node_copy,
    rank_load,
    set_cache,
    warmup_spec,
    write_hf_checkpoint,
    write_warmup_checkpoint,
)
from harness.fsdp import write_fsdp_checkpoint  # noqa: E402
from harness.launch import Launcher  # noqa: E402
from harness.layouts import model_spec  # noqa: E402
from harness.stats import summarise  # noqa: E402

DP, TP, NODES = 2, 2, 2
MEMORY_GOAL = 6 * MiB * 8 + 64 * MiB  # load()'s default batch x its broadcasts in flight + 64 MiB


def prepare(args: argparse.Namespace, launcher: Launcher) -> tuple[object, int, Path, list[Path], str]:
    spec = model_spec(args.quick)
    work = Path(args.workdir)
    hf = work / ("hf-model-quick" if args.quick else "hf-model")
    unique = write_hf_checkpoint(hf, spec)
    warm_hf = Path(write_warmup_checkpoint(work, spec))
    fsdp = hf.with_name(hf.name + "-fsdp4")
    warm = warm_hf.with_name(warm_hf.name + "-fsdp4")
    write_fsdp_checkpoint(launcher, hf, fsdp, spec, args.rank_timeout)
    write_fsdp_checkpoint(launcher, warm_hf, warm, warmup_spec(spec), args.rank_timeout)
    nodes = [node_copy(fsdp, k) for k in range(NODES)]
    for copy in nodes[1:]:
        copy_checkpoint(fsdp, copy)
    return spec, unique, hf, nodes, str(warm)


def main() -> None:
    ap = parser(__doc__, quick="~34 MiB model instead of 1.08 GiB", repeats=1, workdir="/tmp/dcp-reshard-bench",
                rank_timeout=True, json_help="also write the results here")
    ap.add_argument("--methods", default="dcp-auto,dcp,torch", help="comma-separated harness.loaders methods")
    ap.add_argument("--warm", action="store_true",
                    help="page cache warm (every copy read first) instead of evicted before each load")
    args = ap.parse_args()
    launcher = Launcher()
    spec, unique, hf, nodes, warm = prepare(args, launcher)
    print(f"unique bytes {unique / MiB:.1f} MiB; {len(nodes)} node copies of {nodes[0]}")
    results = []
    for rep in range(args.repeats):
        for method in names(args.methods):
            run = Run(method=method, spec=spec, dp=DP, tp=TP, ckpt_dirs=tuple(map(str, nodes)),
                      ranks_per_node=TP, cold=False, simulate_hosts=True, fmt="torch_dcp",
                      verify_dir=str(hf), warmup_dir=warm)
            set_cache(nodes, args.warm)
            per_rank = launcher.run(rank_load, DP * TP, run, timeout=args.rank_timeout)
            s = summarise(per_rank)
            row = {"method": method, "repeat": rep, "wall_s": s["wall_s"],
                   "storage_over_unique": s["read_bytes_total"] / unique,
                   "storage_per_node_over_unique": [b / unique for b in s["read_bytes_per_node"]],
                   "reader_over_unique": (s["report_bytes_read_total"] / unique
                                          if "report_bytes_read_total" in s else None),
                   "extra_anon_max_mib": s.get("extra_anon_max", float("nan")) / MiB,
                   "verified": min(r["verified"] for r in per_rank)}
            results.append(row)
            reader = "-" if row["reader_over_unique"] is None else f"{row['reader_over_unique']:.3f}"
            print(f"rep {rep} {method:9s} wall {row['wall_s']:6.2f} s  storage/unique "
                  f"{row['storage_over_unique']:.3f} (nodes " + " / ".join(
                      f"{x:.3f}" for x in row["storage_per_node_over_unique"]) + f")  reader/unique {reader}  "
                  f"peak extra anon {row['extra_anon_max_mib']:.1f} MiB (goal {MEMORY_GOAL / MiB:.0f})  "
                  f"verified {row['verified']} tensors", flush=True)
            time.sleep(0.5)
    write_json(args.json, {"unique_bytes": unique, "runs": results})


if __name__ == "__main__":
    main()

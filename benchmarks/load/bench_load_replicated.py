"""Scenarios 1 and 4: replicated loads of a >= 1 GiB HF checkpoint on real gloo ranks.

Layouts DP4, DP2xTP2 and DP4xTP2. For each: (a) warm page cache, one copy of the files
shared by every rank (one host); (b) simulated multi-node cold storage: ranks are grouped
into nodes of ``ranks_per_node`` (TP inside a node, DP across nodes, as on real clusters),
each node reads its own byte-identical copy of the files, and the page cache is dropped
right before the load; (c) one host, cold: one copy of the files shared by every rank, page
cache dropped right before the load (what re-reading costs where ranks share a page cache).
Methods: dcp (read once, broadcast: broadcast_replicated_tensors=True), dcp-64k (the same
with 64 KiB batches), dcp-reread (every rank reads what it needs: False), dcp-auto (the
default "auto": re-read within a host, broadcast across hosts; in the simulated multi-node
mode each node gets its own DCP_HOST_ID) and torch.distributed.checkpoint.load
with its HuggingFaceStorageReader. Every rank also samples its resident memory (scenario 4).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness/

from harness.common import (  # noqa: E402
    GiB,
    Run,
    copy_checkpoint,
    measure_disk_bandwidth,
    node_copy,
    readahead_probe,
    warm_files,
    warmup_spec,
    write_hf_checkpoint,
    write_warmup_checkpoint,
)
from harness.layouts import (
    LAYOUT_NAMES,
    LAYOUTS,
    METHOD_NAMES,
    METHOD_RUN,
    METHODS,
    PEERS,
    SOURCES,
    model_dir,
    model_spec,
    peer_status,
    ranks_per_node,
    ratio_in_run,
    run_one,
)
from harness.load_tables import tables
from harness.stats import fmt_bytes

# The layouts' and methods' names moved to harness.layouts; they stay importable from here.
__all__ = ["LAYOUTS", "LAYOUT_NAMES", "METHODS", "METHOD_NAMES", "METHOD_RUN", "PEERS", "SOURCES",
           "model_dir", "model_spec", "peer_status", "prepare_checkpoints", "ratio_in_run", "run", "run_one",
           "tables"]


def prepare_checkpoints(args: Any, log: Any, layouts: list[str], copies_needed: bool
                        ) -> tuple[Any, int, dict[str, dict[str, Any]]]:
    """The checkpoints ``layouts`` read, with a copy per simulated node when asked.

    Returns (spec, unique bytes, sources): sources["hf"] and, for the resharding layouts,
    sources["fsdp4"], each {"fmt", "dirs" (node 0's first), "warm", "verify"}.
    """
    spec = model_spec(args.quick)
    work = Path(args.workdir)
    base = model_dir(args)
    t = time.perf_counter()
    nbytes = write_hf_checkpoint(base, spec)
    log(f"checkpoint {base} {fmt_bytes(nbytes)} ready in {time.perf_counter() - t:.1f} s")
    if not args.quick and nbytes < GiB:
        raise RuntimeError(f"the replicated checkpoint must be >= 1 GiB, got {nbytes}")
    nodes = max(LAYOUTS[lay][0] * LAYOUTS[lay][1] // ranks_per_node(args, lay) for lay in layouts)
    warm = Path(write_warmup_checkpoint(work, spec))
    roots = {"hf": (base, warm)}
    if any(lay in SOURCES for lay in layouts):
        from harness.fsdp import write_fsdp_checkpoint

        t = time.perf_counter()
        f_base, f_warm = base.with_name(base.name + "-fsdp4"), warm.with_name(warm.name + "-fsdp4")
        write_fsdp_checkpoint(args.launcher, base, f_base, spec, args.rank_timeout)
        write_fsdp_checkpoint(args.launcher, warm, f_warm, warmup_spec(spec), args.rank_timeout)
        log(f"FSDP-style torch DCP checkpoint {f_base} ready in {time.perf_counter() - t:.1f} s")
        roots["fsdp4"] = (f_base, f_warm)
    sources: dict[str, dict[str, Any]] = {}
    for kind, (root, wdir) in roots.items():
        dirs = [node_copy(root, k) for k in range(nodes)]
        if copies_needed:
            for c in dirs[1:]:
                copy_checkpoint(root, c)
        sources[kind] = {"fmt": "hf" if kind == "hf" else "torch_dcp", "dirs": [str(d) for d in dirs],
                         "warm": str(wdir), "verify": None if kind == "hf" else str(base)}
    return spec, nbytes, sources


def run(args: Any, log: Any) -> dict[str, Any]:
    layouts, modes = args.layouts, args.modes
    spec, nbytes, sources = prepare_checkpoints(args, log, layouts, "cold" in modes)
    base = Path(sources["hf"]["dirs"][0])
    peers = peer_status()
    runs: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    disk: list[dict[str, float]] = []
    probe = None
    if "cold" in modes or "coldhost" in modes:
        probe = readahead_probe(base)
        log(f"  readahead probe (read_ahead_kb={probe['read_ahead_kb']}): a cold "
            f"{fmt_bytes(probe['box_bytes'])} range costs " + ", ".join(
                f"{k} {fmt_bytes(probe[k])}" for k in ("mmap", "mmap MADV_RANDOM", "preadv",
                                                       "preadv FADV_RANDOM")))
    for rep in range(args.repeats):
        if "cold" in modes or "coldhost" in modes:
            d = measure_disk_bandwidth(base)
            d["repeat"] = rep
            disk.append(d)
            log(f"  disk: cold sequential read {fmt_bytes(d['bytes'])} in {d['seconds']:.3f} s "
                f"= {d['bytes_per_s'] / 1e9:.2f} GB/s")
        for lay in layouts:
            dp, tp = LAYOUTS[lay]
            world = dp * tp
            src = sources[SOURCES.get(lay, "hf")]
            for mode in modes:
                # Rotate the method order every repeat so drift does not favour one method.
                order = list({"warm": args.methods, "coldhost": args.coldhost_methods,
                              "cold": args.cold_methods}[mode])
                k = rep % len(order)
                for method in order[k:] + order[:k]:
                    if mode == "warm":
                        rpn, dirs = world, (src["dirs"][0],)
                        warm_files(Path(src["dirs"][0]))
                    elif mode == "coldhost":
                        rpn, dirs = world, (src["dirs"][0],)
                    else:
                        rpn = ranks_per_node(args, lay)
                        dirs = tuple(src["dirs"][: world // rpn])
                    run_method, batch = METHOD_RUN[method]
                    r = Run(method=run_method, spec=spec, dp=dp, tp=tp, ckpt_dirs=dirs,
                            ranks_per_node=rpn, cold=mode in ("cold", "coldhost"),
                            batch_bytes=args.batch_bytes if batch is None else batch,
                            verify=rep == 0 or args.verify_all, warmup_dir=src["warm"],
                            simulate_hosts=mode == "cold", fmt=src["fmt"], verify_dir=src["verify"])
                    entry = {"layout": lay, "world": world, "dp": dp, "tp": tp, "mode": mode,
                             "method": method, "repeat": rep, "nodes": len(dirs), "ranks_per_node": rpn}
                    done = run_one(args, r, world, entry, failures, peers, log)
                    if done is None:
                        continue
                    runs.append(done)
                    s = done["summary"]
                    log(f"  rep {rep} {lay:7s} {mode:8s} {method:10s} {s['wall_s']:7.3f} s  "
                        f"read {fmt_bytes(s['read_bytes_total'])}  "
                        f"collectives {s['data_collectives_max']}  "
                        f"extra anon {fmt_bytes(s.get('extra_anon_max', float('nan')))}  "
                        f"[{_phases(done['per_rank'])}]")
    return {"spec": spec.__dict__, "unique_bytes": nbytes, "runs": runs, "disk": disk, "probe": probe,
            "copies": sources["hf"]["dirs"], "sources": sources, "peers": peers,
            "peer_failures": failures}


def _phases(per_rank: list[dict[str, Any]]) -> str:
    """Rank 0's set-up phases (s), to see where a run's time goes."""
    st = per_rank[0]["stamps"]
    keys = list(st)
    return " ".join(f"{k} {st[k] - st[p]:.1f}" for p, k in zip(keys, keys[1:], strict=False))

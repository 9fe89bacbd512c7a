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

import importlib
import time
from pathlib import Path
from typing import Any

import _bench_attrib
from _bench_common import (
    GiB,
    ModelSpec,
    Run,
    copy_checkpoint,
    measure_disk_bandwidth,
    rank_load,
    readahead_probe,
    warm_files,
    warmup_spec,
    write_hf_checkpoint,
    write_warmup_checkpoint,
)
from _bench_stats import fmt_bytes, median, summarise, table

LAYOUTS = {"dp4": (4, 1), "dp2tp2": (2, 2), "dp4tp2": (4, 2), "dp2": (2, 1), "dp8": (8, 1),
           "fsdp4-dp2tp2": (2, 2)}
LAYOUT_NAMES = {"dp4": "DP4", "dp2tp2": "DP2xTP2", "dp4tp2": "DP4xTP2", "dp2": "DP2", "dp8": "DP8",
                "fsdp4-dp2tp2": "FSDP4 -> DP2xTP2"}
# Layouts that load another checkpoint than the HF one: the resharding case reads the
# FSDP-style checkpoint torch DCP's own writer saved (Shard(0) over 4 ranks, _bench_fsdp).
SOURCES = {"fsdp4-dp2tp2": "fsdp4"}
METHODS = ("dcp", "dcp-64k", "dcp-reread", "dcp-auto", "torch", "fastsafetensors")
PEERS = ("fastsafetensors",)  # other loaders, run where they install; failures are reported
# label -> (Run.method, broadcast_batch_bytes; None = --batch-bytes, load()'s default 6 MiB).
# dcp-64k: the threshold dcp-load's demo measured as best on gloo (packing copies cost more
# than they save above ~64 KiB there).
METHOD_RUN = {"dcp": ("dcp", None), "dcp-64k": ("dcp", 64 * 1024), "dcp-reread": ("dcp-reread", None),
              "dcp-auto": ("dcp-auto", None), "torch": ("torch", None),
              "fastsafetensors": ("fastsafetensors", None)}
TITLES = {
    "warm": "1a. Warm page cache, one host (every rank reads one copy of the files)",
    "cold": "1b. Simulated multi-node cold storage (a copy of the files per node, page cache "
            "dropped before each load)",
    "coldhost": "1c. Cold storage, one host (one copy of the files shared by every rank, page "
                "cache dropped before each load)",
}
METHOD_NAMES = {"dcp": "dcp (read once + broadcast)", "dcp-64k": "dcp (broadcast, 64 KiB batches)",
                "dcp-reread": "dcp (every rank reads)", "dcp-auto": "dcp (auto, the default)",
                "torch": "torch DCP", "fastsafetensors": "fastsafetensors (ParallelLoader, nogds)"}


def model_spec(quick: bool) -> ModelSpec:
    # 10 layers of hidden 2048: 1.08 GiB of bf16; --quick: ~34 MiB.
    if quick:
        return ModelSpec(layers=2, hidden=512, kv_dim=128, intermediate=1408, vocab=8000,
                         file_bytes=12 * 1024 * 1024)
    return ModelSpec()


def model_dir(args: Any) -> Path:
    """Where the model checkpoint lives (quick and full sizes apart, so neither rewrites the other)."""
    return Path(args.workdir) / ("hf-model-quick" if args.quick else "hf-model")


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
    nodes = max(LAYOUTS[lay][0] * LAYOUTS[lay][1] // _rpn(args, lay) for lay in layouts)
    warm = Path(write_warmup_checkpoint(work, spec))
    roots = {"hf": (base, warm)}
    if any(lay in SOURCES for lay in layouts):
        from _bench_fsdp import write_fsdp_checkpoint

        t = time.perf_counter()
        f_base, f_warm = base.with_name(base.name + "-fsdp4"), warm.with_name(warm.name + "-fsdp4")
        write_fsdp_checkpoint(args.launcher, base, f_base, spec, args.rank_timeout)
        write_fsdp_checkpoint(args.launcher, warm, f_warm, warmup_spec(spec), args.rank_timeout)
        log(f"FSDP-style torch DCP checkpoint {f_base} ready in {time.perf_counter() - t:.1f} s")
        roots["fsdp4"] = (f_base, f_warm)
    sources: dict[str, dict[str, Any]] = {}
    for kind, (root, wdir) in roots.items():
        dirs = [root] + [root.with_name(f"{root.name}-node{k}") for k in range(1, nodes)]
        if copies_needed:
            for c in dirs[1:]:
                copy_checkpoint(root, c)
        sources[kind] = {"fmt": "hf" if kind == "hf" else "torch_dcp", "dirs": [str(d) for d in dirs],
                         "warm": str(wdir), "verify": None if kind == "hf" else str(base)}
    return spec, nbytes, sources


def peer_status() -> dict[str, str | None]:
    """For each peer: None when it imports here, else why not (measured, not assumed)."""
    out: dict[str, str | None] = {}
    for peer in PEERS:
        try:
            importlib.import_module(peer)
            out[peer] = None
        except Exception as e:  # noqa: BLE001 - any import failure is the reported reason
            out[peer] = f"import {peer} failed: {type(e).__name__}: {e}"
    return out


def run_one(args: Any, r: Run, world: int, entry: dict[str, Any], failures: list[dict[str, Any]],
            peers: dict[str, str | None], log: Any) -> dict[str, Any] | None:
    """One measured load; a peer's install or run failure is recorded, not raised."""
    method = entry["method"]
    reason = peers.get(method)
    if reason is None and method in PEERS and r.fmt != "hf":
        reason = f"reads safetensors files only; this layout's checkpoint is {r.fmt}"
    if reason is None:
        try:
            per_rank = args.launcher.run(rank_load, world, r, timeout=args.rank_timeout)
        except Exception as e:  # noqa: BLE001 - only peers get here (see below)
            if method not in PEERS:
                raise
            reason = f"run failed: {type(e).__name__}: {str(e)[-600:]}"
        else:
            return {**entry, "summary": summarise(per_rank), "per_rank": per_rank}
    failures.append({**entry, "reason": reason})
    log(f"  {entry['layout']} {entry['mode']} {method}: not measured: {reason[:300]}")
    return None


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
                        rpn = _rpn(args, lay)
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


def _rpn(args: Any, lay: str) -> int:
    dp, tp = LAYOUTS[lay]
    return args.ranks_per_node or tp


def _runs(res: dict[str, Any], lay: str, mode: str, method: str) -> list[dict[str, Any]]:
    return [r for r in res["runs"] if r["layout"] == lay and r["mode"] == mode and r["method"] == method]


def ratio_in_run(res: dict[str, Any], lay: str, mode: str, a: str, b: str, key: str = "wall_s") -> float:
    """Median over repeats of a/b, each ratio taken within one repeat (side by side)."""
    ra = {r["repeat"]: r["summary"][key] for r in _runs(res, lay, mode, a)}
    rb = {r["repeat"]: r["summary"][key] for r in _runs(res, lay, mode, b)}
    return median([ra[k] / rb[k] for k in ra if k in rb and rb[k]])


def med(res: dict[str, Any], lay: str, mode: str, method: str, key: str) -> float:
    return median([r["summary"][key] for r in _runs(res, lay, mode, method) if key in r["summary"]])


def disk_bw(res: dict[str, Any]) -> float:
    return median([d["bytes_per_s"] for d in res["disk"]])


def tables(res: dict[str, Any]) -> list[str]:
    out: list[str] = []
    unique = res["unique_bytes"]
    layouts = list(dict.fromkeys(r["layout"] for r in res["runs"]))
    methods = list(dict.fromkeys(r["method"] for r in res["runs"]))
    modes = list(dict.fromkeys(r["mode"] for r in res["runs"]))
    reps = len({r["repeat"] for r in res["runs"]})
    for mode in modes:
        rows = []
        floor = unique / disk_bw(res) if mode != "warm" and res["disk"] else None
        for lay in layouts:
            for m in methods:
                rs = _runs(res, lay, mode, m)
                if not rs:
                    continue
                walls = [r["summary"]["wall_s"] for r in rs]
                row = [LAYOUT_NAMES[lay], rs[0]["world"], METHOD_NAMES[m],
                       f"{median(walls):.3f}", f"{min(walls):.3f}-{max(walls):.3f}"]
                row.append(f"{ratio_in_run(res, lay, mode, m, 'torch'):.2f}" if "torch" in methods else "-")
                total = med(res, lay, mode, m, "read_bytes_total")
                row += [fmt_bytes(total), f"{total / unique:.2f}",
                        fmt_bytes(med(res, lay, mode, m, "read_bytes_max")),
                        f"{med(res, lay, mode, m, 'data_collectives_max'):.0f}"]
                cpu = [r["summary"]["cpu_s_total"] for r in rs if "cpu_s_total" in r["summary"]]
                row.append(f"{median(cpu):.2f}" if cpu else "-")
                if floor:
                    row.append(f"{median(walls) / floor:.2f}")
                rows.append(row)
        title = TITLES[mode]
        floor_text = (f" x floor = time / physical floor, the floor being unique bytes / measured "
                      f"disk bandwidth = {fmt_bytes(unique)} / {disk_bw(res) / 1e9:.2f} GB/s = "
                      f"{floor:.3f} s." if floor else "")
        out.append(f"### {title}\n\nCheckpoint {fmt_bytes(unique)} (unique bytes); "
                   f"median of {reps} runs; ratio = time / torch DCP's time in the same repeat "
                   "(median of the per-repeat ratios); storage reads from /proc/self/io read_bytes "
                   f"summed over ranks; amplification = storage reads / unique bytes; CPU = user + system "
                   f"time of every rank's process during the load (all threads), summed over ranks.{floor_text}\n\n"
                   + table(
            ["layout", "ranks", "method", "load s (median)", "range", "x torch",
             "storage read (all ranks)", "amplification", "max per rank", "collectives/rank", "CPU core-s"]
            + (["x floor"] if floor else []), rows))
    if "cold" in modes and res["disk"]:
        bw = disk_bw(res)
        bound = unique / bw
        rows = []
        for lay in layouts:
            for m in methods:
                rs = _runs(res, lay, "cold", m)
                if not rs:
                    continue
                per_rank = [median([r["summary"]["read_bytes_per_rank"][k] for r in rs])
                            for k in range(rs[0]["world"])]
                nodes = rs[0]["nodes"]
                per_node = [median([r["summary"]["read_bytes_per_node"][k] for r in rs]) for k in range(nodes)]
                rows.append([LAYOUT_NAMES[lay], f"{nodes} x {rs[0]['ranks_per_node']}",
                             METHOD_NAMES[m], " / ".join(f"{b / 2**20:.0f}" for b in per_rank),
                             " / ".join(f"{b / unique:.2f}" for b in per_node),
                             f"{sum(per_node) / unique:.2f}", f"{max(per_node) / (unique / nodes):.2f}",
                             f"{med(res, lay, 'cold', m, 'wall_s') / bound:.2f}"])
        p = res.get("probe")
        probe = "" if not p else (
            f"\n\nReadahead probe, same run: copying one cold {fmt_bytes(p['box_bytes'])} range out "
            f"of {p['file']} fetched " + ", ".join(f"{fmt_bytes(p[k])} through {k}" for k in (
                "mmap", "mmap MADV_RANDOM", "preadv", "preadv FADV_RANDOM"))
            + f" (block device read_ahead_kb = {p['read_ahead_kb']}). The loaders' readers, same run: "
            f"the first half of the rows of {p['loaders']['tensor']} "
            f"({fmt_bytes(p['loaders']['box_bytes'])}, cold) fetched {fmt_bytes(p['loaders']['dcp_reader'])} "
            f"through dcp_reader.read and {fmt_bytes(p['loaders']['safetensors get_slice'])} through "
            "safetensors get_slice (torch DCP's HF reader).")
        out.append("### 1b. Bytes fetched from storage per rank and per node, cold (median over repeats)\n\n"
                   f"Raw disk bandwidth, cold sequential 16 MiB reads of the files, median: "
                   f"{bw / 1e9:.2f} GB/s, so the physical floor unique bytes / bandwidth = {bound:.3f} s. "
                   "Per node: the bytes the ranks of simulated node k fetched from their copy of the "
                   "files / unique bytes; node balance = the busiest node's bytes / (unique bytes / "
                   f"nodes), 1.00 when the job's reads are spread evenly over the nodes.{probe}\n\n" + table(
            ["layout", "nodes x ranks", "method", "MiB read per rank (rank 0..N-1)",
             "per node / unique (node 0..N-1)", "all nodes / unique", "node balance",
             "time / floor"], rows))
    if "dcp" in methods and "dcp-reread" in methods:
        rows = []
        for mode in [m for m in ("warm", "coldhost") if m in modes]:
            for lay in layouts:
                row = [LAYOUT_NAMES[lay], mode]
                for m in ("dcp", "dcp-64k", "dcp-reread", "dcp-auto", "torch"):
                    v = med(res, lay, mode, m, "wall_s")
                    row.append("-" if v != v else f"{v:.3f}")
                for m in ("dcp", "dcp-64k"):
                    v = ratio_in_run(res, lay, mode, m, "dcp-reread")
                    row.append("-" if v != v else f"{v:.2f}")
                row.append(fmt_bytes(med(res, lay, mode, "dcp-reread", "read_bytes_total")))
                rows.append(row)
        if rows:
            out.append("### One host: broadcast or re-read?\n\nEvery rank on one host, one copy of "
                       "the files. broadcast / re-read = dcp (read once + broadcast, 6 MiB or 64 KiB "
                       "batches) time over dcp (every rank reads) time in the same repeat (median of the ratios); storage "
                       "read = bytes all ranks fetched from storage when every rank reads.\n\n" + table(
                           ["layout", "cache", "dcp broadcast s", "broadcast 64 KiB s", "dcp re-read s",
                            "dcp auto s", "torch DCP s", "broadcast / re-read", "64 KiB / re-read",
                            "storage read, re-read"], rows))
    attrib, _ = _bench_attrib.tables(res, METHOD_NAMES, LAYOUT_NAMES)
    if attrib:
        out.append(attrib)
    rows = []
    phases = ("prepare", "plan", "validate", "execute", "finish", "total")
    for lay in layouts:
        for mode in modes:
            for m in [m for m in methods if m.startswith("dcp")]:
                rs = _runs(res, lay, mode, m)
                secs = [p.get("report_seconds") for r in rs for p in r["per_rank"][:1]]
                if not rs or not all(secs):
                    continue
                rows.append([LAYOUT_NAMES[lay], mode, METHOD_NAMES[m]]
                            + [f"{median([x.get(k, float('nan')) for x in secs]):.3f}" for k in phases])
    if rows:
        out.append("### dcp's own phase times (LoadReport.seconds of rank 0, median over repeats)\n\n"
                   + table(["layout", "cache", "method", *phases], rows))
    rows = []
    for lay in layouts:
        for mode in modes:
            for m in methods:
                rs = _runs(res, lay, mode, m)
                if not rs or "extra_anon_max" not in rs[0]["summary"]:
                    continue
                dest = rs[0]["summary"]["dest_bytes_total"] / rs[0]["world"]
                rows.append([LAYOUT_NAMES[lay], mode, METHOD_NAMES[m], fmt_bytes(dest),
                             fmt_bytes(med(res, lay, mode, m, "extra_anon_max")),
                             fmt_bytes(med(res, lay, mode, m, "extra_rss_max")),
                             fmt_bytes(med(res, lay, mode, m, "peak_rss_max"))])
    if rows:
        out.append("### 4. Peak resident memory per rank during the load (worst rank, median over "
                   "repeats)\n\nDestination tensors are allocated and poisoned before the load, so "
                   "they are in the baseline. extra private = peak RssAnon (sampled every 2 ms) "
                   "minus RssAnon before the load; extra RSS = VmHWM (reset through "
                   "/proc/self/clear_refs) minus VmRSS before the load, which also counts pages of "
                   "memory-mapped checkpoint files (page cache the kernel can reclaim).\n\n" + table(
                       ["layout", "cache", "method", "destination per rank", "extra private (anon)",
                        "extra RSS (anon + mapped file)", "peak RSS"], rows))
    return out

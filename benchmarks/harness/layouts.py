"""What the replicated-load scenarios share: the layouts, the methods and their names, the
model, the peers, one measured load, and the per-repeat ratios their tables and goals use.

Used by ``bench_load_replicated`` (scenarios 1 and 4), ``bench_load_throttled`` (6),
``bench_load_single`` (3), the report (``harness.report``, ``harness.goals``, ``harness.plot``)
and the scripts that load the same model (``bench_sources``, ``bench_torch_dcp_reshard``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from harness.common import Run, rank_load
from harness.spec import ModelSpec
from harness.stats import by_repeat, median, ratio_by_repeat, summarise

LAYOUTS = {"dp4": (4, 1), "dp2tp2": (2, 2), "dp4tp2": (4, 2), "dp2": (2, 1), "dp8": (8, 1),
           "fsdp4-dp2tp2": (2, 2)}
LAYOUT_NAMES = {"dp4": "DP4", "dp2tp2": "DP2xTP2", "dp4tp2": "DP4xTP2", "dp2": "DP2", "dp8": "DP8",
                "fsdp4-dp2tp2": "FSDP4 -> DP2xTP2"}
# Layouts that load another checkpoint than the HF one: the resharding case reads the
# FSDP-style checkpoint torch DCP's own writer saved (Shard(0) over 4 ranks, harness.fsdp).
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


def ranks_per_node(args: Any, lay: str) -> int:
    dp, tp = LAYOUTS[lay]
    return args.ranks_per_node or tp


def runs_of(res: dict[str, Any], lay: str, mode: str, method: str) -> list[dict[str, Any]]:
    return [r for r in res["runs"] if r["layout"] == lay and r["mode"] == mode and r["method"] == method]


def ratio_in_run(res: dict[str, Any], lay: str, mode: str, a: str, b: str, key: str = "wall_s") -> float:
    """Median over repeats of a/b, each ratio taken within one repeat (side by side)."""
    return ratio_by_repeat(by_repeat(runs_of(res, lay, mode, a), key), by_repeat(runs_of(res, lay, mode, b), key))


def med(res: dict[str, Any], lay: str, mode: str, method: str, key: str) -> float:
    return median([r["summary"][key] for r in runs_of(res, lay, mode, method) if key in r["summary"]])


def disk_bw(res: dict[str, Any]) -> float:
    return median([d["bytes_per_s"] for d in res["disk"]])

"""``dcp plan``: a dry run of a load's plan for any world size, in one process.

Plans the reads as ``load`` would with ``--broadcast`` (``broadcast_replicated_tensors``:
"auto" by default, which broadcasts on object storage as ``True`` does). Prints the
slowest rank's planning time (each distinct rank role timed), the bytes each
rank sends to agree on the plan, bytes read per rank (max, mean, a histogram),
broadcasts per rank and storage amplification; ``--json`` prints the same as one JSON
object, ``--png FILE`` draws bytes read per rank (needs matplotlib: ``dcp-load[plot]``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..run._progress import _isatty
from ..run._units import human_bytes, plural

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Register ``dcp plan`` on the ``dcp`` command's subparsers."""
    p = sub.add_parser("plan", help="dry run: the load plan for any world size (timings, bytes per rank)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="plan for this checkpoint's metadata: a directory or "
                     "s3://bucket/prefix (gs://, az://)")
    src.add_argument("--model", help="a built-in synthetic model: llama-8b, llama-70b or llama-405b "
                     "(bf16, Hugging Face files of ~5 GB, one chunk per tensor)")
    p.add_argument("--mesh", required=True, help="layout, e.g. tp=8,pp=8,dp=256 (TP innermost, then PP, then DP)")
    p.add_argument("--fsdp", action="store_true", help="shard every tensor's dim 0 over dp (else replicate)")
    p.add_argument("--ranks-per-host", type=int, default=8, help="ranks sharing a page cache (default 8)")
    p.add_argument("--broadcast", choices=["auto", "true", "false"], default="auto",
                   help="load's broadcast_replicated_tensors: auto (default: a replicated box is read by each "
                   "of its ranks on one host and broadcast to other hosts; on object storage, broadcast as "
                   "true), true (read once, broadcast) or false (every rank reads what it holds)")
    p.add_argument("--repeats", type=int, default=3, help="time the rank roles in this many passes (every role "
                   "in the first, the roles at or above its median in the others) and keep each role's fastest "
                   "(default 3: other work on the machine only adds time)")
    p.add_argument("--batch-bytes", type=int, default=None, metavar="N",
                   help="load's broadcast_batch_bytes: broadcast items below N bytes are packed into one "
                   "broadcast (default 6 MiB, as load; 0 packs nothing)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--png", metavar="FILE", help="draw bytes read per rank into FILE (matplotlib)")
    # Kept so that command lines that pass it still run: plan reads tensor metadata only,
    # which dcp_reader never unpickles.
    p.add_argument("--allow-pickle", action="store_true", help="has no effect: dcp plan reads no values, and "
                   "checkpoint metadata is never unpickled")


def histogram(values: Sequence[int], bins: int = 8, width: int = 40) -> list[str]:
    """A text histogram of ``values`` (bytes read per rank). Equal values make one line, and
    never more bins than distinct byte counts fit between the extremes; where the rounded
    sizes of two bin edges would print alike, the edges are printed in bytes."""
    lo, hi = min(values), max(values)
    if lo == hi:
        return [f"  {human_bytes(lo):>9} (every rank) | {'#' * width} {len(values)}"]
    bins = min(bins, hi - lo)
    step = (hi - lo) / bins
    if bins == 1:  # two byte counts side by side: a bin for each, one byte wide
        bins, step = 2, 1
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v - lo) / step))] += 1
    top = max(counts)
    edges = [lo + k * step for k in range(bins + 1)]
    labels = [human_bytes(e) for e in edges]
    if len(set(labels)) < len(labels):
        labels = [f"{round(e):,} B" for e in edges]
    w = max(9, *(len(label) for label in labels))
    return [f"  {labels[k]:>{w}} - {labels[k + 1]:>{w}} | "
            f"{'#' * max(1 if c else 0, round(width * c / top)):<{width}} {c}" for k, c in enumerate(counts)]


class StatusLine:
    """One line on a terminal saying what ``dcp plan`` is doing, redrawn in place at most
    ten times a second and erased at the end; nothing when ``stream`` is not a terminal
    (a log or a pipe gets only the result)."""

    def __init__(self, stream: Any = None, clock: Any = time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.on = _isatty(self.stream)
        self.clock, self.last, self.width = clock, float("-inf"), 0

    def __call__(self, text: str) -> None:
        now = self.clock()
        if not self.on or now - self.last < 0.1:
            return
        self.last = now
        line = f"dcp plan: {text}"
        self.stream.write("\r" + line.ljust(self.width))
        self.stream.flush()
        self.width = max(self.width, len(line))

    def close(self) -> None:
        if self.on and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
        self.width = 0


def _tensors(args: argparse.Namespace) -> dict[str, Any]:
    from ..plan._simulate import model_metadata

    if args.model:
        return model_metadata(args.model)
    from dcp_reader import open_checkpoint

    with open_checkpoint(args.checkpoint, allow_pickle=args.allow_pickle) as reader:
        return dict(reader.metadata.tensors)


def _object_store(args: argparse.Namespace) -> bool:
    """Whether the checkpoint is in an object store (no page cache shared by a host's ranks)."""
    if not args.checkpoint:
        return False
    from dcp_reader.storage import PosixStorage, open_storage

    return not isinstance(open_storage(args.checkpoint), PosixStorage)


def _png(path: str, loads: Sequence[int], title: str) -> None:
    try:
        import matplotlib
    except ImportError as exc:
        raise ValueError("--png needs matplotlib: pip install 'dcp-load[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(range(len(loads)), [v / 2**20 for v in loads], linewidth=0.6)
    ax.set_xlabel("rank")
    ax.set_ylabel("MiB read from storage")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mode_text(setting: Any, layout: Any) -> str:
    """What the planned mode does with replicated boxes."""
    if not layout.broadcast:
        return "every rank reads what it holds"
    if layout.same_host_reads:
        return (f"each rank of a box's host reads it ({layout.ranks_per_host} ranks per host), "
                "other hosts receive it by broadcast")
    where = "on object storage, as True: " if setting == "auto" else ""
    return f"{where}each box is read once and broadcast to the other ranks that hold it"


def run(args: argparse.Namespace, out: Any = None, status: Any = None) -> int:
    """Run ``dcp plan`` with parsed ``args``; 0 on success, 2 on bad input or a checkpoint
    that cannot be read (one line on stderr). ``status``: where the progress line goes
    (default ``StatusLine()``: stderr, on a terminal only)."""
    from dcp_reader import CheckpointError

    from ..plan._simulate import BATCH_BYTES, MODES, Layout, load_mode, parse_mesh, simulate
    from ..run._plan_summary import summary_text

    out = out or sys.stdout
    status = status or StatusLine()
    try:
        mesh = parse_mesh(args.mesh)
        if args.ranks_per_host < 1:
            raise ValueError(f"--ranks-per-host must be >= 1, got {args.ranks_per_host}")
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        batch = BATCH_BYTES if args.batch_bytes is None else args.batch_bytes
        if batch < 0:
            raise ValueError(f"--batch-bytes must be >= 0 (0 packs nothing), got {batch}")
        tensors = _tensors(args)
        setting = MODES[args.broadcast]
        object_store = _object_store(args)
        broadcast, same_host_reads = load_mode(setting, object_store=object_store)
        layout = Layout(mesh["tp"], mesh["pp"], mesh["dp"], fsdp=args.fsdp, ranks_per_host=args.ranks_per_host,
                        broadcast=broadcast, same_host_reads=same_host_reads, relay=object_store)
        result = simulate(tensors, layout, repeats=args.repeats, progress=status, batch_bytes=batch)
        title = f"{args.model or args.checkpoint}: tp={layout.tp} pp={layout.pp} dp={layout.dp}"
        if args.png:
            _png(args.png, result["read_bytes_per_rank"], title)
    except (CheckpointError, ValueError, OSError) as exc:
        status.close()
        print(f"dcp plan: {exc}", file=sys.stderr)
        return 2
    status.close()
    loads = result.pop("read_bytes_per_rank")
    result.pop("broadcasts_per_rank")
    result["broadcast_replicated_tensors"] = setting
    if args.json:
        print(json.dumps(result, sort_keys=True), file=out)
        return 0
    lines = [
        f"{title}: {result['world_size']} ranks, {plural(result['tensors'], 'tensor')}, "
        f"{human_bytes(result['unique_bytes'])}",
        f"broadcast_replicated_tensors={setting!r}: {_mode_text(setting, layout)}",
        f"planning per rank (slowest of {result['roles_timed']} roles, fastest of {result['timing_repeats']} passes): "
        f"{result['planning_seconds_max'] * 1e3:.1f} ms wall, {result['planning_cpu_seconds_max'] * 1e3:.1f} ms CPU",
        f"exchanged per rank: {result['exchanged_bytes_per_rank_max']} B (digest), "
        f"broadcast group sets: 0 B on gloo and NCCL (groups made by their members), "
        f"{human_bytes(result['group_set_bytes_per_rank_max'])} where they are gathered (HCCL, MindSpore)",
        *summary_text(result).split("; "),
        "bytes read per rank:", *histogram(loads),
    ]
    print("\n".join(lines), file=out)
    return 0

"""Saving to a disk with a cluster's write bandwidth: ``dcp_load.save`` / ``async_save``
against torch DCP's ``save`` / ``async_save`` (thread mode), side by side in one run.

Four gloo ranks, all in ONE blkio cgroup whose writes to the checkpoint disk are capped at
B (``--bps``, default 100 MiB/s; one node, one disk: ``harness.throttle`` with
``write=True``). The state is ``bench_save``'s: ``--size`` MiB of fp32 (model + AdamW) as
DTensors, layouts DP2 x TP2 and FSDP4. Every save goes into a fresh directory under a
temporary directory in ``--dir`` (default: the repository's root, on the disk being
throttled), after a ``sync`` (outside the cgroup) so that no earlier dirty page is
charged to the save. One warm-up round per part is not counted; the savers alternate
order from one repeat to the next; tables give medians over ``--repeats``.

1. Sync save against the floor. Each rank times its own call between two barriers; the
   time is the slowest rank's. Floor = the job's unique bytes / B, unique bytes = the sum
   over ranks of dcp's ``SaveReport.bytes_written`` (torch writes the same tensors once
   each). Shown: time, time / floor (goal for dcp <= 1.1), dcp / torch, and the bytes the
   cgroup wrote (``blkio.throttle.io_service_bytes``, "Write") against the unique bytes.
2. A training loop while an async save writes. A step is ``--matmuls`` 256 x 256 fp32
   matmuls and one small all-reduce on the default process group; that all-reduce also
   carries each rank's "keep going" flag, so every rank runs the same steps and the loop
   ends when every rank's condition is over. Baseline: steps for ``--window`` seconds with
   no save, just before each save. Then the async save is called and the loop steps until
   every rank's future is done. Shown per saver: the seconds the call blocked, the seconds
   from its return to done (slowest rank), that against the floor, and the step rate while
   writing / the baseline rate (goal >= 0.8). torch's thread-mode ``async_save`` runs the
   whole of ``save`` (its collectives too) on a background thread, so it gets a process
   group of its own (``process_group=``), as torch asks for when training continues.

    python benchmarks/save/bench_save_throttled.py --size 256 --repeats 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness/

from bench_save import WORLD, MiB, _launch, _local_bytes, _rss, _state  # noqa: E402
from harness import throttle as throttle  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = ("dp2tp2", "fsdp4")
SYNC_SAVERS = ("dcp save", "torch save")
ASYNC_SAVERS = ("dcp async", "torch async thread")


# --- the rank side --------------------------------------------------------------------

class _Ctx:
    """What a rank needs to fence one measurement: its cgroup, the one it left, the device."""

    def __init__(self, rank: int, root: str, cfg: dict[str, Any], left: str) -> None:
        self.rank, self.root, self.cfg, self.left = rank, root, cfg, left
        self.cgroup, self.device = cfg["cgroup"], cfg["device"]

    def written(self) -> int:
        return throttle.service_bytes(self.cgroup, self.device, "Write")

    def fenced(self, call: Callable[[], Any]) -> tuple[float, Any, int]:
        """sync (rank 0, outside the cgroup), barrier, ``call`` timed, barrier. Returns
        (seconds of the call, its value, bytes the cgroup wrote meanwhile; rank 0's count)."""
        import torch.distributed as dist

        if self.rank == 0:
            throttle.leave(self.left)
            os.sync()
            throttle.join(self.cgroup)
        w0 = self.written()
        dist.barrier()
        t0 = time.perf_counter()
        value = call()
        took = time.perf_counter() - t0
        dist.barrier()
        return took, value, self.written() - w0

    def fresh(self, *parts: Any) -> str:
        return os.path.join(self.root, "ckpt", "-".join(str(p).replace(" ", "-") for p in parts))

    def drop(self, d: str) -> int:
        """After a ``fenced`` save into ``d``: rank 0 counts the bytes of its files and removes
        it, the others wait for that (a barrier). Returns the bytes (0 on the others)."""
        import torch.distributed as dist

        size = 0
        if self.rank == 0:
            size = sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file())
            shutil.rmtree(d, ignore_errors=True)
        dist.barrier()
        return size


class _Work:
    """A training step of fixed work: matmuls, then one all-reduce that also carries this
    rank's flag; the loop goes on while any rank's flag is set."""

    def __init__(self, matmuls: int) -> None:
        import torch

        g = torch.Generator().manual_seed(7)
        self.a = torch.randn(256, 256, generator=g)
        self.b = torch.randn(256, 256, generator=g) / 16
        self.c = torch.empty(256, 256)
        self.n = matmuls

    def step(self, going: bool) -> bool:
        import torch
        import torch.distributed as dist

        for _ in range(self.n):
            torch.mm(self.a, self.b, out=self.c)
        t = torch.tensor([float(self.c[0, 0]), float(going)])
        dist.all_reduce(t)
        return bool(t[1] > 0)

    def run(self, go: Callable[[], bool]) -> int:
        steps = 1
        while self.step(go()):
            steps += 1
        return steps

    def baseline(self, window: float) -> float:
        t0 = time.perf_counter()
        steps = self.run(lambda: time.perf_counter() - t0 < window)
        return steps / (time.perf_counter() - t0)


def _sync_savers(sd: Any) -> dict[str, Callable[[str], int | None]]:
    import dcp_load
    import torch.distributed.checkpoint as tdcp

    def torch_save(d: str) -> None:
        tdcp.save(sd, checkpoint_id=d)

    return {"dcp save": lambda d: dcp_load.save(sd, checkpoint_id=d).bytes_written, "torch save": torch_save}


def _async_savers(sd: Any, group: Any) -> dict[str, Callable[[str], Any]]:
    import dcp_load
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    def torch_async(d: str) -> Any:
        fut = tdcp.async_save(sd, checkpoint_id=d, process_group=group,
                              async_checkpointer_type=AsyncCheckpointerType.THREAD)
        return getattr(fut, "upload_completion", fut)

    return {"dcp async": lambda d: dcp_load.async_save(sd, checkpoint_id=d), "torch async thread": torch_async}


def _order(names: tuple[str, ...], rep: int) -> tuple[str, ...]:
    return names if rep % 2 == 0 else names[::-1]


def _sync_part(ctx: _Ctx, layout: str, sd: Any) -> dict[str, list[dict[str, Any]]]:
    savers = _sync_savers(sd)
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in savers}
    for rep in range(-1, ctx.cfg["repeats"]):
        for k in _order(SYNC_SAVERS, rep):
            d = ctx.fresh("sync", layout, k, rep)
            took, written, cg = ctx.fenced(partial(savers[k], d))
            disk = ctx.drop(d)
            if rep >= 0:
                rows[k].append({"s": took, "written": written, "cgroup": cg, "disk": disk})
    return rows


def _while_saving(work: _Work, start: Callable[[str], Any], d: str) -> dict[str, Any]:
    """Call ``start(d)``, then step until every rank's future is done."""
    rss, t0 = _rss(), time.perf_counter()
    fut = start(d)
    t1 = time.perf_counter()
    at_return = _rss()
    stamp: list[float] = []
    fut.add_done_callback(lambda _: stamp.append(time.perf_counter()))
    steps = work.run(lambda: not fut.done())
    t2 = time.perf_counter()
    rep = fut.result()
    done = (stamp[0] if stamp else time.perf_counter()) - t1
    return {"blocked": t1 - t0, "done": done, "steps": steps, "rate": steps / (t2 - t1),
            "rss": at_return, "rss_grown": at_return - rss, "written": getattr(rep, "bytes_written", None)}


def _async_part(ctx: _Ctx, layout: str, sd: Any, group: Any) -> dict[str, list[dict[str, Any]]]:
    savers = _async_savers(sd, group)
    work = _Work(ctx.cfg["matmuls"])
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in savers}
    for rep in range(-1, ctx.cfg["repeats"]):
        for k in _order(ASYNC_SAVERS, rep):
            d = ctx.fresh("async", layout, k, rep)
            base = work.baseline(ctx.cfg["window"])
            _, got, cg = ctx.fenced(partial(_while_saving, work, savers[k], d))
            disk = ctx.drop(d)
            if rep >= 0:
                rows[k].append({**got, "baseline": base, "cgroup": cg, "disk": disk})
    return rows


def _in_rank(rank: int, world: int, root: str, cfg: dict[str, Any]) -> dict[str, Any]:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    group = dist.new_group(backend="gloo")  # torch's async_save: its own group, off the loop's
    ctx = _Ctx(rank, root, cfg, throttle.join(cfg["cgroup"]))
    try:
        out: dict[str, Any] = {}
        for layout in cfg["layouts"]:
            sd = _state(layout, cfg["size"])
            out[layout] = {"held": _local_bytes(sd), "sync": _sync_part(ctx, layout, sd),
                           "async": _async_part(ctx, layout, sd, group)}
        return out
    finally:
        throttle.leave(ctx.left)


# --- the host side: tables ------------------------------------------------------------

def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _per_repeat(per_rank: list[dict[str, Any]], layout: str, part: str, saver: str) -> list[list[dict[str, Any]]]:
    """For each repeat, the ranks' rows for ``saver``."""
    reps = len(per_rank[0][layout][part][saver])
    return [[p[layout][part][saver][i] for p in per_rank] for i in range(reps)]


def _sync_lines(per_rank: list[dict[str, Any]], layout: str, bps: int) -> tuple[int, list[str]]:
    reps = _per_repeat(per_rank, layout, "sync", "dcp save")
    unique = int(_med([sum(r["written"] for r in rows) for rows in reps]))
    floor = unique / bps
    lines = [f"  1. sync save: floor {floor:.2f} s = unique {unique / MiB:.1f} MiB / B",
             f"     {'saver':20s} {'time s':>8s} {'x floor':>8s} {'cgroup wrote MiB':>17s} "
             f"{'x unique':>9s} {'files MiB':>10s}"]
    med: dict[str, float] = {}
    for k in SYNC_SAVERS:
        reps = _per_repeat(per_rank, layout, "sync", k)
        med[k] = _med([max(r["s"] for r in rows) for rows in reps])
        cg = _med([rows[0]["cgroup"] for rows in reps])
        disk = _med([rows[0]["disk"] for rows in reps])
        lines.append(f"     {k:20s} {med[k]:8.2f} {med[k] / floor:8.2f} {cg / MiB:17.1f} {cg / unique:9.3f} "
                     f"{disk / MiB:10.1f}")
    per_rep = [max(r["s"] for r in a) / max(r["s"] for r in b) for a, b in
               zip(*(_per_repeat(per_rank, layout, "sync", k) for k in SYNC_SAVERS), strict=True)]
    lines.append(f"     dcp save: {med['dcp save'] / floor:.2f} x floor (goal <= 1.1); dcp / torch "
                 f"{_med(per_rep):.2f} x (median of per-repeat ratios)")
    return unique, lines


def _async_lines(per_rank: list[dict[str, Any]], layout: str, floor: float, unique: int) -> list[str]:
    base = [min(r["baseline"] for r in rows) for k in ASYNC_SAVERS
            for rows in _per_repeat(per_rank, layout, "async", k)]
    lines = [f"  2. async save while training: baseline {_med(base):.1f} steps/s "
             f"({1e3 / _med(base):.1f} ms a step); floor {floor:.2f} s",
             f"     {'saver':20s} {'blocked s':>9s} {'to done s':>9s} {'x floor':>8s} {'steps':>6s} "
             f"{'rate/base':>9s} {'cgroup MiB':>10s} {'RSS MiB':>8s}"]
    for k in ASYNC_SAVERS:
        reps = _per_repeat(per_rank, layout, "async", k)
        blocked = _med([max(r["blocked"] for r in rows) for rows in reps])
        done = _med([max(r["done"] for r in rows) for rows in reps])
        steps = _med([rows[0]["steps"] for rows in reps])
        ratio = _med([min(r["rate"] for r in rows) / min(r["baseline"] for r in rows) for rows in reps])
        cg = _med([rows[0]["cgroup"] for rows in reps])
        rss = _med([max(r["rss"] for r in rows) for rows in reps])
        lines.append(f"     {k:20s} {blocked:9.3f} {done:9.2f} {done / floor:8.2f} {steps:6.0f} {ratio:9.2f} "
                     f"{cg / MiB:10.1f} {rss / MiB:8.0f}")
    lines.append("     goal: rate while writing / baseline >= 0.8; x floor = (to done) / floor; "
                 f"cgroup MiB against unique {unique / MiB:.1f}")
    return lines


def _report(per_rank: list[dict[str, Any]], args: argparse.Namespace, device: str, where: str,
            loads: tuple[tuple[float, ...], ...]) -> list[str]:
    lines = ["command: python " + " ".join([os.path.relpath(sys.argv[0], os.getcwd()), *sys.argv[1:]]),
             f"bench_save_throttled: {WORLD} gloo ranks in one blkio cgroup, writes to device {device} capped "
             f"at B = {args.bps / MiB:.0f} MiB/s; {args.size} MiB of fp32 state (model + AdamW); "
             f"under {where}; median of {args.repeats} repeat(s), slowest rank",
             "load average (1, 5, 15 min) at start " + " ".join(f"{x:.2f}" for x in loads[0])
             + ", at end " + " ".join(f"{x:.2f}" for x in loads[1]),
             f"training step: {args.matmuls} matmuls 256 x 256 fp32 + 1 all-reduce of 2 floats (default group); "
             f"baseline window {args.window:.1f} s"]
    for layout in args.layouts:
        held = max(p[layout]["held"] for p in per_rank)
        lines.append(f"{layout}: at most {held / MiB:.1f} MiB held per rank")
        unique, sync = _sync_lines(per_rank, layout, args.bps)
        lines += sync + _async_lines(per_rank, layout, unique / args.bps, unique)
    return lines


# --- the host side: running -----------------------------------------------------------

def _bps(text: str) -> int:
    try:
        return throttle.parse_bps(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--throttle-bps: ")) from None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=256, help="MiB of fp32 state in all (default 256)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bps", type=_bps, default=_bps("100M"),
                    help="write bandwidth cap, e.g. 100M (MiB/s), 1G or bytes/s (default 100M)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--dir", default=None, help="parent of the temporary directory to write under "
                    "(default: the repository root)")
    ap.add_argument("--matmuls", type=int, default=12, help="256 x 256 matmuls per training step (default 12)")
    ap.add_argument("--window", type=float, default=2.0, help="seconds of the no-save baseline (default 2)")
    args = ap.parse_args(argv)
    args.layouts = [x for x in args.layouts.split(",") if x]
    bad = [x for x in args.layouts if x not in LAYOUTS]
    if bad or not args.layouts:
        ap.error(f"--layouts: {bad or 'none given'}; choose from {', '.join(LAYOUTS)}")
    return args


def _run(args: argparse.Namespace, parent: str) -> tuple[list[dict[str, Any]], str, str]:
    for d in throttle.remove_stale():
        print(f"removed a cgroup an earlier run left: {d}", file=sys.stderr)
    device = throttle.block_device(parent)
    root = tempfile.mkdtemp(prefix=".bench-save-throttled-", dir=parent)
    try:
        os.sync()
        with throttle.Throttle(device, args.bps, ["job"], read=False, write=True) as th:
            cfg = {"cgroup": th.path("job"), "device": device, "size": args.size, "repeats": args.repeats,
                   "layouts": args.layouts, "matmuls": args.matmuls, "window": args.window}
            per_rank = _launch(_in_rank, root, cfg)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return per_rank, device, root


def _on_term(*_: Any) -> None:
    """SIGTERM: end the ranks, then leave through the same ``finally`` blocks as any
    failure (the cgroups and the temporary directory are removed)."""
    for p in mp.active_children():
        p.kill()
    sys.exit(143)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    parent = os.path.abspath(args.dir or REPO)
    reason = throttle.unavailable(parent, write=True)
    if reason is not None:
        print(f"bench_save_throttled: cannot cap writes under {parent}: {reason}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_term)
    loads = [os.getloadavg()]
    per_rank, device, root = _run(args, parent)
    loads.append(os.getloadavg())
    print("\n".join(_report(per_rank, args, device, root, tuple(loads))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Saving side by side: ``dcp_load.save`` / ``async_save`` against torch DCP's ``save`` /
``async_save`` (thread, and process) on 4 gloo ranks (``--world 2``: 2), in one run.

State: ``--size`` MiB of fp32 in all, a third parameters and two thirds AdamW moments
(``exp_avg``, ``exp_avg_sq``; a 0-dim ``step`` each), as DTensors in two layouts:
DP2 x TP2 ([Replicate, Shard(0)] over ("dp", "tp"): every box held by 2 ranks) and FSDP4
([Shard(0)] over 4 ranks); with ``--world 2``, DP2 x TP1 (every box on both ranks, each
written by one) and FSDP2. Each repeat runs every saver once, in an order that rotates from
one repeat to the next (alternating), after one warm-up round that is not counted, each
into its own new directory; a time is the
slowest rank's (each rank times its own call between two barriers); the table gives the
median over repeats. For the async savers: the time the call blocked, and the time to the
future's result. Beside them, in the same rotation and timed the same way: a memcpy of the
bytes the rank writes into a warm buffer (the floor of taking a snapshot), the memory each async saver holds at return (dcp: its staging pool; torch: the growth of
RSS over its first counted call), and dcp's six async saves in a row (RSS growth from
the first, threads left).

    python benchmarks/save/bench_save.py --size 256 --repeats 3 [--world 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor", "dcp_load",
           "dcp_reader"]

MiB = 2**20
WORLD = 4
COLS = 1024


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def layouts(world: int) -> tuple[str, str]:
    """The two layouts of ``world`` ranks: DP2 x TP(world / 2) and FSDP(world)."""
    return f"dp2tp{world // 2}", f"fsdp{world}"


def _state(layout: str, size_mib: int) -> dict[str, Any]:
    """This rank's part of the model and AdamW state (module docstring); ``layout`` is one
    of ``layouts(world)``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if layout.startswith("dp2tp"):
        tp = int(layout[len("dp2tp"):])
        mesh = init_device_mesh("cpu", (2, tp), mesh_dim_names=("dp", "tp"))
        placements, parts, me = [Replicate(), Shard(0)], tp, mesh["tp"].get_local_rank()
    else:
        world = int(layout[len("fsdp"):])
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        placements, parts, me = [Shard(0)], world, mesh.get_local_rank()
    n_params = 8
    rows = max(4, (size_mib * MiB // 3) // (n_params * COLS * 4) // 4 * 4)
    g = torch.Generator().manual_seed(1234)

    def part(seed: int) -> Any:
        full = torch.randn(rows, COLS, generator=g.manual_seed(seed))
        local = full[me * rows // parts:(me + 1) * rows // parts].clone()
        return DTensor.from_local(local, mesh, placements, run_check=False)

    model = {f"layer{i}.weight": part(i) for i in range(n_params)}
    optim = {n: {"exp_avg": part(100 + i), "exp_avg_sq": part(200 + i), "step": torch.tensor(7.0)}
             for i, n in enumerate(model)}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 1e-3, "betas": [0.9, 0.95]}]}}


def _local_bytes(sd: Any) -> int:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(sd, dict):
        return sum(_local_bytes(v) for v in sd.values())
    if isinstance(sd, list):
        return sum(_local_bytes(v) for v in sd)
    if isinstance(sd, DTensor):
        sd = sd.to_local()
    return sd.nbytes if isinstance(sd, torch.Tensor) else 0


def _savers() -> dict[str, Any]:
    """name -> fn(state, directory) returning (seconds blocked, seconds to done, info)."""
    import dcp_load
    import torch.distributed.checkpoint as dcp
    from dcp_load.saving._staging import POOL
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    def dcp_save(fmt: str) -> Any:
        def run(sd: Any, d: str) -> tuple[float, float, dict[str, Any]]:
            t0 = time.perf_counter()
            rep = dcp_load.save(sd, checkpoint_id=d, format=fmt)
            took = time.perf_counter() - t0
            return took, took, {"written": rep.bytes_written}
        return run

    def dcp_async(fmt: str) -> Any:
        def run(sd: Any, d: str) -> tuple[float, float, dict[str, Any]]:
            rss, t0 = _rss(), time.perf_counter()
            fut = dcp_load.async_save(sd, checkpoint_id=d, format=fmt)
            blocked, grown = time.perf_counter() - t0, _rss() - rss
            rep = fut.result()
            return blocked, time.perf_counter() - t0, {"held_at_return": POOL.capacity, "rss_grown": grown,
                                                       "written": rep.bytes_written, "staged": rep.staged_bytes}
        return run

    def torch_save(sd: Any, d: str) -> tuple[float, float, dict[str, Any]]:
        t0 = time.perf_counter()
        dcp.save(sd, checkpoint_id=d)
        took = time.perf_counter() - t0
        return took, took, {}

    def torch_async(kind: Any) -> Any:
        def run(sd: Any, d: str) -> tuple[float, float, dict[str, Any]]:
            rss, t0 = _rss(), time.perf_counter()
            fut = dcp.async_save(sd, checkpoint_id=d, async_checkpointer_type=kind)
            blocked, grown = time.perf_counter() - t0, _rss() - rss
            fut = getattr(fut, "upload_completion", fut)
            fut.result()
            return blocked, time.perf_counter() - t0, {"rss_grown": grown}
        return run

    # "(torch fmt)": dcp writing torch DCP's own format (format="torch_dcp"), as torch_compat does
    return {"dcp save": dcp_save("native"), "dcp save (torch fmt)": dcp_save("torch_dcp"), "torch save": torch_save,
            "dcp async": dcp_async("native"), "dcp async (torch fmt)": dcp_async("torch_dcp"),
            "torch async thread": torch_async(AsyncCheckpointerType.THREAD),
            "torch async process": torch_async(AsyncCheckpointerType.PROCESS)}


def _memcpy_saver(nbytes: int) -> Any:
    """A "saver" that copies ``nbytes`` (the bytes this rank writes) into a warm buffer: the
    floor of a snapshot, timed in the same rotation, between the same barriers, as the savers."""
    import torch

    src, dst = torch.ones(max(nbytes, 1), dtype=torch.uint8), torch.zeros(max(nbytes, 1), dtype=torch.uint8)
    dst.copy_(src)  # warm: the staging pool is reused from one save to the next too

    def run(sd: Any, d: str) -> tuple[float, float, dict[str, Any]]:
        t0 = time.perf_counter()
        dst.copy_(src)
        took = time.perf_counter() - t0
        return took, took, {}
    return run


def _in_rank(rank: int, world: int, root: str, size_mib: int, repeats: int, skip: list[str]) -> dict[str, Any]:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    savers = {k: v for k, v in _savers().items() if k not in skip}
    out: dict[str, Any] = {}
    for layout in layouts(world):
        sd = _state(layout, size_mib)
        import dcp_load

        written = dcp_load.save(sd, checkpoint_id=os.path.join(root, f"{layout}-bytes")).bytes_written
        savers["memcpy"] = _memcpy_saver(written)
        res: dict[str, Any] = {"held": _local_bytes(sd), "times": {k: [] for k in savers}, "info": {}}
        names = list(savers)
        for rep in range(-1, repeats):  # -1: a warm-up round, not counted (first-call costs, a cold pool)
            for k in names[rep % len(names):] + names[:rep % len(names)]:
                d = os.path.join(root, f"{layout}-{k.replace(' ', '-')}-{rep}")
                dist.barrier()
                try:
                    blocked, done, info = savers[k](sd, d)
                except Exception as exc:  # noqa: BLE001 - a saver that cannot run here is reported, not fatal
                    blocked = done = float("nan")
                    info = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                dist.barrier()
                if rep >= 0:
                    res["times"][k].append((blocked, done))
                    res["info"].setdefault(k, info)
        del savers["memcpy"]  # the next layout's bytes differ
        out[layout] = res
    out["six"] = _six_in_a_row(root, size_mib, layouts(world)[0])
    return out


def _six_in_a_row(root: str, size_mib: int, layout: str) -> dict[str, Any]:
    import dcp_load

    sd = _state(layout, size_mib)
    rss = []
    for _ in range(6):
        dcp_load.async_save(sd, checkpoint_id=os.path.join(root, "six")).result()
        rss.append(_rss())
    time.sleep(0.1)
    return {"growth": max(rss) - rss[0], "threads": [t.name for t in threading.enumerate() if t.name.startswith("dcp-")]}


def _table(per_rank: list[dict[str, Any]], size_mib: int) -> list[str]:
    lines = [f"bench_save: {len(per_rank)} gloo ranks, {size_mib} MiB of fp32 state (model + AdamW), "
             "median of repeats, slowest rank"]
    for layout in layouts(len(per_rank)):
        r0 = per_rank[0][layout]
        kinds = list(r0["times"])
        med = {}
        for k in kinds:
            reps = len(r0["times"][k])
            blocked = [max(p[layout]["times"][k][i][0] for p in per_rank) for i in range(reps)]
            done = [max(p[layout]["times"][k][i][1] for p in per_rank) for i in range(reps)]
            med[k] = (statistics.median(blocked), statistics.median(done))
        written = max(p[layout]["info"].get("dcp save", {}).get("written", 0) for p in per_rank)
        memcpy = med.pop("memcpy")[0]
        kinds.remove("memcpy")
        lines.append(f"{layout}: per rank {r0['held'] / MiB:.0f} MiB held, at most {written / MiB:.0f} MiB written; "
                     f"memcpy of those bytes {memcpy:.3f} s")
        for k in kinds:
            err = r0["info"][k].get("error")
            lines.append(f"  {k:20s} " + (f"not run: {err}" if err else
                                          f"blocked {med[k][0]:7.3f} s   done {med[k][1]:7.3f} s"))
        lines += _ratios(med, memcpy)
        held = max(p[layout]["info"].get("dcp async", {}).get("held_at_return", 0) for p in per_rank)
        torch_rss = max(p[layout]["info"].get("torch async thread", {}).get("rss_grown", 0) for p in per_rank)
        lines.append(f"  memory at return: dcp staging pool {held / MiB:.1f} MiB (written {written / MiB:.1f} MiB; "
                     f"goal <= {(1.1 * written + 16 * MiB) / MiB:.1f}); torch thread RSS growth "
                     f"{torch_rss / MiB:.1f} MiB (held {r0['held'] / MiB:.0f} MiB)")
    six = [p["six"] for p in per_rank]
    lines.append(f"six dcp async saves in a row: RSS growth max {max(s['growth'] for s in six) / MiB:.1f} MiB "
                 f"(goal < 48), threads left {sorted({t for s in six for t in s['threads']})}")
    return lines


def _ratios(med: dict[str, tuple[float, float]], memcpy: float) -> list[str]:
    def ratio(a: str, b: str, i: int) -> str:
        return f"{med[a][i] / med[b][i]:.2f} x" if a in med and b in med and med[b][i] > 0 else "n/a"

    out = [f"  save: dcp / torch {ratio('dcp save', 'torch save', 1)} (goal <= 1.0)",
           f"  save in torch's format: dcp / torch {ratio('dcp save (torch fmt)', 'torch save', 1)} (goal <= 0.7); "
           f"/ dcp native {ratio('dcp save (torch fmt)', 'dcp save', 1)} (goal <= 1.05); async blocked / native "
           f"{ratio('dcp async (torch fmt)', 'dcp async', 0)}",
           f"  async blocked: dcp / torch thread {ratio('dcp async', 'torch async thread', 0)} (goal <= 0.7 on "
           f"dp2tp2); dcp / memcpy "
           + (f"{med['dcp async'][0] / memcpy:.2f} x (goal <= 1.3)" if "dcp async" in med and memcpy else "n/a"),
           f"  async done: dcp / torch thread {ratio('dcp async', 'torch async thread', 1)}"]
    return out


def _child(rank: int, world: int, init: str, fn: Any, args: tuple[Any, ...], results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the cores
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    try:
        results.put((rank, fn(rank, world, *args)))
    except BaseException as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        dist.destroy_process_group()


def _launch(fn: Any, root: str, *args: Any, world: int = WORLD) -> list[Any]:
    """``fn(rank, world, root, *args)`` on ``world`` gloo ranks, by rank. The ranks are not
    daemons (dcp_platform.testing's are), since torch's process-based async_save starts a
    process of its own; a forkserver with torch imported starts each in milliseconds."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results = ctx.Queue()
    init = os.path.join(root, "store")
    procs = [ctx.Process(target=_child, args=(r, world, init, fn, (root, *args), results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=3600) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    failed = {r: v for r, v in got.items() if isinstance(v, str)}
    if failed:
        raise RuntimeError(f"ranks failed: {failed}")
    return [got[r] for r in range(world)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1024, help="MiB of fp32 state in all (default 1024)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip", action="append", default=[], help="a saver to leave out (e.g. 'torch async process')")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--world", type=int, default=WORLD, choices=(2, 4), help="gloo ranks (default 4)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-save-", dir=args.dir) as root:
        per_rank = _launch(_in_rank, root, args.size, args.repeats, args.skip, world=args.world)
    print("\n".join(_table(per_rank, args.size)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``transfer(..., atomic=True)`` against today's in-place sync, side by side in one run, on
4 local gloo ranks.

    .venv/bin/python benchmarks/transfer/bench_atomic.py [--repeats 5] [--large-mib 8] [--large 16] [--small 2000]

Ranks 0-1 are the trainer (FSDP2 ``Shard(0)``), ranks 2-3 the engine (TP2: even tensors
``Shard(0)``, odd ones ``Shard(1)``), bf16 on both sides, as in bench_transfer.py. After one
transfer that plans (not timed), each repeat times a plain (``delta=False``) transfer that
reuses the plan, in place and with ``atomic=True`` (which stages what each rank receives and
writes its destinations only once every rank succeeded), in alternating order, destinations
poisoned before each. Per method: the median over the repeats of the slowest rank's wall
time, its ratio to the in-place one, the peak extra resident memory of the engine ranks
(VmHWM after the call minus VmRSS before; atomic's staging is the bytes a rank receives),
the bytes an engine rank receives, and whether the values are exact.

Measured on the shared 2-core development machine (load average 4-6 from other work),
torch 2.13 CPU, ``.venv-dev/bin/python benchmarks/transfer/bench_atomic.py --repeats 5``
(peak extra of in place: the scheduler's batch buffers, 8 x 6 MiB)::

    == 16 x 8 MiB ==
    method                      seconds  x in place  peak extra MiB  received MiB  values
    in place (plan reused)        0.209        1.00            49.3          64.0  exact
    atomic=True (plan reused)     0.339        1.63           112.0          64.0  exact

    == 2000 x 4 KiB ==
    method                      seconds  x in place  peak extra MiB  received MiB  values
    in place (plan reused)        0.878        1.00             6.9           3.9  exact
    atomic=True (plan reused)     1.433        1.63            12.5           3.9  exact

A second run: 0.207 / 0.269 s (1.30 x) and 0.640 / 1.711 s (2.67 x). atomic's extra memory
is its staging, the 64 MiB an engine rank receives; its extra time one more copy of that,
and for the small model the broadcast items built on every call (an in-place plan of one
round keeps its items; atomic's point at staging that is not kept between calls).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
from bench_transfer import SMALL_BYTES, WORLD, _check, _layouts, _model, _poison, _timed  # noqa: E402

METHODS = {"in place (plan reused)": False, "atomic=True (plan reused)": True}


def _trim() -> None:
    """Give freed heap memory back (glibc), so that the next call's staging shows in VmHWM
    instead of reusing pages an earlier call freed."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _once(src: Any, dst: Any, atomic: bool) -> dict[str, int]:
    import dcp_load

    report = dcp_load.transfer(src, dst, atomic=atomic)
    assert report.plan_reused, "the timed transfers reuse the first one's plan"
    return {"received": report.bytes_received}


def _rows(rank: int, model: dict[str, Any], mesh: Any, repeats: int) -> list[dict[str, Any]]:
    """One model: a transfer that plans, then ``repeats`` rounds of both methods."""
    import dcp_load

    src, dst = _layouts(model, rank, mesh)
    dcp_load.transfer(src, dst)  # plans and keeps the plan
    rows: list[dict[str, Any]] = []
    for i in range(repeats):
        row = {}
        for label in list(METHODS) if i % 2 == 0 else list(reversed(METHODS)):
            _poison(dst)
            _trim()
            seconds, got, extra = _timed(lambda atomic=METHODS[label]: _once(src, dst, atomic))
            row[label] = {"seconds": seconds, "extra": extra, "ok": _check(dst, model, rank, 0), **got}
        rows.append(row)
    return rows


def _bench(rank: int, world: int, specs: dict[str, Any], repeats: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("role", "x"))["x"]
    out: dict[str, Any] = {}
    for name, (count, nbytes) in specs.items():
        out[name] = _rows(rank, _model(count, nbytes), mesh, repeats)
        dist.barrier()
    return out


def _table(per_rank: list[dict[str, Any]], name: str) -> list[str]:
    rounds = [r[name] for r in per_rank]
    lines = [f"== {name} ==", f"{'method':27} {'seconds':>7} {'x in place':>11} {'peak extra MiB':>15} "
             f"{'received MiB':>13}  values"]
    base = None
    for label in METHODS:
        secs = statistics.median(max(r[i][label]["seconds"] for r in rounds) for i in range(len(rounds[0])))
        base = base or secs
        engine = [r[i][label] for r in rounds[2:] for i in range(len(rounds[0]))]
        extra = max(e["extra"] for e in engine) / 2**20
        received = max(e["received"] for e in engine) / 2**20
        ok = all(r[i][label]["ok"] for r in rounds for i in range(len(rounds[0])))
        lines.append(f"{label:27} {secs:7.3f} {secs / base:11.2f} {extra:15.1f} {received:13.1f}  "
                     f"{'exact' if ok else 'WRONG'}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--large", type=int, default=16, help="tensors of the large model")
    p.add_argument("--large-mib", type=int, default=8, help="MiB per tensor of the large model")
    p.add_argument("--small", type=int, default=2000, help="4 KiB tensors of the small model")
    args = p.parse_args()
    specs = {f"{args.large} x {args.large_mib} MiB": (args.large, args.large_mib << 20),
             f"{args.small} x 4 KiB": (args.small, SMALL_BYTES)}
    per_rank = run_ranks(_bench, WORLD, specs, args.repeats, timeout=1800)
    for name in specs:
        print("\n".join(_table(per_rank, name)))
        print()


if __name__ == "__main__":
    main()

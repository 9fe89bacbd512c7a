"""The launcher every scenario uses: real gloo ranks, one fresh process per rank per run.

It has the properties of ``dcp_platform.testing.run_ranks`` (a forkserver, a gloo process
group through a ``file://`` store, an explicit timeout, every rank's failure reported) and
one difference: the forkserver imports both loaders and their dependencies once up front
(torch.distributed.checkpoint, DTensor, safetensors, dcp_load), so each rank starts in a
few milliseconds. Importing them in every rank took 25-40 s per run on this 2-core machine
while it was shared (measured 2026-11-30 at load average 12-16), time that belongs to
neither loader.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.hf_storage", "torch.distributed.tensor",
    "torch.distributed.device_mesh", "torch._dynamo", "safetensors", "safetensors.torch", "dcp_platform",
    "dcp_reader", "dcp_broadcast", "dcp_load", "_bench_common",
]


class LaunchError(RuntimeError):
    """A rank raised, died or timed out; ``failures`` maps rank to cause."""

    def __init__(self, failures: dict[int, str]):
        self.failures = dict(sorted(failures.items()))
        super().__init__("\n".join(f"--- rank {r} ---\n{c.rstrip()}" for r, c in self.failures.items()))


class Launcher:
    """Holds the forkserver context; ``run(fn, world, *args)`` returns results by rank."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)

    def run(self, fn: Callable[..., Any], world: int, *args: Any, timeout: float = 900.0,
            threads: int | None = None) -> list[Any]:
        """``fn(rank, world, *args)`` on ``world`` gloo ranks.

        ``threads``: torch intra-op threads per rank (default 1 when world > 1, else all
        cores), so ranks do not oversubscribe the machine's cores.
        """
        if threads is None:
            threads = 1 if world > 1 else (os.cpu_count() or 1)
        results = self._ctx.Queue()
        with tempfile.TemporaryDirectory(prefix="dcp-bench-ranks-") as tmp:
            store = os.path.join(tmp, "store")
            procs = [self._ctx.Process(target=_child, daemon=True,
                                       args=(fn, r, world, store, timeout, threads, args, results))
                     for r in range(world)]
            for p in procs:
                p.start()
            got: dict[int, tuple[bool, Any]] = {}
            deadline = time.monotonic() + timeout
            try:
                while len(got) < world and time.monotonic() < deadline:
                    try:
                        rank, ok, payload = results.get(timeout=0.5)
                        got[rank] = (ok, payload)
                    except queue_mod.Empty:
                        dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
                        if dead:
                            try:  # its report may still be in the pipe
                                rank, ok, payload = results.get(timeout=2.0)
                                got[rank] = (ok, payload)
                            except queue_mod.Empty:
                                for r in dead:
                                    got[r] = (False, f"exited with code {procs[r].exitcode} without reporting")
            finally:
                for p in procs:
                    p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
                for p in procs:
                    if p.is_alive():
                        p.kill()
                        p.join(timeout=5)
                results.close()
        failures = {r: str(v) for r, (ok, v) in got.items() if not ok}
        failures.update({r: f"no result within {timeout:.0f} s (killed)" for r in range(world) if r not in got})
        if failures:
            raise LaunchError(failures)
        return [got[r][1] for r in range(world)]


def _child(fn: Callable[..., Any], rank: int, world: int, store: str, timeout: float,
           threads: int, args: tuple[Any, ...], results: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        try:
            out = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # every failure, SystemExit included, goes back to the parent
        results.put((rank, False, traceback.format_exc()))

"""Run a function on N real local ranks (torch.distributed over gloo), for tests and demos.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, initialises a gloo
process group in each through a ``file://`` store with an explicit timeout, calls
``fn(rank, world_size, *args)`` and returns the per-rank results in rank order. ``fn`` and
its arguments must be picklable (a module-level function). A failure on any rank raises
``RanksFailed`` with every failing rank's traceback; a rank that neither returns nor fails
within ``timeout`` is killed and reported, so a test never hangs.

Processes come from a forkserver that has torch imported already (spawning each child and
importing torch costs ~1 s per rank here; forking from the server costs a few ms).
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

__all__ = ["RanksFailed", "run_ranks"]

_CTX: Any = None


class RanksFailed(RuntimeError):
    """One or more ranks raised, exited or timed out; ``failures`` maps rank to cause."""

    def __init__(self, failures: dict[int, str]):
        self.failures = dict(sorted(failures.items()))
        lines = [f"{len(failures)} rank(s) failed:"]
        for rank, cause in self.failures.items():
            lines.append(f"--- rank {rank} ---\n{cause.rstrip()}")
        super().__init__("\n".join(lines))


def _context() -> Any:
    global _CTX  # the forkserver is per process by nature; this only memoises the context
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        _CTX = ctx
    return _CTX


def _child(fn: Callable[..., Any], rank: int, world_size: int, init_file: str, backend: str,
           pg_timeout_s: float, env: dict[str, str], args: tuple[Any, ...], results: Any) -> None:
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # report every failure, SystemExit included, to the parent
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout: float = 120.0, pg_timeout: float | None = None,
              env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank.

    ``timeout`` bounds the whole run; ``pg_timeout`` (default: ``timeout``) is the process
    group timeout, so a collective that never completes fails inside the ranks too.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dcp-ranks-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, r, world_size, init_file, backend, pg_timeout or timeout,
                      dict(env or {}), args, results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outcome: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outcome) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    rank, ok, payload = results.get(timeout=min(remaining, 0.5))
                except queue_mod.Empty:
                    # A rank that died without reporting (segfault, kill) will never report.
                    dead = [r for r, p in enumerate(procs)
                            if r not in outcome and p.exitcode is not None]
                    if dead:
                        # Give its report a moment to arrive through the queue's pipe.
                        try:
                            rank, ok, payload = results.get(timeout=1.0)
                        except queue_mod.Empty:
                            for r in dead:
                                outcome[r] = (False, f"exited with code {procs[r].exitcode} "
                                              "without reporting")
                            continue
                    else:
                        continue
                outcome[rank] = (ok, payload)
        finally:
            for p in procs:
                p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            results.close()
    failures = {r: str(v) for r, (ok, v) in outcome.items() if not ok}
    for r in range(world_size):
        if r not in outcome:
            failures[r] = f"no result within {timeout:.0f} s (killed)"
    if failures:
        raise RanksFailed(failures)
    return [outcome[r][1] for r in range(world_size)]

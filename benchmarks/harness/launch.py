"""The launcher every scenario uses: real gloo ranks, one fresh process per rank per run.

It is ``dcp_platform.testing.run_ranks`` (a forkserver, a gloo process group through a
``file://`` store, an explicit timeout, every rank's failure reported) with the forkserver
importing both loaders and their dependencies once up front
(torch.distributed.checkpoint, DTensor, safetensors, dcp_load), so each rank starts in a
few milliseconds. Importing them in every rank took 25-40 s per run on this 2-core machine
while it was shared (measured 2026-11-30 at load average 12-16), time that belongs to
neither loader.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

from dcp_platform.testing import add_preload, run_ranks

PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.hf_storage", "torch.distributed.tensor",
    "torch.distributed.device_mesh", "torch._dynamo", "safetensors", "safetensors.torch", "dcp_platform",
    "dcp_reader", "dcp_broadcast", "dcp_load", "harness.spec", "harness.files", "harness.measure",
    "harness.common", "harness.loaders", "harness.phases",
    "harness.throttle", "harness.fsdp",
]
# Peers are preloaded where they are installed; where one is not, its runs report why.
PEER_PRELOAD = ["fastsafetensors"]


class Launcher:
    """``run(fn, world, *args)`` returns results by rank, through ``run_ranks``."""

    def __init__(self) -> None:
        add_preload(*PRELOAD)
        add_preload(*[m for m in PEER_PRELOAD if importlib.util.find_spec(m) is not None])

    def run(self, fn: Callable[..., Any], world: int, *args: Any, timeout: float = 900.0,
            threads: int | None = None) -> list[Any]:
        """``fn(rank, world, *args)`` on ``world`` gloo ranks.

        ``threads``: torch intra-op threads per rank (default 1 when world > 1, else all
        cores), so ranks do not oversubscribe the machine's cores.
        """
        if threads is None:
            threads = 1 if world > 1 else (os.cpu_count() or 1)
        return run_ranks(fn, world, *args, timeout=timeout, threads=threads)

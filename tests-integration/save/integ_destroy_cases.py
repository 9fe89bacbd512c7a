"""A training script that ends right after ``async_save`` (run as a program, one process
per rank, by test_integ_destroy.py), and the in-rank check of what it left (not a test
module: the ranks import it by name).

``python integ_destroy_cases.py RANK WORLD INIT_METHOD PATH GEN MODE``: joins a gloo
group through ``INIT_METHOD`` (``file://`` or ``tcp://``, whose store rank 0 hosts), saves
generation ``GEN`` with ``async_save``, destroys the process group at once and exits without
``result()``. ``MODE``: ``plain``; ``late-readers`` (rank 0 writes 1.5 s longer and the
other ranks poll the store at most every 4 s, so that rank 0 finishes its part well before
they look for the outcome); ``fail`` (rank 1's write fails: the save fails on every rank);
``rank0-exits`` (rank 0's process ends at once, as a killed one does, taking the store it
hosts with it).
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Any

ROWS, COLS = 64, 96


def full(gen: int) -> Any:
    import torch

    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + gen * 1e5


def state(rank: int, world: int, gen: int) -> dict[str, Any]:
    """Save ``gen`` as rank ``rank`` holds it: a row block of ``w``, the whole ``bias``, a value."""
    import torch
    from dcp_load import Chunk

    rows = ROWS // world
    block = full(gen)[rank * rows:(rank + 1) * rows].clone()
    return {"w": Chunk(block, (ROWS, COLS), (rank * rows, 0)), "bias": torch.full((5,), float(gen)), "step": gen}


def _knobs(rank: int, mode: str) -> None:
    from dcp_load.saving import _async
    from dcp_reader import NativeWriter

    real = NativeWriter.write_file

    def slow(self: Any, name: str, tensors: Any) -> int:
        time.sleep(1.5)
        return real(self, name, tensors)

    def full_disk(self: Any, name: str, tensors: Any) -> int:
        raise OSError(28, "No space left on device", name)

    if mode == "late-readers":
        if rank == 0:
            NativeWriter.write_file = slow  # type: ignore[method-assign]
        else:
            _async.POLL_MAX_S = 4.0
    elif mode == "fail" and rank == 1:
        NativeWriter.write_file = full_disk  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    import torch.distributed as dist

    rank, world, init, path, gen, mode = int(argv[0]), int(argv[1]), argv[2], argv[3], int(argv[4]), argv[5]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    import dcp_load

    _knobs(rank, mode)
    dcp_load.async_save(state(rank, world, gen), checkpoint_id=path)  # the future is dropped
    if mode == "rank0-exits" and rank == 0:
        os._exit(0)
    dist.destroy_process_group()
    print(f"rank {rank}: returned", flush=True)


def holds(rank: int, world: int, path: str) -> dict[str, Any]:
    """What ``path`` loads as on this rank, into poisoned targets: the generation every
    value is from (None where they disagree or match none)."""
    import dcp_load
    import torch
    from dcp_load import Chunk

    rows = ROWS // world
    dst = {"w": Chunk(torch.full((rows, COLS), float("nan")), (ROWS, COLS), (rank * rows, 0)),
           "bias": torch.full((5,), float("nan")), "step": None}
    dcp_load.load(dst, checkpoint_id=path)
    step = dst["step"]
    ok = (isinstance(step, int) and torch.equal(dst["w"].tensor, full(step)[rank * rows:(rank + 1) * rows])
          and torch.equal(dst["bias"], torch.full((5,), float(step))))
    return {"gen": step if ok else None}


if __name__ == "__main__":
    main(sys.argv[1:])

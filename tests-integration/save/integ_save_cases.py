"""Functions that run inside 2 gloo ranks for test_integ_save_crash.py (not a test module).

Each case saves over a good collective checkpoint (save 1 of ``save_crash.state``) with a
save that must fail on every rank: boxes that overlap between the ranks, global shapes that
differ between them, and a disk that fills on rank 1 only (its write raises ENOSPC). The
directory listing before and after each is returned, with the error each rank raised.
"""

from __future__ import annotations

import os
from typing import Any

import save_crash as sc
from integ_failure_cases import outcome


def _listing(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n != ".dcp-save.lock")


def refused_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    import dcp_load
    import torch.distributed as dist
    from dcp_load import Chunk
    from dcp_reader import NativeWriter

    path = os.path.join(root, "ckpt")
    dcp_load.save(sc.state(1, rank, world), checkpoint_id=path)
    full = sc.full(2, "t0")
    rows = full.shape[0]
    bad = {
        # rank 0 holds rows [0, 6/8), rank 1 rows [2/8, end): they overlap
        "overlap": Chunk(full[: rows * 3 // 4] if rank == 0 else full[rows // 4:],
                         tuple(full.shape), (0 if rank == 0 else rows // 4, 0)),
        # each rank's half of a tensor whose global shape it states differently
        "shapes": Chunk(full[rank * rows // 2:(rank + 1) * rows // 2], (rows + rank, full.shape[1]),
                        (rank * rows // 2, 0)),
    }
    out: dict[str, Any] = {"before": _listing(path)}
    for case, t in bad.items():
        out[case] = outcome(lambda t=t: dcp_load.save({**sc.state(2, rank, world), "t0": t}, checkpoint_id=path))
        dist.barrier()
        out[f"{case}_after"] = _listing(path)

    real = NativeWriter.write_file

    def fill_disk(self: Any, name: str, tensors: Any) -> Any:
        if rank == 1:
            with open(os.path.join(self.path, name + f".tmp-{os.getpid()}"), "wb") as f:
                f.write(b"partial")  # as a full disk leaves it, then the writer removes it
            os.remove(os.path.join(self.path, name + f".tmp-{os.getpid()}"))
            raise OSError(28, "No space left on device")
        return real(self, name, tensors)

    NativeWriter.write_file = fill_disk  # type: ignore[method-assign]
    try:
        out["disk_full"] = outcome(lambda: dcp_load.save(sc.state(2, rank, world), checkpoint_id=path))
    finally:
        NativeWriter.write_file = real  # type: ignore[method-assign]
    dist.barrier()
    out["disk_full_after"] = _listing(path)
    if rank == 0:
        out["check"] = sc.check(path, 1, 2)
    return out


def load_during_overwrite(rank: int, world: int, root: str) -> dict[str, Any]:
    """A checkpoint of values only, overwritten by another job's save after rank 0 opened it
    and before rank 1 did: the ranks must not load values of two different saves."""
    import time

    import dcp_load
    import dcp_reader
    import torch.distributed as dist

    path = os.path.join(root, "values-only")
    dcp_load.save({"step": 1, "lrs": [0.1, 0.2]}, checkpoint_id=path)
    dist.barrier()
    flag = os.path.join(root, "overwritten")
    real = dcp_reader.open_checkpoint

    def opened(*args: Any, **kwargs: Any) -> Any:
        if rank == 1:  # opens once the overwrite committed
            deadline = time.monotonic() + 60
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.02)
            return real(*args, **kwargs)
        reader = real(*args, **kwargs)
        try:  # the other job's save, committed while this load runs
            dcp_load.save({"step": 2, "lrs": [0.2, 0.4]}, checkpoint_id=path, no_dist=True)
        finally:
            open(flag, "w").close()
        return reader

    dcp_reader.open_checkpoint = opened
    try:
        dest: dict[str, Any] = {"step": None, "lrs": None}
        out = outcome(lambda: dcp_load.load(dest, checkpoint_id=path, timeout=60))
    finally:
        dcp_reader.open_checkpoint = real
    return {**out, "dest": dest}


def relative_from_two_cwds(rank: int, world: int, root: str) -> dict[str, Any]:
    """A relative checkpoint_id from a different working directory on each rank: the ranks
    name two directories, which must be refused before anything is written."""
    import dcp_load

    path = os.path.join(root, "ckpt")
    dcp_load.save(sc.state(1, rank, world), checkpoint_id=path)
    before = _listing(path)
    cwd = os.path.join(root, f"cwd{rank}") if rank else root
    os.makedirs(cwd, exist_ok=True)
    old = os.getcwd()
    os.chdir(cwd)
    try:
        out = outcome(lambda: dcp_load.save(sc.state(2, rank, world), checkpoint_id="ckpt"))
    finally:
        os.chdir(old)
    out["unchanged"] = _listing(path) == before
    out["elsewhere"] = sorted(os.listdir(os.path.join(cwd, "ckpt"))) if rank else []
    return out

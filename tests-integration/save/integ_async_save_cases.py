"""Functions that run inside 4 gloo ranks for test_integ_async_save.py (not a test module).

The state: DP2 x TP2 DTensors ([Replicate, Shard(0)] over ("dp", "tp"): each box is held
by two ranks and written by one of them), a plain tensor every rank holds, and values;
every element of save ``gen`` says which save and tensor it is from.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from integ_failure_cases import outcome

NAMES = ["w0", "w1", "w2", "w3"]
SHAPE = (64, 256)
_MESH: Any = None


def full(gen: int, name: str) -> Any:
    import torch

    base = torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE)
    return base + gen * 1e6 + int(name[1:]) * 1e4 if name != "bias" else torch.full((7,), float(gen))


def state(gen: int) -> dict[str, Any]:
    """Save ``gen`` as this rank holds it (fresh tensors: the caller may change them)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    global _MESH
    if _MESH is None:  # one mesh per process: each init_device_mesh creates groups
        _MESH = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh = _MESH
    tp, rows = mesh["tp"].get_local_rank(), SHAPE[0] // 2
    sd: dict[str, Any] = {n: DTensor.from_local(full(gen, n)[tp * rows:(tp + 1) * rows].clone(), mesh,
                                                [Replicate(), Shard(0)], run_check=False) for n in NAMES}
    sd["bias"] = full(gen, "bias")
    sd["step"] = gen
    sd["sched"] = {"lr": [0.5 ** gen]}
    del torch
    return sd


def holds(path: str, gen: int) -> bool:
    """Whether ``path`` loads (on every rank, into poisoned targets) as exactly save ``gen``."""
    return gen in held(path, (gen,))


def held(path: str, gens: tuple[int, ...]) -> list[int]:
    """The saves among ``gens`` that one load of ``path`` (on every rank, into poisoned
    targets) equals exactly: one, or none for a torn or other checkpoint."""
    import dcp_load
    import torch

    dst = state(-1)
    for n in NAMES:
        dst[n].to_local().fill_(float("nan"))
    dst["bias"].fill_(float("nan"))
    dst.update(step=None, sched={"lr": None})
    dcp_load.load(dst, checkpoint_id=path)
    out = []
    for gen in gens:
        want = state(gen)
        if (all(torch.equal(dst[n].to_local(), want[n].to_local()) for n in NAMES)
                and torch.equal(dst["bias"], want["bias"]) and dst["step"] == gen and dst["sched"] == want["sched"]):
            out.append(gen)
    return out


def _change_everything(sd: dict[str, Any]) -> None:
    """What a training step does to the state right after the call returns: every tensor
    changes (an exact change: neg_ of values that are never 0 but at one element), and so
    do the values."""
    for n in NAMES:
        sd[n].to_local().neg_().sub_(1)
    sd["bias"].neg_().sub_(1)
    sd["step"] = -1
    sd["sched"]["lr"].append(9.0)


def _slow_writes(rank: int, seconds: float) -> Any:
    """Make this rank's data-file writes take ``seconds`` longer; returns the undo."""
    from dcp_reader import NativeWriter

    real = NativeWriter.write_file

    def slow(self: Any, name: str, tensors: Any) -> int:
        time.sleep(seconds)
        return real(self, name, tensors)

    if rank == 1:
        NativeWriter.write_file = slow  # type: ignore[method-assign]
    return lambda: setattr(NativeWriter, "write_file", real)


def snapshot_while_training(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save 1, then async_save 2 and change every tensor at once; all-reduces on the
    default group run while rank 1's write is slow (so the commit's coordination happens
    meanwhile); a load of the directory in the middle; then the checkpoint holds save 2."""
    import dcp_load
    import torch
    import torch.distributed as dist

    path = os.path.join(root, "ckpt")
    dcp_load.save(state(1), checkpoint_id=path)
    out: dict[str, Any] = {}
    undo = _slow_writes(rank, 1.5)
    try:
        sd = state(2)
        held = sum(sd[n].to_local().nbytes for n in NAMES) + sd["bias"].nbytes
        fut = dcp_load.async_save(sd, checkpoint_id=path)
        _change_everything(sd)
        out["done_at_return"] = fut.done()
        steps = 0
        for _ in range(40):  # the same number of steps on every rank, ~2 s: longer than the save
            x = torch.full((1024,), float(rank))
            dist.all_reduce(x)  # the training loop's collective on the default group
            assert x[0].item() == sum(range(world))
            steps += not fut.done()
            time.sleep(0.05)
        out["steps_while_saving"] = steps
        report = fut.result(timeout=60)
    finally:
        undo()
    out["report"] = {k: getattr(report, k) for k in ("bytes_written", "staged_bytes", "chunks_written")}
    out["held"] = held
    out["holds_2"] = holds(path, 2)
    out["threads"] = _dcp_threads()
    return out


def load_while_writing(rank: int, world: int, root: str) -> dict[str, Any]:
    """async_save 2 over save 1, then at once a load of the same directory in this process
    (while the write runs: it loads save 1 or save 2, whole), then after result() save 2."""
    import dcp_load

    path = os.path.join(root, "ckpt")
    dcp_load.save(state(1), checkpoint_id=path)
    undo = _slow_writes(rank, 0.5)
    try:
        fut = dcp_load.async_save(state(2), checkpoint_id=path)
        during = held(path, (1, 2))  # one load: two could straddle the commit
        fut.result(timeout=60)
    finally:
        undo()
    return {"during": during, "after": holds(path, 2)}


def overlapping_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    """Two async saves into one directory, the second called while the first writes: the
    second waits for the first; both commit, in call order; a save after them waits too.
    Then six saves in a row: RSS and threads."""
    import dcp_load

    path = os.path.join(root, "ckpt")
    undo = _slow_writes(rank, 0.5)
    try:
        first = dcp_load.async_save(state(1), checkpoint_id=path)
        second = dcp_load.async_save(state(2), checkpoint_id=path)
        out: dict[str, Any] = {"first_done_when_second_returned": first.done()}
        out["reports"] = [first.result(timeout=60).path, second.result(timeout=60).path]
    finally:
        undo()
    out["holds_2"] = holds(path, 2)
    rss = []
    for gen in range(3, 9):
        dcp_load.async_save(state(gen), checkpoint_id=path).result(timeout=60)
        rss.append(_rss())
    out["rss"] = rss
    out["holds_8"] = holds(path, 8)
    out["threads"] = _dcp_threads()
    return out


def failing_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 2's write fails (ENOSPC) during an async save over save 1: every rank's future
    raises naming rank 2; save 1 still loads; the next save succeeds (the lock was freed)."""
    import dcp_load
    from dcp_reader import NativeWriter

    path = os.path.join(root, "ckpt")
    import torch.distributed as dist

    dcp_load.save(state(1), checkpoint_id=path)
    dist.barrier()  # rank 0 tidies up (its lock, the writers' indexes) after the others return
    before = sorted(os.listdir(path))
    real = NativeWriter.write_file

    def fill_disk(self: Any, name: str, tensors: Any) -> int:
        if rank == 2:
            raise OSError(28, "No space left on device")
        return real(self, name, tensors)

    NativeWriter.write_file = fill_disk  # type: ignore[method-assign]
    try:
        fut = dcp_load.async_save(state(2), checkpoint_id=path)
        out = outcome(lambda: fut.result(timeout=60))
    finally:
        NativeWriter.write_file = real  # type: ignore[method-assign]
    dist.barrier()
    out["unchanged"] = sorted(os.listdir(path)) == before
    out["holds_1"] = holds(path, 1)
    dcp_load.async_save(state(3), checkpoint_id=path).result(timeout=60)
    out["holds_3"] = holds(path, 3)
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _dcp_threads() -> list[str]:
    """Threads of dcp left once a save's future is done (given a moment to exit), less the
    process's one idle heartbeat thread (dcp-platform README, "Failing together")."""
    from dcp_platform import HEARTBEAT_THREAD

    end = time.monotonic() + 2
    while True:
        left = [t.name for t in threading.enumerate() if t.name.startswith("dcp-") and t.name != HEARTBEAT_THREAD]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.01)


def s3_snapshot(rank: int, world: int, uri: str) -> dict[str, Any]:
    """async_save 1 then 2 into ``uri`` (an s3:// prefix), every tensor changed right after
    each call: the prefix holds save 1, then save 2."""
    import dcp_load

    out: dict[str, Any] = {}
    for gen in (1, 2):
        sd = state(gen)
        fut = dcp_load.async_save(sd, checkpoint_id=uri)
        _change_everything(sd)
        report = fut.result(timeout=120)
        out[f"holds_{gen}"] = holds(uri, gen)
        out[f"staged_{gen}"] = report.staged_bytes == report.bytes_written
    out["threads"] = _dcp_threads()
    return out

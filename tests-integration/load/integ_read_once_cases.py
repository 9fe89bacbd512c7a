"""Functions that run inside ranks for test_integ_read_once (not a test module).

Storage-level read-once: 4 gloo ranks on two simulated nodes (ranks 0-1 and 2-3, TP
inside a node as on clusters). Node k reads its own byte-identical copy of the checkpoint,
so one node's page cache cannot serve the other; the copies are dropped from the page
cache (fsync + posix_fadvise DONTNEED) before each load, and ``/proc/self/io`` read_bytes
counts what each rank really fetched from the block device, page faults included.
"""

from __future__ import annotations

import os
from typing import Any

import torch

HOST_ID_ENV = "DCP_HOST_ID"
ROWS, COLS = 2048, 512  # float32: a 2 KiB row, so the two column halves share every page


def full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(ROWS, COLS, generator=g)


NAMES = ["wq", "wo", "w1", "w2", "norm"]


def write_checkpoint(path: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {n: full(n) for n in NAMES}
    tensors["norm"] = tensors["norm"][0].clone()
    save_file(tensors, os.path.join(path, "model.safetensors"))


def drop_cache(path: str) -> None:
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("no read_bytes in /proc/self/io")


def _states(mesh: Any, rank: int) -> dict[str, dict[str, Any]]:
    from dcp_load import Chunk
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def dt(name: str, placements: list[Any]) -> Any:
        t = full(name) if name != "norm" else full(name)[0]
        return distribute_tensor(torch.full_like(t, float("nan")), mesh, placements, src_data_rank=None)

    R = Replicate()
    lo = rank * 464  # rows [lo, lo + 640): each rank overlaps its neighbours partly
    return {
        # row-parallel (Shard(1)) halves only: every page is shared by the two halves
        "row_parallel": {n: dt(n, [R, Shard(1)]) for n in ("wo", "w2")},
        # a torchtitan-like mix: column-parallel, row-parallel, replicated norm
        "dp2_tp2": {"wq": dt("wq", [R, Shard(0)]), "w1": dt("w1", [R, Shard(0)]),
                    "wo": dt("wo", [R, Shard(1)]), "w2": dt("w2", [R, Shard(1)]), "norm": dt("norm", [R, R])},
        "col_only": {"wq": dt("wq", [R, Shard(0)])},
        "partial_overlap": {"w1": Chunk(torch.full((640, COLS), float("nan")), (ROWS, COLS), (lo, 0))},
    }


def _expected(name: str, value: Any) -> torch.Tensor:
    from dcp_load import Chunk
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    t = full(name) if name != "norm" else full(name)[0]
    if isinstance(value, Chunk):
        box = zip(value.offsets, value.sizes, strict=True)
        return t[tuple(slice(o, o + s) for o, s in box)], value.tensor
    shape, off = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return t[tuple(slice(o, o + s) for o, s in zip(off, shape, strict=True))], value.to_local()


def _count_mapped_boxes() -> list[bool]:
    """Records, for each strided box of a safetensors file this process reads, whether it was
    copied out of a memory map (dcp-reader storage/_mapped.py): a map's page faults are
    fetches no byte count sees, so the tests check the cases that go through one."""
    from dcp_reader.formats import _safetensors_file

    calls: list[bool] = []
    real = _safetensors_file.map_runs

    def counted(*args: Any, **kw: Any) -> bool:
        calls.append(real(*args, **kw))
        return calls[-1]

    _safetensors_file.map_runs = counted
    return calls


def read_once_cases(rank: int, world: int, copies: list[str], mode: Any) -> dict[str, Any]:
    import dcp_load
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    node = rank // 2
    os.environ[HOST_ID_ENV] = f"node{node}"
    mapped = _count_mapped_boxes()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out: dict[str, Any] = {}
    # Warm-up: every case once, in the measured mode, before any measurement. A first load
    # along a code path imports modules and faults in library pages (read from the disk when
    # they are not cached: a fresh machine, or another process dropping the page cache);
    # keep those bytes out of the measured loads.
    for state in _states(mesh, rank).values():
        dcp_load.load(state, checkpoint_id=copies[node], broadcast_replicated_tensors=mode)
    for case, state in _states(mesh, rank).items():
        dist.barrier()
        if rank % 2 == 0:
            drop_cache(copies[node])
        dist.barrier()
        before, boxes = read_bytes(), len(mapped)
        report = dcp_load.load(state, checkpoint_id=copies[node], broadcast_replicated_tensors=mode)
        fetched = read_bytes() - before
        wrong = [n for n, v in state.items() if not torch.equal(*_expected(n, v))]
        out[case] = {"fetched": fetched, "unique": report.job_unique_bytes, "wrong": wrong,
                     "received": report.bytes_received,
                     "reader_bytes": report.bytes_read, "pieces": report.pieces_read,
                     "mapped": sum(mapped[boxes:])}
    return out


def assert_fetched_once(per_rank: list[dict[str, Any]], case: str, mode: Any) -> tuple[int, str]:
    """For ``case`` of a ``read_once_cases`` run: no wrong value on any rank, and the ranks
    together fetched at most 1.02 x the case's unique bytes from storage. Returns (unique
    bytes, a per-rank account for further messages)."""
    wrong = [w for r in per_rank for w in r[case]["wrong"]]
    assert not wrong, f"{case}: wrong values in {wrong}"
    unique = per_rank[0][case]["unique"]
    fetched = sum(r[case]["fetched"] for r in per_rank)
    detail = ", ".join(f"rank {i} fetched {r[case]['fetched']}, read {r[case]['reader_bytes']} in "
                       f"{r[case]['pieces']} pieces" for i, r in enumerate(per_rank))
    assert unique > 0 and fetched <= 1.02 * unique, (
        f"{case} ({mode}): fetched {fetched} bytes for {unique} unique ({fetched / max(unique, 1):.3f} x): {detail}")
    return unique, detail


"""The per-rank load every load scenario measures, and the names the benchmark scripts share.

Everything a rank does is in ``rank_load``: it builds its (poisoned) destination state dict,
synchronises with the other ranks, optionally drops the page cache, then measures one load
(wall clock, ``/proc/self/io`` read_bytes, resident memory, collectives called) with dcp or
with torch.distributed.checkpoint, and afterwards checks every loaded value against the
files. Ranks are real gloo processes started by ``harness.launch.Launcher``.

The pieces below it live one module down, so that no two harness modules import each other:
``harness.spec`` (the models and a TP rank's box), ``harness.files`` (checkpoints on disk),
``harness.measure`` (bytes, memory, collectives, the page cache), ``harness.loaders`` (each
method's load call). Their names are re-exported here, where the scripts import them.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
from pathlib import Path
from typing import Any

from harness import throttle as _throttle
from harness.files import (
    checkpoint_files,
    copy_checkpoint,
    node_copy,
    warm_files,
    write_hf_checkpoint,
    write_warmup_checkpoint,
)
from harness.loaders import METHODS, do_load, import_for
from harness.measure import (
    CollectiveCounter,
    MemorySampler,
    can_drop_caches,
    cpu_seconds,
    drop_page_cache,
    fadvise_dontneed,
    loader_probe,
    measure_disk_bandwidth,
    now,
    read_ahead_kb,
    read_bytes,
    readahead_probe,
    set_cache,
)
from harness.spec import GiB, MiB, ModelSpec, SmallSpec, box, spec_nbytes, warmup_spec

_box = box  # the name the scripts used before the spec moved down a module

__all__ = [
    "GiB", "MiB", "CollectiveCounter", "MemorySampler", "ModelSpec", "Run", "SmallSpec", "build_state_dict",
    "can_drop_caches", "checkpoint_files", "copy_checkpoint", "node_copy", "cpu_seconds", "drop_page_cache",
    "fadvise_dontneed", "loader_probe", "make_mesh", "measure_disk_bandwidth", "now", "rank_load",
    "read_ahead_kb", "read_bytes", "readahead_probe", "set_cache", "spec_nbytes", "verify_state_dict", "warm_files",
    "warmup_spec", "write_hf_checkpoint", "write_warmup_checkpoint",
]

@dataclasses.dataclass(frozen=True)
class Run:
    """One measured load. ``method``: one of ``harness.loaders.METHODS``.

    ``simulate_hosts``: each simulated node gets its own ``DCP_HOST_ID``, so dcp's "auto"
    mode sees the nodes as separate hosts (as on a cluster). ``fmt``: the files' format,
    ``hf`` (safetensors + index) or ``torch_dcp`` (torch.distributed.checkpoint's default
    writer). ``verify_dir``: the HF checkpoint holding the same tensors, to check the loaded
    values against (default: the node's own checkpoint, which must then be HF).
    ``cgroups``: blkio cgroup directories (``harness.throttle``); node k's ranks run the
    measured load inside ``cgroups[k]``, or all inside ``cgroups[0]`` when there is one.
    """

    method: str
    spec: ModelSpec | SmallSpec
    dp: int
    tp: int
    ckpt_dirs: tuple[str, ...]  # one per simulated node
    ranks_per_node: int
    cold: bool = False
    batch_bytes: int = 6 * MiB
    verify: bool = True
    sample_memory: bool = True
    warmup_dir: str | None = None  # a checkpoint of warmup_spec(spec), loaded first
    simulate_hosts: bool = False
    fmt: str = "hf"
    verify_dir: str | None = None
    cgroups: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        if self.fmt not in ("hf", "torch_dcp"):
            raise ValueError(f"unknown checkpoint format {self.fmt!r}: hf or torch_dcp")
        if self.fmt != "hf" and self.verify and self.verify_dir is None:
            raise ValueError(f"a {self.fmt} checkpoint is verified against an HF copy: give verify_dir")
        if self.cgroups and len(self.cgroups) not in (1, len(self.ckpt_dirs)):
            raise ValueError(f"{len(self.cgroups)} cgroups for {len(self.ckpt_dirs)} nodes: give one "
                             "per node (per-node link) or one for all (shared file system)")
        if len(self.ckpt_dirs) * self.ranks_per_node < self.dp * self.tp:
            raise ValueError(f"{len(self.ckpt_dirs)} node copies x {self.ranks_per_node} ranks "
                             f"cannot hold {self.dp * self.tp} ranks")


def make_mesh(run: Run, distributed: bool) -> Any:
    """A (dp, tp) DeviceMesh when tp > 1 (DTensors), else None (plain tensors, as in DDP)."""
    if not (distributed and run.tp > 1):
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (run.dp, run.tp), mesh_dim_names=("dp", "tp"))


def build_state_dict(spec: ModelSpec | SmallSpec, run: Run, rank: int, mesh: Any
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Poisoned (NaN) destinations for ``spec``: DTensors on ``mesh``, or plain tensors.

    Returns (state_dict, local tensors by name): the local tensors are the memory the load
    must fill.
    """
    import torch

    dtype = getattr(torch, spec.dtype)
    sd: dict[str, Any] = {}
    local: dict[str, Any] = {}
    tp_rank = mesh.get_local_rank("tp") if mesh is not None else rank % run.tp
    for name, shape, tp_dim in spec.tensors():
        _, sizes = box(shape, tp_dim, run.tp, tp_rank)
        t = torch.empty(sizes, dtype=dtype).fill_(float("nan"))
        local[name] = t
        if mesh is None:
            sd[name] = t
        else:
            from torch.distributed.tensor import DTensor, Replicate, Shard

            placement = Replicate() if tp_dim is None else Shard(tp_dim)
            stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
            sd[name] = DTensor.from_local(t, mesh, [Replicate(), placement], run_check=False,
                                          shape=torch.Size(shape), stride=stride)
    return sd, local


def verify_state_dict(run: Run, ckpt: str, local: dict[str, Any], tp_rank: int) -> int:
    """Compare every destination with the file contents; returns tensors checked."""
    import torch
    from safetensors import safe_open

    index = json.loads((Path(ckpt) / "model.safetensors.index.json").read_text())["weight_map"]
    handles: dict[str, Any] = {}
    bad: list[str] = []
    try:
        for name, shape, tp_dim in run.spec.tensors():
            fname = index[name]
            if fname not in handles:
                handles[fname] = safe_open(str(Path(ckpt) / fname), framework="pt")
            offsets, sizes = box(shape, tp_dim, run.tp, tp_rank)
            want = handles[fname].get_slice(name)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=False))]
            if not torch.equal(local[name], want):
                bad.append(name)
    finally:
        handles.clear()
    if bad:
        raise AssertionError(f"{run.method}: {len(bad)} tensors differ from the checkpoint "
                             f"after the load, first {bad[:3]}")
    return len(run.spec.tensors())


def _warm_up(run: Run, rank: int, mesh: Any, distributed: bool, tp_rank: int) -> None:
    """A load of a tiny checkpoint with the same structure first, by the same method:
    first-call costs (lazy imports, library code paged in after a cache drop) stay out of
    the measured load; both loaders get the same warm-up."""
    assert run.warmup_dir is not None
    wsd, wlocal = build_state_dict(warmup_spec(run.spec), run, rank, mesh)
    do_load(dataclasses.replace(run, spec=warmup_spec(run.spec)), wsd, wlocal, run.warmup_dir, distributed, tp_rank)


def rank_load(rank: int, world: int, run: Run) -> dict[str, Any]:
    """Entry point of every rank (module level so the launcher can pickle it)."""
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore")  # torch DCP warns about no_dist / HF reader details
    distributed = world > 1
    import_for(run.method)  # module loading is not measured
    node = rank // run.ranks_per_node
    ckpt = run.ckpt_dirs[node]
    if run.simulate_hosts:
        os.environ["DCP_HOST_ID"] = f"bench-node-{node}"  # read by dcp_load's "auto" mode
    stamps = {"start": now()}
    mesh = make_mesh(run, distributed)
    tp_rank = mesh.get_local_rank("tp") if mesh is not None else rank % run.tp
    stamps["mesh"] = now()
    if run.warmup_dir:
        _warm_up(run, rank, mesh, distributed, tp_rank)
    stamps["warmup"] = now()
    sd, local = build_state_dict(run.spec, run, rank, mesh)
    stamps["build"] = now()
    gc.collect()
    left = _throttle.join(run.cgroups[node % len(run.cgroups)]) if run.cgroups else None
    if distributed:
        dist.barrier()
    drop = None
    if run.cold:
        if rank == 0:
            drop = drop_page_cache(run.ckpt_dirs)
        if distributed:
            dist.barrier()
    counter = CollectiveCounter()
    sampler = MemorySampler() if run.sample_memory else None
    io0 = read_bytes()
    if sampler:
        sampler.__enter__()
    with counter:
        cpu0 = cpu_seconds()
        t0 = now()
        info = do_load(run, sd, local, ckpt, distributed, tp_rank)
        t1 = now()
        cpu1 = cpu_seconds()
    if sampler:
        sampler.__exit__(None, None, None)
    io1 = read_bytes()
    if left is not None:
        _throttle.leave(left)  # verification below is not throttled
    if distributed:
        dist.barrier()
    stamps["load"] = now()
    checked = verify_state_dict(run, run.verify_dir or ckpt, local, tp_rank) if run.verify else 0
    stamps["verify"] = now()
    dest = sum(t.numel() * t.element_size() for t in local.values())
    del sd, local
    return {
        "rank": rank, "node": node, "t0": t0, "t1": t1, "seconds": t1 - t0, "cpu_s": cpu1 - cpu0,
        "read_bytes": io1 - io0, "dest_bytes": dest, "collectives": dict(counter.counts),
        "data_collectives": counter.data_collectives,
        "collective_seconds": dict(counter.seconds), "drop": drop, "verified": checked,
        "memory": sampler.result if sampler else None, "stamps": stamps, **info,
    }

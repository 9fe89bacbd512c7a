"""Functions that run inside ranks for test_integ_repeat (not a test module).

4 gloo ranks load one checkpoint again and again, in one ``broadcast_replicated_tensors``
mode, on a DP2 x TP2 mesh: rows sharded over TP and replicated over DP (broadcast between
replicas when the mode says so), columns sharded (covering reads through staging), a
bfloat16 destination of a float32 tensor (a cast through staging), a tensor every rank
holds whole, and a value. Every destination is poisoned before each load and compared
with the truth after. After a warm-up each rank records its resident memory after every
round of loads.
"""

from __future__ import annotations

import os
from typing import Any

import torch

#: name -> global shape; float32 on disk. Big enough that casts and covering reads use
#: staging buffers (16 MiB pieces at most), small enough that 4 ranks load it ~10 times a second.
SHAPES = {"emb": (512, 1024), "col": (1024, 512), "cast": (256, 1024), "whole": (64, 512),
          **{f"layers.{i}.w": (128, 256) for i in range(32)}}
NAMES = sorted(SHAPES)


def full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919)
    return torch.randn(*SHAPES[name], generator=g)


def write(native: str, hf: str) -> None:
    """The checkpoint twice: dcp's native format (saved on one process) and one Hugging Face file."""
    import dcp_load
    from safetensors.torch import save_file

    state = {n: full(n) for n in NAMES}
    dcp_load.save({**state, "step": 7}, checkpoint_id=native, no_dist=True)
    os.makedirs(hf, exist_ok=True)
    save_file(state, os.path.join(hf, "model.safetensors"))


def _state(mesh: Any, with_value: bool) -> dict[str, Any]:
    """Poisoned destinations: NaN floats, and -1 for the value."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def poisoned(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full(SHAPES[name], float("nan"), dtype=dtype)

    out: dict[str, Any] = {
        "emb": distribute_tensor(poisoned("emb"), mesh, [Replicate(), Shard(0)], src_data_rank=None),
        "col": distribute_tensor(poisoned("col"), mesh, [Replicate(), Shard(1)], src_data_rank=None),
        "cast": distribute_tensor(poisoned("cast", torch.bfloat16), mesh, [Replicate(), Shard(0)],
                                  src_data_rank=None),
        "whole": poisoned("whole"),
        **{n: distribute_tensor(poisoned(n), mesh, [Replicate(), Shard(0)], src_data_rank=None)
           for n in SHAPES if n.startswith("layers.")},
    }
    if with_value:
        out["step"] = -1
    return out


def _wrong(state: dict[str, Any], with_value: bool) -> list[str]:
    from torch.distributed.tensor import distribute_tensor

    bad = []
    for name in NAMES:
        value = state[name]
        if hasattr(value, "to_local"):
            want = distribute_tensor(full(name).to(value.dtype), value.device_mesh, list(value.placements),
                                     src_data_rank=None).to_local()
            got = value.to_local()
        else:
            want, got = full(name), value
        if not torch.equal(got, want):
            bad.append(name)
    if with_value and state["step"] != 7:
        bad.append("step")
    return bad


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def memory() -> tuple[int, int]:
    """(VmRSS, RssAnon) of this process in bytes: all of its resident memory, and the part
    no file backs (what freed memory kept by the allocator shows in; code pages of the
    libraries touched for the first time add to VmRSS only)."""
    return _kib("VmRSS") * 1024, _kib("RssAnon") * 1024


def trimmed_anon() -> int:
    """RssAnon in bytes after glibc's ``malloc_trim(0)``: the memory the process still holds,
    free pages kept by the allocator given back (what a leak keeps and a trim cannot)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _kib("RssAnon") * 1024


def repeated(rank: int, world: int, paths: dict[str, str], modes: list[Any], rounds: int) -> dict[str, Any]:
    """A warm-up round, then ``rounds`` rounds; a round loads each of ``paths`` (format ->
    checkpoint) in each of ``modes`` once. Memory after the warm-up and after each round, and
    (``held``) after a trim made after the warm-up and after the last round only, so that the
    rounds between run under dcp's own trimming alone."""
    import dcp_load
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rss, anon, held, wrong = [], [], [], []
    for r in range(1 + rounds):
        for fmt, path in paths.items():
            for mode in modes:
                state = _state(mesh, with_value=fmt == "native")
                dcp_load.load(state, checkpoint_id=path, broadcast_replicated_tensors=mode)
                wrong += [f"round {r}, {fmt}, {mode!r}: {n}" for n in _wrong(state, fmt == "native")]
                del state
        now = memory()
        rss.append(now[0])
        anon.append(now[1])
        if r in (0, rounds):
            held.append(trimmed_anon())
    return {"rss": rss, "anon": anon, "held": held, "wrong": wrong}

"""The resharding case's checkpoint: FSDP-style, saved by torch.distributed.checkpoint itself.

Four gloo ranks each hold rows ``[k*n/4, (k+1)*n/4)`` of every tensor of the HF benchmark
checkpoint as a DTensor ``Shard(0)`` on a one-dimensional mesh of 4 (what FSDP2 keeps), and
call ``torch.distributed.checkpoint.save`` with its default ``FileSystemWriter``
(``__0_0.distcp`` .. ``__3_0.distcp`` + a pickled ``.metadata``). The values are the HF
checkpoint's, so a load from either is checked against the HF files.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

SAVE_RANKS = 4


def write_fsdp_checkpoint(launcher: Any, hf_dir: Path, out: Path, spec: Any, timeout: float) -> None:
    """Write ``out`` from ``hf_dir`` (both of ``spec``) unless it is there already."""
    marker = out / "bench-spec.json"
    want = json.dumps({"from": (hf_dir / "bench-spec.json").read_text(), "ranks": SAVE_RANKS,
                       "writer": "torch.distributed.checkpoint.FileSystemWriter"}, sort_keys=True)
    if marker.exists() and marker.read_text() == want:
        return
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    launcher.run(rank_save, SAVE_RANKS, str(hf_dir), str(out), spec, timeout=timeout)
    os.sync()
    marker.write_text(want)


def rank_save(rank: int, world: int, hf_dir: str, out: str, spec: Any) -> int:
    """One FSDP rank: read its rows from the HF files, save them with torch DCP."""
    import torch
    import torch.distributed.checkpoint as tdcp
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    index = json.loads((Path(hf_dir) / "model.safetensors.index.json").read_text())["weight_map"]
    handles: dict[str, Any] = {}
    sd: dict[str, Any] = {}
    for name, shape, _ in spec.tensors():
        if shape[0] % world:
            raise ValueError(f"{name}: dim 0 of {shape} does not divide by {world} FSDP ranks")
        rows = shape[0] // world
        f = index[name]
        if f not in handles:
            handles[f] = safe_open(str(Path(hf_dir) / f), framework="pt")
        local = handles[f].get_slice(name)[rank * rows:(rank + 1) * rows].clone()
        stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
        sd[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                      shape=torch.Size(shape), stride=stride)
    handles.clear()
    tdcp.save(sd, checkpoint_id=out)
    return sum(t.to_local().numel() * t.to_local().element_size() for t in sd.values())


"""Benchmark checkpoints on disk: written from a spec, copied per simulated node, warmed.

``write_hf_checkpoint`` writes a ``harness.spec`` model as Hugging Face safetensors shards and
reuses files written from the same spec (a ``bench-spec.json`` marker, written last).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path

from harness.spec import ITEMSIZE, MiB, ModelSpec, SmallSpec, spec_nbytes, warmup_spec


def write_hf_checkpoint(path: Path, spec: ModelSpec | SmallSpec, seed: int = 0) -> int:
    """Write ``spec`` as HF safetensors shards plus ``model.safetensors.index.json``.

    Reuses an existing checkpoint written from the same spec (a ``bench-spec.json``
    marker is written last). Returns the bytes of tensor data.
    """
    import torch
    from safetensors.torch import save_file

    marker = path / "bench-spec.json"
    want = json.dumps({"type": type(spec).__name__, **dataclasses.asdict(spec), "seed": seed},
                      sort_keys=True)
    if marker.exists() and marker.read_text() == want:
        return spec_nbytes(spec)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    dtype = getattr(torch, spec.dtype)
    gen = torch.Generator().manual_seed(seed)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape, _ in spec.tensors():
        nb = math.prod(shape) * ITEMSIZE[spec.dtype]
        if groups[-1] and size + nb > spec.file_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nb
    weight_map: dict[str, str] = {}
    total = 0
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in group}
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del tensors
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    os.sync()
    marker.write_text(want)
    return total


def write_warmup_checkpoint(workdir: Path, spec: ModelSpec | SmallSpec) -> str:
    """The tiny checkpoint each rank loads before the measured load (see rank_load)."""
    import hashlib

    tag = hashlib.sha1(repr(spec).encode()).hexdigest()[:8]  # quick and full runs apart
    path = workdir / f"warmup-{type(spec).__name__.lower()}-{tag}"
    write_hf_checkpoint(path, warmup_spec(spec), seed=1)
    return str(path)


def checkpoint_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and p.name != "bench-spec.json")


def node_copy(root: Path, node: int) -> Path:
    """Where simulated node ``node`` keeps its copy of ``root``: ``node<k>/<root's name>``
    beside it, the same directory name on every node, as a cluster's nodes mount one path
    (dcp tells checkpoints without checksums apart by their directory's name)."""
    return root if node == 0 else root.parent / f"node{node}" / root.name


def copy_checkpoint(src: Path, dst: Path) -> None:
    """A byte-identical copy: a simulated node's own copy of the files."""
    marker = src / "bench-spec.json"
    if (dst / "bench-spec.json").exists() and (dst / "bench-spec.json").read_text() == marker.read_text():
        return
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in checkpoint_files(src):
        shutil.copyfile(f, dst / f.name)
    os.sync()
    shutil.copyfile(marker, dst / "bench-spec.json")


def warm_files(path: Path) -> None:
    """Pull every file of ``path`` into the page cache."""
    buf = bytearray(16 * MiB)
    for f in checkpoint_files(path):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass

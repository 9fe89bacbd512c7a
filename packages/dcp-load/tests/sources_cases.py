"""Helpers for the ``sources=`` tests: random saved chunkings written in the native format,
compositions evaluated on whole tensors (the reference), and a reader that counts every
stored element it reads."""

from __future__ import annotations

import os
from typing import Any

import torch
from dcp_load import Concat, Slice, Stack
from dcp_reader import CheckpointMetadata, ChunkMeta, NativeWriter, TensorMeta, chunk_key


def grid(shape: tuple[int, ...], cuts: list[list[int]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the cells of ``shape`` cut at ``cuts[d]`` along each dim d."""
    bounds = [sorted({0, n, *(c for c in cs if 0 < c < n)}) for n, cs in zip(shape, cuts, strict=True)]
    cells: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), ())]
    for b in bounds:
        cells = [(o + (lo,), s + (hi - lo,)) for o, s in cells for lo, hi in zip(b, b[1:], strict=False)]
    return cells


def box(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
        t = t.narrow(d, o, s)
    return t


def write_chunked(path: str, full: dict[str, torch.Tensor], cuts: dict[str, list[list[int]]], files: int = 2) -> None:
    """A native checkpoint holding each tensor of ``full`` in the chunks of its grid,
    dealt round robin over ``files`` data files."""
    os.makedirs(path, exist_ok=True)
    w = NativeWriter(path)
    per_file: dict[str, dict[str, torch.Tensor]] = {}
    tensors = {}
    n = 0
    for name, t in full.items():
        chunks = []
        for offsets, sizes in grid(tuple(t.shape), cuts[name]):
            file = f"data-{n % files}.safetensors"
            n += 1
            key = chunk_key(name, offsets)
            per_file.setdefault(file, {})[key] = box(t, offsets, sizes).contiguous()
            chunks.append(ChunkMeta(offsets, sizes, file, key))
        dtype = str(t.dtype).removeprefix("torch.")
        tensors[name] = TensorMeta(name, tuple(t.shape), dtype, tuple(chunks))
    for file, part in per_file.items():
        w.write_file(file, part)
    w.commit(CheckpointMetadata(tensors=tensors, values={}, format="native"))


def evaluate(source: Any, full: dict[str, torch.Tensor]) -> torch.Tensor:
    """What ``source`` means, computed on whole tensors with torch."""
    if isinstance(source, str):
        return full[source]
    if isinstance(source, Slice):
        return evaluate(source.source, full).narrow(source.dim, source.start, source.stop - source.start)
    parts = [evaluate(p, full) for p in source.parts]
    if isinstance(source, Stack):
        return torch.stack(parts, source.dim)
    assert isinstance(source, Concat)
    blocks = [p.chunk(source.groups, source.dim) for p in parts]
    return torch.cat([b[k] for k in range(source.groups) for b in blocks], source.dim)


class CountingReader:
    """Wraps a ``CheckpointReader``; ``counts[name]`` (an int64 tensor of the saved shape)
    is how many times each stored element was read. Siblings share the counts."""

    def __init__(self, inner: Any, counts: dict[str, torch.Tensor] | None = None):
        self.inner = inner
        self.counts = counts if counts is not None else {
            n: torch.zeros(t.shape, dtype=torch.int64) for n, t in inner.metadata.tensors.items()}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def bytes_read(self) -> int:
        return self.inner.bytes_read

    def sibling(self) -> CountingReader:
        return CountingReader(self.inner.sibling(), self.counts)

    def _count(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        box(self.counts[name], offsets, sizes).add_(1)

    def read(self, name, chunk, offsets, sizes, **kw):
        self._count(name, offsets, sizes)
        return self.inner.read(name, chunk, offsets, sizes, **kw)

    def read_into(self, name, chunk, offsets, sizes, out, **kw):
        self._count(name, offsets, sizes)
        return self.inner.read_into(name, chunk, offsets, sizes, out, **kw)

    def close(self) -> None:
        self.inner.close()


def expected_counts(sources: list[Any], full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """How many times each stored element is needed by ``sources`` (each read whole)."""
    ids, base = {}, 0
    for name, t in full.items():
        ids[name] = torch.arange(base, base + t.numel(), dtype=torch.int64).reshape(t.shape)
        base += t.numel()
    used = torch.cat([evaluate(s, ids).reshape(-1) for s in sources]) if sources else torch.zeros(0, dtype=torch.int64)
    flat = torch.bincount(used, minlength=base)
    out, base = {}, 0
    for name, t in full.items():
        out[name] = flat[base:base + t.numel()].reshape(t.shape)
        base += t.numel()
    return out

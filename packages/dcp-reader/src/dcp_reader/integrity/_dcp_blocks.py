"""Block checksums of torch DCP chunks that dcp wrote (``dcp-checksums.json``).

A chunk's blocks are counted from the first byte of the tensor's data inside its torch.save
blob (file offset ``storage[0] + layout.start``) over its ``numel * itemsize`` bytes, as
for a safetensors entry: the reader reads and verifies the whole blocks a box touches
(``read_verified``, hashed on the reader's ``HashWorker``), each block once per reader.
dcp writes every chunk row-major; a layout whose box reaches past those bytes (another
torch's strides, a tampered blob) cannot be checked and is a MetadataError.
"""

from __future__ import annotations

import math
from typing import Any

from .._dtypes import itemsize, numpy_bits_dtype
from .._errors import MetadataError
from ..formats._torch_save_box import _span
from ..formats._torch_save_zip import BlobTensor
from ._checksum import BlockSums, _xxh3, read_verified
from ._hash_worker import HashWorker

__all__ = ["check_loaded", "chunk_key", "inside", "read_box_verified", "verify_chunk"]


def chunk_key(name: str, offsets: tuple[int, ...]) -> str:
    """How errors name a torch DCP chunk: ``"w@0,128"`` (as native chunk keys)."""
    return f"{name}@{','.join(map(str, offsets))}"


def inside(hi: int, nbytes: int, *, path: str, name: str) -> None:
    """MetadataError when a box's bytes reach past the chunk's ``nbytes`` checksummed bytes."""
    if hi > nbytes:
        raise MetadataError(f"the blob of {name!r} lays its tensor out past its {nbytes} bytes (to byte {hi}): "
                            "dcp writes row-major chunks, so the blob does not match its checksums; the file "
                            "is corrupt: re-copy or re-save it", path=path, key=name)


def _row_major_ones(sizes: tuple[int, ...], strides: tuple[int, ...], width: int) -> tuple[int, ...]:
    """``strides`` with those of size-1 dims made row-major (torch's ``.view(dtype)`` then
    takes a (1, 1) box of a transposed tensor)."""
    row_major = [width] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        row_major[d] = row_major[d + 1] * sizes[d + 1]
    return tuple(rm if n == 1 else st for n, st, rm in zip(sizes, strides, row_major, strict=True))


def read_box_verified(fd: Any, base: int, t: BlobTensor, slices: tuple[slice, ...], sums: BlockSums, *,
                      worker: HashWorker | None, path: str, key: str, name: str,
                      counts: dict[str, int]) -> tuple[Any, int] | None:
    """(numpy array of the box, the box's bytes) read as the whole blocks it touches and
    verified (ChecksumError naming file and tensor); None when every block it touches was
    verified already, or it is empty (the caller reads it as usual). ``base``: the file
    offset of the tensor's first byte."""
    import numpy as np

    width = itemsize(t.dtype)
    sizes, lo, hi, _ = _span(t, slices, width)
    nbytes = math.prod(t.shape) * width
    if hi == lo or sums.done(lo, hi):
        return None
    inside(hi, nbytes, path=path, name=name)
    a, b = sums.span(lo, hi, nbytes)
    buf = np.empty(b - a, dtype=np.uint8)
    read_verified(fd, buf, base + a, a, sums, worker=worker, path=path, key=key, name=name)
    counts["narrowed" if t.c_contiguous else "strided"] += 1
    strides = _row_major_ones(sizes, tuple(st * width for st in t.stride), width)
    arr = np.ndarray(sizes, dtype=numpy_bits_dtype(t.dtype), buffer=buf, offset=lo - a, strides=strides)
    return arr, math.prod(sizes) * width


def verify_chunk(fd: Any, base: int, nbytes: int, sums: BlockSums, *, worker: HashWorker | None, path: str,
                 key: str, name: str, window_blocks: int = 16) -> int:
    """Verify every block of a chunk's ``nbytes`` bytes at file offset ``base`` (ChecksumError
    at the first bad one), ``window_blocks`` blocks at a time into one reused buffer; the
    bytes checked."""
    window = sums.block * window_blocks
    buf = memoryview(bytearray(min(window, nbytes)))
    for lo in range(0, nbytes, window):
        read_verified(fd, buf[:min(window, nbytes - lo)], base + lo, lo, sums, worker=worker, path=path, key=key,
                      name=name)
    return nbytes


def check_loaded(tensor: Any, sums: BlockSums, *, path: str, key: str, name: str) -> None:
    """Verify the blocks of a tensor torch.load gave (a blob loaded whole: its layout could
    not be read in place) over its row-major bytes."""
    import torch

    flat = tensor.contiguous().reshape(-1)
    view = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
    for i, lo in enumerate(range(0, len(view), sums.block)):
        if i not in sums.verified:
            block = view[lo:lo + sums.block]
            sums.check(i, _xxh3(block), len(block), path=path, key=key, name=name)

"""Where every byte of a converted checkpoint goes, computed before anything is read.

Output tensors are assigned in name order to files of at most ``max_shard_bytes`` (header
included), and inside a file placed larger elements first so that each starts at a multiple
of its element size; a tensor larger than that gets a file of its own (a safetensors tensor cannot be
split). Each file's safetensors header is final before its data is written, so the file can
be preallocated and filled in place, in any order, by any worker.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["OutFile", "OutTensor", "cast_dtype", "file_names", "layout_files", "parse_size"]

#: transformers' ``save_pretrained`` default shard size.
DEFAULT_SHARD_BYTES = 5 * 10**9

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")

#: --dtype spellings users type, to neutral names.
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32", "fp64": "float64", "double": "float64"}
FLOATING = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5 * 10**9, ``"2GiB"`` -> 2 * 2**30, ``"500MB"``, ``"1024"`` (bytes)."""
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = _SIZE.match(str(text))
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"shard size {text!r} is not a size: write it as 5GB, 500MB, 2GiB or a number of "
                             "bytes (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"shard size must be positive, got {text!r}")
    return n


def cast_dtype(name: str | None) -> str | None:
    """A --dtype value as a neutral floating dtype name (``bf16`` -> ``bfloat16``)."""
    if name is None:
        return None
    import torch

    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    neutral = _DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if neutral not in FLOATING:
        raise ValueError(f"dtype {name!r} is not a floating dtype; --dtype casts floating tensors only: use one "
                         f"of {sorted(FLOATING)} (or bf16, fp16, fp32)")
    return neutral


@dataclass(frozen=True)
class OutTensor:
    """One output tensor: its name, shape, output dtype and its key in the file."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    key: str

    @property
    def nbytes(self) -> int:
        from dcp_reader._dtypes import itemsize

        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class OutFile:
    """One output file: its final name, its header (padded), and each tensor's byte range
    inside the data section."""

    name: str
    header: bytes
    tensors: tuple[tuple[OutTensor, int, int], ...]

    @property
    def data_start(self) -> int:
        return 8 + len(self.header)

    @property
    def data_bytes(self) -> int:
        return self.tensors[-1][2] if self.tensors else 0

    @property
    def size(self) -> int:
        return self.data_start + self.data_bytes


def _entry(t: OutTensor, begin: int, end: int) -> str:
    from dcp_reader._dtypes import to_safetensors

    return json.dumps({t.key: {"dtype": to_safetensors(t.dtype), "shape": list(t.shape),
                               "data_offsets": [begin, end]}}, separators=(",", ":"))[1:-1]


def _header(meta: Mapping[str, str], placed: Sequence[tuple[OutTensor, int, int]]) -> bytes:
    head = json.dumps({"__metadata__": dict(meta)}, separators=(",", ":"))[:-1]
    text = ",".join([head[1:], *(_entry(*p) for p in placed)])
    raw = ("{" + text + "}").encode()
    return raw + b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes


def _itemsize(t: OutTensor) -> int:
    from dcp_reader._dtypes import itemsize

    return itemsize(t.dtype)


def _placed(group: Sequence[OutTensor]) -> list[tuple[OutTensor, int, int]]:
    """The tensors of one file in data order: larger elements first, then by name (as
    safetensors' own writer orders them). The data section starts 8-byte aligned and holds
    no gaps (safetensors refuses holes), so each tensor then starts at a multiple of its
    element size: a zero-copy loader may ``view`` the mapping as its dtype."""
    out, pos = [], 0
    for t in sorted(group, key=lambda t: (-_itemsize(t), t.name)):
        out.append((t, pos, pos + t.nbytes))
        pos += t.nbytes
    return out


def layout_files(tensors: Sequence[OutTensor], max_shard_bytes: int, meta: Mapping[str, str]) -> list[OutFile]:
    """Files in order, tensors assigned to them in name order, each file at most
    ``max_shard_bytes`` bytes (header included) unless it holds a single larger tensor;
    inside a file, tensors in data order (``_placed``). Names are given by ``file_names``
    afterwards, once the count is known."""
    base = len(json.dumps({"__metadata__": dict(meta)}, separators=(",", ":"))) + 8 + 7
    # a header entry is sized with offsets as long as the file's largest: the data order is
    # known only once the file's tensors are
    widest = max(max_shard_bytes, max((t.nbytes for t in tensors), default=0))
    groups: list[list[OutTensor]] = [[]]
    size = base
    for t in sorted(tensors, key=lambda t: t.name):
        add = t.nbytes + len(_entry(t, widest, widest)) + 1
        if groups[-1] and size + add > max_shard_bytes:
            groups.append([])
            size = base
        groups[-1].append(t)
        size += add
    names = file_names(len(groups))
    out = []
    for name, group in zip(names, groups, strict=True):
        placed = _placed(group)
        out.append(OutFile(name, _header(meta, placed), tuple(placed)))
    for f in out:
        assert len(f.tensors) == 1 or f.size <= max_shard_bytes, (f.name, f.size)
    return out


def file_names(n: int) -> list[str]:
    """``model-00001-of-00003.safetensors``..., as transformers names its shards."""
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def oversized(files: Sequence[OutFile], max_shard_bytes: int) -> list[Any]:
    """(file, its tensor) of each file over the limit (a single tensor larger than it)."""
    return [(f.name, f.tensors[0][0].name, f.size) for f in files if f.size > max_shard_bytes]

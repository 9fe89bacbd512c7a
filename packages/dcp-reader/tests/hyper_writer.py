"""Writes checkpoints in hyper-parallel's format for the tests (not a test module).

Built from the format's description alone (dcp-reader's README, "hyper-parallel"), without
importing hyper-parallel or any dcp package: the classes below are named like the seed's
and, while a checkpoint is written, registered as the modules
``hyper_parallel.core.distributed_checkpoint.metadata`` / ``.storage`` so that pickle
records those paths. Data files are written by ``safetensors`` (torch tensors, or numpy
arrays with MindSpore's dtype names) or by ``mindspore.save_checkpoint``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import types
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

HP = "hyper_parallel.core.distributed_checkpoint"


@dataclass(frozen=True)
class MetadataIndex:
    fqn: str
    offset: tuple = field(default_factory=tuple)
    index: int | None = field(default=None, compare=False, hash=False)


@dataclass(frozen=True)
class ChunkStorageMetadata:
    offsets: tuple
    sizes: tuple


@dataclass(frozen=True)
class TensorProperties:
    dtype: str
    requires_grad: bool = False
    memory_format: str | None = None


@dataclass
class BytesStorageMetadata:
    pass


@dataclass(frozen=True)
class TensorStorageMetadata:
    properties: TensorProperties
    size: tuple
    chunks: list = field(default_factory=list)


@dataclass
class Metadata:
    state_dict_metadata: dict
    planner_data: Any = None
    storage_data: dict | None = None
    version: str = "1.0"


@dataclass
class StorageInfo:
    relative_path: str
    offset: int
    length: int
    tensor_key: str | None = None


_CLASSES = {"metadata": (MetadataIndex, ChunkStorageMetadata, TensorProperties, BytesStorageMetadata,
                         TensorStorageMetadata, Metadata), "storage": (StorageInfo,)}


@contextlib.contextmanager
def seed_modules() -> Iterator[None]:
    """The seed's module paths in sys.modules (parents too: pickle imports the full path)."""
    added = []
    parts = HP.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name)
            added.append(name)
    for sub, classes in _CLASSES.items():
        mod = types.ModuleType(f"{HP}.{sub}")
        for cls in classes:
            cls.__module__ = mod.__name__
            setattr(mod, cls.__name__, cls)
        sys.modules[mod.__name__] = mod
        added.append(mod.__name__)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def dump_metadata(md: Any, file: str, protocol: int | None = None) -> None:
    with seed_modules(), open(file, "wb") as f:
        pickle.dump(md, f, protocol=protocol)


def tensor_keys(fqns: Sequence[str]) -> list[str]:
    """The safetensors key of each of one rank's chunks (in order): the fqn, or
    ``{fqn}.__dcp_chunk_{i}`` with ``_`` appended until it collides with nothing."""
    counts = Counter(fqns)
    used: set[str] = set()
    nxt: dict[str, int] = {}
    out = []
    for fqn in fqns:
        key = fqn
        if counts[fqn] > 1:
            i = nxt.get(fqn, 0)
            nxt[fqn] = i + 1
            key = f"{fqn}.__dcp_chunk_{i}"
            while key in counts or key in used:
                key += "_"
        used.add(key)
        out.append(key)
    return out


def dtype_name(t: Any) -> str:
    """The dtype string the seed records: str(dtype) ("torch.bfloat16", "Float32")."""
    if type(t).__module__.startswith("numpy"):
        return {"float32": "Float32", "float64": "Float64", "float16": "Float16", "int64": "Int64",
                "int32": "Int32", "int8": "Int8", "uint8": "UInt8", "bool": "Bool"}[str(t.dtype)]
    return str(t.dtype)


def _save_tensors(tensors: dict[str, Any], file: str, framework: str) -> None:
    if framework == "torch":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, file)
    elif framework == "numpy":  # what a MindSpore save looks like, without MindSpore
        import numpy as np
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, file, metadata={"format": "ms"})
    else:
        import mindspore as ms

        params = {k: ms.Parameter(v, name=k) for k, v in tensors.items()}
        ms.save_checkpoint(save_obj=params, ckpt_file_name=file, format="safetensors")


def _is_chunks(v: Any) -> bool:
    """[(offsets, tensor), ...]: a tensor's chunks; anything else is a value."""
    return isinstance(v, list) and bool(v) and all(
        isinstance(p, tuple) and len(p) == 2 and hasattr(p[1], "shape") for p in v)


def write_checkpoint(path: str | os.PathLike[str], ranks: Mapping[int, Mapping[str, Any]],
                     shapes: Mapping[str, tuple[int, ...]], *, per_rank: bool = False,
                     framework: str = "torch", tensor_key: bool = True,
                     planner_data: Mapping[str, Any] | None = None) -> None:
    """Write ``ranks``: rank -> {fqn: [(offsets, tensor), ...] for tensors, or any value}.

    ``shapes``: fqn -> global shape. ``per_rank``: write ``{rank}.metadata`` per rank (a save
    without collectives) instead of one ``.metadata``. ``tensor_key=False``: omit
    ``StorageInfo.tensor_key`` where the key is the fqn."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    metas = []
    for rank, items in ranks.items():
        sd_meta: dict[str, Any] = {}
        storage: dict[Any, Any] = {}
        chunks = [(fqn, off, t) for fqn, v in items.items() if _is_chunks(v) for off, t in v]
        data_file = f"_rank{rank}_.safetensors"
        keys = tensor_keys([fqn for fqn, _, _ in chunks])
        if chunks:
            _save_tensors({k: t for k, (_, _, t) in zip(keys, chunks, strict=True)}, os.path.join(path, data_file),
                          framework)
        for key, (fqn, off, t) in zip(keys, chunks, strict=True):
            md = sd_meta.setdefault(fqn, TensorStorageMetadata(TensorProperties(dtype_name(t)), shapes[fqn], []))
            md.chunks.append(ChunkStorageMetadata(tuple(off), tuple(t.shape)))
            idx = MetadataIndex(fqn, tuple(off), len(md.chunks) - 1)
            storage[idx] = StorageInfo(data_file, 0, -1, key if (tensor_key or key != fqn) else None)
        values = {fqn: v for fqn, v in items.items() if not _is_chunks(v)}
        if values:
            bytes_file = f"_rank{rank}_.bytes"
            with open(os.path.join(path, bytes_file), "wb") as f:
                for fqn, v in values.items():
                    payload = pickle.dumps(v)
                    storage[MetadataIndex(fqn)] = StorageInfo(bytes_file, f.tell(), len(payload))
                    f.write(payload)
                    sd_meta[fqn] = BytesStorageMetadata()
        metas.append((rank, sd_meta, storage))
    if per_rank:
        for rank, sd_meta, storage in metas:
            dump_metadata(Metadata(sd_meta, dict(planner_data or {}), storage), os.path.join(path, f"{rank}.metadata"))
        return
    merged: dict[str, Any] = {}
    storage_all: dict[Any, Any] = {}
    for _, sd_meta, storage in metas:
        for fqn, md in sd_meta.items():
            if fqn in merged and isinstance(md, TensorStorageMetadata):
                merged[fqn].chunks.extend(md.chunks)
            else:
                merged[fqn] = md
        storage_all.update(storage)
    dump_metadata(Metadata(merged, dict(planner_data or {}), storage_all), os.path.join(path, ".metadata"))

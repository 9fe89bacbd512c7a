"""torch.distributed.checkpoint's default format: a pickled ``.metadata`` plus ``*.distcp``.

The pickle is read by ``_unpickle._RestrictedUnpickler``: an allow-list of names, each
resolved to an inert stand-in, with bounds on memo indices and on the elements built (no
torch code runs, and torch is not even imported). Tensor payloads are torch.save blobs at
(offset, length) in a .distcp file: the reader reads boxes of them narrowed in the file
(``_torch_save_zip``, ``_torch_save_box``); ``load_blob`` (``torch.load(weights_only=True)``)
reads values and the blobs that cannot be narrowed.
"""

from __future__ import annotations

import io
import os
from typing import Any

from .._dtypes import DTYPE_NAMES
from .._errors import (
    CheckpointError,
    MetadataError,
    MissingFileError,
    MissingMetadataError,
    TruncatedFileError,
    UnknownDtypeError,
    short_repr,
    summarise,
)
from .._model import CheckpointMetadata, ChunkMeta, TensorMeta, ValueMeta
from ..storage._names import METADATA_LIMIT
from ..storage._pread import pread_into
from ..storage._roots import check_files, file_size, read_regular
from ._torch_save_zip import check_blob_pickles
from ._unpickle import _ALLOWED, _TORCH_DTYPES, _Dtype, _Record, _RestrictedUnpickler

# Re-exported: readers of other pickled formats subclass _RestrictedUnpickler from here.
__all__ = ["METADATA_FILE", "_ALLOWED", "_TORCH_DTYPES", "_Dtype", "_Record", "_RestrictedUnpickler",
           "load_blob", "load_torch_dcp"]

METADATA_FILE = ".metadata"
_DCP = "torch.distributed.checkpoint"


def _neutral(dtype: Any, path: str, fqn: str) -> str:
    name = dtype.name if isinstance(dtype, _Dtype) else None
    aliases = {"half": "float16", "float": "float32", "double": "float64", "long": "int64", "int": "int32",
               "short": "int16", "cfloat": "complex64"}
    name = aliases.get(name, name) if name else None
    if name not in DTYPE_NAMES:
        raise UnknownDtypeError(f"tensor {fqn!r} has dtype {short_repr(dtype)}, which dcp-reader cannot represent; "
                                "convert it when saving", path=path, key=fqn)
    return name


_STRUCTURE_ERRORS = (AttributeError, TypeError, ValueError, IndexError, KeyError, RecursionError)


def _unpickle_metadata(root_real: str, path: str) -> Any:
    try:
        data = read_regular(root_real, METADATA_FILE, limit=METADATA_LIMIT, key=METADATA_FILE)
    except MissingFileError:
        raise MissingMetadataError(f"{METADATA_FILE} is missing: an incomplete torch.distributed.checkpoint "
                                   "save (it writes .metadata last); re-run the save", path=root_real,
                                   key=METADATA_FILE) from None
    try:
        md = _RestrictedUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed pickle: report, never propagate half-built state
        raise MetadataError(f"cannot read the pickled metadata ({type(e).__name__}: {str(e)[:200]}); the file "
                            "is corrupt or from an unsupported torch version", path=path) from None
    if getattr(md, "qualname", None) != f"{_DCP}.metadata.Metadata":
        raise MetadataError(f"the pickle holds {type(md).__name__}, not a Metadata", path=path)
    return md


def _storage_index(md: Any) -> dict[tuple[str, tuple[int, ...] | None], Any]:
    where: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for idx, info in (md.get("storage_data", 2) or {}).items():
        off = idx.get("offset", 1)
        where[(idx.get("fqn", 0), tuple(off) if off is not None else None)] = info
    return where


def _entries(md: Any, path: str) -> tuple[dict[str, TensorMeta], dict[str, ValueMeta]]:
    where = _storage_index(md)
    tensors: dict[str, TensorMeta] = {}
    values: dict[str, ValueMeta] = {}
    problems: list[CheckpointError] = []

    def loc(fqn: str, offsets: tuple[int, ...] | None) -> tuple[str, tuple[int, int]]:
        info = where.get((fqn, offsets))
        if info is None:
            raise MetadataError(f"no storage entry for {fqn!r} at offsets {short_repr(offsets)}", path=path,
                                key=fqn)
        td = info.get("transform_descriptors", 3)
        if td:
            raise MetadataError(f"{fqn!r} is stored with transforms {short_repr(td, 100)} (e.g. compression), which "
                                "dcp-reader does not support; re-save without them", path=path, key=fqn)
        return info.get("relative_path", 0), (info.get("offset", 1), info.get("length", 2))

    for fqn, m in (md.get("state_dict_metadata", 0) or {}).items():
        if not isinstance(fqn, str):  # before it is formatted into any message
            raise MetadataError(f"state_dict_metadata has a key {short_repr(fqn)}, not a str: the file is "
                                "corrupt; copy it again or re-save the checkpoint", path=path)
        try:
            q = getattr(m, "qualname", "")
            if q.endswith(".BytesStorageMetadata"):
                file, st = loc(fqn, None)
                values[fqn] = ValueMeta(name=fqn, file=file, key=fqn, storage=st)
                continue
            if not q.endswith(".TensorStorageMetadata"):
                raise MetadataError(f"{fqn!r} has metadata of type {q or type(m).__name__}", path=path, key=fqn)
            dtype = _neutral(m.get("properties", 0).get("dtype", 0), path, fqn)
            chunks = []
            for c in m.get("chunks", 2):
                offsets = tuple(c.get("offsets", 0))
                file, st = loc(fqn, offsets)
                chunks.append(ChunkMeta(offsets=offsets, sizes=tuple(c.get("sizes", 1)), file=file,
                                        key=fqn, storage=st))
            tensors[fqn] = TensorMeta(name=fqn, shape=tuple(m.get("size", 1)), dtype=dtype, chunks=tuple(chunks))
        except CheckpointError as e:
            problems.append(e.with_path(path))
    if problems:
        first = problems[0]
        raise type(first)(f"{len(problems)} problem(s) in the metadata: "
                          f"{summarise([p.message for p in problems])}", path=path, key=first.key,
                          offenders=[p.key or "" for p in problems])
    return tensors, values


def check_storage(root_real: str, stored: list[tuple[str, str, tuple[int, int]]]) -> None:
    """Every (file, name, (offset, length)) lies inside its file (one ``stat`` per file) and no
    two overlap in one file: what can be checked before any byte is read or written."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for file, name, (off, length) in stored:
        by_file.setdefault(file, []).append((off, off + length, name))
    past: list[tuple[str, str]] = []
    overlap: list[tuple[str, str]] = []
    for file, ranges in by_file.items():
        size = file_size(root_real, file, key=ranges[0][2] if ranges else None)
        ranges.sort()
        prev_end, prev_name = 0, None
        for start, end, name in ranges:
            if end > size:
                past.append((name, f"{name!r} at bytes [{start}, {end}) of {file!r} ({size} bytes)"))
            if start < prev_end and end > start:
                overlap.append((name, f"{name!r} at [{start}, {end}) overlaps {prev_name!r} in {file!r}"))
            if end > prev_end:
                prev_end, prev_name = end, name
    if past:
        raise TruncatedFileError(f"{len(past)} stored item(s) lie past the end of their file: "
                                 f"{summarise([m for _, m in past])}. The file is truncated or the metadata "
                                 "is wrong: re-copy or re-save the checkpoint", path=root_real,
                                 key=past[0][0], offenders=[n for n, _ in past])
    if overlap:
        raise MetadataError(f"{len(overlap)} stored item(s) overlap another in the same file: "
                            f"{summarise([m for _, m in overlap])}; the metadata is corrupt: re-save it",
                            path=root_real, key=overlap[0][0], offenders=[n for n, _ in overlap])


def load_torch_dcp(root_real: str, *, check: bool = True) -> CheckpointMetadata:
    """The metadata of a torch DCP checkpoint, with every file checked (inside the directory,
    regular) and every stored byte range checked against its file's size, before any read
    (``check=False``: not checked; ``verify`` checks each file on its own)."""
    path = os.path.join(root_real, METADATA_FILE)
    md = _unpickle_metadata(root_real, path)
    try:
        tensors, values = _entries(md, path)
    except _STRUCTURE_ERRORS as e:
        raise MetadataError(f"unexpected metadata structure ({type(e).__name__}: {str(e)[:200]})",
                            path=path) from None
    files = [(c.file, n) for n, t in tensors.items() for c in t.chunks]
    files += [(v.file, n) for n, v in values.items() if v.file]
    if check:
        check_files(root_real, files)
        check_storage(root_real, stored_ranges(tensors, values))
    try:
        return CheckpointMetadata(tensors=tensors, values=values, format="torch-dcp")
    except CheckpointError as e:
        raise e.with_path(path) from None


def stored_ranges(tensors: dict[str, TensorMeta], values: dict[str, ValueMeta]
                  ) -> list[tuple[str, str, tuple[int, int]]]:
    """(file, name, (offset, length)) of every stored chunk and value."""
    stored = [(c.file, n, c.storage) for n, t in tensors.items() for c in t.chunks if c.storage is not None]
    return stored + [(v.file, n, v.storage) for n, v in values.items() if v.file and v.storage is not None]


def load_blob(fd: int, storage: tuple[int, int], *, path: str, key: str, weights_only: bool = True) -> Any:
    """torch.load of the torch.save blob at ``storage`` in the open file ``fd``, its pickles
    checked first (``check_blob_pickles``: UnsafePickleError, MetadataError); a short read
    is TruncatedFileError, anything torch.load raises is left to the caller."""
    import torch

    offset, length = storage
    buf = bytearray(length)
    pread_into(fd, buf, offset, path=path, key=key)
    check_blob_pickles(fd, offset, length, buf, path=path, key=key)
    return torch.load(io.BytesIO(buf), map_location="cpu", weights_only=weights_only)

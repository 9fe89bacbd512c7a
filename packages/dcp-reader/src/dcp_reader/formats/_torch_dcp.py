"""torch.distributed.checkpoint's default format: a pickled ``.metadata`` plus ``*.distcp``.

The pickle is read by ``_unpickle._RestrictedUnpickler``: an allow-list of names, each
resolved to an inert stand-in, with bounds on memo indices and on the elements built (no
torch code runs, and torch is not even imported). Tensor payloads are torch.save blobs at
(offset, length) in a .distcp file: the reader reads boxes of them narrowed in the file
(``_torch_save_zip``, ``_torch_save_box``); ``load_blob`` (``torch.load(weights_only=True)``)
reads values and the blobs that cannot be narrowed. An item stored through torch's
``ZStandard`` extension (``transform_descriptors=["stream.zstd/1"]``, ``_zstd_frames``) is
inflated first, then read the same way (``_zstd_items``); any other transform is refused,
naming it, the file and the key.

A checkpoint that dcp wrote in this format has ``dcp-checksums.json`` beside ``.metadata``
(torch ignores it): the block checksums of every chunk's tensor bytes (the data inside the
blob, blocks counted from its first byte; for a chunk stored compressed, of its bytes as
stored) and the checksum of every value's whole blob (as stored).
``load_torch_dcp`` attaches them to the chunks and values (``_attach_checksums``), so that
the reader verifies what it reads; one torch wrote has none and is read unverified.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import re
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
from .._json import load_json
from .._model import CheckpointMetadata, ChunkMeta, TensorMeta, ValueMeta
from ..integrity._checksum import ALGORITHM, BLOCK_BYTES, BlockSums
from ..integrity._value_sums import check_bytes
from ..integrity._value_sums import parse as parse_value_sum
from ..storage._names import METADATA_LIMIT
from ..storage._pread import pread_into
from ..storage._roots import check_files, file_size, read_regular
from ._native import SAVE_ID_RE
from ._torch_save_zip import check_blob_pickles
from ._unpickle import _ALLOWED, _TORCH_DTYPES, _Dtype, _Record, _RestrictedUnpickler
from ._zstd_frames import check_transforms

# Re-exported: readers of other pickled formats subclass _RestrictedUnpickler from here.
__all__ = ["CHECKSUMS_FILE", "METADATA_FILE", "_ALLOWED", "_TORCH_DTYPES", "_Dtype", "_Record", "_RestrictedUnpickler",
           "load_blob", "load_torch_dcp"]

METADATA_FILE = ".metadata"
_DCP = "torch.distributed.checkpoint"
#: dcp's side file of block checksums (``write._torch_dcp_writer``): {"tensors": {name:
#: {"<offsets joined by ,>": "<block checksum string>"}}, "values": {name: checksum}}
CHECKSUMS_FILE = "dcp-checksums.json"
# The data files dcp's writer names (``__<rank>_<save id>.distcp``, ``__values_<save id>.distcp``);
# torch's own are ``__<rank>_<n>.distcp``.
_DCP_DATA_RE = re.compile(rf"__(?:\d+|values)_{SAVE_ID_RE.pattern}\.distcp")
_BLOCK_SUM_RE = re.compile(rf"{re.escape(ALGORITHM)}/[1-9][0-9]{{0,15}}:(?:[0-9a-f]{{16}}(?:,[0-9a-f]{{16}})*)?")

logger = logging.getLogger(__name__)


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

    def loc(fqn: str, offsets: tuple[int, ...] | None) -> tuple[str, tuple[int, int], tuple[str, ...]]:
        info = where.get((fqn, offsets))
        if info is None:
            raise MetadataError(f"no storage entry for {fqn!r} at offsets {short_repr(offsets)}", path=path,
                                key=fqn)
        file = info.get("relative_path", 0)
        transforms = check_transforms(info.get("transform_descriptors", 3), path=path, file=file, key=fqn)
        return file, (info.get("offset", 1), info.get("length", 2)), transforms

    for fqn, m in (md.get("state_dict_metadata", 0) or {}).items():
        if not isinstance(fqn, str):  # before it is formatted into any message
            raise MetadataError(f"state_dict_metadata has a key {short_repr(fqn)}, not a str: the file is "
                                "corrupt; copy it again or re-save the checkpoint", path=path)
        try:
            q = getattr(m, "qualname", "")
            if q.endswith(".BytesStorageMetadata"):
                file, st, tr = loc(fqn, None)
                values[fqn] = ValueMeta(name=fqn, file=file, key=fqn, storage=st, transforms=tr)
                continue
            if not q.endswith(".TensorStorageMetadata"):
                raise MetadataError(f"{fqn!r} has metadata of type {q or type(m).__name__}", path=path, key=fqn)
            dtype = _neutral(m.get("properties", 0).get("dtype", 0), path, fqn)
            chunks = []
            for c in m.get("chunks", 2):
                offsets = tuple(c.get("offsets", 0))
                file, st, tr = loc(fqn, offsets)
                chunks.append(ChunkMeta(offsets=offsets, sizes=tuple(c.get("sizes", 1)), file=file,
                                        key=fqn, storage=st, transforms=tr))
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


def load_torch_dcp(root_real: str, *, check: bool = True, checksums: bool = True) -> CheckpointMetadata:
    """The metadata of a torch DCP checkpoint, with every file checked (inside the directory,
    regular) and every stored byte range checked against its file's size, before any read
    (``check=False``: not checked; ``verify`` checks each file on its own), and the checksums
    of ``dcp-checksums.json`` attached to its chunks and values when dcp wrote it
    (``checksums=False``: not read)."""
    path = os.path.join(root_real, METADATA_FILE)
    md = _unpickle_metadata(root_real, path)
    try:
        tensors, values = _entries(md, path)
    except CheckpointError:
        raise
    except _STRUCTURE_ERRORS as e:
        raise MetadataError(f"unexpected metadata structure ({type(e).__name__}: {str(e)[:200]})",
                            path=path) from None
    if checksums:
        tensors, values = _attach_checksums(root_real, tensors, values)
    files = [(c.file, n) for n, t in tensors.items() for c in t.chunks]
    files += [(v.file, n) for n, v in values.items() if v.file]
    if check:
        check_files(root_real, files)
        check_storage(root_real, stored_ranges(tensors, values))
    try:
        return CheckpointMetadata(tensors=tensors, values=values, format="torch-dcp")
    except CheckpointError as e:
        raise e.with_path(path) from None


def summed_bytes(c: ChunkMeta, t: TensorMeta) -> int:
    """The bytes a chunk's block checksums cover: its tensor data inside its blob, or, for a
    chunk stored compressed (``transforms``), its bytes as stored."""
    return c.storage[1] if c.transforms and c.storage is not None else c.numel * t.itemsize


def _checksums_limit(tensors: dict[str, TensorMeta], values: dict[str, ValueMeta]) -> int:
    """The most bytes ``dcp-checksums.json`` of this metadata takes as dcp writes it (names
    escaped to ASCII, 17 bytes per 4 MiB block), with room to spare: a larger one is refused
    before it is read."""
    n = 64 * 1024
    for name, t in tensors.items():
        n += 12 * len(name) + 16
        for c in t.chunks:
            n += 21 * len(c.offsets) + 64 + 17 * (summed_bytes(c, t) // BLOCK_BYTES + 1)
    return min(METADATA_LIMIT, n + sum(12 * len(name) + 64 for name in values))


def _attach_checksums(root_real: str, tensors: dict[str, TensorMeta], values: dict[str, ValueMeta]
                      ) -> tuple[dict[str, TensorMeta], dict[str, ValueMeta]]:
    """``tensors`` and ``values`` with the checksums of ``dcp-checksums.json``; unchanged
    when there is none (torch wrote the checkpoint) or when it was left by an earlier dcp
    save and torch saved since (the metadata names none of dcp's data files). A file that is
    too large, not the JSON dcp writes, or that does not match the metadata entry for entry
    (a name, offsets or value the metadata lacks or that it lacks, a wrong block count) is a
    MetadataError naming it."""
    named = {c.file for t in tensors.values() for c in t.chunks} | {v.file for v in values.values() if v.file}
    path = os.path.join(root_real, CHECKSUMS_FILE)
    try:
        size = file_size(root_real, CHECKSUMS_FILE, key=CHECKSUMS_FILE)
    except MissingFileError:
        return tensors, values
    if named and not any(_DCP_DATA_RE.fullmatch(f) for f in named):
        logger.warning("%s: ignored: the metadata names only torch's own data files (%s), so torch saved "
                       "over a checkpoint dcp wrote; the checkpoint is read without checksums", path,
                       summarise(sorted(named), 3))
        return tensors, values
    limit = _checksums_limit(tensors, values)
    if size > limit:
        raise MetadataError(f"{size} bytes, more than the {limit} bytes the checksums of the metadata's "
                            f"{len(tensors)} tensors and {len(values)} values take: the file is corrupt or not "
                            "dcp's; re-save the checkpoint, or delete the file to read it unverified",
                            path=path, key=CHECKSUMS_FILE)
    doc = load_json(read_regular(root_real, CHECKSUMS_FILE, limit=limit, key=CHECKSUMS_FILE), path,
                    "the checksums file is corrupt: re-save the checkpoint, or delete it to read unverified")
    if not isinstance(doc, dict) or set(doc) != {"tensors", "values"} or not all(
            isinstance(doc[k], dict) for k in doc):
        raise MetadataError("not the checksums dcp writes: a JSON object with exactly the objects 'tensors' and "
                            f"'values' was expected, got {short_repr(doc if not isinstance(doc, dict) else sorted(doc))}"
                            "; re-save the checkpoint, or delete the file to read it unverified",
                            path=path, key=CHECKSUMS_FILE)
    problems: list[tuple[str, str]] = []
    tensors = _tensor_sums(doc["tensors"], tensors, path, problems)
    values = _value_sums(doc["values"], values, path, problems)
    if problems:
        raise MetadataError(f"{len(problems)} checksum entr(ies) do not match the metadata: "
                            f"{summarise([m for _, m in problems])}. The file is corrupt or belongs to another "
                            "save; re-save the checkpoint, or delete the file to read it unverified",
                            path=path, key=problems[0][0], offenders=[n for n, _ in problems])
    return tensors, values


def _tensor_sums(doc: dict[str, Any], tensors: dict[str, TensorMeta], path: str,
                 problems: list[tuple[str, str]]) -> dict[str, TensorMeta]:
    """``tensors`` with each chunk's checksum from ``doc`` (``{name: {offsets: sum}}``),
    every mismatch appended to ``problems`` as (name, message)."""
    out: dict[str, TensorMeta] = {}
    for name in sorted(set(doc) - set(tensors))[:100]:
        problems.append((name, f"tensor {short_repr(name)} is not in the metadata"))
    for name, t in tensors.items():
        sums = doc.get(name)
        out[name] = t
        if not isinstance(sums, dict):
            problems.append((name, f"tensor {name!r} has {'no checksums' if sums is None else short_repr(sums)}, "
                                   "not an object of its chunks' checksums"))
            continue
        want = {",".join(map(str, c.offsets)) for c in t.chunks}
        extra = sorted(set(sums) - want)
        if extra:
            problems.append((name, f"tensor {name!r} has no chunk at offsets {short_repr(extra)}"))
        chunks = []
        for c in t.chunks:
            text = sums.get(",".join(map(str, c.offsets)))
            where = f"the chunk of tensor {name!r} at offsets {list(c.offsets)}"
            if not isinstance(text, str) or not _BLOCK_SUM_RE.fullmatch(text):
                problems.append((name, f"{where} has checksum {short_repr(text)}, not "
                                       f"'{ALGORITHM}/<block>:<16 hex digits>,...'"))
                continue
            try:
                BlockSums.parse(text, summed_bytes(c, t), path=path, key=name)
            except MetadataError as e:
                problems.append((name, f"{where}: {e.message}"))
                continue
            chunks.append(dataclasses.replace(c, checksum=text))
        if len(chunks) == len(t.chunks) and not extra:
            out[name] = dataclasses.replace(t, chunks=tuple(chunks))
    return out


def _value_sums(doc: dict[str, Any], values: dict[str, ValueMeta], path: str,
                problems: list[tuple[str, str]]) -> dict[str, ValueMeta]:
    """``values`` with each one's checksum from ``doc`` (``{name: sum}``), every mismatch
    appended to ``problems``."""
    out = dict(values)
    for name in sorted(set(doc) - set(values))[:100]:
        problems.append((name, f"value {short_repr(name)} is not in the metadata"))
    for name, v in values.items():
        text = doc.get(name)
        try:
            if not isinstance(text, str):
                raise MetadataError(f"value {name!r} has checksum {short_repr(text)}, not a str", key=name)
            parse_value_sum(text, path=path, name=name)
        except MetadataError as e:
            problems.append((name, e.message))
            continue
        out[name] = dataclasses.replace(v, checksum=text)
    return out


def stored_ranges(tensors: dict[str, TensorMeta], values: dict[str, ValueMeta]
                  ) -> list[tuple[str, str, tuple[int, int]]]:
    """(file, name, (offset, length)) of every stored chunk and value."""
    stored = [(c.file, n, c.storage) for n, t in tensors.items() for c in t.chunks if c.storage is not None]
    return stored + [(v.file, n, v.storage) for n, v in values.items() if v.file and v.storage is not None]


def load_blob(fd: int, storage: tuple[int, int], *, path: str, key: str, weights_only: bool = True,
              checksum: str | None = None) -> Any:
    """torch.load of the torch.save blob at ``storage`` in the open file ``fd``, its bytes
    checked against ``checksum`` first when given (ChecksumError naming ``key`` and the
    file), then its pickles (``check_blob_pickles``: UnsafePickleError, MetadataError); a
    short read is TruncatedFileError, anything torch.load raises is left to the caller."""
    import torch

    offset, length = storage
    buf = bytearray(length)
    pread_into(fd, buf, offset, path=path, key=key)
    if checksum is not None:
        check_bytes(key, os.path.basename(path), buf, checksum, path=path, at=storage)
    check_blob_pickles(fd, offset, length, buf, path=path, key=key)
    return torch.load(io.BytesIO(buf), map_location="cpu", weights_only=weights_only)

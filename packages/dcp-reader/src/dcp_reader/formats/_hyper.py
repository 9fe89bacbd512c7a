"""hyper-parallel's format (MindSpore's parallel library, ``hyper_parallel.core.distributed_checkpoint``).

A checkpoint directory holds:

- ``.metadata``: a pickle of its ``Metadata`` (written last by rank 0 after a save with
  collectives), or, after a save without collectives, one ``{rank}.metadata`` per rank that
  describes only what that rank wrote (each rank then loads from its own file alone);
- ``_rank{r}_.safetensors``: the chunks rank r wrote, keyed by the fqn, or by
  ``{fqn}.__dcp_chunk_{i}`` (``_`` appended until unique) when the rank wrote several chunks
  of one fqn; ``StorageInfo.tensor_key`` names the key, the fqn when it is absent;
- ``_rank{r}_.bytes``: non-tensor values, pickled back to back, each at
  ``(StorageInfo.offset, StorageInfo.length)``.

The metadata pickle is read by a subclass of torch DCP's restricted unpickler whose
allow-list holds only the seed's metadata classes (as inert records), ``torch.Size``, torch
dtypes/memory formats and plain containers; anything else raises UnsafePickleError before it
is built. hyper-parallel itself is never imported. Data files are plain safetensors (torch's
``save_file`` or ``mindspore.save_checkpoint(format="safetensors")``, which writes the same
dtype codes and a ``{"format": "ms"}`` header metadata), read by the shared safetensors path.
"""

from __future__ import annotations

import _compat_pickle
import io
import os
import posixpath
import re
from typing import Any

from .._dtypes import DTYPE_NAMES
from .._errors import (
    CheckpointError,
    MetadataError,
    MissingMetadataError,
    UnknownDtypeError,
    UnsafePickleError,
    summarise,
)
from .._model import CheckpointMetadata, ChunkMeta, TensorMeta, ValueMeta
from ..storage._names import METADATA_LIMIT
from ..storage._pread import close_fd, pread_bytes
from ..storage._roots import check_files, lexists, listdir, open_regular, read_regular, storage_type
from ..storage._uri import parent
from ._unpickle import _record_class, _RestrictedUnpickler

FORMAT = "hyper-parallel"
METADATA_FILE = ".metadata"
VERSIONS = ("1.0",)
_HP = "hyper_parallel.core.distributed_checkpoint"
_MARKER = _HP.encode()
_RANK_METADATA = re.compile(r"(\d+)\.metadata")
_RANK_DATA = re.compile(r"_rank(\d+)_\.(safetensors|bytes)")

_RECORDS = {
    f"{_HP}.metadata": ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                        "TensorProperties", "MetadataIndex"),
    f"{_HP}.storage": ("StorageInfo",),
}
_ALLOWED = {(mod, name): _record_class(f"{mod}.{name}") for mod, names in _RECORDS.items() for name in names}

# MindSpore's dtype names (str(mindspore.float32) == "Float32"); torch's are "torch.<name>"
_MS_DTYPES = {"Float64": "float64", "Float32": "float32", "Float16": "float16", "BFloat16": "bfloat16",
              "Int64": "int64", "Int32": "int32", "Int16": "int16", "Int8": "int8", "UInt64": "uint64",
              "UInt32": "uint32", "UInt16": "uint16", "UInt8": "uint8", "Bool": "bool",
              "Complex64": "complex64", "Float8E4M3FN": "float8_e4m3fn", "Float8E5M2": "float8_e5m2"}
_TORCH_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "long": "int64", "int": "int32",
                  "short": "int16", "cfloat": "complex64"}


class _HyperUnpickler(_RestrictedUnpickler):
    """The restricted unpickler with hyper-parallel's metadata classes allowed instead of
    torch DCP's: torch.Size, dtypes and containers still resolve through the base class."""

    def __init__(self, f: Any, path: str):
        super().__init__(f, path)
        self._hyper_path = path

    def find_class(self, module: str, name: str) -> Any:
        # protocols 0-2 name Python 2 modules (copy_reg, __builtin__): map them as pickle's own
        # find_class does; the allow-list below still decides
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        allowed = _ALLOWED.get((module, name))
        if allowed is not None:
            return allowed
        if not module.startswith("torch.distributed"):
            try:
                return super().find_class(module, name)
            except UnsafePickleError:
                pass
        raise UnsafePickleError(
            f"the pickled metadata refers to {module}.{name}, which is not a hyper-parallel checkpoint "
            "metadata class; refusing to load it (nothing was executed). If you trust this checkpoint, "
            "load it with hyper-parallel itself", path=self._hyper_path, key=f"{module}.{name}")


def neutral_dtype(dtype: Any, *, path: str, fqn: str) -> str:
    """"torch.bfloat16" / "BFloat16" -> "bfloat16"; UnknownDtypeError naming the file and fqn."""
    name = None
    if isinstance(dtype, str):
        if dtype.startswith("torch."):
            name = dtype.removeprefix("torch.")
            name = _TORCH_ALIASES.get(name, name)
        else:
            name = _MS_DTYPES.get(dtype)
    if name not in DTYPE_NAMES:
        raise UnknownDtypeError(
            f"tensor {fqn!r} has dtype {dtype!r}, which dcp-reader cannot represent (it reads torch "
            f"names such as 'torch.bfloat16' and MindSpore names such as {sorted(_MS_DTYPES)[:4]}...); "
            "convert the tensor when saving", path=path, key=fqn)
    return name


def rank_metadata_files(root_real: str, names: set[str] | None = None) -> list[str]:
    """The per-rank ``{rank}.metadata`` files of a directory, by rank."""
    names = listdir(root_real) if names is None else names
    found = [(int(m.group(1)), n) for n in names if (m := _RANK_METADATA.fullmatch(n))]
    return [n for _, n in sorted(found)]


def detect_hyper(root_real: str, names: set[str]) -> bool:
    """True for a hyper-parallel checkpoint; MissingMetadataError for its data files alone."""
    if METADATA_FILE in names:
        if any(n.endswith(".distcp") for n in names):
            return False
        try:
            head = _head(root_real, METADATA_FILE, 4096)  # the pickle names Metadata's module first
        except (OSError, CheckpointError):  # unreadable: let the torch-dcp reader (or the data files) decide
            head = b""
        return _MARKER in head or any(_RANK_DATA.fullmatch(n) for n in names)
    if rank_metadata_files(root_real, names):
        return True
    data = sorted(n for n in names if _RANK_DATA.fullmatch(n))
    if data:
        raise MissingMetadataError(
            f"{METADATA_FILE} is missing next to hyper-parallel data files ({summarise(data, 3)}): an "
            "incomplete save (rank 0 writes .metadata last; a save without collectives writes "
            "{rank}.metadata per rank). Re-run the save", path=root_real, key=METADATA_FILE)
    return False


def is_rank_local(path: str | os.PathLike[str]) -> bool:
    """True when the directory holds only per-rank ``{rank}.metadata`` (a hyper-parallel save
    without collectives): each rank must open it with ``rank=`` and load without collectives.
    Decided from the directory listing alone, which every rank sees alike; False when the
    directory cannot be listed (opening it then reports why). In an object store, where
    every rank would list the bucket, two HEAD requests decide instead (``0.metadata``, then
    ``.metadata``): no listing."""
    kind = storage_type(path)
    if not kind.local:
        storage = kind(path)
        try:
            return storage.exists(f"0{METADATA_FILE}") and not storage.exists(METADATA_FILE)
        except CheckpointError:
            return False
    try:
        names = set(os.listdir(path))  # a listing needs no real path (one per load: no realpath)
    except OSError:
        return False
    return METADATA_FILE not in names and bool(rank_metadata_files("", names))


def _head(root_real: str, name: str, n: int) -> bytes:
    """The first ``n`` bytes of a file inside the checkpoint (fewer when it is shorter)."""
    fd = open_regular(root_real, name, key=name)
    try:
        return pread_bytes(fd, n, 0, path=name, key=name)
    finally:
        close_fd(fd)


def _metadata_path(root_real: str, rank: int | None) -> str:
    if lexists(root_real, METADATA_FILE):
        return os.path.join(root_real, METADATA_FILE)
    per_rank = rank_metadata_files(root_real)
    if rank is None:
        raise MissingMetadataError(
            f"no {METADATA_FILE}: this hyper-parallel checkpoint was saved without collectives and holds "
            f"one metadata file per rank ({summarise(per_rank, 4)}); open it with rank=<the rank> (each "
            "rank loads only what it saved)", path=root_real, key=METADATA_FILE)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0 or None, got {rank!r}")
    name = f"{rank}{METADATA_FILE}"
    if name not in per_rank:
        raise MissingMetadataError(
            f"no {name} for rank {rank}: the checkpoint was saved without collectives by ranks with "
            f"{summarise(per_rank, 4)}; load it with the same ranks that saved it", path=root_real, key=name)
    return os.path.join(root_real, name)


def _unpickle(path: str) -> Any:
    try:
        # a regular file inside the directory, at most METADATA_LIMIT bytes (no FIFO, no
        # symlink out, no /dev/zero), then the bounded restricted unpickler
        raw = read_regular(parent(path), posixpath.basename(path), limit=METADATA_LIMIT)
        md = _HyperUnpickler(io.BytesIO(raw), path).load()
    except CheckpointError:
        raise
    except Exception as e:  # any malformed pickle: report, never propagate half-built state
        raise MetadataError(f"cannot read the pickled metadata ({type(e).__name__}: {e}); the file is "
                            "corrupt or from an unsupported hyper-parallel version", path=path) from None
    if getattr(md, "qualname", None) != f"{_HP}.metadata.Metadata":
        raise MetadataError(f"the pickle holds {getattr(md, 'qualname', type(md).__name__)}, not a "
                            "hyper-parallel Metadata", path=path)
    version = md.get("version", 3)
    if version not in VERSIONS:
        raise MetadataError(f"metadata version {version!r} is not one dcp-reader reads ({VERSIONS}); "
                            "upgrade dcp-reader or re-save with a supported hyper-parallel", path=path,
                            key="version")
    return md


def _storage_index(md: Any, path: str) -> dict[tuple[str, tuple[int, ...]], Any]:
    """(fqn, offsets) -> StorageInfo record (MetadataIndex.index plays no part, as in the seed)."""
    storage = md.get("storage_data", 2)
    if not isinstance(storage, dict):
        raise MetadataError(f"storage_data is {type(storage).__name__}, not a dict: the save did not "
                            "finish writing its metadata; re-save", path=path, key="storage_data")
    where = {}
    for idx, info in storage.items():
        if getattr(idx, "qualname", "") != f"{_HP}.metadata.MetadataIndex" or \
                getattr(info, "qualname", "") != f"{_HP}.storage.StorageInfo":
            raise MetadataError(f"storage_data maps {type(idx).__name__} to {type(info).__name__}, not "
                                "MetadataIndex to StorageInfo", path=path, key="storage_data")
        where[(idx.get("fqn", 0), tuple(idx.get("offset", 1) or ()))] = info
    return where


def _tensor(fqn: str, m: Any, where: dict[tuple[str, tuple[int, ...]], Any], path: str) -> TensorMeta:
    props = m.get("properties", 0)
    dtype = neutral_dtype(props.get("dtype", 0) if props is not None else None, path=path, fqn=fqn)
    chunks = []
    for c in m.get("chunks", 2) or ():
        offsets = tuple(c.get("offsets", 0))
        info = where.get((fqn, offsets))
        if info is None:
            raise MetadataError(f"no storage_data entry for {fqn!r} at offsets {offsets}; the metadata is "
                                "incomplete: re-save", path=path, key=fqn)
        key = info.get("tensor_key", 3) or fqn
        chunks.append(ChunkMeta(offsets=offsets, sizes=tuple(c.get("sizes", 1)), file=info.get("relative_path", 0),
                                key=key))
    return TensorMeta(name=fqn, shape=tuple(m.get("size", 1)), dtype=dtype, chunks=tuple(chunks))


def _value(fqn: str, by_fqn: dict[str, list[Any]], path: str) -> ValueMeta:
    infos = by_fqn.get(fqn, [])
    if len(infos) != 1:
        raise MetadataError(f"value {fqn!r} has {len(infos)} storage_data entries, expected 1; re-save",
                            path=path, key=fqn)
    info = infos[0]
    return ValueMeta(name=fqn, file=info.get("relative_path", 0), key=fqn,
                     storage=(info.get("offset", 1), info.get("length", 2)))


def load_hyper(root_real: str, *, rank: int | None = None) -> CheckpointMetadata:
    """The neutral metadata of a hyper-parallel checkpoint: ``.metadata``, else ``{rank}.metadata``."""
    path = _metadata_path(root_real, rank)
    md = _unpickle(path)
    tensors: dict[str, TensorMeta] = {}
    values: dict[str, ValueMeta] = {}
    problems: list[CheckpointError] = []
    try:
        where = _storage_index(md, path)
        by_fqn: dict[str, list[Any]] = {}
        for (name, _), info in where.items():
            by_fqn.setdefault(name, []).append(info)
        sd_meta = md.get("state_dict_metadata", 0)
        if not isinstance(sd_meta, dict):
            raise MetadataError(f"state_dict_metadata is {type(sd_meta).__name__}, not a dict", path=path)
        for fqn, m in sd_meta.items():
            try:
                q = getattr(m, "qualname", "")
                if q == f"{_HP}.metadata.BytesStorageMetadata":
                    values[fqn] = _value(fqn, by_fqn, path)
                elif q == f"{_HP}.metadata.TensorStorageMetadata":
                    tensors[fqn] = _tensor(fqn, m, where, path)
                else:
                    raise MetadataError(f"{fqn!r} has metadata of type {q or type(m).__name__}", path=path, key=fqn)
            except CheckpointError as e:
                problems.append(e.with_path(path))
    except (AttributeError, TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise MetadataError(f"unexpected metadata structure ({type(e).__name__}: {e})", path=path) from None
    if problems:
        first = problems[0]
        raise type(first)(f"{len(problems)} problem(s) in the metadata: {summarise([p.message for p in problems])}",
                          path=path, key=first.key, offenders=[p.key or "" for p in problems])
    files = [(c.file, n) for n, t in tensors.items() for c in t.chunks]
    files += [(v.file, n) for n, v in values.items() if v.file]
    check_files(root_real, files)
    try:
        return CheckpointMetadata(tensors=tensors, values=values, format=FORMAT,
                                  partial=os.path.basename(path) != METADATA_FILE)
    except CheckpointError as e:
        raise e.with_path(path) from None

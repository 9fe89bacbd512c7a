"""torch.distributed.checkpoint's default format: a pickled ``.metadata`` plus ``*.distcp``.

The pickle is read by an unpickler that resolves only an allow-list of names, each to an
inert stand-in defined here (a record of its arguments): no torch class, function or
constructor from the checkpoint ever runs, and torch is not even imported. Any other name
raises UnsafePickleError before anything is built. Tensor payloads are torch.save blobs at
(offset, length) in a .distcp file, read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

from ._dtypes import DTYPE_NAMES
from ._errors import (
    CheckpointError,
    MetadataError,
    MissingFileError,
    UnknownDtypeError,
    UnsafePickleError,
    summarise,
)
from ._model import CheckpointMetadata, ChunkMeta, TensorMeta, ValueMeta
from ._paths import METADATA_LIMIT, check_files, read_regular
from ._pread import pread_into

METADATA_FILE = ".metadata"
_DCP = "torch.distributed.checkpoint"


class _Record:
    """Inert stand-in for an allowed class: keeps constructor args and pickled state."""

    qualname = "?"
    args: tuple[Any, ...] = ()
    state: Any = None

    # pickle's NEWOBJ calls __new__ without __init__: record the arguments here
    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:
        obj = super().__new__(cls)
        obj.args = args
        obj.state = dict(kwargs)
        return obj

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], (dict, type(None))):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots) form
        self.state = state

    def get(self, name: str, index: int | None = None) -> Any:
        if isinstance(self.state, dict) and name in self.state:
            return self.state[name]
        if index is not None:
            if isinstance(self.state, tuple) and len(self.state) > index:
                return self.state[index]
            if len(self.args) > index:
                return self.args[index]
        return None


def _record_class(qualname: str) -> type[_Record]:
    return type(qualname.rsplit(".", 1)[-1], (_Record,), {"qualname": qualname})


class _Dtype:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"torch.{self.name}"


def _size(*args: Any) -> tuple[int, ...]:  # torch.Size(iterable) -> plain tuple
    return tuple(args[0]) if args else ()


def _opaque(*args: Any) -> Any:  # layouts, memory formats, paths: values we do not need
    return args


def _reconstructor(cls: Any, base: Any, state: Any = None) -> Any:  # copyreg, protocol < 2
    if not (isinstance(cls, type) and issubclass(cls, _Record)):
        raise pickle.UnpicklingError(f"copyreg._reconstructor of {cls!r}")
    return cls.__new__(cls)


_RECORDS = {
    f"{_DCP}.metadata": ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                          "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta"),
    f"{_DCP}.filesystem": ("_StorageInfo",),
}
_ALLOWED: dict[tuple[str, str], Any] = {
    (mod, name): _record_class(f"{mod}.{name}") for mod, names in _RECORDS.items() for name in names
}
_ALLOWED.update({
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _opaque,
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"): _opaque,
    ("pathlib", "PosixPath"): _opaque,
    ("pathlib", "WindowsPath"): _opaque,
    ("pathlib", "PurePosixPath"): _opaque,
    ("collections", "OrderedDict"): dict,
    ("builtins", "set"): set,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("builtins", "object"): object,
})
for _n in ("strided", "sparse_coo", "contiguous_format", "channels_last", "preserve_format"):
    _ALLOWED[("torch", _n)] = _n
# every dtype name torch has or had: an unknown one becomes UnknownDtypeError, not a refusal
_TORCH_DTYPES = DTYPE_NAMES | {
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7", "int1", "int2", "int3", "int4",
    "int5", "int6", "int7", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
    "complex32", "complex128", "qint8", "quint8", "qint32", "quint4x2", "quint2x4", "bits1x8",
    "bits2x4", "bits4x2", "bits8", "bits16", "half", "float", "double", "cfloat", "cdouble", "long",
    "int", "short", "chalf"}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, f: Any, path: str):
        super().__init__(f)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in _TORCH_DTYPES:
            return _Dtype(name)
        raise UnsafePickleError(
            f"the pickled metadata refers to {module}.{name}, which is not a torch.distributed.checkpoint "
            "metadata class; refusing to load it (nothing was executed). If you trust this checkpoint, "
            "convert it with torch.distributed.checkpoint itself", path=self._path, key=f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"persistent id {pid!r:.80} in the metadata pickle; refusing it",
                                path=self._path)


def _neutral(dtype: Any, path: str, fqn: str) -> str:
    name = dtype.name if isinstance(dtype, _Dtype) else None
    aliases = {"half": "float16", "float": "float32", "double": "float64", "long": "int64", "int": "int32",
               "short": "int16", "cfloat": "complex64"}
    name = aliases.get(name, name) if name else None
    if name not in DTYPE_NAMES:
        raise UnknownDtypeError(f"tensor {fqn!r} has dtype {dtype!r}, which dcp-reader cannot represent; "
                                "convert it when saving", path=path, key=fqn)
    return name


def load_torch_dcp(root_real: str) -> CheckpointMetadata:
    path = os.path.join(root_real, METADATA_FILE)
    try:
        data = read_regular(root_real, METADATA_FILE, limit=METADATA_LIMIT, key=METADATA_FILE)
    except MissingFileError:
        from ._errors import MissingMetadataError

        raise MissingMetadataError(f"{METADATA_FILE} is missing: an incomplete torch.distributed.checkpoint "
                                   "save (it writes .metadata last); re-run the save", path=root_real,
                                   key=METADATA_FILE) from None
    try:
        md = _RestrictedUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as e:  # any malformed pickle: report, never propagate half-built state
        raise MetadataError(f"cannot read the pickled metadata ({type(e).__name__}: {e}); the file is "
                            "corrupt or from an unsupported torch version", path=path) from None
    if getattr(md, "qualname", None) != f"{_DCP}.metadata.Metadata":
        raise MetadataError(f"the pickle holds {type(md).__name__}, not a Metadata", path=path)
    sd_meta = md.get("state_dict_metadata", 0) or {}
    storage = md.get("storage_data", 2) or {}
    where: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for idx, info in storage.items():
        off = idx.get("offset", 1)
        where[(idx.get("fqn", 0), tuple(off) if off is not None else None)] = info
    tensors: dict[str, TensorMeta] = {}
    values: dict[str, ValueMeta] = {}
    problems: list[CheckpointError] = []

    def loc(fqn: str, offsets: tuple[int, ...] | None) -> tuple[str, tuple[int, int]]:
        info = where.get((fqn, offsets))
        if info is None:
            raise MetadataError(f"no storage entry for {fqn!r} at offsets {offsets}", path=path, key=fqn)
        td = info.get("transform_descriptors", 3)
        if td:
            raise MetadataError(f"{fqn!r} is stored with transforms {td!r} (e.g. compression), which "
                                "dcp-reader does not support; re-save without them", path=path, key=fqn)
        return info.get("relative_path", 0), (info.get("offset", 1), info.get("length", 2))

    try:
        for fqn, m in sd_meta.items():
            try:
                q = getattr(m, "qualname", "")
                if q.endswith(".BytesStorageMetadata"):
                    file, st = loc(fqn, None)
                    values[fqn] = ValueMeta(name=fqn, file=file, key=fqn, storage=st)
                    continue
                if not q.endswith(".TensorStorageMetadata"):
                    raise MetadataError(f"{fqn!r} has metadata of type {q or type(m).__name__}", path=path, key=fqn)
                props = m.get("properties", 0)
                dtype = _neutral(props.get("dtype", 0), path, fqn)
                chunks = []
                for c in m.get("chunks", 2):
                    offsets = tuple(c.get("offsets", 0))
                    file, st = loc(fqn, offsets)
                    chunks.append(ChunkMeta(offsets=offsets, sizes=tuple(c.get("sizes", 1)), file=file,
                                            key=fqn, storage=st))
                tensors[fqn] = TensorMeta(name=fqn, shape=tuple(m.get("size", 1)), dtype=dtype,
                                          chunks=tuple(chunks))
            except CheckpointError as e:
                problems.append(e.with_path(path))
    except (AttributeError, TypeError, ValueError) as e:
        raise MetadataError(f"unexpected metadata structure ({type(e).__name__}: {e})", path=path) from None
    if problems:
        first = problems[0]
        raise type(first)(f"{len(problems)} problem(s) in the metadata: "
                          f"{summarise([p.message for p in problems])}", path=path, key=first.key,
                          offenders=[p.key or "" for p in problems])
    files = [(c.file, n) for n, t in tensors.items() for c in t.chunks]
    files += [(v.file, n) for n, v in values.items() if v.file]
    check_files(root_real, files)
    try:
        return CheckpointMetadata(tensors=tensors, values=values, format="torch-dcp")
    except CheckpointError as e:
        raise e.with_path(path) from None


def load_blob(fd: int, storage: tuple[int, int], *, path: str, key: str, weights_only: bool = True) -> Any:
    """torch.load of the torch.save blob at ``storage`` in the open file ``fd``; a short
    read is TruncatedFileError, anything torch.load raises is left to the caller."""
    import torch

    offset, length = storage
    buf = bytearray(length)
    pread_into(fd, buf, offset, path=path, key=key)
    return torch.load(io.BytesIO(buf), map_location="cpu", weights_only=weights_only)

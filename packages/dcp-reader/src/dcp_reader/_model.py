"""The framework-neutral metadata model: frozen dataclasses that validate on creation and
round-trip through JSON with a schema version."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ._coverage import coverage_problems
from ._dtypes import is_dtype_name, itemsize
from ._errors import CoverageError, MetadataError, UnknownDtypeError, short_repr, summarise
from ._json import load_json
from ._values import decode_value, encode_value, is_storable_value

SCHEMA_VERSION = 1
FORMATS = ("native", "hf", "torch-dcp-hf", "torch-dcp",
           "hyper-parallel")  # _hyper.FORMAT


def _str_tuple(value: Any, what: str, *, key: str | None) -> tuple[str, ...]:
    """``value`` (transform descriptors) as a tuple of str; MetadataError otherwise."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or not all(
            isinstance(v, str) for v in value):
        raise MetadataError(f"{what}: transforms must be a sequence of str, got {short_repr(value)}", key=key)
    return tuple(value)


def _int_tuple(value: Any, what: str, *, key: str | None) -> tuple[int, ...]:
    try:
        out = tuple(value)
    except TypeError:
        raise MetadataError(f"{what} must be a sequence of ints, got {short_repr(value)}", key=key) from None
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise MetadataError(f"{what} must hold non-negative ints, got {short_repr(value)}", key=key)
    return tuple(int(v) for v in out)


@dataclass(frozen=True)
class ChunkMeta:
    """One saved piece of a tensor: the box [offsets, offsets + sizes) of the global tensor,
    stored in ``file`` (posix path relative to the checkpoint dir) under ``key``.

    ``storage``: (byte offset, length) inside the file where the format needs it (torch DCP
    ``.distcp``); ``checksum``: optional, e.g. "crc32:1a2b3c4d" (not yet written or checked).
    ``transforms``: torch DCP's transform descriptors of the stored bytes (``"stream.zstd/1"``:
    zstd-compressed, torch's ``ZStandard`` extension); ``storage`` and ``checksum`` are then
    those of the bytes as stored.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    key: str
    checksum: str | None = None
    storage: tuple[int, int] | None = None
    transforms: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        offsets = _int_tuple(self.offsets, "ChunkMeta.offsets", key=self.key)
        sizes = _int_tuple(self.sizes, "ChunkMeta.sizes", key=self.key)
        if len(offsets) != len(sizes):
            raise MetadataError(f"chunk {self.key!r}: offsets {offsets} and sizes {sizes} differ in "
                                "length", key=self.key)
        if not isinstance(self.file, str) or not self.file:
            raise MetadataError(f"chunk {self.key!r}: file must be a non-empty str, got {short_repr(self.file)}",
                                key=self.key)
        if not isinstance(self.key, str):
            raise MetadataError(f"chunk key must be a str, got {short_repr(self.key)}", key=None)
        if self.checksum is not None and not isinstance(self.checksum, str):
            raise MetadataError(f"chunk {self.key!r}: checksum must be a str or None, got "
                                f"{short_repr(self.checksum)}", key=self.key)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "transforms", _str_tuple(self.transforms, f"chunk {self.key!r}", key=self.key))
        if self.storage is not None:
            storage = _int_tuple(self.storage, "ChunkMeta.storage", key=self.key)
            if len(storage) != 2:
                raise MetadataError(f"chunk {self.key!r}: storage must be (offset, length), got "
                                    f"{short_repr(self.storage)}", key=self.key)
            object.__setattr__(self, "storage", storage)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class TensorMeta:
    """A global tensor: shape, neutral dtype name and the chunks it was saved in."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[ChunkMeta, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise MetadataError(f"tensor name must be a str, got {short_repr(self.name)}")
        shape = _int_tuple(self.shape, f"shape of {self.name!r}", key=self.name)
        object.__setattr__(self, "shape", shape)
        if not is_dtype_name(self.dtype):
            raise UnknownDtypeError(f"tensor {self.name!r} has unknown dtype {short_repr(self.dtype)}; use a "
                                    "neutral name such as 'float32', 'bfloat16', 'float8_e4m3fn'",
                                    key=self.name)
        chunks = tuple(self.chunks)
        for c in chunks:
            if not isinstance(c, ChunkMeta):
                raise MetadataError(f"tensor {self.name!r}: chunks must be ChunkMeta, got {type(c)!r}",
                                    key=self.name)
            if len(c.offsets) != len(shape):
                raise MetadataError(f"tensor {self.name!r} has {len(shape)} dims (shape {shape}) but "
                                    f"its chunk in {c.file!r} key {c.key!r} has offsets {c.offsets}",
                                    key=self.name)
        object.__setattr__(self, "chunks", chunks)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class ValueMeta:
    """A non-tensor entry: inline JSON ``value``, or (pickled, opt-in) stored in ``file``
    under ``key``. ``storage``: (byte offset, length) inside ``file`` (torch DCP).
    ``checksum``: optional, ``"xxh3-64:<hex>"`` of the value's canonical JSON, or of the
    bytes of ``file`` (native format; see ``_value_sums``). ``transforms``: as for a chunk
    (``ChunkMeta``): the stored bytes' torch DCP transform descriptors."""

    name: str
    value: Any = None
    file: str | None = None
    key: str | None = None
    storage: tuple[int, int] | None = None
    checksum: str | None = None
    transforms: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise MetadataError(f"value name must be a str, got {short_repr(self.name)}")
        if self.file is None:
            if not is_storable_value(self.value):
                raise MetadataError(f"value {self.name!r} of type {type(self.value).__name__} cannot be "
                                    "stored as JSON (None, bool, int, float, str, and lists, tuples and "
                                    "dicts of them); store it pickled (allow_pickle=True) or convert it",
                                    key=self.name)
        elif not isinstance(self.file, str) or not self.file:
            raise MetadataError(f"value {self.name!r}: file must be a non-empty str, got {short_repr(self.file)}",
                                key=self.name)
        elif self.value is not None:
            raise MetadataError(f"value {self.name!r} has both an inline value and a file", key=self.name)
        elif self.key is not None and not isinstance(self.key, str):
            raise MetadataError(f"value {self.name!r}: key must be a str or None, got {short_repr(self.key)}",
                                key=self.name)
        if self.checksum is not None and not isinstance(self.checksum, str):
            raise MetadataError(f"value {self.name!r}: checksum must be a str or None, got {short_repr(self.checksum)}",
                                key=self.name)
        object.__setattr__(self, "transforms", _str_tuple(self.transforms, f"value {self.name!r}", key=self.name))
        if self.storage is not None:
            storage = _int_tuple(self.storage, "ValueMeta.storage", key=self.name)
            if len(storage) != 2:
                raise MetadataError(f"value {self.name!r}: storage must be (offset, length)", key=self.name)
            object.__setattr__(self, "storage", storage)


@dataclass(frozen=True)
class CheckpointMetadata:
    """Everything a loader needs to plan: tensors (with chunks) and non-tensor values.

    Creating one checks that every tensor's chunks tile its shape (CoverageError listing
    every offending tensor). ``partial``: what one rank of a save without collectives wrote
    (hyper-parallel's ``{rank}.metadata``): chunks may leave gaps, never overlap; a loader
    must check that each box it wants is covered.
    """

    tensors: Mapping[str, TensorMeta]
    values: Mapping[str, ValueMeta]
    format: str
    schema_version: int = SCHEMA_VERSION
    partial: bool = False

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise MetadataError(f"format must be one of {FORMATS}, got {self.format!r}")
        if isinstance(self.schema_version, bool) or self.schema_version != SCHEMA_VERSION:
            raise MetadataError(
                f"schema_version {self.schema_version!r} is not supported by this dcp-reader "
                f"(it reads version {SCHEMA_VERSION}); upgrade dcp-reader to read this checkpoint")
        for what, mapping, cls in (("tensors", self.tensors, TensorMeta), ("values", self.values, ValueMeta)):
            for name, meta in mapping.items():
                if not isinstance(meta, cls) or meta.name != name:
                    raise MetadataError(f"{what}[{name!r}] must be a {cls.__name__} named {name!r}, got "
                                        f"{short_repr(meta, 200)}", key=name)
        both = sorted(set(self.tensors) & set(self.values))
        if both:
            raise MetadataError(f"names used for both a tensor and a value: {summarise(both)}", key=both[0])
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))
        problems: list[str] = []
        offenders: list[str] = []
        for name, t in self.tensors.items():
            p = coverage_problems(name, t.shape, t.chunks, allow_gaps=self.partial)
            if p:
                problems.extend(p)
                offenders.append(name)
        if problems:
            raise CoverageError(f"{len(offenders)} tensor(s) are not covered exactly by their saved "
                                f"chunks: {summarise(problems)}. The checkpoint is incomplete or "
                                "inconsistent; re-save it", key=offenders[0], offenders=offenders)

    def __reduce__(self) -> Any:  # read-only mapping views do not pickle; rebuild from dicts
        return (type(self), (dict(self.tensors), dict(self.values), self.format, self.schema_version,
                             self.partial))

    # -- JSON ------------------------------------------------------------------------------
    def to_json(self) -> str:
        tensors = {}
        for name, t in self.tensors.items():
            chunks = []
            for c in t.chunks:
                d: dict[str, Any] = {"offsets": list(c.offsets), "sizes": list(c.sizes),
                                     "file": c.file, "key": c.key}
                if c.checksum is not None:
                    d["checksum"] = c.checksum
                if c.storage is not None:
                    d["storage"] = list(c.storage)
                if c.transforms:
                    d["transforms"] = list(c.transforms)
                chunks.append(d)
            tensors[name] = {"shape": list(t.shape), "dtype": t.dtype, "chunks": chunks}
        values = {}
        for name, v in self.values.items():
            d = {"value": encode_value(v.value)} if v.file is None else {"file": v.file, "key": v.key}
            if v.storage is not None:
                d["storage"] = list(v.storage)
            if v.transforms:
                d["transforms"] = list(v.transforms)
            values[name] = d
        doc = {"schema_version": self.schema_version, "format": self.format, "tensors": tensors, "values": values}
        # apart from the values: a corrupted value entry must not take its checksum with it
        sums = {name: v.checksum for name, v in self.values.items() if v.checksum is not None}
        if sums:
            doc["value_checksums"] = sums
        if self.partial:
            doc["partial"] = True
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> CheckpointMetadata:
        """Parse and validate; MetadataError (no path: the caller adds it) on any problem."""
        doc = load_json(text, None, "the metadata file is corrupt or was not written by dcp-reader")
        if not isinstance(doc, dict):
            raise MetadataError(f"metadata must be a JSON object, got {type(doc).__name__}")
        version = doc.get("schema_version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise MetadataError(f"schema_version missing or not an int: {version!r}")
        if version != SCHEMA_VERSION:
            raise MetadataError(f"unknown schema_version {version} (this dcp-reader reads "
                                f"{SCHEMA_VERSION}); upgrade dcp-reader", key="schema_version")
        value_sums = _value_checksums(doc)
        try:
            tensors = {}
            for name, t in _obj(doc, "tensors").items():
                chunks = tuple(
                    ChunkMeta(offsets=c["offsets"], sizes=c["sizes"], file=c["file"], key=c["key"],
                              checksum=c.get("checksum"), storage=c.get("storage"),
                              transforms=c.get("transforms", ()))
                    for c in t["chunks"])
                tensors[name] = TensorMeta(name=name, shape=t["shape"], dtype=t["dtype"], chunks=chunks)
            values = {}
            for name, v in _obj(doc, "values").items():
                if "value" not in v and "file" not in v and name not in value_sums:
                    # a renamed key would read as the value None, with no checksum to catch it
                    raise MetadataError(f"value {name!r} has neither 'value' nor 'file' (keys "
                                        f"{short_repr(sorted(v))}); the metadata file is corrupt: re-copy or "
                                        "re-save the checkpoint", key=name)
                values[name] = ValueMeta(name=name, value=decode_value(v.get("value")), file=v.get("file"),
                                         key=v.get("key"), storage=v.get("storage"), checksum=value_sums.get(name),
                                         transforms=v.get("transforms", ()))
        except RecursionError:
            raise MetadataError("a value in the metadata is nested too deeply; the file is corrupt") from None
        except MetadataError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
            raise MetadataError(f"malformed metadata entry ({type(e).__name__}: {e}); the file is "
                                "corrupt or from an incompatible writer") from None
        return cls(tensors=tensors, values=values, format=doc.get("format", "native"),
                   schema_version=version, partial=doc.get("partial") is True)


def _value_checksums(doc: dict[str, Any]) -> dict[str, Any]:
    """The ``value_checksums`` map; MetadataError when it names a value the metadata does not
    hold (a value entry lost or renamed by corruption)."""
    sums = _obj(doc, "value_checksums")
    orphans = sorted(set(sums) - set(_obj(doc, "values")))
    if orphans:
        shown = summarise([repr(n) for n in orphans])
        raise MetadataError(f"value_checksums names value(s) the metadata does not hold: {shown}; the metadata "
                            "file is corrupt: re-copy or re-save the checkpoint", key=orphans[0], offenders=orphans)
    return sums


def _obj(doc: dict[str, Any], name: str) -> dict[str, Any]:
    v = doc.get(name, {})
    if not isinstance(v, dict):
        raise MetadataError(f"{name!r} must be a JSON object, got {type(v).__name__}")
    return v

"""Where the one tensor of a ``torch.save`` blob lies inside the blob, read from the blob's
own zip structure without loading it.

torch.distributed.checkpoint's ``FileSystemWriter`` stores each tensor chunk as a
``torch.save`` blob at (offset, length) in a ``.distcp`` file. Since torch 1.6 a
``torch.save`` output is an uncompressed ("stored") zip archive: ``<archive>/data.pkl``
(a small pickle whose tensor rebuild call names a storage key, the dtype, the storage
offset, size and stride), ``<archive>/byteorder`` and one ``<archive>/data/<key>`` entry
per storage whose bytes are the raw storage. torch 2.13 pads every entry's local extra
field so its data starts 64-byte aligned within the archive, sets the data-descriptor flag
(sizes are 0 in the local headers; the central directory has them) and always writes the
zip64 end records (checked by parsing torch.save outputs in tests/test_reader_torch_save_zip.py).

So a reader needs the central directory (at the blob's end), ``data.pkl`` and the storage
entry's local header (both at the blob's start): two small reads, then it can read any
box's bytes straight from the file.

Every offset and length is checked to lie inside the blob before it is used, and what is
read for the index is bounded (``_DIR_LIMIT``, ``_PICKLE_LIMIT``): anything malformed is a
``MetadataError`` naming the file and the tensor. A blob this module cannot narrow (not a
zip: torch's legacy format; compressed entries; big-endian data; a pickle that is more than
one plain tensor) raises ``CannotNarrow`` with the reason: the caller then loads the whole
blob with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from .._dtypes import DTYPE_NAMES, itemsize
from .._errors import CheckpointError, MetadataError, UnsafePickleError, short_repr
from ..storage._pread import pread_into
from ._pickle_scan import scan_pickle
from ._unpickle import _TORCH_DTYPES, Inert, _Dtype, _RestrictedUnpickler, charged, counted, is_bomb

# First and last bytes of a blob read to find its index. torch.save's data.pkl and the
# storage entry's local header end at byte ~770 of a one-tensor blob and its central
# directory with the end records is ~560 bytes; anything beyond is read separately.
HEAD = 1024
TAIL = 1024
_DIR_LIMIT = 1 << 20  # a one-tensor blob's central directory holds ~7 entries (~500 bytes)
_PICKLE_LIMIT = 1 << 20  # its data.pkl is ~150-200 bytes

_EOCD, _EOCD64_LOC, _EOCD64, _CENTRAL, _LOCAL = 0x06054B50, 0x07064B50, 0x06064B50, 0x02014B50, 0x04034B50
_EOCD_LEN, _LOC_LEN, _EOCD64_LEN, _CENTRAL_LEN, _LOCAL_LEN = 22, 20, 56, 46, 30
_ZIP64_EXTRA = 0x0001

# torch's legacy typed-storage classes (``_rebuild_tensor_v2``) and the dtype of their items;
# newer dtypes (float8, uint16..64) come as ``UntypedStorage`` plus a dtype (``_v3``).
_STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
}
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "long": "int64",
                  "int": "int32", "short": "int16", "cfloat": "complex64"}


class CannotNarrow(Exception):
    """The blob is well formed as far as checked, but not a layout this module narrows."""


@dataclass(frozen=True)
class BlobTensor:
    """The tensor of a torch.save blob: neutral dtype, shape, stride (in elements) and the
    blob-relative byte offset of its first element (storage start + storage offset)."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    start: int

    @property
    def c_contiguous(self) -> bool:
        """Laid out row-major without gaps (dims of size 1 may have any stride)."""
        step = 1
        for size, st in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size == 0:
                return True
            if size != 1 and st != step:
                return False
            step *= size
        return True


@dataclass(frozen=True)
class _Entry:
    name: str
    method: int
    flags: int
    csize: int
    usize: int
    local: int


class _Blob:
    """Bounded reads of one blob at (offset, length) of an open file: the head and the tail
    are read once, anything else on demand; every range is checked against the blob."""

    def __init__(self, fd: int, offset: int, length: int, path: str, key: str):
        self.fd, self.offset, self.length, self.path, self.key = fd, offset, length, path, key
        self.spent = 0
        small = length <= HEAD + TAIL  # one read of the whole blob
        self.head = self._pread(0, length if small else HEAD)
        self.tail_at = max(0, length - TAIL)
        self.tail = self.head[self.tail_at:] if small else self._pread(self.tail_at, length)

    def bad(self, what: str) -> MetadataError:
        return MetadataError(f"the torch.save payload of {self.key!r} at (offset, length) "
                             f"({self.offset}, {self.length}) is malformed: {what}; the file is corrupt: "
                             "re-copy or re-save it", path=self.path, key=self.key)

    def _pread(self, lo: int, hi: int) -> bytes:
        buf = bytearray(hi - lo)
        pread_into(self.fd, buf, self.offset + lo, path=self.path, key=self.key)
        self.spent += hi - lo
        return bytes(buf)

    def read(self, lo: int, hi: int, what: str) -> bytes:
        """Blob bytes [lo, hi), which must lie inside the blob."""
        if not 0 <= lo <= hi <= self.length:
            raise self.bad(f"{what} at bytes [{lo}, {hi}) lies outside the {self.length}-byte blob")
        if hi <= len(self.head):
            return self.head[lo:hi]
        if lo >= self.tail_at:
            return self.tail[lo - self.tail_at:hi - self.tail_at]
        return self._pread(lo, hi)


def _end_records(b: _Blob) -> tuple[int, int, int, int]:
    """(entries, directory size, directory offset, where the directory must end)."""
    tail = b.tail
    for p in range(len(tail) - _EOCD_LEN, max(-1, len(tail) - _EOCD_LEN - 65536), -1):
        if tail[p:p + 4] == b"PK\x05\x06" and p + _EOCD_LEN + int.from_bytes(tail[p + 20:p + 22], "little") \
                == len(tail):
            break
    else:
        raise b.bad(f"no end-of-central-directory record in its last {len(tail)} bytes")
    at = b.tail_at + p
    _, disk, cd_disk, n_disk, n, size, offset, _ = struct.unpack("<IHHHHIIH", tail[p:p + _EOCD_LEN])
    if disk or cd_disk or n_disk != n:
        raise b.bad("a multi-disk zip archive")
    if n != 0xFFFF and size != 0xFFFFFFFF and offset != 0xFFFFFFFF:
        return n, size, offset, at
    loc = b.read(at - _LOC_LEN, at, "the zip64 end locator")
    sig, _, rec, _ = struct.unpack("<IIQI", loc)
    if sig != _EOCD64_LOC:
        raise b.bad("the end record has saturated fields but no zip64 locator precedes it")
    raw = b.read(rec, rec + _EOCD64_LEN, "the zip64 end record")
    sig, _, _, _, _, _, n_disk, n, size, offset = struct.unpack("<IQHHIIQQQQ", raw)
    if sig != _EOCD64 or n_disk != n:
        raise b.bad(f"no valid zip64 end record at byte {rec}")
    return n, size, offset, rec


def _zip64(extra: bytes, fields: list[int], blob: _Blob) -> list[int]:
    """``fields`` (usize, csize, local offset) with saturated ones taken from the zip64 extra."""
    p = 0
    while p + 4 <= len(extra):
        kind, size = struct.unpack("<HH", extra[p:p + 4])
        body = extra[p + 4:p + 4 + size]
        if len(body) != size:
            raise blob.bad("a central directory extra field runs past its end")
        if kind == _ZIP64_EXTRA:
            q = 0
            for i, v in enumerate(fields):
                if v == 0xFFFFFFFF:
                    if q + 8 > size:
                        raise blob.bad("a zip64 extra field is too short for its saturated sizes")
                    fields[i] = int.from_bytes(body[q:q + 8], "little")
                    q += 8
        p += 4 + size
    if any(v == 0xFFFFFFFF for v in fields):
        raise blob.bad("saturated entry sizes without a zip64 extra field")
    return fields


def _directory(b: _Blob) -> tuple[dict[str, _Entry], list[str], int]:
    """The central directory's entries by name, their order, and the directory's offset."""
    n, size, offset, end = _end_records(b)
    if offset + size > end:
        raise b.bad(f"the central directory [{offset}, {offset + size}) overlaps its end record at {end}")
    if size > _DIR_LIMIT or n > size // _CENTRAL_LEN:
        raise b.bad(f"a central directory of {size} bytes for {n} entries (a torch.save blob of one "
                    "tensor has a few hundred bytes)")
    raw = b.read(offset, offset + size, "the central directory")
    entries: dict[str, _Entry] = {}
    order: list[str] = []
    p = 0
    for _ in range(n):
        if p + _CENTRAL_LEN > size or int.from_bytes(raw[p:p + 4], "little") != _CENTRAL:
            raise b.bad(f"no central directory entry at directory byte {p}")
        (_, _, _, flags, method, _, _, _, csize, usize, ln, le, lc, _, _, _,
         local) = struct.unpack("<IHHHHHHIIIHHHHHII", raw[p:p + _CENTRAL_LEN])
        q = p + _CENTRAL_LEN
        if q + ln + le + lc > size:
            raise b.bad(f"central directory entry at directory byte {p} runs past the directory")
        try:
            name = raw[q:q + ln].decode("utf-8")
        except UnicodeDecodeError:
            raise b.bad(f"an entry name that is not UTF-8: {raw[q:q + ln][:60]!r}") from None
        usize, csize, local = _zip64(raw[q + ln:q + ln + le], [usize, csize, local], b)
        if name in entries:
            raise b.bad(f"entry {name!r} appears twice")
        if local + _LOCAL_LEN > offset:
            raise b.bad(f"entry {name!r} has its local header at byte {local}, past the data section "
                        f"(which ends at {offset})")
        entries[name] = _Entry(name, method, flags, csize, usize, local)
        order.append(name)
        p = q + ln + le + lc
    return entries, order, offset


def _data(b: _Blob, e: _Entry, data_end: int, limit: int | None = None) -> tuple[int, bytes | None]:
    """(blob offset of entry ``e``'s data, its bytes when ``limit`` is given)."""
    if e.method != 0 or e.flags & 1:
        raise CannotNarrow(f"entry {e.name!r} is compressed or encrypted (method {e.method}, flags {e.flags:#x})")
    if e.csize != e.usize:
        raise b.bad(f"stored entry {e.name!r} has compressed size {e.csize} != size {e.usize}")
    head = b.read(e.local, e.local + _LOCAL_LEN, f"the local header of {e.name!r}")
    sig, ln, le = int.from_bytes(head[:4], "little"), *struct.unpack("<HH", head[26:30])
    if sig != _LOCAL:
        raise b.bad(f"no local header for {e.name!r} at byte {e.local}")
    name = b.read(e.local + _LOCAL_LEN, e.local + _LOCAL_LEN + ln, f"the local name of {e.name!r}")
    if name != e.name.encode("utf-8"):
        raise b.bad(f"the local header at byte {e.local} names {name[:60]!r}, the directory {e.name!r}")
    start = e.local + _LOCAL_LEN + ln + le
    if start + e.usize > data_end:
        raise b.bad(f"entry {e.name!r} claims {e.usize} bytes at [{start}, {start + e.usize}), past the data "
                    f"section (which ends at {data_end})")
    if limit is None:
        return start, None
    if e.usize > limit:
        raise CannotNarrow(f"entry {e.name!r} has {e.usize} bytes (more than {limit})")
    return start, b.read(start, start + e.usize, e.name)


# -- data.pkl ------------------------------------------------------------------------------
# The stand-ins below are Inert: BUILD on one (a {"numel": None} state on the storage
# reference, a slot state on a storage type) is refused while unpickling, not found later
# as a bare TypeError.
class _StorageType(Inert):
    __slots__ = ("dtype",)

    def __init__(self, dtype: str | None):
        self.dtype = dtype  # None: UntypedStorage (bytes; the dtype comes with the rebuild call)


@dataclass(frozen=True)
class _StorageRef(Inert):
    dtype: str | None
    key: str
    numel: int


class _Rebuilt(Inert):
    __slots__ = ("args", "version")

    def __init__(self, version: int, args: tuple[Any, ...]):
        self.version, self.args = version, args


def _rebuild_v2(*args: Any) -> _Rebuilt:
    return _Rebuilt(2, args)


def _rebuild_v3(*args: Any) -> _Rebuilt:
    return _Rebuilt(3, args)


class _DataPickle(_RestrictedUnpickler):
    """data.pkl of a one-tensor torch.save: the rebuild call, storage types, dtypes and the
    storage's persistent id become inert records. Any other name: CannotNarrow (torch.load
    with weights_only=True then decides)."""

    allowed = {("torch._utils", "_rebuild_tensor_v2"): charged(_rebuild_v2),
               ("torch._utils", "_rebuild_tensor_v3"): charged(_rebuild_v3),
               ("collections", "OrderedDict"): counted(dict)}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if (module, name) in (("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage")):
            return _StorageType(None)
        if module == "torch" and name in _TORCH_DTYPES:
            return _Dtype(name)
        raise CannotNarrow(f"data.pkl refers to {module[:200]}.{name[:200]}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)
                and type(pid[4]) is int and pid[4] >= 0):
            raise pickle.UnpicklingError(f"unexpected persistent id {short_repr(pid, 100)}")
        return _StorageRef(pid[1].dtype, pid[2], pid[4])


def _neutral(name: str) -> str:
    return _DTYPE_ALIASES.get(name, name)


def _rebuild_args(b: _Blob, obj: Any) -> tuple[_StorageRef, str, int, tuple[int, ...], tuple[int, ...]]:
    """(storage, dtype, storage offset, size, stride) of the rebuild call, checked."""
    if not isinstance(obj, _Rebuilt):
        raise MetadataError(f"the payload of {b.key!r} at (offset, length) ({b.offset}, {b.length}) holds a "
                            f"{type(obj).__name__}, not a tensor; the metadata and the file disagree: re-save "
                            "the checkpoint", path=b.path, key=b.key)
    args = obj.args
    n = 7 if obj.version == 3 else 6
    if len(args) not in (n, n + 1):
        raise b.bad(f"_rebuild_tensor_v{obj.version} called with {len(args)} arguments")
    storage, offset, size, stride = args[:4]
    extra = args[n] if len(args) > n else None
    if extra:
        raise CannotNarrow(f"the tensor carries metadata {short_repr(extra)}")
    if not isinstance(storage, _StorageRef):
        raise b.bad("the tensor's storage is not a persistent storage reference")
    ints = (type(offset) is int and offset >= 0 and isinstance(size, tuple) and isinstance(stride, tuple)
            and len(size) == len(stride) and all(type(v) is int and v >= 0 for v in size + stride))
    if not ints:
        raise b.bad(f"storage offset {short_repr(offset, 40)}, size {short_repr(size)}, stride "
                    f"{short_repr(stride)} are not "
                    "non-negative integers of one rank")
    if obj.version == 3:
        if not isinstance(args[6], _Dtype) or storage.dtype is not None:
            raise b.bad("_rebuild_tensor_v3 without a dtype over an untyped storage")
        dtype = _neutral(args[6].name)
    elif storage.dtype is None:
        raise b.bad("_rebuild_tensor_v2 over an untyped storage")
    else:
        dtype = storage.dtype
    if dtype not in DTYPE_NAMES:
        raise CannotNarrow(f"dtype {dtype!r}")
    return storage, dtype, offset, size, stride


def _unpickle(b: _Blob, raw: bytes) -> Any:
    try:
        return _DataPickle(io.BytesIO(raw), b.path).load()
    except CannotNarrow:
        raise
    except CheckpointError as e:  # memo bombs, element budget: keep the type, name the tensor
        raise type(e)(f"the data.pkl of {b.key!r}'s torch.save payload: {e.message}", path=b.path,
                      key=b.key) from None
    except Exception as e:  # noqa: BLE001 - unpickling corrupt bytes raises nearly anything
        raise b.bad(f"its data.pkl cannot be read ({type(e).__name__}: {str(e)[:200]})") from None


def parse_blob(fd: int, offset: int, length: int, *, path: str, key: str) -> tuple[BlobTensor, int]:
    """Where the tensor of the torch.save blob at (``offset``, ``length``) of ``fd`` lies, and
    the bytes read to learn it. The blob must lie inside the file (the caller checks).
    CannotNarrow (a reason) for layouts read whole; MetadataError for malformed blobs."""
    b = _Blob(fd, offset, length, path, key)
    if b.head[:4] != b"PK\x03\x04":
        raise CannotNarrow("not a zip archive (torch's legacy serialization)")
    entries, order, data_end = _directory(b)
    prefix = order[0].split("/", 1)[0] if order and "/" in order[0] else None
    pkl = entries.get(f"{prefix}/data.pkl")
    if pkl is None:
        raise b.bad(f"no data.pkl entry (entries: {order[:8]})")
    order_mark = entries.get(f"{prefix}/byteorder")
    if order_mark is not None:
        _, mark = _data(b, order_mark, data_end, limit=16)
        if mark == b"big":
            raise CannotNarrow("big-endian storage")
        if mark != b"little":
            raise b.bad(f"byteorder {mark!r}")
    _, raw = _data(b, pkl, data_end, limit=_PICKLE_LIMIT)
    storage, dtype, soff, size, stride = _rebuild_args(b, _unpickle(b, raw))
    entry = entries.get(f"{prefix}/data/{storage.key}")
    if entry is None:
        raise b.bad(f"data.pkl refers to storage {storage.key!r}, which has no data/ entry")
    width = itemsize(dtype)
    nbytes = storage.numel * (width if storage.dtype is not None else 1)
    if entry.usize != nbytes:
        raise b.bad(f"storage {storage.key!r} has {entry.usize} bytes but data.pkl says {storage.numel} "
                    f"{'items of ' + dtype if storage.dtype else 'bytes'} ({nbytes} bytes)")
    if math.prod(size):
        last = soff + sum((s - 1) * st for s, st in zip(size, stride, strict=True))
        if (last + 1) * width > nbytes:
            raise b.bad(f"a {dtype} tensor of size {list(size)}, stride {list(stride)} at storage offset "
                        f"{soff} reaches byte {(last + 1) * width} of its {nbytes}-byte storage")
    start, _ = _data(b, entry, data_end)
    return BlobTensor(dtype, size, stride, start + soff * width), b.spent


# torch's legacy format is five pickles back to back (magic number, protocol, system info,
# the object, the storage keys), then the storages' raw bytes
_LEGACY_PICKLES = 5


def check_blob_pickles(fd: int, offset: int, length: int, blob: bytes | bytearray, *, path: str, key: str) -> None:
    """Refuse the torch.save blob ``blob`` (read from (``offset``, ``length``) of ``fd``) when a
    pickle torch.load would unpickle from it fails ``scan_pickle``: torch.load, with
    weights_only or not, hashes and copies what the pickle builds in C, where a dict key of
    200,000 nested tuples overflowed the stack (SIGSEGV). UnsafePickleError for a bomb,
    MetadataError for anything else that cannot be checked."""
    b = _Blob(fd, offset, length, path, key)
    if b.head[:4] != b"PK\x03\x04":  # legacy: the pickles lie at the start, one after another
        data, at = bytes(blob), 0
        for i in range(_LEGACY_PICKLES):
            problem, at = scan_pickle(data, at)
            if problem:
                _refuse(b, problem, f"its pickle #{i + 1} (legacy format)")
        return
    entries, order, data_end = _directory(b)
    prefix = order[0].split("/", 1)[0] if order and "/" in order[0] else None
    pkl = entries.get(f"{prefix}/data.pkl")
    if pkl is None:
        raise b.bad(f"no data.pkl entry (entries: {short_repr(order[:8], 200)})")
    try:
        _, raw = _data(b, pkl, data_end, limit=length)
    except CannotNarrow as e:
        raise b.bad(f"its data.pkl cannot be checked before torch.load reads it ({e})") from None
    problem, _ = scan_pickle(raw or b"")
    if problem:
        _refuse(b, problem, "its data.pkl")


def _refuse(b: _Blob, problem: str, what: str) -> None:
    if is_bomb(problem):
        raise UnsafePickleError(f"{what} in the torch.save payload of {b.key!r} at (offset, length) "
                                f"({b.offset}, {b.length}): {problem}; refusing it before torch.load builds "
                                "anything. The file is corrupt or hostile: re-save the checkpoint",
                                path=b.path, key=b.key)
    raise b.bad(f"{what} cannot be unpickled ({problem})")

"""A restricted, bounded unpickler for torch.distributed.checkpoint's ``.metadata``.

It resolves only an allow-list of names, each to an inert stand-in defined here (a record
of its arguments): no torch class, function or constructor from the checkpoint runs, and
torch is not imported. Any other name raises UnsafePickleError before anything is built.

Bounds, checked before and while building (UnsafePickleError beyond them):
- memo indices: a walk over the opcodes (``memo_problem``) refuses a PUT or GET
  index beyond the entries stored so far. pickle numbers them 0, 1, 2, ...; the C
  unpickler grows its memo table to the index given, so one corrupted byte made
  ``b"\\x80\\x04}r\\x00\\x00\\x00\\x08."`` (13 bytes) allocate ~1.8 GB.
- elements built: each opcode builds at most one object, so what the pickle's own bytes
  pay for is bounded by its size; the stand-ins that copy a container (``torch.Size``,
  ``OrderedDict``, ``set``, keyword arguments, ``(dict, slots)`` state) charge its length
  to a budget of ``base_elements + elements_per_byte * len(pickle)``. Reusing one shared
  list in 50,000 ``torch.Size`` calls otherwise builds 50 million references from a few
  hundred kilobytes.

Subclass it to allow more names: extend ``allowed`` (a {(module, name): object} mapping)
or override ``find_class`` and call ``self.refuse(module, name)`` for names not allowed.
Wrap an allowed callable that copies its first argument with ``counted``.
"""

from __future__ import annotations

import contextvars
import io
import pickle
import pickletools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from .._dtypes import DTYPE_NAMES
from .._errors import MetadataError, UnsafePickleError

_DCP = "torch.distributed.checkpoint"


class _Budget:
    def __init__(self, limit: int, path: str):
        self.left = limit
        self.limit = limit
        self.path = path

    def charge(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise UnsafePickleError(
                f"the pickle builds more than {self.limit} elements by copying shared containers, far more "
                "than its size accounts for (a memory bomb or a corrupt file); refusing it",
                path=self.path)


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("dcp_reader_unpickle_budget",
                                                                        default=None)


def charge(n: int) -> None:
    """Charge ``n`` built elements to the unpickling in progress (none outside ``load``)."""
    budget = _BUDGET.get()
    if budget is not None:
        budget.charge(n)


def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` charging the length of its first argument and its keyword count (it copies them)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        n = len(kwargs) + len(args)
        if args:
            try:
                n += len(args[0])
            except TypeError:
                pass  # not a container: nothing copied
        charge(n)
        return fn(*args, **kwargs)

    call.__name__ = getattr(fn, "__name__", "counted")
    return call


class _Record:
    """Inert stand-in for an allowed class: keeps constructor args and pickled state."""

    qualname = "?"
    args: tuple[Any, ...] = ()
    state: Any = None

    # pickle's NEWOBJ calls __new__ without __init__: record the arguments here
    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:
        charge(len(kwargs))
        obj = super().__new__(cls)
        obj.args = args
        obj.state = dict(kwargs)
        return obj

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], (dict, type(None))):
            first, second = state[0] or {}, state[1] or {}
            charge(len(first) + (len(second) if isinstance(second, dict) else 1))
            state = {**first, **second}  # (dict, slots) form
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
    __slots__ = ("name",)  # no __dict__: a pickled BUILD cannot copy state into it

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
    ("torch", "Size"): counted(_size),
    ("torch.serialization", "_get_layout"): _opaque,
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"): _opaque,
    ("pathlib", "PosixPath"): _opaque,
    ("pathlib", "WindowsPath"): _opaque,
    ("pathlib", "PurePosixPath"): _opaque,
    ("collections", "OrderedDict"): counted(dict),
    ("builtins", "set"): counted(set),
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

# How each opcode's argument is laid out, from pickletools' table: a fixed byte count (>= 0),
# or one of pickletools' codes: -1 up to a newline, -2/-3/-4/-5 a length prefix of 1/4/4/8
# bytes. A walk that only skips arguments was 2.6x faster than pickletools.genops, which
# decodes every one (a 9.5 MB torch DCP metadata of 64,000 chunks, on a 2-core machine at
# load average 16: 5.2 s against 13.5 s, while unpickling it took 19 s).
_ARG: dict[int, int] = {}
_LINES: dict[int, int] = {}
for _op in pickletools.opcodes:
    _code = ord(_op.code.encode("latin-1"))
    _ARG[_code] = _op.arg.n if _op.arg is not None else 0
    _LINES[_code] = 2 if _op.name in ("GLOBAL", "INST") else 1
_PUT_1 = {ord("q"): 1, ord("r"): 4}  # BINPUT, LONG_BINPUT: little-endian index
_GET_1 = {ord("h"): 1, ord("j"): 4}  # BINGET, LONG_BINGET
_PUT_TEXT, _GET_TEXT, _MEMOIZE, _STOP = ord("p"), ord("g"), ord("\x94"), ord(".")


def memo_problem(data: bytes) -> str | None:
    """Why ``data``'s memo indices could make an unpickler allocate by them (an index past the
    entries stored so far; pickle numbers them 0, 1, 2, ...), or a malformed opcode; None
    when fine. Walks the opcodes without building anything."""
    stored = pos = 0
    end = len(data)
    while pos < end:
        code = data[pos]
        n = _ARG.get(code)
        if n is None:
            return f"unknown pickle opcode {code:#x} at byte {pos}"
        at, pos = pos, pos + 1
        if code == _STOP:
            return None
        if n >= 0:
            index = None
            if code in _PUT_1 or code in _GET_1:
                index = int.from_bytes(data[pos:pos + n], "little")
            pos += n
        elif n == -1:
            index = None
            for _ in range(_LINES[code]):
                nl = data.find(b"\n", pos)
                if nl < 0:
                    return f"unterminated argument of opcode {code:#x} at byte {at}"
                if code in (_PUT_TEXT, _GET_TEXT):
                    try:
                        index = int(data[pos:nl])
                    except ValueError:
                        return f"bad memo index {data[pos:nl][:20]!r} at byte {at}"
                pos = nl + 1
        else:
            width = {-2: 1, -3: 4, -4: 4, -5: 8}[n]
            length = int.from_bytes(data[pos:pos + width], "little", signed=n == -3)
            pos += width + length
            index = None
        if code == _MEMOIZE:
            stored += 1
        elif index is not None:
            put = code in _PUT_1 or code == _PUT_TEXT
            if index > stored or (not put and index == stored) or index < 0:
                return (f"memo index {index} at byte {at} but only {stored} entries were stored before it "
                        "(pickle numbers them in order)")
            stored += put and index == stored
    return f"no STOP opcode before the end ({end} bytes): the pickle is truncated"


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickles ``f`` (a binary file, read whole: the caller bounds its size) resolving only
    ``allowed`` names, within the bounds above. ``path`` names the file in errors."""

    allowed: ClassVar[Mapping[tuple[str, str], Any]] = _ALLOWED
    base_elements: ClassVar[int] = 65536
    elements_per_byte: ClassVar[int] = 2

    def __init__(self, f: Any, path: str):
        self._data = f.read()
        super().__init__(io.BytesIO(self._data))
        self._path = path

    def load(self) -> Any:
        self._prescan()
        token = _BUDGET.set(_Budget(self.base_elements + self.elements_per_byte * len(self._data), self._path))
        try:
            return super().load()
        finally:
            _BUDGET.reset(token)

    def _prescan(self) -> None:
        """Refuse out-of-order memo indices before the C unpickler sizes its table by them."""
        problem = memo_problem(self._data)
        if problem and problem.startswith("memo index"):
            raise UnsafePickleError(f"{problem}; the file is corrupt. Refusing it before building anything",
                                    path=self._path)
        if problem:
            raise MetadataError(f"cannot read the pickled metadata ({problem}); the file is corrupt or "
                                "truncated", path=self._path)

    def refuse(self, module: str, name: str) -> UnsafePickleError:
        return UnsafePickleError(
            f"the pickled metadata refers to {module}.{name}, which is not a torch.distributed.checkpoint "
            "metadata class; refusing to load it (nothing was executed). If you trust this checkpoint, "
            "convert it with torch.distributed.checkpoint itself", path=self._path, key=f"{module}.{name}")

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and name in _TORCH_DTYPES:
            return _Dtype(name)
        raise self.refuse(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"persistent id {pid!r:.80} in the metadata pickle; refusing it",
                                path=self._path)

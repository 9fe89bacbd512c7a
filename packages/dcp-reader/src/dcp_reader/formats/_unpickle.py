"""A restricted, bounded unpickler for torch.distributed.checkpoint's ``.metadata``.

It resolves only an allow-list of names, each to an inert stand-in defined here (a record
of its arguments): no torch class, function or constructor from the checkpoint runs, and
torch is not imported. Any other name raises UnsafePickleError before anything is built.

Bounds, checked before and while building (UnsafePickleError beyond them):
- before: a walk over the opcodes (``_pickle_scan.scan_pickle``) refuses length prefixes that
  are negative or run past the end, memo indices out of order (one corrupted byte made a
  13-byte pickle allocate ~1.8 GB), nesting deeper than ``MAX_DEPTH`` (hashing a dict key
  of 200,000 nested tuples overflowed the C stack) and calls that would copy shared
  containers beyond the budget below.
- elements built: each opcode builds at most one object, so what the pickle's own bytes
  pay for is bounded by its size; every allowed callable copies its arguments (a ``*args``
  tuple is a new tuple per call) and the stand-ins that copy a container (``torch.Size``,
  ``OrderedDict``, ``set``, keyword arguments, ``(dict, slots)`` state) copy that too: each
  copy is charged to a budget of ``base_elements + elements_per_byte * len(pickle)``. One
  20,000-element tuple passed to 5,000 calls otherwise built 100 million references (780 MiB)
  from a 45 KB pickle.
- stand-ins that take no state (dtypes, storage types and references, the allowed
  callables, whose attributes every later load would see) refuse BUILD.

Subclass it to allow more names: extend ``allowed`` (a {(module, name): object} mapping)
or override ``find_class`` and call ``self.refuse(module, name)`` for names not allowed.
Wrap every allowed callable with ``charged``, or with ``counted`` when it also copies its
first argument; a stand-in class derives from ``_Record`` (which charges its arguments) or
from ``Inert`` (which refuses BUILD).
"""

from __future__ import annotations

import contextvars
import io
import pickle
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from .._dtypes import DTYPE_NAMES
from .._errors import MetadataError, UnsafePickleError, short_repr
from ._pickle_scan import MAX_DEPTH, scan_pickle

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


class Inert:
    """Base of stand-ins that hold no pickled state: BUILD on one is refused (it would set
    their fields to anything after they were checked, or the attributes of a function
    shared by every later load)."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"BUILD (set state) on a {type(self).__name__.lstrip('_')} "
                                     f"stand-in, which takes none: state {short_repr(state, 60)}")


class _Charged(Inert):
    """An allowed callable that charges what a call copies: its argument and keyword counts
    (a call packs them into a new tuple and dict) and, with ``first``, the length of its
    first argument (``fn`` copies it). An object, not a function: BUILD on it is refused."""

    __slots__ = ("fn", "first")

    def __init__(self, fn: Callable[..., Any], first: bool):
        self.fn, self.first = fn, first

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        n = len(kwargs) + len(args)
        if self.first and args:
            try:
                n += len(args[0])
            except TypeError:
                pass  # not a container: nothing copied
        charge(n)
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<allowed {getattr(self.fn, '__name__', '?')}>"


def charged(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as an allowed callable charging its argument and keyword counts."""
    return _Charged(fn, first=False)


def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` charging its arguments and the length of its first one (it copies them)."""
    return _Charged(fn, first=True)


class _Record:
    """Inert stand-in for an allowed class: keeps constructor args and pickled state."""

    qualname = "?"
    args: tuple[Any, ...] = ()
    state: Any = None

    # pickle's NEWOBJ calls __new__ without __init__: record the arguments here
    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:
        charge(len(args) + len(kwargs))  # both are copies made for this call
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


class _Dtype(Inert):
    __slots__ = ("name",)  # no __dict__, and Inert refuses BUILD

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
    ("torch.serialization", "_get_layout"): charged(_opaque),
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"): charged(_opaque),
    ("pathlib", "PosixPath"): charged(_opaque),
    ("pathlib", "WindowsPath"): charged(_opaque),
    ("pathlib", "PurePosixPath"): charged(_opaque),
    ("collections", "OrderedDict"): counted(dict),
    ("builtins", "set"): counted(set),
    ("copyreg", "_reconstructor"): charged(_reconstructor),
    ("builtins", "object"): object,  # a C type: a call takes the unpickler's tuple, no copy
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

def memo_problem(data: bytes) -> str | None:
    """Why ``data`` must not be unpickled (``scan_pickle``: lengths, memo indices, nesting,
    malformed opcodes); None when fine. Builds nothing."""
    return scan_pickle(data)[0]


def is_bomb(problem: str) -> bool:
    """A scan problem that makes an unpickler allocate or recurse without bound (refused as
    UnsafePickleError), rather than plain corruption (MetadataError)."""
    return problem.startswith(("memo index", "nesting", "calls that copy"))


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickles ``f`` (a binary file, read whole: the caller bounds its size) resolving only
    ``allowed`` names, within the bounds above. ``path`` names the file in errors."""

    allowed: ClassVar[Mapping[tuple[str, str], Any]] = _ALLOWED
    base_elements: ClassVar[int] = 65536
    elements_per_byte: ClassVar[int] = 2
    max_depth: ClassVar[int] = MAX_DEPTH

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
        """Refuse what ``scan_pickle`` finds before the C unpickler reads a byte."""
        problem, _ = scan_pickle(self._data, max_depth=self.max_depth)
        if problem and is_bomb(problem):
            raise UnsafePickleError(f"{problem}; the file is corrupt. Refusing it before building anything",
                                    path=self._path)
        if problem:
            raise MetadataError(f"cannot read the pickled metadata ({problem}); the file is corrupt or "
                                "truncated", path=self._path)

    def refuse(self, module: str, name: str) -> UnsafePickleError:
        module, name = module[:200], name[:200]
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
        raise UnsafePickleError(f"persistent id {short_repr(pid)} in the metadata pickle; refusing it",
                                path=self._path)

"""Neutral dtype names (torch's names, as dcp-platform uses them) and their safetensors codes."""

from __future__ import annotations

from typing import Any

from ._errors import UnknownDtypeError

# neutral name -> (itemsize in bytes, safetensors code)
_DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "F64"),
    "float32": (4, "F32"),
    "float16": (2, "F16"),
    "bfloat16": (2, "BF16"),
    "float8_e4m3fn": (1, "F8_E4M3"),
    "float8_e5m2": (1, "F8_E5M2"),
    "int64": (8, "I64"),
    "int32": (4, "I32"),
    "int16": (2, "I16"),
    "int8": (1, "I8"),
    "uint64": (8, "U64"),
    "uint32": (4, "U32"),
    "uint16": (2, "U16"),
    "uint8": (1, "U8"),
    "bool": (1, "BOOL"),
    "complex64": (8, "C64"),
}
_FROM_CODE = {code: name for name, (_, code) in _DTYPES.items()}

DTYPE_NAMES: frozenset[str] = frozenset(_DTYPES)

# numpy has no native type for these; their bits are handed out as an unsigned integer of
# the same width unless a numpy dtype of that name is registered (ml_dtypes, MindSpore).
_NUMPY_BITS = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


def is_dtype_name(name: object) -> bool:
    return isinstance(name, str) and name in _DTYPES


def itemsize(name: str) -> int:
    try:
        return _DTYPES[name][0]
    except KeyError:
        raise UnknownDtypeError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}", key=None) from None


def to_safetensors(name: str) -> str:
    """Neutral name -> safetensors code ("bfloat16" -> "BF16")."""
    try:
        return _DTYPES[name][1]
    except KeyError:
        raise UnknownDtypeError(f"dtype {name!r} has no safetensors code; known: {sorted(_DTYPES)}") from None


def from_safetensors(code: str, *, path: str | None = None, key: str | None = None) -> str:
    """safetensors code -> neutral name; UnknownDtypeError naming the file and key."""
    try:
        return _FROM_CODE[code]
    except (KeyError, TypeError):
        raise UnknownDtypeError(
            f"tensor {key!r} has dtype {code!r}, which dcp-reader cannot represent "
            f"(known safetensors dtypes: {sorted(_FROM_CODE)}); convert it when saving",
            path=path, key=key) from None


def numpy_dtype(name: str) -> Any:
    """The numpy dtype for a neutral name. bfloat16/float8 use a registered numpy type of
    that name when one exists (ml_dtypes, or MindSpore once imported), otherwise the raw
    bits as an unsigned integer of the same width."""
    import numpy as np

    if name in _NUMPY_BITS:
        try:
            return np.dtype(name)
        except TypeError:
            pass
        dt = _registered_numpy_type(name)
        return dt if dt is not None else np.dtype(_NUMPY_BITS[name])
    itemsize(name)  # raises UnknownDtypeError for unknown names
    return np.dtype(name)


def numpy_bits_dtype(name: str) -> Any:
    """The numpy dtype that holds ``name``'s values or, for bfloat16/float8, their raw bits."""
    import numpy as np

    itemsize(name)  # raises UnknownDtypeError for unknown names
    return np.dtype(_NUMPY_BITS.get(name, name))


def _registered_numpy_type(name: str) -> Any:
    import sys

    import numpy as np

    ml = sys.modules.get("ml_dtypes")
    if ml is not None and hasattr(ml, name):
        return np.dtype(getattr(ml, name))
    if name == "bfloat16" and "mindspore" in sys.modules:
        try:
            from mindspore.common import np_dtype  # registered by MindSpore >= 2.3
            return np.dtype(np_dtype.bfloat16)
        except (ImportError, AttributeError):
            return None
    return None


def torch_dtype_name(dtype: Any) -> str:
    """Neutral name of a torch dtype ("torch.bfloat16" -> "bfloat16"), without importing torch."""
    name = str(dtype).removeprefix("torch.")
    return name

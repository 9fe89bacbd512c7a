"""Non-tensor values in JSON, without pickle: tuples and non-string dict keys included.

JSON has no tuple and only string keys, yet state dicts hold both (an optimizer's
``param_groups[i]["betas"]`` is a tuple; ``optimizer.state_dict()["state"]`` has int keys).
They are written as single-key tagged objects that decode back to the same Python value;
no code runs on decoding, whatever the file holds.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["decode_value", "encode_value", "is_storable_value"]

_TUPLE = "__tuple__"
_MAP = "__map__"  # a dict whose keys are not all str, or that could be mistaken for a tag
_FLOAT = "__float__"  # nan, inf and -inf, which strict JSON has no literal for
_SCALARS = (str, int, float, bool, type(None))


def is_storable_value(value: Any) -> bool:
    """True when ``encode_value`` can store ``value`` so that it decodes equal and alike."""
    if isinstance(value, _SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_storable_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, _SCALARS + (tuple,)) and is_storable_value(k) and is_storable_value(v)
                   for k, v in value.items())
    return False


def _plain_dict(value: dict[Any, Any]) -> bool:
    return all(isinstance(k, str) for k in value) and not (
        len(value) == 1 and next(iter(value)) in (_TUPLE, _MAP, _FLOAT))


def encode_value(value: Any) -> Any:
    """A strict-JSON document for a value that ``is_storable_value`` accepts."""
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT: repr(value)}
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, tuple):
        return {_TUPLE: [encode_value(v) for v in value]}
    if isinstance(value, dict):
        if _plain_dict(value):
            return {k: encode_value(v) for k, v in value.items()}
        return {_MAP: [[encode_value(k), encode_value(v)] for k, v in value.items()]}
    raise TypeError(f"cannot store a {type(value).__module__}.{type(value).__qualname__} as JSON")


def decode_value(doc: Any) -> Any:
    """The value ``encode_value`` stored; ValueError on a malformed tag."""
    if isinstance(doc, list):
        return [decode_value(v) for v in doc]
    if not isinstance(doc, dict):
        return doc
    if len(doc) == 1:
        tag, body = next(iter(doc.items()))
        if tag == _TUPLE:
            if not isinstance(body, list):
                raise ValueError(f"{_TUPLE} must hold a list, got {type(body).__name__}")
            return tuple(decode_value(v) for v in body)
        if tag == _MAP:
            if not isinstance(body, list) or not all(isinstance(p, list) and len(p) == 2 for p in body):
                raise ValueError(f"{_MAP} must hold [key, value] pairs")
            return {decode_value(k): decode_value(v) for k, v in body}
        if tag == _FLOAT:
            if body not in ("nan", "inf", "-inf"):
                raise ValueError(f"{_FLOAT} must be 'nan', 'inf' or '-inf', got {body!r}")
            return float(body)
    return {k: decode_value(v) for k, v in doc.items()}

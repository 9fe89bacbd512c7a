"""Flattening a nested state dict into checkpoint names, and the ``Chunk`` annotation.

Names follow torch.distributed.checkpoint's flattening (``_traverse.traverse_state_dict``
since torch 2.4), so that the keys of a checkpoint saved by either tool match:

* a mapping is always descended into; its keys become ``str(key)``;
* a list is descended into (element names ``"0"``, ``"1"``...) only when it holds a tensor,
  a mapping, or a list that is itself descended into; otherwise the whole list is one value;
* anything else (tuples included) is a leaf.

Leaves that are tensors are loaded in place; other leaves are replaced in their container.
Two kinds of leaf are neither, and ``unsupported_values`` names them so that ``load``
refuses them before anything is written: objects with state of their own (a module, an
optimizer, a scheduler: anything with ``state_dict`` and ``load_state_dict``), which a
replacement would silently drop, and arrays of other libraries (numpy), which cannot be
written in place.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._flat import Flat

__all__ = ["Chunk", "Flat", "Leaf", "flatten_state_dict", "is_tensor", "unsupported_values"]


def _shape_of(tensor: Any) -> tuple[int, ...]:
    shape = getattr(tensor, "shape", None)
    if shape is None:
        raise TypeError(f"Chunk.tensor must be a tensor with a .shape, got {type(tensor).__qualname__}")
    return tuple(int(s) for s in shape)


@dataclass(frozen=True)
class Chunk:
    """A tensor that holds the box ``[offsets, offsets + tensor.shape)`` of a global tensor.

    This is how a MindSpore tensor, or a torch tensor sharded by hand, says which part of
    the checkpoint's ``global_shape`` tensor it holds. ``load`` fills ``tensor`` in place;
    ``save`` writes it as one chunk of the global tensor.
    """

    tensor: Any
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        try:
            global_shape = tuple(int(s) for s in self.global_shape)
            offsets = tuple(int(o) for o in self.offsets)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"Chunk: global_shape and offsets must be sequences of ints, got "
                f"global_shape={self.global_shape!r}, offsets={self.offsets!r}"
            ) from exc
        object.__setattr__(self, "global_shape", global_shape)
        object.__setattr__(self, "offsets", offsets)
        local = _shape_of(self.tensor)
        if not (len(global_shape) == len(offsets) == len(local)):
            raise ValueError(
                f"Chunk: tensor of shape {local}, global_shape {global_shape} and offsets "
                f"{offsets} must have the same number of dimensions"
            )
        bad = [d for d, (o, n, g) in enumerate(zip(offsets, local, global_shape, strict=True)) if o < 0 or o + n > g]
        if bad:
            raise ValueError(
                f"Chunk: the box offsets={offsets} shape={local} does not fit in global_shape "
                f"{global_shape} along dimension(s) {bad}; offsets + shape must be <= global_shape"
            )

    @property
    def sizes(self) -> tuple[int, ...]:
        """The shape of the box this chunk holds (the local tensor's shape)."""
        return _shape_of(self.tensor)


def is_tensor(value: Any) -> bool:
    """A value that is loaded in place: a torch or MindSpore tensor (a DTensor and a torch
    ShardedTensor included, both ``torch.Tensor`` subclasses), a ``Chunk`` or a ``Flat``.

    Decided by type, subclasses included (torch ``nn.Parameter``; MindSpore ``Parameter``,
    whose class reports module ``abc``, so the module name cannot decide). Frameworks are
    looked up only when already imported, so none is imported here.
    """
    if isinstance(value, (Chunk, Flat)):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return True
    ms = sys.modules.get("mindspore")
    return ms is not None and isinstance(value, ms.Tensor)


@dataclass(frozen=True)
class Leaf:
    """One flattened entry: its name, its value, and where it sits (to replace non-tensors)."""

    name: str
    value: Any
    container: Any
    key: Any
    #: the keys from the state dict's top down (torch DCP's ``planner_data`` entry of ``name``)
    keys: tuple[Any, ...] = ()

    def replace(self, new: Any) -> None:
        """Put ``new`` where this leaf's value sits (used for non-tensor values)."""
        self.container[self.key] = new


def _descends(value: Any) -> bool:
    """Whether flattening goes inside ``value`` (torch's ``not _is_terminal``)."""
    if isinstance(value, Mapping):
        return True
    if not isinstance(value, list):
        return False
    return any(is_tensor(v) or _descends(v) for v in value)


def _walk(path: str, value: Any, container: Any, key: Any, keys: tuple[Any, ...]) -> Iterator[Leaf]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _walk(f"{path}.{k}", v, value, k, (*keys, k))
    elif _descends(value):
        for i, v in enumerate(value):
            yield from _walk(f"{path}.{i}", v, value, i, (*keys, i))
    else:
        yield Leaf(path, value, container, key, keys)


def flatten_state_dict(state_dict: Mapping[Any, Any]) -> list[Leaf]:
    """The leaves of ``state_dict`` under torch.distributed.checkpoint's flattened names.

    Raises ``ValueError`` when two entries flatten to the same name (for example a key
    ``"a.b"`` next to ``{"a": {"b": ...}}``), naming both.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping (dict), got {type(state_dict).__qualname__}")
    leaves: list[Leaf] = []
    seen: set[str] = set()
    for k, v in state_dict.items():
        for leaf in _walk(str(k), v, state_dict, k, (k,)):
            if leaf.name in seen:
                raise ValueError(
                    f"two state dict entries flatten to the same name {leaf.name!r}; rename one "
                    "(nested keys are joined with '.')"
                )
            seen.add(leaf.name)
            leaves.append(leaf)
    return leaves



def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _unsupported_kind(value: Any) -> tuple[str, str] | None:
    """("stateful" or "array", the offending type) or None for a non-tensor leaf (the items
    of lists and tuples looked into)."""
    if isinstance(value, (list, tuple)):
        inner = next((k for k in map(_unsupported_kind, value) if k), None)
        return None if inner is None else (inner[0], f"{_type_name(value)} holding {inner[1]}")
    if is_tensor(value) or isinstance(value, type):
        return None
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return "stateful", _type_name(value)  # torch nn.Module, Optimizer, LR scheduler, a torch DCP Stateful
    ms = sys.modules.get("mindspore")
    if ms is not None and isinstance(value, ms.nn.Cell):
        return "stateful", _type_name(value)
    if hasattr(value, "__dlpack__") or (hasattr(value, "__array_interface__") and getattr(value, "ndim", 0) > 0):
        return "array", _type_name(value)  # numpy (its scalars are values: no __dlpack__, ndim 0)
    return None


def unsupported_values(leaves: Sequence[Leaf]) -> tuple[list[str], list[Leaf]]:
    """(errors, the other leaves) for the non-tensor ``leaves`` of a state dict to load into:
    one error per kind of unsupported entry, naming every such key and its type."""
    found: dict[str, list[str]] = {}
    keep: list[Leaf] = []
    for leaf in leaves:
        kind = _unsupported_kind(leaf.value)
        if kind is None:
            keep.append(leaf)
        else:
            found.setdefault(kind[0], []).append(f"{leaf.name!r}: {kind[1]}")
    errors = []
    if "stateful" in found:
        errors.append(
            f"{len(found['stateful'])} state dict entr(ies) hold an object with its own state (a module, optimizer "
            f"or scheduler), which load neither fills nor may replace: {_listed(found['stateful'])}; put its "
            "state_dict() there instead (for a model and its optimizer: torch.distributed.checkpoint.state_dict."
            "get_state_dict) and hand the loaded state back with load_state_dict (or set_state_dict)")
    if "array" in found:
        errors.append(
            f"{len(found['array'])} state dict entr(ies) hold an array that load cannot write in place "
            f"(it writes torch and MindSpore tensors): {_listed(found['array'])}; put torch.from_numpy(array) "
            "there, which shares the array's memory, so the array is filled")
    return errors, keep


def _listed(items: Sequence[str], limit: int = 20) -> str:
    return ", ".join(items[:limit]) + (f" ... and {len(items) - limit} more" if len(items) > limit else "")

"""An inference engine's weights as ``transfer`` destinations.

An engine (vLLM, SGLang) holds plain tensors, each its tensor-parallel shard of a named
parameter, and knows each parameter's full shape and which dimension its rank splits.
``engine_shards`` turns ``{name: (tensor, offsets)}`` into ``Chunk``s of the given global
shapes, checked per name; ``tp_offsets`` gives a shard's offsets from its rank in an even
split. A fused parameter (``qkv``, ``gate_up``) is one destination whose source is
composed with ``sources=`` as for any ``transfer``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..layouts._state import Chunk, is_tensor

__all__ = ["engine_shards", "tp_offsets"]


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"tp_offsets: {what} must be an int, got {value!r}")
    return value


def tp_offsets(global_shape: Sequence[int], dim: int | None, rank: int, size: int) -> tuple[int, ...]:
    """The offsets of tensor-parallel rank ``rank``'s shard among ``size`` even shards of
    ``global_shape`` along ``dim`` (None: replicated, all zeros; negative: from the end)."""
    shape = tuple(int(s) for s in global_shape)
    rank, size = _int(rank, "rank"), _int(size, "size")
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tp_offsets: rank must be in [0, {size}) and size >= 1, got rank={rank}, size={size}")
    if dim is None:
        return (0,) * len(shape)
    dim = _int(dim, "dim")
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"tp_offsets: dim {dim} is out of range for global_shape {shape} ({len(shape)} "
                         "dimension(s))")
    d = dim % len(shape)
    if shape[d] % size:
        raise ValueError(f"tp_offsets: dimension {dim} of global_shape {shape} does not split evenly into {size} "
                         "shards; pass offsets of your own")
    return tuple(rank * shape[d] // size if i == d else 0 for i in range(len(shape)))


def _one(name: str, value: Any, shape: Any) -> Chunk:
    if isinstance(value, Chunk):
        if shape is not None and tuple(shape) != value.global_shape:
            raise ValueError(f"engine_shards: {name!r} is a Chunk of global_shape {value.global_shape} but "
                             f"global_shapes gives {tuple(shape)}")
        return value
    if isinstance(value, tuple) and len(value) == 2 and is_tensor(value[0]):
        tensor, offsets = value
    elif is_tensor(value):
        tensor, offsets = value, (0,) * len(tuple(value.shape))
        if shape is not None and tuple(tensor.shape) != tuple(shape):  # a shard passed alone would land at 0
            raise ValueError(f"engine_shards: {name!r} is a plain tensor of shape {tuple(tensor.shape)} but "
                             f"global_shapes gives {tuple(shape)}: a plain tensor stands for the whole parameter; "
                             "pass a shard as (tensor, offsets), e.g. offsets from tp_offsets")
    else:
        raise TypeError(f"engine_shards: {name!r} must be (tensor, offsets), a Chunk or a tensor, got "
                        f"{type(value).__name__}")
    if shape is None:
        raise ValueError(f"engine_shards: {name!r} has no entry in global_shapes; give the parameter's full "
                         "(unsharded) shape")
    try:
        return Chunk(tensor, tuple(shape), tuple(offsets))
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"engine_shards: {name!r}: {exc}") from None


def engine_shards(shards: Mapping[str, Any], global_shapes: Mapping[str, Sequence[int]] | None = None
                  ) -> dict[str, Chunk]:
    """``transfer`` destinations from an engine's shards: ``{name: (tensor, offsets)}`` (or a
    ``Chunk``, or a tensor: at offsets 0) with ``global_shapes[name]`` the parameter's full
    shape. Each tensor is filled in place; every problem names its key."""
    shapes = dict(global_shapes or {})
    unknown = sorted(set(shapes) - set(shards))
    if unknown:
        raise ValueError(f"engine_shards: global_shapes names {unknown[:5]} that shards lacks")
    return {name: _one(name, value, shapes.get(name)) for name, value in shards.items()}

"""torch's ``ShardedTensor`` (``torch.distributed._shard.sharded_tensor``, what FSDP1's
``SHARDED_STATE_DICT`` holds) as a target: each local shard is one box of the global tensor.

The boxes are read from torch's own metadata, never re-derived from a sharding spec: shard
``k`` of ``local_shards()`` holds ``[shard_offsets, shard_offsets + shard_sizes)`` of the
tensor of ``metadata().size``. A rank may hold several shards (each its own tensor) or none.
``load`` writes each shard's tensor in place; ``save`` writes each one as a chunk.

torch's sharded tensor module is looked up only when already imported: a ShardedTensor
cannot exist without it, so nothing here imports it for a state dict that holds none.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from ._targets import Box, Target, adapter_for

__all__ = ["ShardedTarget", "is_sharded_tensor", "sharded_target"]

_MODULE = "torch.distributed._shard.sharded_tensor.api"


def is_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch ShardedTensor (its module is not imported to find out)."""
    module = sys.modules.get(_MODULE)
    if module is None:
        return False
    kind = getattr(module, "ShardedTensorBase", None) or module.ShardedTensor
    return isinstance(value, kind)


@dataclass(frozen=True)
class ShardedTarget(Target):
    """A target whose box ``k`` is the whole of ``shards[k]`` (``local`` is the first shard,
    or an empty tensor of the dtype where this rank holds none)."""

    shards: tuple[Any, ...] = ()

    @property
    def ties(self) -> bool:
        """Whether another key may share this target's memory exactly (``_aliases``): only
        a one-shard target is one tensor, so only it can be the same memory as another."""
        return len(self.shards) == 1

    def view(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        offsets, sizes = tuple(offsets), tuple(sizes)
        for box, shard in zip(self.boxes, self.shards, strict=True):
            if box.contains(offsets, sizes):
                rel = tuple(o - b for o, b in zip(offsets, box.offsets, strict=True))
                return self.adapter.view(shard, rel, sizes)
        raise ValueError(f"{self.name!r}: the global box offsets={offsets} sizes={sizes} lies inside none of "
                         f"this rank's ShardedTensor shards {[(b.offsets, b.sizes) for b in self.boxes]}")


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def sharded_target(name: str, value: Any) -> ShardedTarget:
    """The target of a ShardedTensor state dict entry: one box per local shard, placed by
    the shard's own metadata (``shard_offsets``, ``shard_sizes``) in ``metadata().size``."""
    meta = value.metadata()
    global_shape = _ints(meta.size)
    boxes, shards = [], []
    for shard in value.local_shards():
        tensor = shard.tensor.detach() if shard.tensor.requires_grad else shard.tensor
        offsets, sizes = _ints(shard.metadata.shard_offsets), _ints(shard.metadata.shard_sizes)
        if _ints(tensor.shape) != sizes or len(offsets) != len(global_shape):
            raise ValueError(f"{name!r}: a ShardedTensor's local shard of shape {_ints(tensor.shape)} has the "
                             f"metadata offsets {offsets}, sizes {sizes} in a tensor of {global_shape}; they "
                             "must agree")
        if 0 in sizes:
            continue  # holds nothing (torch places an empty chunk past the end: offset 6 of 5 columns)
        boxes.append(Box(offsets, sizes, (0,) * len(sizes)))
        shards.append(tensor)
    local = shards[0] if shards else _empty_like(meta)
    adapter = adapter_for(local)
    dtypes = {adapter.dtype_name(s) for s in shards}
    if len(dtypes) > 1:
        raise ValueError(f"{name!r}: the ShardedTensor's local shards have several dtypes {sorted(dtypes)}")
    return ShardedTarget(name, global_shape, tuple(boxes), adapter.dtype_name(local), local, adapter,
                         shards=tuple(shards))


def _empty_like(meta: Any) -> Any:
    """An empty tensor of the ShardedTensor's dtype, on the device type its shards are
    placed on: what a rank holding no shard names it with."""
    import torch

    placed = [m.placement for m in meta.shards_metadata if m.placement is not None]
    device = placed[0].device().type if placed else "cpu"
    return torch.empty(0, dtype=meta.tensor_properties.dtype, device=device)

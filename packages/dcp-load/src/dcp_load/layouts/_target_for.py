"""The target of one state dict leaf: a plain tensor, a ``Chunk``, a DTensor, a torch ShardedTensor
or a ``Flat``."""

from __future__ import annotations

from ._flat_target import flat_target
from ._sharded import is_sharded_tensor, sharded_target
from ._state import Chunk, Flat, Leaf
from ._targets import Target, adapter_for, dtensor_boxes, is_dtensor

__all__ = ["target_for"]


def target_for(leaf: Leaf) -> Target:
    """The target of a tensor leaf (see ``dcp_load.layouts._state.is_tensor``)."""
    value = leaf.value
    if isinstance(value, Flat):
        return flat_target(leaf.name, value)
    if isinstance(value, Chunk):
        local = value.tensor
        adapter = adapter_for(local)
        if adapter.name == "torch" and local.requires_grad:
            local = local.detach()
        return Target.single(leaf.name, value.global_shape, value.offsets, value.sizes,
                             adapter.dtype_name(local), local, adapter)
    if is_dtensor(value):
        coordinate = value.device_mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(f"{leaf.name!r}: this rank is not in the DTensor's device mesh "
                             f"{value.device_mesh}, so it holds no part of it")
        boxes, local = dtensor_boxes(value, coordinate)
        adapter = adapter_for(local)
        return Target(leaf.name, tuple(int(s) for s in value.shape), boxes, adapter.dtype_name(local), local, adapter)
    if is_sharded_tensor(value):
        return sharded_target(leaf.name, value)
    adapter = adapter_for(value)
    local = value.detach() if adapter.name == "torch" else value
    shape = tuple(int(s) for s in value.shape)
    return Target.single(leaf.name, shape, (0,) * len(shape), shape, adapter.dtype_name(value), local, adapter)

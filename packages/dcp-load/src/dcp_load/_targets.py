"""What each rank wants: the box of the global tensor every state dict entry holds.

A torch DTensor holds the box its mesh and placements give this rank (uneven shards
included); a plain tensor holds the whole tensor; a ``Chunk`` holds the box it names.
Framework specifics (views of a sub-box, copies, dtype names) sit behind a small adapter
per framework; each framework is imported only when a tensor of it is met.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Protocol

from ._state import Chunk, Leaf

__all__ = ["FrameworkAdapter", "Target", "adapter_for", "target_for"]


class FrameworkAdapter(Protocol):
    """Framework operations ``load`` needs on a destination tensor.

    ``view`` returns a tensor that aliases the sub-box ``[rel_offsets, rel_offsets+sizes)``
    of ``local`` (written in place by ``copy`` or by a broadcast); ``views`` is False for a
    framework whose sub-box views do not alias (then only a whole local tensor can take a
    broadcast). All methods are called from the thread that runs the load step at hand.
    """

    name: str
    views: bool
    read_framework: str  # what CheckpointReader.read returns for copy(): "torch" or "numpy"

    def dtype_name(self, tensor: Any) -> str: ...
    def device_type(self, tensor: Any) -> str: ...
    def view(self, local: Any, rel_offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any: ...
    def copy(self, dest: Any, src: Any) -> None: ...


class _TorchAdapter:
    name = "torch"
    views = True
    read_framework = "torch"

    def __init__(self) -> None:
        import torch

        self._torch = torch

    def dtype_name(self, tensor: Any) -> str:
        return str(tensor.dtype).removeprefix("torch.")

    def device_type(self, tensor: Any) -> str:
        return str(tensor.device.type)

    def view(self, local: Any, rel_offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        out = local
        for dim, (o, n) in enumerate(zip(rel_offsets, sizes, strict=True)):
            if o != 0 or n != out.shape[dim]:
                out = out.narrow(dim, o, n)
        return out

    def copy(self, dest: Any, src: Any) -> None:
        with self._torch.no_grad():
            dest.copy_(src)


class _MindSporeAdapter:
    """MindSpore tensors on the CPU: written through a NumPy array aliasing their memory.

    MindSpore does not write through views there (``copy_`` into a slice leaves the base
    unchanged), so a sub-box is a (tensor, index) pair and data goes in through
    ``asnumpy()``, which aliases a tensor that owns its memory. Sub-boxes cannot take a
    broadcast (``views`` is False); the planner reads them locally instead.
    """

    name = "mindspore"
    views = False
    read_framework = "numpy"

    def dtype_name(self, tensor: Any) -> str:
        # MindSpore spells dtypes "Float32", "BFloat16", "Bool": the neutral name is lowercase.
        return str(tensor.dtype).lower()

    def device_type(self, tensor: Any) -> str:
        return "cpu"

    def view(self, local: Any, rel_offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        if all(o == 0 for o in rel_offsets) and sizes == tuple(local.shape):
            return local
        return _SubBox(local, tuple(slice(o, o + n) for o, n in zip(rel_offsets, sizes, strict=True)), sizes)

    def copy(self, dest: Any, src: Any) -> None:
        import numpy as np

        base, index = (dest.tensor, dest.index) if isinstance(dest, _SubBox) else (dest, ...)
        arr = base.asnumpy()
        if arr.size and arr.ctypes.data != base.data_ptr():
            raise ValueError(
                f"a MindSpore destination of shape {tuple(base.shape)} is a view of another tensor; "
                "MindSpore on the CPU does not write through views: pass tensors that own their memory"
            )
        src = src.asnumpy() if hasattr(src, "asnumpy") else np.asarray(src)
        arr[index] = src.reshape(arr[index].shape)


@dataclass(frozen=True)
class _SubBox:
    """A MindSpore destination sub-box: the tensor and the index that assignment writes."""

    tensor: Any
    index: tuple[slice, ...]
    shape: tuple[int, ...]


_ADAPTERS: dict[str, FrameworkAdapter] = {}


def adapter_for(tensor: Any) -> FrameworkAdapter:
    """The adapter of ``tensor``'s framework (created once per process, on first use)."""
    top = (type(tensor).__module__ or "").split(".", 1)[0]
    if top not in ("torch", "mindspore"):
        raise TypeError(
            f"unsupported tensor type {type(tensor).__module__}.{type(tensor).__qualname__}: "
            "load and save take torch or MindSpore tensors (wrap a hand-sharded one in dcp_load.Chunk)"
        )
    # The adapters are stateless; caching them only avoids re-importing the framework.
    if top not in _ADAPTERS:
        _ADAPTERS[top] = _TorchAdapter() if top == "torch" else _MindSporeAdapter()
    return _ADAPTERS[top]


@dataclass(frozen=True)
class Target:
    """One tensor entry of this rank's state dict and the box of the global tensor it holds.

    ``local`` is the tensor written in place (a DTensor's local shard, detached); its
    element ``i`` is element ``offsets + i`` of the global tensor.
    """

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: str
    local: Any
    adapter: FrameworkAdapter

    def __post_init__(self) -> None:
        if not (len(self.global_shape) == len(self.offsets) == len(self.sizes)):
            raise ValueError(
                f"{self.name!r}: global shape {self.global_shape}, offsets {self.offsets} and "
                f"sizes {self.sizes} differ in rank"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def view(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        """The destination for the global box ``[offsets, offsets+sizes)`` inside this target."""
        rel = tuple(o - b for o, b in zip(offsets, self.offsets, strict=True))
        return self.adapter.view(self.local, rel, sizes)


def _dtensor_box(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...], Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    unsupported = [p for p in tensor.placements if type(p) not in (Shard, Replicate)]
    if unsupported:
        raise TypeError(
            f"DTensor placements {list(tensor.placements)} are not supported: only Shard and "
            f"Replicate hold a box of the global tensor (got {unsupported}); redistribute first"
        )
    local = tensor.detach().to_local()
    if local.requires_grad:
        local = local.detach()
    shape, offsets = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tuple(int(o) for o in offsets), tuple(int(s) for s in shape), local


def _is_dtensor(value: Any) -> bool:
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def target_for(leaf: Leaf) -> Target:
    """The target of a tensor leaf (see ``dcp_load._state.is_tensor``)."""
    value = leaf.value
    if isinstance(value, Chunk):
        local = value.tensor
        adapter = adapter_for(local)
        if adapter.name == "torch" and local.requires_grad:
            local = local.detach()
        return Target(leaf.name, value.global_shape, value.offsets, value.sizes,
                      adapter.dtype_name(local), local, adapter)
    if _is_dtensor(value):
        offsets, sizes, local = _dtensor_box(value)
        adapter = adapter_for(local)
        return Target(leaf.name, tuple(int(s) for s in value.shape), offsets, sizes,
                      adapter.dtype_name(local), local, adapter)
    adapter = adapter_for(value)
    local = value.detach() if adapter.name == "torch" else value
    shape = tuple(int(s) for s in value.shape)
    return Target(leaf.name, shape, (0,) * len(shape), shape, adapter.dtype_name(value), local, adapter)

"""What each rank wants: the box of the global tensor every state dict entry holds.

A torch DTensor holds what its mesh and placements give this rank, computed with torch's
own sharding functions (uneven and strided shards included): one box, or several when its
local rows are not contiguous in the global tensor (``_StridedShard``); a plain tensor
holds the whole tensor; a ``Chunk`` holds the box it names; a ``Flat`` holds the boxes of
its interval (``_flat_target``).
Framework specifics (views of a sub-box, copies, dtype names) sit behind a small adapter
per framework; each framework is imported only when a tensor of it is met.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Box", "FrameworkAdapter", "Target", "adapter_for", "boxes_at", "dim_indices", "in_mesh"]


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
        if isinstance(dest, _SubBox) and dest.flat is not None:  # a box of a flat buffer (``_flat_target``)
            pos, n, box = dest.flat
            arr = arr.reshape(-1)[pos:pos + n].reshape(box)
        src = src.asnumpy() if hasattr(src, "asnumpy") else np.asarray(src)
        arr[index] = src.reshape(arr[index].shape)


@dataclass(frozen=True)
class _SubBox:
    """A MindSpore destination sub-box: the tensor and the index that assignment writes;
    ``flat``: (first element, elements, box shape) of a flat buffer's box to index into."""

    tensor: Any
    index: tuple[slice, ...]
    shape: tuple[int, ...]
    flat: tuple[int, int, tuple[int, ...]] | None = None


_ADAPTERS: dict[str, FrameworkAdapter] = {}


def _framework_of(tensor: Any) -> str | None:
    """``"torch"`` or ``"mindspore"`` by type (subclasses included: ``nn.Parameter``, and
    MindSpore's ``Parameter``, whose class lives in module ``abc``), else None. A framework
    is looked up only when already imported."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tensor, torch.Tensor):
        return "torch"
    ms = sys.modules.get("mindspore")
    if ms is not None and isinstance(tensor, ms.Tensor):
        return "mindspore"
    return None


def adapter_for(tensor: Any) -> FrameworkAdapter:
    """The adapter of ``tensor``'s framework (created once per process, on first use)."""
    top = _framework_of(tensor)
    if top is None:
        raise TypeError(
            f"unsupported tensor type {type(tensor).__module__}.{type(tensor).__qualname__}: "
            "load and save take torch or MindSpore tensors (wrap a hand-sharded one in dcp_load.Chunk)"
        )
    # The adapters are stateless; caching them only avoids re-importing the framework.
    if top not in _ADAPTERS:
        _ADAPTERS[top] = _TorchAdapter() if top == "torch" else _MindSporeAdapter()
    return _ADAPTERS[top]


@dataclass(frozen=True)
class Box:
    """A box ``[offsets, offsets + sizes)`` of the global tensor that a target holds at
    ``[local_offsets, local_offsets + sizes)`` of its local tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.offsets) == len(self.sizes) == len(self.local_offsets)):
            raise ValueError(f"Box: offsets {self.offsets}, sizes {self.sizes} and local_offsets "
                             f"{self.local_offsets} differ in rank")
        if any(v < 0 for v in (*self.offsets, *self.sizes, *self.local_offsets)):
            raise ValueError(f"Box: negative offsets or sizes: offsets {self.offsets}, sizes "
                             f"{self.sizes}, local_offsets {self.local_offsets}")

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def contains(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
        """Whether the global box ``[offsets, offsets + sizes)`` lies inside this box."""
        return len(offsets) == len(self.offsets) and all(
            b <= o and o + n <= b + m for o, n, b, m in zip(offsets, sizes, self.offsets, self.sizes, strict=True))


@dataclass(frozen=True)
class Target:
    """One tensor entry of this rank's state dict and the boxes of the global tensor it holds.

    ``local`` is the tensor written in place (a DTensor's local shard, detached).
    ``boxes`` do not overlap and together tile ``local``: box ``b``'s element ``i`` is
    element ``b.offsets + i`` of the global tensor and ``b.local_offsets + i`` of ``local``.
    """

    name: str
    global_shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    dtype: str
    local: Any
    adapter: FrameworkAdapter

    def __post_init__(self) -> None:
        object.__setattr__(self, "boxes", tuple(self.boxes))
        bad = [b for b in self.boxes if len(b.offsets) != len(self.global_shape)]
        if bad:
            raise ValueError(f"{self.name!r}: global shape {self.global_shape} and box offsets "
                             f"{bad[0].offsets} differ in rank")

    @classmethod
    def single(cls, name: str, global_shape: tuple[int, ...], offsets: tuple[int, ...],
               sizes: tuple[int, ...], dtype: str, local: Any, adapter: FrameworkAdapter) -> Target:
        """A target that holds one box, which is its whole local tensor."""
        if not (len(global_shape) == len(offsets) == len(sizes)):
            raise ValueError(f"{name!r}: global shape {global_shape}, offsets {offsets} and "
                             f"sizes {sizes} differ in rank")
        return cls(name, global_shape, (Box(offsets, sizes, (0,) * len(sizes)),), dtype, local, adapter)

    def _one_box(self) -> Box:
        if len(self.boxes) != 1:
            raise ValueError(f"{self.name!r} holds {len(self.boxes)} boxes of the global tensor, "
                             "not one: iterate Target.boxes")
        return self.boxes[0]

    @property
    def offsets(self) -> tuple[int, ...]:
        """The global offsets of a one-box target (``ValueError`` for several boxes)."""
        return self._one_box().offsets

    @property
    def sizes(self) -> tuple[int, ...]:
        """The sizes of a one-box target (``ValueError`` for several boxes)."""
        return self._one_box().sizes

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.boxes)

    def view(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        """The destination for the global box ``[offsets, offsets+sizes)``, which must lie
        inside one of this target's boxes."""
        offsets, sizes = tuple(offsets), tuple(sizes)
        for b in self.boxes:
            if b.contains(offsets, sizes):
                rel = tuple(lo + o - bo for lo, o, bo in zip(b.local_offsets, offsets, b.offsets, strict=True))
                return self.adapter.view(self.local, rel, sizes)
        raise ValueError(f"{self.name!r}: the global box offsets={offsets} sizes={sizes} lies inside "
                         f"none of this rank's boxes {[(b.offsets, b.sizes) for b in self.boxes]}")

    def in_place(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
        """Whether ``view`` of this box is a tensor that a broadcast writes in place."""
        return bool(self.adapter.views) or (len(self.boxes) == 1 and self.boxes[0].offsets == tuple(offsets)
                                            and self.boxes[0].sizes == tuple(sizes))

    def values(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        """The values of a box this target holds, for writing to a file (``view``, or an
        array where a framework's sub-box is no tensor)."""
        return self.view(offsets, sizes)


def _runs(index: Any) -> list[tuple[int, int, int]]:
    """(global start, length, local start) of each run of consecutive global indices
    (``index``: a 1-D integer tensor or a list). Vectorised: an embedding's 16k rows per
    rank cost one diff, not a Python loop per row."""
    import torch

    idx = torch.as_tensor(index, dtype=torch.int64).reshape(-1)
    if idx.numel() == 0:
        return []
    breaks = (torch.nonzero(idx[1:] - idx[:-1] != 1).reshape(-1) + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, int(idx.numel())]
    first = idx[starts].tolist()
    return [(int(g), e - s, s) for g, s, e in zip(first, starts, ends, strict=True)]


def _check_placements(placements: Sequence[Any]) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    partial = [p for p in placements if p.is_partial()]
    if partial:
        raise TypeError(f"DTensor placements {list(placements)}: a Partial placement holds unreduced "
                        "values, not a part of the global tensor; call .redistribute(placements="
                        "[Replicate() or Shard(d) ...]) or .full_tensor() before loading or saving")
    other = [p for p in placements if not isinstance(p, (Shard, _StridedShard, Replicate))]
    if other:
        raise TypeError(f"DTensor placements {list(placements)}: {other} not supported (Shard, "
                        "_StridedShard and Replicate are); redistribute first")


def dim_indices(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                placements: Sequence[Any]) -> dict[int, Any]:
    """For each sharded dim, the global index (a 1-D tensor) of every local position along it, at
    ``coordinate`` of a mesh of ``mesh_shape``.

    Walks the placements left to right as torch's ``_compute_local_shape_and_global_offset``
    does, calling torch's own per-placement step (``_get_shard_size_and_offsets``, which
    applies ``Shard`` and ``_StridedShard`` splitting) and keeping every index instead of
    only the first.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets

    _check_placements(placements)
    shape = [int(s) for s in global_shape]
    index: dict[int, Any] = {}
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        size, offsets = _get_shard_size_and_offsets(shape[p.dim], mesh_shape[mesh_dim], coordinate[mesh_dim], p,
                                                    index.get(p.dim), int(global_shape[p.dim]), False)
        shape[p.dim] = size
        index[p.dim] = offsets[:size]
    return dict(index)


def boxes_at(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
             placements: Sequence[Any]) -> tuple[Box, ...]:
    """The boxes the rank at ``coordinate`` holds: runs of consecutive global indices along
    each dim, crossed (none when it holds no element). Cached: the layers of a model share
    a few (shape, placements) pairs, and computing one costs ~0.5 ms (90 DTensors of a
    10-layer model: 53 ms uncached)."""
    return _boxes_at(tuple(int(s) for s in global_shape), tuple(int(s) for s in mesh_shape),
                     tuple(int(c) for c in coordinate), tuple(placements))


@functools.lru_cache(maxsize=1024)
def _boxes_at(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
              placements: tuple[Any, ...]) -> tuple[Box, ...]:
    indices = dim_indices(global_shape, mesh_shape, coordinate, placements)
    per_dim = [_runs(indices[d]) if d in indices else [(0, int(n), 0)] for d, n in enumerate(global_shape)]
    return tuple(Box(tuple(r[0] for r in combo), tuple(r[1] for r in combo), tuple(r[2] for r in combo))
                 for combo in itertools.product(*per_dim))


def dtensor_boxes(tensor: Any, coordinate: Sequence[int]) -> tuple[tuple[Box, ...], Any]:
    local = tensor.to_local()  # detaching the local tensor, not the DTensor: no DTensor dispatch
    if local.requires_grad:
        local = local.detach()
    global_shape = tuple(int(s) for s in tensor.shape)
    mesh_shape = tuple(tensor.device_mesh.shape)
    boxes = boxes_at(global_shape, mesh_shape, coordinate, tensor.placements)
    if local.numel() == 0 or not boxes:
        # An empty shard: one empty box where torch places it, so that the tensor is still named.
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        boxes = (Box(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes), (0,) * len(sizes)),)
    held = tuple(max(b.local_offsets[d] + b.sizes[d] for b in boxes) for d in range(len(global_shape)))
    if held != tuple(local.shape):
        raise ValueError(f"DTensor of global shape {global_shape} with placements {list(tensor.placements)}: "
                         f"its local shape {tuple(local.shape)} differs from the {held} torch's sharding gives")
    return boxes, local


def is_dtensor(value: Any) -> bool:
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def in_mesh(value: Any) -> bool:
    """False for a DTensor whose device mesh does not include this rank (it holds nothing)."""
    return not is_dtensor(value) or value.device_mesh.get_coordinate() is not None

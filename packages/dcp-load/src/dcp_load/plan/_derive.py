"""Derived wants: which box every rank holds, computed from the mesh instead of gathered.

A DTensor's box on any mesh member follows from the mesh, the placements and the global
shape (torch's ``_compute_local_shape_and_global_offset`` accepts any coordinate). The box
depends only on the coordinates of the *sharded* mesh dimensions, so ``mesh_boxes``
computes one box per distinct shard coordinate and lists its holders from the mesh array
(every rank along the replicated dimensions), cached per (mesh ranks, placements, global
shape). A plain tensor is the whole tensor on every rank that holds it; it is derivable
when every rank of the job holds it (the digest exchange checks that, ``_digest``).

``_StridedShard`` (FSDP2 over a TP-sharded dim, as torchtitan lays out) is derived the same
way: each shard coordinate's rows come from ``_targets.boxes_at`` (torch's own per-placement
step), and a coordinate whose rows are not contiguous holds several boxes.

Entries that cannot be derived (``Chunk`` annotations, ``Flat`` intervals, ShardedTensors, MindSpore
tensors, placements other than ``Shard``/``_StridedShard``/``Replicate``) make the whole
load use the gathered wants.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Derived", "derive_entry", "mesh_boxes"]

#: (offsets, sizes, holder ranks sorted) of one distinct box of a tensor
HeldBox = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class Derived:
    """One state-dict entry and every rank's box of it.

    ``layout``: what determines the boxes, hashed into the digest: ``("plain",)`` or
    ``("mesh", mesh shape, mesh ranks, placements)``. ``holders``: every rank holding the
    entry (the mesh, or the world for a plain tensor), sorted. ``boxes``: distinct boxes
    (empty ones dropped) with their holders.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    flags: int
    layout: tuple[Any, ...]
    holders: tuple[int, ...]
    boxes: tuple[HeldBox, ...]


def _placement_key(placements: Sequence[Any]) -> tuple[Any, ...]:
    """``("R",)``, ``("S", dim)`` or ``("SS", dim, split_factor)`` per placement; () when one
    of them cannot be derived."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[tuple[Any, ...]] = []
    for p in placements:
        if type(p) is Replicate:
            out.append(("R",))
        elif type(p) is Shard:
            out.append(("S", int(p.dim)))
        elif type(p) is _StridedShard:
            out.append(("SS", int(p.dim), int(p.split_factor)))
        else:
            return ()
    return tuple(out)


def _placement_objects(placements: tuple[tuple[Any, ...], ...]) -> tuple[Any, ...]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    kinds = {"R": lambda: Replicate(), "S": lambda d: Shard(d), "SS": lambda d, f: _StridedShard(d, split_factor=f)}
    return tuple(kinds[p[0]](*p[1:]) for p in placements)


@functools.lru_cache(maxsize=4096)
def mesh_boxes(shape: tuple[int, ...], mesh_shape: tuple[int, ...], ranks: tuple[int, ...],
               placements: tuple[tuple[Any, ...], ...]) -> tuple[HeldBox, ...]:
    """Distinct non-empty boxes of a tensor of global ``shape`` laid out on a mesh of
    ``mesh_shape`` whose ranks are ``ranks`` (row-major), with ``placements`` given as
    ``_placement_key`` writes them; each with the sorted ranks holding it. A box depends
    only on the coordinates along the sharded mesh dims (``_targets.boxes_at``, torch's own
    sharding step); every rank along the replicated dims holds it too."""
    import numpy as np

    from ..layouts._targets import boxes_at

    objs = _placement_objects(placements)
    grid = np.asarray(ranks, dtype=np.int64).reshape(mesh_shape)
    sharded = [d for d, p in enumerate(placements) if p[0] != "R"]
    merged: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for coords in itertools.product(*(range(mesh_shape[d]) for d in sharded)):
        coordinate = [0] * len(mesh_shape)
        index: list[Any] = [slice(None)] * len(mesh_shape)
        for d, c in zip(sharded, coords, strict=True):
            coordinate[d] = c
            index[d] = c
        holders = [int(r) for r in np.ravel(grid[tuple(index)])]
        for box in boxes_at(shape, mesh_shape, coordinate, objs):
            if all(s > 0 for s in box.sizes):
                merged.setdefault((box.offsets, box.sizes), []).extend(holders)
    return tuple((o, s, tuple(sorted(h))) for (o, s), h in merged.items())


@functools.lru_cache(maxsize=16)
def _world(world: int) -> tuple[int, ...]:
    return tuple(range(world))


def derive_entry(value: Any, name: str, shape: tuple[int, ...], dtype: str, flags: int, world: int,
                 own: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], rank: int,
                 meshes: dict[int, Any] | None = None, to_group: Mapping[int, int] | None = None) -> Derived | None:
    """The derived entry of one state-dict value, or None when it cannot be derived.

    ``own``: this rank's own boxes (``Target.boxes``: offsets, sizes), checked against the
    derived ones so that a layout torch computes differently falls back instead of misplanning.
    ``meshes``: the caller's cache of (ranks, shape) per device mesh object, for one load:
    ``DeviceMesh.mesh`` is rebuilt from its layout on every access (~0.35 ms; 180 accesses
    for a 90-DTensor state dict took 62 ms). ``to_group``: global rank -> rank of the
    process group the load runs within (None: the world); a mesh with a rank outside that
    group cannot be derived.
    """
    from ..layouts._sharded import is_sharded_tensor
    from ..layouts._state import Chunk, Flat
    from ..layouts._targets import is_dtensor

    if isinstance(value, Flat):
        # Even a whole-tensor interval says nothing of the other ranks: a ZeRO partition cut at
        # tensor edges holds a tensor whole on one rank and not at all on the others, whereas
        # a plain tensor is derived as held by every rank.
        return None
    if isinstance(value, Chunk) or (type(value).__module__ or "").split(".", 1)[0] != "torch":
        return None
    if is_sharded_tensor(value):  # its shards are where its metadata says, not on every rank
        return None
    if not is_dtensor(value):
        box = ((0,) * len(shape), shape, _world(world))
        return Derived(name, shape, dtype, flags, ("plain",), _world(world),
                       (box,) if all(s > 0 for s in shape) else ())
    placements = _placement_key(value.placements)
    if not placements:
        return None
    mesh = value.device_mesh
    known = meshes.get(id(mesh)) if meshes is not None else None
    if known is None or known[0] is not mesh:
        grid = mesh.mesh
        known = (mesh, tuple(int(r) for r in grid.flatten().tolist()), tuple(int(s) for s in grid.shape))
        if meshes is not None:
            meshes[id(mesh)] = known
    _, ranks, mesh_shape = known
    if to_group is not None:
        if any(r not in to_group for r in ranks):
            return None
        ranks = tuple(to_group[r] for r in ranks)
    boxes = mesh_boxes(shape, mesh_shape, ranks, placements)
    mine = sorted((o, s) for o, s, h in boxes if rank in h)
    if mine != sorted((o, s) for o, s in own if all(n > 0 for n in s)):  # empty shards hold nothing
        return None
    return Derived(name, shape, dtype, flags, ("mesh", mesh_shape, ranks, placements),
                   tuple(sorted(ranks)), boxes)


def held_boxes(entries: Sequence[Derived]) -> dict[str, dict[tuple[Any, ...], list[Any]]]:
    """``collect_boxes``-shaped input for ``PlanBuilder.add_tensor`` from derived entries."""
    from ._items import BROADCASTABLE

    out: dict[str, dict[tuple[Any, ...], list[Any]]] = {}
    for e in entries:
        ok = bool(e.flags & BROADCASTABLE)
        out[e.name] = {(o, s, e.dtype): [list(h), ok] for o, s, h in e.boxes}
    return out

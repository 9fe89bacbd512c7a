"""What one rank holds (``src``) and must fill (``dst``), as targets and as plain tuples.

The tuples (``Entry``: name, global shape, dtype, boxes) are what the ranks gather once
per layout to plan. ``signature`` is the cheap description a rank hashes on every call to
decide whether its cached plan still fits: it is computed from the tensors' layout
metadata (shapes, dtypes, meshes, placements, local shapes and strides), never from the
boxes, so a reused transfer does not recompute any sharding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..layouts._flat_target import check_overlaps
from ..layouts._state import Chunk, Flat, flatten_state_dict, is_tensor
from ..layouts._target_for import target_for
from ..layouts._targets import Target, in_mesh, is_dtensor

__all__ = ["Entry", "Side", "build_targets", "entries", "pointers", "signature", "side_of", "with_locals"]

#: (name, global shape, dtype, ((offsets, sizes), ...)): one tensor entry of one rank
Entry = tuple[str, tuple[int, ...], str, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]]


@dataclasses.dataclass
class Side:
    """One side (``src`` or ``dst``) of this rank: its leaves, targets and problems."""

    what: str
    leaves: list[Any] = dataclasses.field(default_factory=list)
    targets: dict[str, Target] = dataclasses.field(default_factory=dict)
    outside: list[str] = dataclasses.field(default_factory=list)  # DTensors whose mesh leaves this rank out
    errors: list[str] = dataclasses.field(default_factory=list)


def _leaves(what: str, value: Any, side: Side) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping):
        side.errors.append(f"transfer: {what} must be a mapping of names to tensors (or None on a rank that "
                           f"{'holds' if what == 'src' else 'fills'} nothing), got {type(value).__name__}")
        return
    try:
        leaves = flatten_state_dict(value)
    except (TypeError, ValueError) as exc:
        side.errors.append(f"transfer: {what}: {type(exc).__name__}: {exc}")
        return
    others = [f"{leaf.name!r} ({type(leaf.value).__name__})" for leaf in leaves if not is_tensor(leaf.value)]
    if others:
        side.errors.append(f"transfer: {what} holds {len(others)} value(s) that are not tensors: "
                           f"{', '.join(others[:10])}{' ...' if len(others) > 10 else ''}; transfer moves "
                           "tensors only: drop them from the mapping")
    side.leaves = [leaf for leaf in leaves if is_tensor(leaf.value)]


def side_of(what: str, value: Any) -> Side:
    """The leaves of ``value`` (a mapping or None) and their problems; no targets yet."""
    side = Side(what)
    _leaves(what, value, side)
    return side


def build_targets(side: Side, caps: Any) -> None:
    """Targets of ``side``'s leaves, with every problem this rank can see alone."""
    targets = []
    for leaf in side.leaves:
        if not in_mesh(leaf.value):
            side.outside.append(leaf.name)
            continue
        try:
            targets.append(target_for(leaf))
        except (TypeError, ValueError) as exc:
            side.errors.append(f"transfer: {side.what}[{leaf.name!r}]: {exc}")
    bad_device = []
    for t in targets:
        device = t.adapter.device_type(t.local)
        if device == "meta" or not (caps.host_collectives if device == "cpu" else device == caps.device_type):
            bad_device.append(f"{t.name!r} ({device})")
    if bad_device:
        where = "the 'cpu' device or " if caps.host_collectives else ""
        side.errors.append(f"transfer: {side.what} tensor(s) on a device the platform cannot send from or "
                           f"receive into: {', '.join(bad_device[:10])}; place them on {where}the "
                           f"{caps.device_type!r} device (a 'meta' tensor holds no memory: materialise it)")
    if side.what == "dst":
        side.errors.extend(check_overlaps(targets))
    side.targets = {t.name: t for t in targets}


def entries(side: Side) -> list[Entry]:
    """The gathered description of ``side``: one ``Entry`` per target, in leaf order."""
    return [(t.name, tuple(t.global_shape), t.dtype, tuple((b.offsets, b.sizes) for b in t.boxes))
            for t in side.targets.values()]


def _local_of(value: Any) -> Any:
    """The tensor a target of ``value`` writes or reads (as ``target_for`` takes it)."""
    if isinstance(value, (Chunk, Flat)):
        value = value.tensor
    elif is_dtensor(value):
        # the local shard itself (what ``to_local`` returns, without its autograd call:
        # ~0.1 ms each, measured 2,000 DTensors per call on the development machine)
        value = value._local_tensor if hasattr(value, "_local_tensor") else value.to_local()
    return value.detach() if type(value).__module__.startswith("torch") else value


def _mesh_key(mesh: Any, cache: dict[int, Any]) -> Any:
    key = cache.get(id(mesh))
    if key is None:
        key = cache[id(mesh)] = (tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), mesh.get_coordinate())
    return key


def signature(side: Side) -> tuple[Any, ...]:
    """What ``side``'s layout is, per leaf: name, kind, global shape, dtype, mesh and
    placements (DTensor), box (Chunk) or interval (Flat), local shape and strides."""
    out: list[Any] = [side.what, tuple(side.errors)]
    meshes: dict[int, Any] = {}
    for leaf in side.leaves:
        v = leaf.value
        if isinstance(v, Flat):
            t = v.tensor
            extra: Any = ("flat", tuple(v.global_shape), v.start, v.local_start, v.numel)
        elif isinstance(v, Chunk):
            t = v.tensor
            extra = ("chunk", tuple(v.global_shape), tuple(v.offsets))
        elif is_dtensor(v):
            t = _local_of(v)
            extra = ("dtensor", tuple(v.shape), _mesh_key(v.device_mesh, meshes), tuple(map(repr, v.placements)))
        else:
            t = v
            extra = ("tensor",)
        out.append((leaf.name, extra, str(t.dtype), tuple(t.shape), tuple(t.stride()) if hasattr(t, "stride")
                    else (), str(getattr(t, "device", ""))))
    return tuple(out)


def with_locals(side: Side, cached: Mapping[str, Target]) -> dict[str, Target]:
    """``cached`` targets (same layout as ``side``) pointing at ``side``'s tensors now: a
    reused plan needs no sharding computed, only the current local tensors."""
    out = {}
    for leaf in side.leaves:
        old = cached.get(leaf.name)
        if old is not None:
            local = _local_of(leaf.value)
            # the same memory (the old target's views keep its storage alive, so an equal
            # address is the same storage): the old target serves as it is
            out[leaf.name] = old if _ptr(local) == _ptr(old.local) else dataclasses.replace(old, local=local)
    return out


def _ptr(tensor: Any) -> Any:
    ptr = getattr(tensor, "data_ptr", None)
    return ptr() if ptr is not None else id(tensor)


def pointers(targets: Mapping[str, Target]) -> tuple[Any, ...]:
    """Where each target's tensor lives now: views made of them stay valid while these do."""
    return tuple(_ptr(t.local) for t in targets.values())


"""A ``Flat`` destination as a target of several boxes, each a view of the flat buffer.

The planner sees a ``FlatTarget`` as any target holding several boxes (as a
``_StridedShard`` DTensor does): wants, replica groups, broadcasts and saves need nothing
else. Only where a box lives differs: box ``k`` is elements ``[starts[k], starts[k] +
numel)`` of the local tensor's flattening, reshaped to the box (torch: a real view, so
reads and broadcasts land in place; MindSpore: a ``_SubBox`` written through NumPy).
``check_overlaps`` refuses a flat view whose memory overlaps another destination of the
rank: two entries would be written into the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._flat import Flat
from ._targets import Box, Target, _SubBox, adapter_for

__all__ = ["FlatTarget", "check_overlaps", "flat_target"]


@dataclass(frozen=True)
class FlatTarget(Target):
    """A target whose box ``k`` sits at element ``starts[k]`` of ``local``'s flattening."""

    starts: tuple[int, ...] = ()
    #: never tied to another key (``_aliases``): overlapping memory is refused instead
    flat = True

    def _box_view(self, box: Box, pos: int) -> Any:
        return self.local.reshape(-1)[pos:pos + box.numel].view(box.sizes)

    def view(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        offsets, sizes = tuple(offsets), tuple(sizes)
        for box, pos in zip(self.boxes, self.starts, strict=True):
            if box.contains(offsets, sizes):
                rel = tuple(o - b for o, b in zip(offsets, box.offsets, strict=True))
                if self.adapter.name == "torch":
                    return self.adapter.view(self._box_view(box, pos), rel, sizes)
                index = tuple(slice(r, r + n) for r, n in zip(rel, sizes, strict=True))
                return _SubBox(self.local, index, sizes, flat=(pos, box.numel, box.sizes))
        raise ValueError(f"{self.name!r}: the global box offsets={offsets} sizes={sizes} lies inside none of "
                         f"this rank's flat boxes {[(b.offsets, b.sizes) for b in self.boxes]}")

    def in_place(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
        return bool(self.adapter.views)

    def values(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        dest = self.view(offsets, sizes)
        if not isinstance(dest, _SubBox):
            return dest
        pos, n, box = dest.flat
        return dest.tensor.asnumpy().reshape(-1)[pos:pos + n].reshape(box)[(*dest.index, ...)]  # a view, 0-dim too


def flat_target(name: str, value: Flat) -> FlatTarget:
    """The target of a ``Flat`` state dict entry."""
    local = value.tensor
    adapter = adapter_for(local)
    if adapter.name == "torch" and local.requires_grad:
        local = local.detach()
    boxes, starts = [], []
    for offsets, sizes, pos in value.boxes():
        boxes.append(Box(offsets, sizes, (0,) * len(sizes)))
        starts.append(value.local_start + pos)
    return FlatTarget(name, value.global_shape, tuple(boxes), adapter.dtype_name(local), local, adapter,
                      starts=tuple(starts))


def _span(target: Target) -> tuple[Any, int, int] | None:
    """(device, first byte address, end address) of the memory ``target`` writes; None
    when it writes nothing or its framework gives no address."""
    local = target.local
    if target.adapter.name == "torch":
        if local.device.type == "meta":
            return None  # no memory (every address is 0): refused as meta by ``check_targets``
        itemsize, device = local.element_size(), (local.device.type, local.device.index)
        if isinstance(target, FlatTarget):
            n = sum(b.numel for b in target.boxes)
            first = local.data_ptr() + (target.starts[0] if target.starts else 0) * itemsize
            return (device, first, first + n * itemsize) if n else None
        if local.numel() == 0:
            return None
        extent = 1 + sum((s - 1) * st for s, st in zip(local.shape, local.stride(), strict=True))
        return device, local.data_ptr(), local.data_ptr() + extent * itemsize
    ptr = getattr(local, "data_ptr", None)
    if not callable(ptr):
        return None
    itemsize = int(getattr(local, "itemsize", 0))
    if not itemsize:
        return None
    if isinstance(target, FlatTarget):
        n = sum(b.numel for b in target.boxes)
        first = ptr() + (target.starts[0] if target.starts else 0) * itemsize
        return ("cpu", first, first + n * itemsize) if n else None
    total = 1
    for s in local.shape:
        total *= int(s)
    return ("cpu", ptr(), ptr() + total * itemsize) if total else None


def check_overlaps(targets: Sequence[Target]) -> list[str]:
    """Errors for every flat target whose memory overlaps another target of this rank
    (same device, overlapping byte ranges): a load would write both into the same bytes.
    Targets that are not flat are compared only against flat ones (tied weights, which
    share memory on purpose, are ``_aliases``'s concern)."""
    if not any(isinstance(t, FlatTarget) for t in targets):
        return []  # without a flat view there is nothing to check (and nothing to pay)
    spans = []
    for t in targets:
        span = _span(t)
        if span is not None:
            spans.append((span[0], span[1], span[2], t))
    spans.sort(key=lambda s: (str(s[0]), s[1], s[2]))
    bad: list[str] = []
    for i, (dev, lo, hi, t) in enumerate(spans):
        for dev2, lo2, hi2, u in spans[i + 1:]:
            if dev2 != dev or lo2 >= hi:
                break
            if isinstance(t, FlatTarget) or isinstance(u, FlatTarget):
                bad.append(f"{t.name!r} and {u.name!r} overlap in memory (bytes [{max(lo, lo2):#x}, "
                           f"{min(hi, hi2):#x}) of one {t.dtype} buffer)")
    if not bad:
        return []
    shown = ", ".join(bad[:10]) + (f" ... and {len(bad) - 10} more" if len(bad) > 10 else "")
    return [f"{len(bad)} flat destination(s) overlap another destination of this rank: {shown}; each entry "
            "must own its memory: give each dcp_load.Flat a disjoint part of the buffer (flat_views does)"]

"""``Flat``: a contiguous interval of a tensor's row-major flattening, and ``flat_views``.

ZeRO-style optimizers (DeepSpeed, Megatron's distributed optimizer, FSDP1 flat parameters)
and ragged shardings hold a tensor as an interval ``[start, start + n)`` of its row-major
flattening, crossing row boundaries. ``flat_boxes`` cuts such an interval into maximal
boxes of the global tensor, recursively over the dimensions: a partial leading block, one
block of full rows, and a partial trailing block, at most ``2N - 1`` boxes for N
dimensions. Every box is a contiguous run of the flattening, so each one is a view of the
caller's buffer (a reshape of a slice of it): reads go straight there.

This module imports no framework and nothing else of ``dcp_load``: ``_state`` imports it.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Flat", "flat_boxes", "flat_views"]

#: One box of an interval: (global offsets, sizes, position of its first element in the interval)
FlatBox = tuple[tuple[int, ...], tuple[int, ...], int]


def _numel_of(tensor: Any) -> int:
    # By type, as ``_targets`` decides (MindSpore's Parameter reports module ``abc``); a
    # framework not yet imported cannot have made ``tensor``.
    kinds = tuple(t for t in (getattr(sys.modules.get(m), "Tensor", None) for m in ("torch", "mindspore"))
                  if isinstance(t, type))
    if not isinstance(tensor, kinds):
        raise TypeError(f"Flat.tensor must be a torch or MindSpore tensor, got {type(tensor).__qualname__}")
    return math.prod(int(s) for s in tensor.shape)


def _index(value: Any) -> int:
    """``value`` as an int when it is one (Python, NumPy or a 0-dim integer tensor); a
    ``TypeError`` for anything ``int()`` would truncate or parse (2.5, "2") and for bools."""
    if isinstance(value, (bool, str, bytes)) or "bool" in str(getattr(value, "dtype", "")):
        raise TypeError(f"not an int: {value!r}")
    return operator.index(value)


def _int(what: str, value: Any) -> int:
    try:
        return _index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__})") from None


def _shape(what: str, value: Any) -> tuple[int, ...]:
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError("a string")
        return tuple(_index(s) for s in value)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of ints, got {value!r} ({type(value).__name__})") from None


def _is_contiguous(tensor: Any) -> bool:
    check = getattr(tensor, "is_contiguous", None)
    return bool(check()) if callable(check) else True


@dataclass(frozen=True)
class Flat:
    """A tensor that holds elements ``[start, start + numel)`` of the row-major flattening
    of a tensor of shape ``global_shape``.

    ``tensor`` is contiguous, of any shape (a ZeRO partition's 1-D slice, say); by default
    all of its elements form the interval. ``local_start`` and ``numel`` (keyword-only)
    place the interval at ``[local_start, local_start + numel)`` of ``tensor``'s own
    flattening instead: how ``flat_views`` describes parts of one MindSpore buffer, whose
    slices on the CPU do not write through. ``load`` fills the interval in place; ``save``
    writes it, one chunk per box of ``flat_boxes``.
    """

    tensor: Any
    global_shape: tuple[int, ...]
    start: int
    local_start: int = field(default=0, kw_only=True)
    numel: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        shape = _shape("Flat: global_shape", self.global_shape)
        start, local_start = _int("Flat: start", self.start), _int("Flat: local_start", self.local_start)
        if any(s < 0 for s in shape):
            raise ValueError(f"Flat: global_shape {shape} has a negative size; give the global tensor's shape")
        if "torch.distributed.tensor" in type(self.tensor).__module__:
            raise TypeError("Flat.tensor is a DTensor; pass its local tensor (DTensor.to_local()) holding the "
                            "interval, or load the DTensor itself")
        held = _numel_of(self.tensor)
        numel = held - local_start if self.numel is None else _int("Flat: numel", self.numel)
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "local_start", local_start)
        object.__setattr__(self, "numel", numel)
        if local_start < 0 or numel < 0 or local_start + numel > held:  # first: numel may follow from it
            raise ValueError(f"Flat: local_start={local_start}, numel={numel} do not fit in the tensor of "
                             f"{held} element(s) (shape {tuple(int(s) for s in self.tensor.shape)}); both must "
                             f"be >= 0 and local_start + numel <= {held}")
        total = math.prod(shape)
        if start < 0 or start + numel > total:
            raise ValueError(f"Flat: the interval [start, start + numel) = [{start}, {start + numel}) does not fit "
                             f"in global_shape {shape}, which has {total} element(s); start must be >= 0 and "
                             f"start + numel <= {total}")
        if not _is_contiguous(self.tensor):
            raise ValueError(f"Flat: the tensor of shape {tuple(int(s) for s in self.tensor.shape)} is not "
                             "contiguous, so its elements are not one run of memory; pass tensor.contiguous() "
                             "and copy it back, or a contiguous buffer")

    @property
    def whole(self) -> bool:
        """Whether the interval is the whole tensor."""
        return self.start == 0 and self.numel == math.prod(self.global_shape)

    def boxes(self) -> list[FlatBox]:
        """The maximal boxes of the interval (``flat_boxes``)."""
        assert self.numel is not None
        return flat_boxes(self.global_shape, self.start, self.numel)


def flat_boxes(global_shape: Sequence[int], start: int, numel: int) -> list[FlatBox]:
    """The interval ``[start, start + numel)`` of the row-major flattening of a tensor of
    ``global_shape`` as maximal boxes, in order: (global offsets, sizes, position of the
    box's first element in the interval). Boxes are disjoint, tile the interval exactly,
    are at most ``2N - 1`` for N dimensions, and each is a contiguous run of the interval.
    An empty interval has no box, except that a tensor with no element at all gets one
    empty box (so that ``save`` still names it)."""
    shape = tuple(int(s) for s in global_shape)
    total = math.prod(shape)
    if not 0 <= start <= start + numel <= total:
        raise ValueError(f"flat_boxes: [{start}, {start + numel}) does not fit in {shape} ({total} elements)")
    if total == 0:
        return [((0,) * len(shape), shape, 0)]
    out: list[FlatBox] = []
    pos = 0
    for offsets, sizes in _decompose(shape, start, start + numel, ()):
        out.append((offsets, sizes, pos))
        pos += math.prod(sizes)
    return out


def _decompose(shape: tuple[int, ...], lo: int, hi: int, prefix: tuple[int, ...]
               ) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes of ``[lo, hi)`` of a tensor of ``shape`` (the trailing dims), each prefixed by
    the fixed indices ``prefix`` of the leading dims (size 1 there)."""
    if lo >= hi:
        return
    ones = (1,) * len(prefix)
    if not shape:
        yield prefix, ones
        return
    row = math.prod(shape[1:])
    first, lo_col = divmod(lo, row)
    last, hi_col = divmod(hi, row)
    if first == last:  # inside one row: cut it along the next dimension
        yield from _decompose(shape[1:], lo_col, hi_col, (*prefix, first))
        return
    if lo_col:  # the partial leading row
        yield from _decompose(shape[1:], lo_col, row, (*prefix, first))
        first += 1
    if last > first:  # the full rows, one box
        yield (*prefix, first, *(0,) * (len(shape) - 1)), (*ones, last - first, *shape[1:])
    if hi_col:  # the partial trailing row
        yield from _decompose(shape[1:], 0, hi_col, (*prefix, last))


def flat_views(shapes: Sequence[tuple[str, Sequence[int]]] | Mapping[str, Sequence[int]], buffer: Any,
               offset: int) -> dict[str, Flat]:
    """The ``Flat`` views of a rank's part of a flat parameter space, keyed by name.

    ``shapes``: the space's tensors in order, as ``(name, shape)`` pairs (or a mapping in
    order): tensor ``k`` occupies the elements after tensor ``k - 1``'s. ``buffer``: this
    rank's contiguous tensor, holding elements ``[offset, offset + buffer.numel())`` of the
    space. Tensors the buffer does not touch are left out; one of no element is kept by the
    buffers whose interval holds its position (ends included). A torch buffer gives 1-D slices
    of it; a MindSpore buffer gives ``Flat``s over the whole buffer with ``local_start``
    and ``numel`` (its slices do not write through on the CPU).
    """
    items = list(shapes.items()) if isinstance(shapes, Mapping) else list(shapes)
    offset = _int("flat_views: offset", offset)
    size = _numel_of(buffer)
    if offset < 0:
        raise ValueError(f"flat_views: offset must be >= 0, got {offset}")
    if not _is_contiguous(buffer):
        raise ValueError(f"flat_views: the buffer of shape {tuple(buffer.shape)} is not contiguous; pass a "
                         "contiguous buffer")
    torch_buffer = type(buffer).__module__.split(".", 1)[0] == "torch"
    flat = buffer.reshape(-1) if torch_buffer else buffer
    out: dict[str, Flat] = {}
    begin = 0
    seen: set[Any] = set()
    for name, shape in items:
        try:
            shape = _shape("", shape)
        except TypeError:
            raise TypeError(f"flat_views: {name!r} has shape {shape!r}; give a sequence of ints") from None
        if any(s < 0 for s in shape):  # it would shift every later tensor of the space
            raise ValueError(f"flat_views: {name!r} has shape {shape}, with a negative size")
        if name in seen:  # even where the buffer touches one of them: ranks would disagree on its place
            raise ValueError(f"flat_views: {name!r} appears twice in shapes")
        seen.add(name)
        end = begin + math.prod(shape)
        lo, hi = max(begin, offset), min(end, offset + size)
        # A tensor of no element sits at the point ``begin``: the buffers around it name it,
        # so that ``save`` writes it and ``load`` checks it.
        if hi > lo or (begin == end and offset <= begin <= offset + size):
            if torch_buffer:
                out[name] = Flat(flat[lo - offset:hi - offset], shape, lo - begin)
            else:
                out[name] = Flat(buffer, shape, lo - begin, local_start=lo - offset, numel=hi - lo)
        begin = end
    if offset + size > begin:
        raise ValueError(f"flat_views: the buffer holds elements [{offset}, {offset + size}) but the "
                         f"space of {len(items)} tensor(s) has only {begin}; check the offset and the shapes")
    return out

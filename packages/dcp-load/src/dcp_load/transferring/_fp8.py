"""FP8 blockwise destinations: quantized on the sender, so only FP8 bytes and scales travel.

A destination ``D`` of dtype ``float8_e4m3fn`` that comes with a destination named
``D_scale_inv`` (on any rank; vLLM's layout of a block-quantized weight) is filled with a
blockwise quantization: per 128 x 128 block of the 2-D source, ``scale = amax / 448``
(448: the largest e4m3fn value; an all-zero block gets scale 1; NaN elements do not count
in amax and stay NaN; a scale below the smallest float32 is that smallest, never 0),
``D = x / scale`` as e4m3fn and ``D_scale_inv[i, j] = scale`` (float32) of block ``(i, j)``
(the last blocks may be partial). Without ``D_scale_inv``, an FP8 destination is an
ordinary cast, as before. A fused destination (``Concat``) needs each part placed on block
boundaries (every part but the last a multiple of 128 along the concat dim), so that each
block's scale is one source block's; otherwise it is refused, naming the part.

How: once the ranks' layouts are gathered (the plan exchange), ``derive`` rewrites them as
if every source tensor ``s`` that feeds such a destination were held as FP8 (same boxes)
together with ``s_scale_inv`` (its blocks' scales), and maps ``D_scale_inv`` to the same
composition of those scale tensors (``sources=`` renames, ``Concat`` with groups, ``Stack``).
The planner then plans FP8 into FP8 as any transfer. On each call a sender quantizes the
boxes it holds into buffers kept with the plan (``Quantizer``); a box must start on a block
boundary and end on one or at the tensor's end, so that no block spans two holders.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..layouts._sources import Slice, SourceError, SourceMap, compose, describe, leaves, map_leaves
from ..layouts._targets import Target
from ._layout import Entry
from ._planner import TransferPlan, plan_transfer

__all__ = ["BLOCK", "FP8", "FP8_MAX", "SCALE_SUFFIX", "Fp8Layout", "Quantizer", "derive", "plan_layouts",
           "quantize_blockwise"]

FP8 = "float8_e4m3fn"
FP8_MAX = 448.0
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"

#: The smallest positive float32 (a subnormal): the scale of a block whose amax / 448
#: underflows to 0 (amax below about 6e-43), so that no block divides by 0.
TINY_SCALE = 2.0 ** -149


def quantize_blockwise(x: Any, out: Any = None, scales: Any = None, block: int = BLOCK) -> tuple[Any, Any]:
    """(e4m3fn tensor, float32 scales) of 2-D ``x`` per ``block`` x ``block`` block, into
    ``out`` / ``scales`` when given. Computed in float32 on ``x``'s device."""
    import torch

    rows, cols = x.shape
    nr, nc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(nr * block, nc * block, dtype=torch.float32, device=x.device)
    padded[:rows, :cols] = x
    tiles = padded.view(nr, block, nc, block)
    magnitude = tiles.abs()
    # a NaN element does not make its block's scale NaN (or 1): it stays NaN by itself
    amax = torch.where(magnitude.isnan(), torch.zeros_like(magnitude), magnitude).amax(dim=(1, 3))
    # a tensor divisor, not a Python number: CUDA divides by a number as a multiplication by
    # its reciprocal (torch 2.11 on an H200: the last bit of about half the scales differed
    # from the CPU's), and sender and reference must agree to the bit on every device
    scaled = (amax / torch.full_like(amax, FP8_MAX)).clamp_(min=TINY_SCALE)
    scale = torch.where(amax > 0, scaled, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).view(nr * block, nc * block)
    q = q[:rows, :cols].to(torch.float8_e4m3fn)
    if out is None:
        return q, scale
    out.copy_(q)
    scales.copy_(scale)
    return out, scales


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


@dataclass
class Fp8Layout:
    """``derive``'s result: the rewritten layouts and sources, the quantized source names
    (name -> an FP8 destination it feeds, for messages) and the problems, per rank."""

    layouts: list[tuple[list[Entry], list[Entry]]]
    source_map: SourceMap
    quantized: dict[str, str]
    errors: dict[int, list[str]] = field(default_factory=dict)


def _fp8_destinations(layouts: Sequence[tuple[Sequence[Entry], Sequence[Entry]]]) -> list[str]:
    names = {e[0]: e[2] for _, dst in layouts for e in dst}
    return sorted(n for n, dtype in names.items() if dtype == FP8 and n + SCALE_SUFFIX in names)


def _has_slice(source: Any) -> bool:
    if isinstance(source, Slice):
        return True
    return not isinstance(source, str) and any(_has_slice(p) for p in source.parts)


@dataclass(frozen=True)
class _Whole:
    """A source tensor as ``compose`` takes it: its shape, as one chunk."""

    shape: tuple[int, ...]
    dtype: str = ""

    @property
    def chunks(self) -> list[Any]:
        return [self]

    @property
    def offsets(self) -> tuple[int, ...]:
        return (0,) * len(self.shape)

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.shape


def _misplaced(name: str, source: Any, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """Why ``source``'s parts do not each sit on whole blocks of ``name`` (a fused FP8
    destination): a block that mixes two parts would get one part's scale. None when they do
    (or when the planner will name a missing part or a shape that does not fit)."""
    if isinstance(source, str) or not all(n in shapes for n in leaves(source)):
        return None
    try:
        shape, _, pieces = compose(source, {n: _Whole(tuple(shapes[n])) for n in leaves(source)}, name)
    except SourceError:
        return None
    for piece in pieces:
        for d, (lo, size, whole) in enumerate(zip(piece.offsets, piece.sizes, shape, strict=True)):
            real = piece.axes.index(d) if d in piece.axes else None  # and where it is read from
            held = real is None or _aligned(lo + piece.shift[real], size, shapes[piece.source][real])
            if not (_aligned(lo, size, whole) and held):
                return (f"dst {name!r} is FP8 with {name + SCALE_SUFFIX!r}, but its source {describe(source)} puts "
                        f"part {piece.source!r} at [{lo}, {lo + size}) along dim {d} of {shape[d]}: each part of a "
                        f"fused FP8 destination must start and end on {BLOCK} x {BLOCK} blocks (or at the "
                        f"tensor's end), so that each block's scale is one part's; make every part but the last a "
                        f"multiple of {BLOCK} along dim {d}")
    return None


def _sources(fp8: Sequence[str], source_map: SourceMap | None, all_dst: set[str],
             shapes: Mapping[str, tuple[int, ...]], fail: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``sources=`` entries with ``D_scale_inv`` added for each FP8 ``D``, and the
    source tensors to quantize."""
    entries = {key: source for key, _, _, source in (source_map.entries if source_map else [])}
    quantized: dict[str, str] = {}
    for name in fp8:
        found = source_map.match(name) if source_map else None
        source = found[1] if found else name
        if _has_slice(source):
            fail(f"dst {name!r} is FP8 with {name + SCALE_SUFFIX!r}, but its source {source!r:.200} slices: "
                 "blockwise FP8 takes renames, Concat and Stack of whole source tensors")
            continue
        misplaced = _misplaced(name, source, shapes)
        if misplaced:
            fail(misplaced)
            continue
        quantized.update({leaf: name for leaf in leaves(source)})
        if source_map is None or source_map.match(name + SCALE_SUFFIX) is None:
            entries[name + SCALE_SUFFIX] = map_leaves(source, lambda n: n + SCALE_SUFFIX)
    for other in sorted(all_dst - set(fp8) - {n + SCALE_SUFFIX for n in fp8}):
        found = source_map.match(other) if source_map else None
        shared = [leaf for leaf in leaves(found[1] if found else other) if leaf in quantized]
        if shared:
            fail(f"src {shared[0]!r} feeds the blockwise FP8 dst {quantized[shared[0]]!r} and also dst "
                 f"{other!r}; a source tensor is sent either quantized or not: pass it to one of them")
    return entries, quantized


def _aligned(off: int, size: int, whole: int) -> bool:
    return off % BLOCK == 0 and ((off + size) % BLOCK == 0 or off + size == whole)


def _rewrite(rank: int, src: Sequence[Entry], quantized: Mapping[str, str], fail: Any) -> list[Entry]:
    """``src`` of ``rank`` with each quantized tensor held as FP8, plus its scales' boxes."""
    out: list[Entry] = []
    for name, shape, dtype, boxes in src:
        if name not in quantized:
            out.append((name, shape, dtype, boxes))
            continue
        dst = quantized[name]
        if len(shape) != 2 or len(boxes) != 1 or not dtype.startswith(("float", "bfloat")):
            fail(f"src {name!r} (for the blockwise FP8 dst {dst!r}) must be a 2-D floating tensor held as one "
                 f"box per rank; here it is {dtype} of shape {tuple(shape)} in {len(boxes)} box(es)", rank)
            continue
        (off, sz), = boxes
        if not all(_aligned(o, s, w) for o, s, w in zip(off, sz, shape, strict=True)):
            fail(f"src {name!r}: the box offsets={tuple(off)} sizes={tuple(sz)} of shape {tuple(shape)} does not "
                 f"start and end on {BLOCK} x {BLOCK} blocks (or the tensor's end); the blockwise FP8 dst "
                 f"{dst!r} needs each block on one holder: shard its rows at multiples of {BLOCK}", rank)
            continue
        out.append((name, shape, FP8, boxes))
        scale_box = (tuple(o // BLOCK for o in off),
                     tuple(_blocks(o + s) - o // BLOCK for o, s in zip(off, sz, strict=True)))
        out.append((name + SCALE_SUFFIX, tuple(_blocks(s) for s in shape), "float32", (scale_box,)))
    return out


def derive(layouts: Sequence[tuple[Sequence[Entry], Sequence[Entry]]], source_map: SourceMap | None
           ) -> Fp8Layout | None:
    """The layouts as planned when FP8 blockwise destinations exist, else None (nothing
    changes). Pure: every rank derives the same from the same gathered layouts."""
    fp8 = _fp8_destinations(layouts)
    if not fp8:
        return None
    errors: dict[int, list[str]] = {}
    wanting = sorted({r for r, (_, dst) in enumerate(layouts) if any(e[0] in fp8 for e in dst)})

    def fail(message: str, rank: int | None = None) -> None:
        for r in ([rank] if rank is not None else wanting):
            errors.setdefault(r, []).append(message)

    all_dst = {e[0] for _, dst in layouts for e in dst}
    scale_dtypes = {e[0]: e[2] for _, dst in layouts for e in dst if e[0] in {n + SCALE_SUFFIX for n in fp8}}
    for scale_name, dtype in sorted(scale_dtypes.items()):
        if dtype != "float32":  # a narrower dtype would round the scales with no error
            fail(f"dst {scale_name!r} is {dtype}: blockwise FP8 scales are float32; pass a float32 tensor")
    shapes = {e[0]: tuple(e[1]) for src, _ in layouts for e in src}
    entries, quantized = _sources(fp8, source_map, all_dst, shapes, fail)
    out = [(_rewrite(r, src, quantized, fail), list(dst)) for r, (src, dst) in enumerate(layouts)]
    return Fp8Layout(out, SourceMap(entries, owner="transfer"), quantized, errors)


class Quantizer:
    """This rank's FP8 sources: its held boxes of the quantized tensors, quantized on each
    call into buffers kept with the plan (their addresses stay, so a kept plan's prepared
    broadcasts stay valid)."""

    def __init__(self, quantized: Mapping[str, str]):
        self.names = frozenset(quantized)
        self._kept: dict[str, tuple[Target, Target]] = {}

    def _buffers(self, target: Target) -> tuple[Target, Target]:
        import torch

        kept = self._kept.get(target.name)
        if kept is None:
            (rows, cols), (r0, c0) = target.sizes, target.offsets
            device = target.local.device
            q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device)
            scale = torch.empty(_blocks(rows), _blocks(cols), dtype=torch.float32, device=device)
            shape = tuple(target.global_shape)
            kept = self._kept[target.name] = (
                Target.single(target.name, shape, target.offsets, target.sizes, FP8, q, target.adapter),
                Target.single(target.name + SCALE_SUFFIX, tuple(_blocks(s) for s in shape),
                              (r0 // BLOCK, c0 // BLOCK), tuple(scale.shape), "float32", scale, target.adapter))
        return kept

    def quantized(self, src: Mapping[str, Target]) -> dict[str, Target]:
        """``src`` with each quantized tensor replaced by its FP8 box and its scales, quantized now."""
        out: dict[str, Target] = {}
        for name, target in src.items():
            if name not in self.names:
                out[name] = target
                continue
            q, scale = self._buffers(target)
            quantize_blockwise(target.view(target.offsets, target.sizes), q.local, scale.local)
            out[name], out[scale.name] = q, scale
        return out


def plan_layouts(layouts: Sequence[tuple[Sequence[Entry], Sequence[Entry]]], source_map: SourceMap | None,
                 **settings: Any) -> tuple[Any, Quantizer | None]:
    """``plan_transfer`` of ``layouts``, as rewritten by ``derive`` when FP8 blockwise
    destinations exist; and this rank's ``Quantizer`` (None without them)."""
    fp8 = derive(layouts, source_map)
    if fp8 is None:
        return plan_transfer(layouts, source_map=source_map, **settings), None
    if fp8.errors:
        return TransferPlan(errors=fp8.errors), None
    return plan_transfer(fp8.layouts, source_map=fp8.source_map, **settings), Quantizer(fp8.quantized)

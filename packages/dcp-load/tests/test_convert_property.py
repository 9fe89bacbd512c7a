"""``convert`` against ``read_state_dict`` + plain torch, on random mappings: renames, one
saved tensor fanned out to two outputs, ``{i}`` placeholders over 1-3 layers, Concat (with
groups, parts that are Slices), Stack, Slice, tensors the mapping leaves alone, an optional
``prefix=`` (a training checkpoint's ``model.``), every dtype safetensors stores (float8
included), parts of two floating dtypes, an optional cast, tiny and larger tensors with a
small fill group and shard size so that fill groups and files split and merge; into both
output formats. Every output name and every output byte is checked: the reference moves
the bytes as same-sized integers, so nothing is compared through a float."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from unittest import mock

import dcp_load
import torch
from dcp_load import Concat, Slice, Stack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.int64,
          torch.int32, torch.int8, torch.uint8, torch.bool]
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers of its element size (moved exactly by cat/stack/narrow)."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t.view(_SAME_SIZE[t.element_size()])


def _value(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


class _Case:
    """Saved tensors, the ``sources`` mapping and, per output, how plain torch makes it."""

    def __repr__(self) -> str:
        saved = {n: (tuple(t.shape), str(t.dtype)) for n, t in self.saved.items()}
        return f"_Case(saved={saved}, sources={self.sources}, outputs={self.outputs})"

    def __init__(self) -> None:
        self.saved: dict[str, torch.Tensor] = {}
        self.sources: dict[str, object] = {}
        self.outputs: dict[str, object] = {}  # output name -> source over saved names (a name: itself)

    def leaf(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> str:
        self.saved[name] = _value(shape, dtype, len(self.saved))
        return name


@st.composite
def _part(draw, shape: tuple[int, ...], dtype: torch.dtype):
    """A part of ``shape``: (saved shape, dtype, None) for a saved tensor, or (larger saved
    shape, dtype, (dim, start)) for a Slice of a larger one."""
    if not draw(st.integers(0, 3)):
        d = draw(st.integers(0, len(shape) - 1))
        lo, hi = draw(st.integers(0, 2)), draw(st.integers(0, 2))
        return (*shape[:d], shape[d] + lo + hi, *shape[d + 1:]), dtype, (d, lo, shape[d])
    return shape, dtype, None


def _made(case: _Case, name: str, spec) -> object:
    """The saved tensor (or Slice of one) ``spec`` describes, saved under ``name``."""
    shape, dtype, cut = spec
    leaf = case.leaf(name, shape, dtype)
    return leaf if cut is None else Slice(leaf, cut[0], cut[1], cut[1] + cut[2])


@st.composite
def _entry(draw, case: _Case, e: int, layers: int):
    """One mapping entry (its structure drawn once, its saved tensors made per layer)."""
    kind = draw(st.sampled_from(["rename", "fanout", "concat", "concat", "stack", "slice", "plain"]))
    dtype = draw(st.sampled_from(DTYPES))
    mixed = dtype in FLOATS and draw(st.booleans())  # later parts in another floating dtype
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    if draw(st.integers(0, 5)) == 0:
        shape = (draw(st.integers(40, 90)), 512)  # 80-180 KiB of float32: fill groups and files split
    d, groups, specs = 0, 1, []
    if kind in ("rename", "fanout", "plain"):
        specs = [(shape, dtype, None)]
    elif kind == "slice":
        d = draw(st.integers(0, len(shape) - 1))
        specs = [draw(_part((*shape[:d], shape[d] + 2, *shape[d + 1:]), dtype))]
    else:
        d = draw(st.integers(0, len(shape) - (kind == "concat")))
        groups = draw(st.sampled_from([1, 2])) if kind == "concat" else 1
        for p in range(draw(st.integers(1, 3))):
            size = list(shape)
            if kind == "concat":
                size[d] = groups * draw(st.integers(1, 3))
            specs.append(draw(_part(tuple(size), draw(st.sampled_from(FLOATS)) if mixed and p else dtype)))
    per_layer = kind != "plain" and draw(st.booleans())
    for i in range(layers if per_layer else 1):
        name = f"e{e}.{i if per_layer else 'x'}"
        parts = [_made(case, f"{name}.p{p}", spec) for p, spec in enumerate(specs)]
        if kind == "plain":
            case.outputs[parts[0]] = parts[0]
            continue
        src = (Slice(parts[0], d, 1, 1 + shape[d]) if kind == "slice" else Concat(parts, d, groups)
               if kind == "concat" else Stack(parts, d) if kind == "stack" else parts[0])
        seg = "{i}" if per_layer else "x"
        for dest in [f"out{e}.{seg}.w"] + ([f"tied{e}.{seg}.w"] if kind == "fanout" else []):
            case.sources[dest] = _templ(src, name, f"e{e}.{seg}")
            case.outputs[dest.replace("{i}", str(i))] = src


def _templ(src, old: str, new: str):
    """``src`` with the prefix ``old`` of its saved names replaced by ``new``."""
    from dcp_load.layouts._sources import map_leaves

    return map_leaves(src, lambda n: new + n[len(old):] if n.startswith(old) else n)


@st.composite
def _cases(draw):
    case = _Case()
    layers = draw(st.integers(1, 3))
    for e in range(draw(st.integers(1, 4))):
        draw(_entry(case, e, layers))
    return case, dict(
        to=draw(st.sampled_from(["hf", "native"])), fmt=draw(st.sampled_from(["hf", "native"])),
        dtype=draw(st.sampled_from([None, None, "bfloat16", "float32"])),
        prefix=draw(st.booleans()), group=draw(st.sampled_from([64, 4096, 1 << 30])),
        shard=draw(st.sampled_from(["2KB", "100KB", "5GB"])))


def _make(src, saved: dict[str, torch.Tensor], target: torch.dtype) -> torch.Tensor:
    """Plain torch: the output ``src`` composes, each part cast to ``target`` first."""
    if isinstance(src, str):
        return saved[src].to(target)
    if isinstance(src, Slice):
        return _bits(_make(src.source, saved, target)).narrow(src.dim, src.start, src.stop - src.start)\
            .contiguous().view(target)
    parts = [_bits(_make(p, saved, target)) for p in src.parts]
    if isinstance(src, Stack):
        return torch.stack(parts, src.dim).view(target)
    blocks = [p.narrow(src.dim, j * (p.shape[src.dim] // src.groups), p.shape[src.dim] // src.groups)
              for j in range(src.groups) for p in parts]
    return torch.cat(blocks, src.dim).view(target)


def _first(src, saved: dict[str, torch.Tensor]) -> torch.dtype:
    from dcp_load.layouts._sources import leaves

    return saved[leaves(src)[0]].dtype


# 30 examples cost ~25 s on the 2-core development machine; DCP_CONVERT_EXAMPLES searches longer
@settings(max_examples=int(os.environ.get("DCP_CONVERT_EXAMPLES", "30")), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_cases())
def test_convert_equals_read_state_dict_and_plain_torch(drawn):
    from dcp_load.conversion import _fill

    case, opt = drawn
    cast = getattr(torch, opt["dtype"]) if opt["dtype"] else None
    pre = "model." if opt["prefix"] else ""
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(_fill, "GROUP_BYTES", opt["group"]):
        src = Path(tmp) / "src"
        stored = {pre + n: t for n, t in case.saved.items()}
        if pre:
            stored["optim.state.e0.exp_avg"] = torch.zeros(3)  # left out by prefix=
        if opt["fmt"] == "native":
            dcp_load.save(stored, checkpoint_id=str(src), no_dist=True)
        else:
            src.mkdir()
            save_file(stored, str(src / "model.safetensors"), metadata={"format": "pt"})
        dcp_load.convert(src, Path(tmp) / "out", to=opt["to"], sources=case.sources or None, dtype=opt["dtype"],
                         prefix=pre or None, max_shard_bytes=opt["shard"], quiet=True)
        saved = {n[len(pre):]: t for n, t in dcp_load.read_state_dict(src).items() if n.startswith(pre)}
        got = dcp_load.read_state_dict(Path(tmp) / "out")
    assert sorted(got) == sorted(case.outputs)
    for name, source in case.outputs.items():
        target = _first(source, saved)
        if cast is not None and target.is_floating_point:  # integer and bool outputs keep their dtype
            target = cast
        want = _make(source, saved, target)
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(_bits(got[name]), _bits(want)), name

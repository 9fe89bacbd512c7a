"""Staged reads (casts, strided destinations) cut into bounded pieces: the pieces tile the
box exactly, in row-major order, each within the limit (hypothesis); a cast load of a
tensor larger than the limit reads it piece by piece through the staging pool, with the values
of a plain cast."""

from __future__ import annotations

import math

import dcp_load
import torch
from dcp_load.run import _stage
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file


@st.composite
def boxes(draw):
    nd = draw(st.integers(1, 4))
    sizes = tuple(draw(st.lists(st.integers(0, 9), min_size=nd, max_size=nd)))
    offsets = tuple(draw(st.lists(st.integers(0, 5), min_size=nd, max_size=nd)))
    item = draw(st.sampled_from([1, 2, 4, 8]))
    limit = draw(st.integers(1, 2000))
    return offsets, sizes, item, limit


@settings(max_examples=300, deadline=None)
@given(boxes())
def test_pieces_tile_the_box_within_the_limit(box):
    offsets, sizes, item, limit = box
    nbytes = math.prod(sizes) * item
    pieces = _stage.stage_pieces(offsets, sizes, nbytes, limit)
    seen = []
    for offs, sz in pieces:
        assert len(offs) == len(sz) == len(sizes)
        if nbytes > limit:
            assert math.prod(sz) * item <= max(limit, item)
        for o, s, o0, s0 in zip(offs, sz, offsets, sizes, strict=True):
            assert o0 <= o and o + s <= o0 + s0
        seen += [tuple(o + i for o, i in zip(offs, idx, strict=True))
                 for idx in __import__("itertools").product(*(range(s) for s in sz))]
    everything = [tuple(o + i for o, i in zip(offsets, idx, strict=True))
                  for idx in __import__("itertools").product(*(range(s) for s in sizes))]
    assert seen == everything  # each element once, in row-major order


def test_cast_load_goes_through_bounded_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(_stage, "STAGE_BYTES", 4096)
    seen = []
    real = _stage.StagingPool.take

    def take(self, nbytes):
        seen.append(nbytes)
        return real(self, nbytes)

    monkeypatch.setattr(_stage.StagingPool, "take", take)
    w = torch.randn(100, 30)
    save_file({"w": w, "s": w[:, :7].contiguous()}, str(tmp_path / "model.safetensors"))
    dest = {"w": torch.full((100, 30), 7.0, dtype=torch.bfloat16)}
    dcp_load.load(dest, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(dest["w"], w.to(torch.bfloat16))
    assert seen and max(seen) <= 4096 and sum(seen) == w.numel() * 4
    strided = torch.full((100, 10), 7.0)  # same dtype, a strided view: staged, then copied
    dcp_load.load({"s": strided[:, :7]}, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(strided[:, :7], w[:, :7]) and (strided[:, 7:] == 7.0).all()

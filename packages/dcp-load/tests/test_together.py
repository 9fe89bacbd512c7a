"""Boxes of one slab's rows read together (``run/_together.py``): which consecutive reads
form a group (the same chunk, rows, dtype and caching, tiling their bounding box), and the
values: boxes of any shape, column split, staging buffer size and cast, read through one
covering range of a real safetensors file, equal the saved slices (hypothesis); a group
whose bounding box does not span whole rows is left to the per-box reads when that would
over-read."""

from __future__ import annotations

import math

import torch
from dcp_load.plan._items import ReadItem
from dcp_load.run._stage import StagingPool
from dcp_load.run._together import bounding_box, read_together, row_groups
from dcp_reader import open_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file


def _item(offsets, sizes, name="w", chunk=0, dtype="", cached=False):
    return ReadItem(name, chunk, tuple(offsets), tuple(sizes), math.prod(sizes) * 4, (0,), None, dtype, cached)


def test_groups_are_consecutive_tiles_of_one_chunk_s_rows() -> None:
    left, right = _item((0, 0), (4, 3)), _item((0, 3), (4, 5))
    assert row_groups([left, right]) == [[0, 1]]
    assert row_groups([left, _item((4, 0), (4, 3))]) == [[0], [1]]  # other rows
    assert row_groups([left, _item((0, 3), (4, 5), chunk=1)]) == [[0], [1]]  # another chunk
    assert row_groups([left, _item((0, 3), (4, 5), dtype="bfloat16")]) == [[0], [1]]  # another cast
    assert row_groups([left, _item((0, 3), (4, 5), cached=True)]) == [[0], [1]]  # verified elsewhere
    assert row_groups([left, _item((0, 2), (4, 6))]) == [[0], [1]]  # overlapping: no tiling
    assert row_groups([left, _item((0, 4), (4, 4))]) == [[0], [1]]  # a gap: no tiling
    assert row_groups([left, _item((0, 0), (4, 0)), right]) == [[0], [1], [2]]  # an empty box between
    assert row_groups([_item((), ()), _item((), ())]) == [[0], [1]]  # 0-dim: never grouped
    assert bounding_box([left, right]) == ((0, 0), (4, 8))


@st.composite
def _cases(draw):
    nd = draw(st.integers(2, 4))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=nd, max_size=nd)))
    d = draw(st.integers(1, nd - 1))  # the dim the boxes split
    cuts = sorted(draw(st.sets(st.integers(1, shape[d] - 1), max_size=3))) if shape[d] > 1 else []
    edges = [0, *cuts, shape[d]]
    row0 = draw(st.integers(0, shape[0] - 1))
    rows = draw(st.integers(1, shape[0] - row0))
    saved = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    dest = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
    buffer = draw(st.integers(1, 4096))
    return shape, d, edges, row0, rows, saved, dest, buffer


@settings(max_examples=80, deadline=None)
@given(_cases())
def test_boxes_read_together_equal_the_saved_slices(tmp_path_factory, case) -> None:
    shape, d, edges, row0, rows, saved, dest_dtype, buffer = case
    path = tmp_path_factory.mktemp("together")
    full = torch.randn(shape).to(saved)
    save_file({"w": full}, str(path / "model.safetensors"))
    reader = open_checkpoint(str(path))
    chunk = reader.metadata.tensors["w"].chunks[0]
    items, dests = [], []
    for a, b in zip(edges, edges[1:], strict=False):
        offsets = [row0] + [0] * (len(shape) - 1)
        sizes = [rows, *shape[1:]]
        offsets[d], sizes[d] = a, b - a
        items.append(_item(offsets, sizes))
        dests.append(torch.full(sizes, float("nan"), dtype=dest_dtype))
    pool = StagingPool(buffers=1, buffer_bytes=buffer)
    try:
        assert read_together(reader, items, chunk, dests, saved.itemsize, pool, True, 1.0)
    finally:
        pool.close()
        reader.close()
    for item, dest in zip(items, dests, strict=True):
        want = full[tuple(slice(o, o + s) for o, s in zip(item.offsets, item.sizes, strict=True))]
        assert torch.equal(dest, want.to(dest_dtype)), (item.offsets, item.sizes)


def test_a_bounding_box_short_of_whole_rows_is_not_over_read(tmp_path) -> None:
    save_file({"w": torch.arange(64.0).reshape(8, 8)}, str(tmp_path / "model.safetensors"))
    reader = open_checkpoint(str(tmp_path))
    chunk = reader.metadata.tensors["w"].chunks[0]
    items = [_item((0, 0), (8, 2)), _item((0, 2), (8, 2))]  # columns 0-3 of 8: the range covers 2 x
    dests = [torch.zeros(8, 2), torch.zeros(8, 2)]
    pool = StagingPool(buffers=1)
    try:
        assert not read_together(reader, items, chunk, dests, 4, pool, True, 1.05)
        assert all(not d.any() for d in dests) and reader.bytes_read == 0
        assert read_together(reader, items, chunk, dests, 4, pool, True, 8.0)
        assert torch.equal(torch.cat(dests, 1), torch.arange(64.0).reshape(8, 8)[:, :4])
    finally:
        pool.close()
        reader.close()

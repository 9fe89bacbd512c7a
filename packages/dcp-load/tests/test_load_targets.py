"""Targets: the box a plain tensor or a Chunk holds, dtype names, destination views that
alias the local tensor, and refusals of unsupported tensor types."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dcp_load import Chunk
from dcp_load.layouts._state import Leaf
from dcp_load.layouts._target_for import target_for
from dcp_load.layouts._targets import adapter_for


def _leaf(name, value):
    return Leaf(name, value, {name: value}, name)


def test_plain_tensor_is_the_whole_tensor():
    t = target_for(_leaf("w", torch.zeros(3, 4, dtype=torch.bfloat16)))
    assert (t.global_shape, t.offsets, t.sizes, t.dtype) == ((3, 4), (0, 0), (3, 4), "bfloat16")


def test_chunk_is_its_box_and_views_alias_it():
    local = torch.zeros(2, 3)
    t = target_for(_leaf("w", Chunk(local, (8, 6), (4, 3))))
    assert (t.global_shape, t.offsets, t.sizes, t.dtype) == ((8, 6), (4, 3), (2, 3), "float32")
    view = t.view((5, 4), (1, 2))  # global box rows 5, cols 4-5 -> local row 1, cols 1-2
    t.adapter.copy(view, torch.tensor([[7.0, 8.0]]))
    assert local.tolist() == [[0, 0, 0], [0, 7, 8]]


def test_parameter_is_written_through_a_detached_alias():
    p = torch.nn.Parameter(torch.zeros(2))
    t = target_for(_leaf("p", p))
    t.adapter.copy(t.view((0,), (2,)), torch.ones(2))
    assert p.detach().tolist() == [1, 1] and p.requires_grad


def test_zero_dim_and_float8_dtype_names():
    assert target_for(_leaf("s", torch.tensor(1))).sizes == ()
    assert target_for(_leaf("f", torch.zeros(2, dtype=torch.float8_e4m3fn))).dtype == "float8_e4m3fn"


def test_unsupported_types_say_what_to_do():
    with pytest.raises(TypeError, match="wrap a hand-sharded one in dcp_load.Chunk"):
        adapter_for(np.zeros(2))


def test_box_views_and_multi_box_targets():
    from dcp_load.layouts._targets import Box, Target

    local = torch.zeros(4, 3)
    # Local rows 0-1 are global rows 2-3, local rows 2-3 are global rows 6-7 (a strided shard).
    boxes = (Box((2, 0), (2, 3), (0, 0)), Box((6, 0), (2, 3), (2, 0)))
    t = Target("w", (8, 3), boxes, "float32", local, adapter_for(local))
    assert t.numel == 12
    t.adapter.copy(t.view((7, 1), (1, 2)), torch.tensor([[5.0, 6.0]]))
    assert local[3].tolist() == [0, 5, 6]
    with pytest.raises(ValueError, match="lies inside none of this rank's boxes"):
        t.view((3, 0), (4, 3))  # spans both boxes
    with pytest.raises(ValueError, match="holds 2 boxes of the global tensor, not one: iterate Target.boxes"):
        _ = t.offsets
    with pytest.raises(ValueError, match="negative"):
        Box((-1,), (2,), (0,))


def test_runs_compress_index_lists():
    from dcp_load.layouts._targets import _runs

    assert _runs([0, 1, 2, 4, 5, 7]) == [(0, 3, 0), (4, 2, 3), (7, 1, 5)]
    assert _runs([]) == []


def _placements_strategy():
    from hypothesis import strategies as st
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    @st.composite
    def layout(draw):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
        mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
        kinds = [draw(st.sampled_from(["R", "S", "SS"])) for _ in mesh]
        placements = []
        for kind in kinds:
            dim = draw(st.integers(0, ndim - 1))
            placements.append(Replicate() if kind == "R" else Shard(dim) if kind == "S"
                              else _StridedShard(dim, split_factor=draw(st.integers(1, 4))))
        return shape, mesh, placements
    return layout()


def test_boxes_partition_the_tensor_as_torch_shards_it():
    """For any mesh and any mix of Shard, _StridedShard and Replicate: each rank's boxes tile
    its local shape as torch computes it, start at torch's global offset, and every global
    element is held by exactly the ranks that replicate it."""
    import itertools
    import math

    from dcp_load.layouts._targets import boxes_at
    from hypothesis import given, settings
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    @settings(max_examples=150, deadline=None)
    @given(_placements_strategy())
    def check(layout):
        shape, mesh, placements = layout
        counts = torch.zeros(shape, dtype=torch.int64)
        for coord in itertools.product(*(range(m) for m in mesh)):
            boxes = boxes_at(shape, mesh, list(coord), placements)
            local, offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
            if math.prod(local) == 0:
                assert sum(b.numel for b in boxes) == 0
                continue
            assert sum(b.numel for b in boxes) == math.prod(local)
            assert boxes[0].offsets == tuple(offset)
            seen = torch.zeros(local, dtype=torch.int64)
            for b in boxes:
                seen[tuple(slice(o, o + n) for o, n in zip(b.local_offsets, b.sizes, strict=True))] += 1
                counts[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes, strict=True))] += 1
            assert bool((seen == 1).all())
        replicas = math.prod(m for m, p in zip(mesh, placements, strict=True) if isinstance(p, Replicate))
        assert bool((counts == replicas).all())

    check()

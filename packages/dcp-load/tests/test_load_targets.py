"""Targets: the box a plain tensor or a Chunk holds, dtype names, destination views that
alias the local tensor, and refusals of unsupported tensor types."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dcp_load import Chunk
from dcp_load._state import Leaf
from dcp_load._targets import adapter_for, target_for


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
    from dcp_load._targets import Box, Target

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
    from dcp_load._targets import _runs

    assert _runs([0, 1, 2, 4, 5, 7]) == [(0, 3, 0), (4, 2, 3), (7, 1, 5)]
    assert _runs([]) == []

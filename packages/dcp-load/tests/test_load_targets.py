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

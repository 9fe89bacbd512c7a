"""``engine_shards`` and ``tp_offsets``: an engine's plain tensor-parallel shards as
``transfer`` destinations; every problem names its key."""

from __future__ import annotations

import pytest
import torch
from dcp_load import Chunk, engine_shards, tp_offsets


def test_tp_offsets_of_column_row_and_replicated_shards():
    assert tp_offsets((40, 8), 0, 1, 2) == (20, 0)
    assert tp_offsets((8, 16), 1, 3, 4) == (0, 12)
    assert tp_offsets((8, 16), -1, 1, 2) == (0, 8)
    assert tp_offsets((8,), None, 1, 2) == (0,)
    with pytest.raises(ValueError, match="does not split evenly into 3"):
        tp_offsets((8, 16), 0, 0, 3)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        tp_offsets((8, 16), 0, 2, 2)


def test_shards_become_chunks_of_the_global_shape():
    a, b, c = torch.zeros(20, 8), torch.zeros(8, 8), torch.zeros(8)
    got = engine_shards({"qkv": (a, (20, 0)), "down": (b, (0, 8)), "norm": Chunk(c, (8,), (0,))},
                        {"qkv": (40, 8), "down": (8, 16)})
    assert got["qkv"].tensor is a and got["qkv"].offsets == (20, 0) and got["qkv"].global_shape == (40, 8)
    assert got["down"].offsets == (0, 8) and got["norm"].global_shape == (8,)


def test_bad_shards_name_their_key():
    with pytest.raises(ValueError, match="'qkv' has no entry in global_shapes"):
        engine_shards({"qkv": (torch.zeros(20, 8), (20, 0))})
    with pytest.raises(ValueError, match="'qkv': Chunk: the box offsets=\\(30, 0\\)"):
        engine_shards({"qkv": (torch.zeros(20, 8), (30, 0))}, {"qkv": (40, 8)})
    with pytest.raises(TypeError, match="'w' must be \\(tensor, offsets\\), a Chunk or a tensor, got list"):
        engine_shards({"w": [1, 2]}, {"w": (2,)})
    with pytest.raises(ValueError, match="'norm' is a Chunk of global_shape \\(8,\\) but global_shapes gives"):
        engine_shards({"norm": Chunk(torch.zeros(8), (8,), (0,))}, {"norm": (16,)})
    with pytest.raises(ValueError, match="global_shapes names \\['x'\\] that shards lacks"):
        engine_shards({}, {"x": (1,)})


def test_a_plain_tensor_that_is_not_the_whole_parameter_is_refused():
    with pytest.raises(ValueError, match=r"'w' is a plain tensor of shape \(4, 6\) but global_shapes gives \(8, 6\).*"
                                         r"pass a shard as \(tensor, offsets\)"):
        engine_shards({"w": torch.zeros(4, 6)}, {"w": (8, 6)})
    whole = torch.zeros(8, 6)
    assert engine_shards({"w": whole}, {"w": (8, 6)})["w"].offsets == (0, 0)


def test_tp_offsets_refuses_a_dim_out_of_range_and_non_int_arguments():
    with pytest.raises(ValueError, match=r"dim 2 is out of range for global_shape \(8, 6\)"):
        tp_offsets((8, 6), 2, 1, 2)
    with pytest.raises(ValueError, match=r"dim -3 is out of range"):
        tp_offsets((8, 6), -3, 1, 2)
    with pytest.raises(TypeError, match="rank must be an int, got True"):
        tp_offsets((8, 6), 1, True, 2)
    with pytest.raises(TypeError, match="dim must be an int, got 1.0"):
        tp_offsets((8, 6), 1.0, 1, 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 0\) and size >= 1"):
        tp_offsets((8, 6), 1, 0, 0)

"""Flattened names match torch.distributed.checkpoint's; Chunk validates its box; leaves
that are not tensors are replaced in their container."""

from __future__ import annotations

import pytest
import torch
from dcp_load import Chunk
from dcp_load.layouts._state import flatten_state_dict, is_tensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict as torch_flatten


def _model_and_optimizer_state() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7}


@pytest.mark.parametrize(
    "state",
    [
        _model_and_optimizer_state(),
        {"a": {"b": [torch.zeros(1), {"c": 1}], "d": [1, 2, 3], "e": (torch.zeros(1), 2)}},
        {"x": [[1, 2], [torch.ones(2)]], "y": [[1, 2], [3]], 5: {"z": None}},
        {"empty": {}, "list": [], "s": "text"},
    ],
    ids=["model+adamw", "nested", "lists-of-lists", "empties"],
)
def test_names_match_torch_dcp(state: dict) -> None:
    ours = {leaf.name: leaf.value for leaf in flatten_state_dict(state)}
    theirs, _ = torch_flatten(state)
    assert list(ours) == list(theirs)
    for name, value in theirs.items():
        assert ours[name] is value


def test_optimizer_layout_names() -> None:
    names = [leaf.name for leaf in flatten_state_dict(_model_and_optimizer_state())]
    assert "optim.state.0.exp_avg" in names
    assert "optim.param_groups.0.lr" in names
    assert "optim.param_groups.0.params" in names  # a list of ints is one value
    assert "model.0.weight" in names


def test_values_are_replaced_in_their_container() -> None:
    state = {"a": {"lr": 0.1}, "groups": [{"lr": 0.2}], "top": 3}
    for leaf in flatten_state_dict(state):
        leaf.replace(f"new {leaf.name}")
    assert state == {"a": {"lr": "new a.lr"}, "groups": [{"lr": "new groups.0.lr"}], "top": "new top"}


def test_duplicate_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="'a.b'"):
        flatten_state_dict({"a.b": 1, "a": {"b": 2}})


def test_not_a_mapping() -> None:
    with pytest.raises(TypeError, match="mapping"):
        flatten_state_dict([torch.zeros(1)])  # type: ignore[arg-type]


def test_chunk_validates_box() -> None:
    c = Chunk(torch.zeros(2, 3), [4, 6], [2, 3])
    assert c.global_shape == (4, 6) and c.offsets == (2, 3) and c.sizes == (2, 3)
    assert is_tensor(c)
    with pytest.raises(ValueError, match="does not fit"):
        Chunk(torch.zeros(2, 3), (4, 6), (3, 0))
    with pytest.raises(ValueError, match="same number of dimensions"):
        Chunk(torch.zeros(2, 3), (4,), (0,))
    with pytest.raises(TypeError, match="sequences of ints"):
        Chunk(torch.zeros(2), ("x",), (0,))
    with pytest.raises(TypeError, match="shape"):
        Chunk(object(), (1,), (0,))
    with pytest.raises(AttributeError):
        c.offsets = (0, 0)  # type: ignore[misc]

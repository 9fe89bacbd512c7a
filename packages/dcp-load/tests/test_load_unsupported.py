"""Destinations ``load`` cannot fill are named before anything is written: an object with
its own state inside a tuple (a value), and a numpy array. (Stateful objects elsewhere are
loaded: test_load_stateful.py.)"""

from __future__ import annotations

import dcp_load
import numpy as np
import pytest
import torch
from dcp_load import LoadError


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp_load.save({"w": torch.arange(4.0), "arr": torch.ones(3), "cfg": {"lr": 0.1}, "step": 7},
                  checkpoint_id=path, no_dist=True)
    return path


STATEFUL = "hold an object with its own state"


def test_a_stateful_inside_a_tuple_is_named(ckpt):
    """A tuple is a value (torch DCP's flattening), so a Stateful inside it can be neither
    filled nor replaced: named, before anything is written."""
    w = torch.zeros(4)
    state = {"w": w, "step": (torch.nn.Linear(2, 2),)}
    with pytest.raises(LoadError, match="validate") as err:
        dcp_load.load(state, checkpoint_id=ckpt)
    text = str(err.value)
    assert STATEFUL in text and "'step': builtins.tuple holding torch.nn.modules.linear.Linear" in text, text
    assert torch.equal(w, torch.zeros(4))


def test_a_numpy_array_is_named_with_the_fix(ckpt):
    arr = np.zeros(3, dtype=np.float32)
    with pytest.raises(LoadError, match=r"'arr': numpy\.ndarray; put torch\.from_numpy\(array\)") as err:
        dcp_load.load({"w": torch.zeros(4), "arr": arr}, checkpoint_id=ckpt)
    assert "tensor/value mismatch" not in str(err.value)
    dcp_load.load({"w": torch.zeros(4), "arr": torch.from_numpy(arr)}, checkpoint_id=ckpt)
    assert arr.tolist() == [1.0, 1.0, 1.0]  # the fix works: the array is filled in place


def test_plain_values_and_numpy_scalars_are_still_replaced(ckpt):
    state = {"w": torch.zeros(4), "step": np.float64(2.0), "cfg": {"lr": None}}
    dcp_load.load(state, checkpoint_id=ckpt)
    assert state["step"] == 7 and state["cfg"] == {"lr": 0.1}

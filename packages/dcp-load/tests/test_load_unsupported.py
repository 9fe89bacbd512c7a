"""Destinations ``load`` cannot fill are named before anything is written, on every rank:
a module, an optimizer or another object with its own state (under a key the checkpoint
lacks, holds as a value, or inside a list), and a numpy array."""

from __future__ import annotations

import sys
from pathlib import Path

import dcp_load
import numpy as np
import pytest
import torch
from dcp_load import LoadError
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import load_unsupported_cases as cases  # noqa: E402


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp_load.save({"w": torch.arange(4.0), "arr": torch.ones(3), "cfg": {"lr": 0.1}, "step": 7},
                  checkpoint_id=path, no_dist=True)
    return path


STATEFUL = "hold an object with its own state (a module, optimizer or scheduler)"


@pytest.mark.parametrize(("key", "value", "named"), [
    ("model", torch.nn.Linear(2, 2), "'model': torch.nn.modules.linear.Linear"),  # a key the checkpoint lacks
    ("step", torch.nn.Linear(2, 2), "'step': torch.nn.modules.linear.Linear"),  # a key it holds as a value
    ("step", [torch.nn.Linear(2, 2)], "'step': builtins.list holding torch.nn.modules.linear.Linear"),
])
def test_a_module_is_named_not_missing_nor_replaced(ckpt, key, value, named):
    w = torch.zeros(4)
    state = {"w": w, key: value}
    with pytest.raises(LoadError, match="validate") as err:
        dcp_load.load(state, checkpoint_id=ckpt)
    text = str(err.value)
    assert STATEFUL in text and named in text and "state_dict()" in text and "missing" not in text, text
    assert state[key] is value and torch.equal(w, torch.zeros(4))


def test_an_optimizer_is_named(ckpt):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(LoadError, match=r"'cfg': torch\.optim\.sgd\.SGD"):
        dcp_load.load({"w": torch.zeros(4), "cfg": opt}, checkpoint_id=ckpt)


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


def test_every_rank_raises_when_one_rank_holds_a_module(ckpt):
    results = run_ranks(cases.load_with_module_on_rank_1, 2, ckpt, timeout=120)
    for rank, (raised, unchanged) in enumerate(results):
        assert unchanged, rank
        assert "rank 1: 1 state dict entr(ies) " + STATEFUL in raised and "'extra'" in raised, raised
        assert "rank 0:" not in raised, raised

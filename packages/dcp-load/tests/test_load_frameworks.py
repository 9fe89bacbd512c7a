"""Tensors are recognised by type, subclasses included, in every package: torch
``nn.Parameter``, and a MindSpore ``Parameter`` whose class reports module ``abc`` (here a
stand-in ``mindspore`` module whose ``Parameter`` subclasses its ``Tensor`` the same way;
the real one is exercised on MindSpore workers in tests-integration)."""

from __future__ import annotations

import abc
import sys
import types

import numpy as np
import pytest
import torch
from dcp_load import Chunk
from dcp_load.layouts._state import is_tensor
from dcp_load.layouts._targets import adapter_for
from dcp_platform._select import platform_name
from dcp_reader.write._writer import _as_bytes


@pytest.fixture
def fake_ms(monkeypatch):
    ms = types.ModuleType("mindspore")

    class Tensor:
        __module__ = "mindspore.common.tensor"

        def __init__(self, array):
            self._a = np.asarray(array)
            self.shape, self.dtype = self._a.shape, "Float32"

        def asnumpy(self):
            return self._a

    # MindSpore builds Parameter with a metaclass from abc, so its class reports module "abc".
    Parameter = abc.ABCMeta("Parameter", (Tensor,), {"__module__": "abc"})
    ms.Tensor, ms.Parameter = Tensor, Parameter
    monkeypatch.setitem(sys.modules, "mindspore", ms)
    return ms


def test_mindspore_parameter_is_a_tensor_everywhere(fake_ms):
    p = fake_ms.Parameter(np.arange(4, dtype=np.float32))
    assert type(p).__module__ == "abc"
    assert is_tensor(p)
    assert adapter_for(p).name == "mindspore"
    assert platform_name(tensor=p) == "mindspore"
    assert platform_name(tensor=Chunk(p, (8,), (4,)).tensor) == "mindspore"
    dtype, shape, raw = _as_bytes(p, "w")
    assert (dtype, shape, raw.tobytes()) == ("float32", (4,), np.arange(4, dtype=np.float32).tobytes())


def test_torch_parameter_is_a_tensor_everywhere():
    p = torch.nn.Parameter(torch.arange(3.0))
    assert is_tensor(p) and adapter_for(p).name == "torch" and platform_name(tensor=p) == "torch"
    assert _as_bytes(p, "p")[:2] == ("float32", (3,))


def test_an_unknown_chunk_tensor_fails_through_the_exchange(tmp_path):
    import dcp_load

    path = str(tmp_path / "c")
    dcp_load.save({"w": torch.zeros(4)}, checkpoint_id=path, no_dist=True)

    class Foreign:  # has a shape, so Chunk accepts it, but no framework knows it
        shape = (2,)

    with pytest.raises(dcp_load.LoadError, match="unsupported tensor type"):
        dcp_load.load({"w": Chunk(Foreign(), (4,), (0,))}, checkpoint_id=path)

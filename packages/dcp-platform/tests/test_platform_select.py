"""Choosing a backend: the name argument first, then $DCP_PLATFORM, then a tensor's type;
an error listing the choices when none decides or a name is unknown; a new object per call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dcp_platform import ENV_VAR, PLATFORM_NAMES, get_platform, platform_name
from dcp_platform._torch import TorchPlatform


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def test_names_cover_every_backend():
    assert ENV_VAR == "DCP_PLATFORM"
    assert set(PLATFORM_NAMES) == {"torch", "ascend", "mindspore"}


def test_name_argument_wins_over_env_and_tensor(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "mindspore")
    assert platform_name("torch", tensor=object()) == "torch"
    assert isinstance(get_platform(" Torch "), TorchPlatform)


def test_env_var_wins_over_tensor(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "torch")
    assert platform_name(tensor=np.zeros(1)) == "torch"


def test_tensor_type_decides_last():
    assert platform_name(tensor=torch.zeros(2)) == "torch"
    p = get_platform(tensor=torch.zeros(2))
    assert isinstance(p, TorchPlatform) and p.name == "torch"
    assert get_platform("torch") is not get_platform("torch")  # no hidden module global


def test_undecided_and_unknown_list_the_choices(monkeypatch):
    with pytest.raises(ValueError, match="no platform chosen") as info:
        platform_name()
    assert all(n in str(info.value) for n in PLATFORM_NAMES) and ENV_VAR in str(info.value)
    with pytest.raises(ValueError, match="numpy.ndarray") as info:
        platform_name(tensor=np.zeros(1))
    assert all(n in str(info.value) for n in PLATFORM_NAMES)
    with pytest.raises(ValueError, match="'tpu'.*the name argument"):
        platform_name("tpu")
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=r"'cuda' \(from \$DCP_PLATFORM\)"):
        get_platform()


def test_constructor_options_reach_the_backend():
    p = get_platform("torch", device="cpu")
    assert p.device == torch.device("cpu") and p.capabilities.device_type == "cpu"

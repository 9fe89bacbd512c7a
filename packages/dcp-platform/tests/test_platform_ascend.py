"""The Ascend backend against a fake ``torch_npu`` (this machine has no Ascend NPU).

A fixture puts a recording fake ``torch_npu`` in ``sys.modules`` (and registers "npu" as
torch's private-use device name, as the real torch_npu does). Covered: selection by name,
by ``$DCP_PLATFORM`` and by a tensor whose device type is "npu"; the device
(``npu:<current>``) and backend (``hccl``) strings and capabilities; synchronize draining
the NPU through torch_npu (the fake records the call); a clear ImportError when torch_npu
is missing.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from dcp_platform import get_platform, platform_name

pytestmark = pytest.mark.ascend

CURRENT_NPU = 1


class _FakeNpu(types.ModuleType):
    """The part of ``torch_npu.npu`` the backend uses, recording every call."""

    def __init__(self) -> None:
        super().__init__("torch_npu.npu")
        self.calls: list[tuple] = []

    def current_device(self) -> int:
        self.calls.append(("current_device",))
        return CURRENT_NPU

    def synchronize(self, device=None) -> None:
        self.calls.append(("synchronize", device))

    def is_available(self) -> bool:
        return True


@pytest.fixture
def fake_npu(monkeypatch) -> _FakeNpu:
    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")  # what the real torch_npu does on import
    npu = _FakeNpu()
    module = types.ModuleType("torch_npu")
    module.npu = npu
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", npu)
    # Import the backend afresh against this fake, and forget it afterwards.
    monkeypatch.delitem(sys.modules, "dcp_platform._ascend", raising=False)
    monkeypatch.delenv("DCP_PLATFORM", raising=False)
    yield npu
    sys.modules.pop("dcp_platform._ascend", None)


class _NpuTensor(torch.Tensor):
    """A torch tensor that reports an NPU device: selection checks ``isinstance(t,
    torch.Tensor)`` and ``t.device.type`` (a real one cannot be allocated without an NPU)."""

    @property
    def device(self):  # type: ignore[override]
        return types.SimpleNamespace(type="npu", index=CURRENT_NPU)


def _NpuTensorStub() -> torch.Tensor:
    return torch.Tensor._make_subclass(_NpuTensor, torch.zeros(1))


def test_ascend_selected_by_name_env_and_npu_tensor(fake_npu, monkeypatch):
    from dcp_platform._ascend import AscendPlatform

    assert isinstance(get_platform("ascend"), AscendPlatform)
    assert platform_name(tensor=_NpuTensorStub()) == "ascend"
    assert isinstance(get_platform(tensor=_NpuTensorStub()), AscendPlatform)
    assert platform_name(tensor=torch.zeros(1)) == "torch"
    monkeypatch.setenv("DCP_PLATFORM", "Ascend")
    p = get_platform()
    assert isinstance(p, AscendPlatform) and p.name == "ascend"


def test_ascend_device_backend_and_capabilities(fake_npu):
    p = get_platform("ascend")
    assert p.device == torch.device("npu", CURRENT_NPU)
    assert str(p.device) == f"npu:{CURRENT_NPU}"
    assert p.backend == "hccl"
    caps = p.capabilities
    assert caps.device_type == "npu"
    assert caps.subgroups is True
    assert caps.host_collectives is False
    assert {"bfloat16", "float8_e4m3fn", "int64"} <= caps.native_dtypes
    assert "int16" not in caps.native_dtypes
    assert ("current_device",) in fake_npu.calls
    # Not distributed in this process: the torch answers.
    assert (p.rank(), p.world_size(), p.is_distributed()) == (0, 1, False)
    assert p.all_gather_object({"a": 1}) == [{"a": 1}]
    assert p.dtype_from_name("bfloat16") is torch.bfloat16


def test_ascend_synchronize_drains_the_npu(fake_npu):
    p = get_platform("ascend")
    fake_npu.calls.clear()
    p.synchronize()
    assert fake_npu.calls == [("synchronize", torch.device("npu", CURRENT_NPU))]


def test_ascend_explicit_cpu_staging_device_has_nothing_to_drain(fake_npu):
    p = get_platform("ascend", device="cpu")
    fake_npu.calls.clear()
    p.synchronize()
    assert fake_npu.calls == []
    assert p.capabilities.device_type == "cpu"


def test_ascend_without_torch_npu_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes "import torch_npu" fail
    monkeypatch.delitem(sys.modules, "dcp_platform._ascend", raising=False)
    with pytest.raises(ImportError, match="torch_npu") as info:
        get_platform("ascend")
    message = str(info.value)
    assert "pip install torch-npu" in message and "'torch' platform" in message
    sys.modules.pop("dcp_platform._ascend", None)

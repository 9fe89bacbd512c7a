"""The torch backend's CUDA paths: synchronize calls torch.cuda.synchronize on a CUDA
staging device (checked here with a recording stand-in, no GPU needed) and does nothing on
the CPU; with a real GPU (marker ``cuda``), allocation, byte views, fused copy and
synchronize on the device."""

from __future__ import annotations

import pytest
import torch
from dcp_platform import get_platform


def test_synchronize_calls_cuda_on_a_cuda_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    p = get_platform("torch", device="cuda:0")
    assert p.capabilities.device_type == "cuda" and p.capabilities.async_overlap is True
    p.synchronize()
    assert calls == [torch.device("cuda", 0)]
    calls.clear()
    get_platform("torch", device="cpu").synchronize()
    assert calls == []


@pytest.mark.cuda
def test_cuda_device_methods():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    p = get_platform("torch", device="cuda")
    srcs = [torch.randn(64, 33, device="cuda").to(torch.bfloat16) for _ in range(8)]
    dsts = [p.empty((33, 64), torch.bfloat16).fill_(float("nan")).t() for _ in srcs]
    p.fused_copy(dsts, srcs)
    p.synchronize()
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d, s)
    t = torch.arange(5, device="cuda", dtype=torch.int64)
    raw = p.as_bytes(t)
    assert raw.device.type == "cuda" and p.nbytes(t) == raw.numel() == 40
    assert torch.equal(p.from_bytes(raw, torch.int64, (5,)), t)

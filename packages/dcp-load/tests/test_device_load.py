"""Loads into, and async saves from, accelerator memory, on the fake accelerator of
``dcp_platform.testing``: reads land in pinned buffers, copies run late on a copy stream,
and a pinned buffer reused before its copy's event fired would corrupt values."""

from __future__ import annotations

import dcp_load
import pytest
import torch
from dcp_platform import _device
from dcp_platform.testing import FakeAccelerator


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"w{i}": torch.randn(17 + i, 33, generator=g) for i in range(20)}
    out["big"] = torch.randn(5 * 1024 * 1024 + 11, generator=g)  # 20 MiB: two ring pieces
    out["half"] = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    out["ids"] = torch.arange(999, dtype=torch.int64)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    src = _state()
    dcp_load.save(src, checkpoint_id=str(path), no_dist=True)
    return str(path), src


def _poisoned(fake: FakeAccelerator, src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    dst = {k: fake.empty(v.shape, v.dtype) for k, v in src.items()}
    dst["half"] = fake.empty((48, 64), torch.float32).t()  # a cast into a strided destination
    for v in dst.values():
        v.fill_(-7 if not v.is_floating_point() else float("nan"))
    return dst


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_load_into_device_memory(saved, seed):
    path, src = saved
    fake = FakeAccelerator(max_delay_s=0.003, seed=seed)
    try:
        dst = _poisoned(fake, src)
        dcp_load.load(dst, checkpoint_id=path, no_dist=True, platform=fake.platform())
        for k, v in src.items():
            assert torch.equal(dst[k].to(v.dtype), v), k
        assert fake.violations == []
        assert fake.copies == len(src) + 1  # one per piece: "big" is two
        assert fake.stream_syncs == 1  # once per load, not per tensor
    finally:
        fake.close()


def test_reuse_before_the_event_is_caught(saved, monkeypatch):
    """The check above fails when the ring hands out a buffer without waiting for its
    copy's event."""
    path, src = saved
    fake = FakeAccelerator(max_delay_s=0.02, seed=3)

    def careless(self):
        with self._ready:
            if self._free:
                return self._free.popleft()[0]
            self._made += 1
        return self._copies.host_buffer(self.buffer_bytes)

    monkeypatch.setattr(_device.PinnedRing, "acquire", careless)
    try:
        dst = _poisoned(fake, src)
        dcp_load.load(dst, checkpoint_id=path, no_dist=True, platform=fake.platform())
        assert any("rewritten before the copy ran" in v for v in fake.violations)
        assert any(not torch.equal(dst[k].to(v.dtype), v) for k, v in src.items())
    finally:
        fake.close()


def test_host_destinations_take_the_plain_path(saved):
    path, src = saved
    fake = FakeAccelerator()
    try:
        dst = {k: torch.full_like(v, 0) for k, v in src.items()}
        dst["w0"] = fake.empty(src["w0"].shape, torch.float32).fill_(float("nan"))
        dcp_load.load(dst, checkpoint_id=path, no_dist=True, platform=fake.platform())
        for k, v in src.items():
            assert torch.equal(dst[k], v), k
        assert fake.copies == 1 and fake.violations == []
    finally:
        fake.close()


def _device_state(fake: FakeAccelerator) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    host = {f"p{i}": torch.randn(40 + i, 24, generator=g) for i in range(8)}
    host["h"] = torch.randn(16, 8, generator=g).to(torch.bfloat16)
    return host, {k: fake.to_device(v) for k, v in host.items()}


def test_async_save_from_device_memory(tmp_path):
    """The snapshot is taken when async_save returns: the device tensors are overwritten at
    once, and the checkpoint still holds the values they had."""
    fake = FakeAccelerator(max_delay_s=0.01, seed=4)
    try:
        host, dev = _device_state(fake)
        fut = dcp_load.async_save(dev, checkpoint_id=str(tmp_path / "c"), no_dist=True, platform=fake.platform())
        for v in dev.values():
            v.fill_(3)
        fut.result()
        out = {k: torch.zeros_like(v) for k, v in host.items()}
        dcp_load.load(out, checkpoint_id=str(tmp_path / "c"), no_dist=True)
        for k, v in host.items():
            assert torch.equal(out[k], v), k
        assert fake.violations == [] and fake.copies == len(host)
        assert fake.event_waits == 1  # the last copy's event, once
    finally:
        fake.close()
        dcp_load.release_staging()


def test_async_save_without_the_wait_is_caught(tmp_path, monkeypatch):
    """The test above fails when stage returns before the copies' events fired."""
    fake = FakeAccelerator(max_delay_s=0.05, seed=6)
    monkeypatch.setattr(type(fake.engine), "wait_event", lambda self, event: None)
    try:
        host, dev = _device_state(fake)
        fut = dcp_load.async_save(dev, checkpoint_id=str(tmp_path / "c"), no_dist=True, platform=fake.platform())
        for v in dev.values():
            v.fill_(3)
        fut.result()
        out = {k: torch.zeros_like(v) for k, v in host.items()}
        dcp_load.load(out, checkpoint_id=str(tmp_path / "c"), no_dist=True)
        assert any(not torch.equal(out[k], v) for k, v in host.items())
    finally:
        fake.close()
        dcp_load.release_staging()

"""The copy engine (``dcp_platform._device``) on the fake accelerator, and its absence on
the host."""

from __future__ import annotations

import threading

import pytest
import torch
from dcp_platform import _device
from dcp_platform._torch import TorchPlatform
from dcp_platform.testing import FakeAccelerator


@pytest.fixture
def fake():
    f = FakeAccelerator(max_delay_s=0.004, seed=1)
    yield f
    f.close()


def test_host_and_meta_have_no_engine():
    p = TorchPlatform()
    assert p.device_copies("cpu") is None
    assert p.device_copies(torch.device("meta")) is None
    assert _device.torch_device_copies("cpu") is None


def test_ring_copies_are_exact_and_overlap(fake):
    """Pieces staged through the ring arrive exactly, every copy from a pinned buffer,
    with one stream wait in all."""
    engine = fake.engine
    ring = engine.ring()
    dests = [fake.empty((1000,), torch.float32).fill_(float("nan")) for _ in range(12)]
    engine.begin()
    for i, d in enumerate(dests):
        buf = ring.acquire()
        staged = buf[:4000].view(torch.float32)
        staged.copy_(torch.arange(1000, dtype=torch.float32) + i)
        ring.release(buf, engine.to_device(d, staged))
    engine.finish()
    for i, d in enumerate(dests):
        assert torch.equal(d, torch.arange(1000, dtype=torch.float32) + i)
    assert fake.violations == []
    assert fake.copies == 12 and fake.stream_syncs == 1
    assert ring._made <= ring.buffers  # the bound on pinned memory


def test_reuse_before_event_is_caught(fake):
    """The fake catches a buffer rewritten before its copy ran (the check the load tests
    rely on): rewriting at once corrupts the destination and is recorded."""
    engine = fake.engine
    buf = engine.host_buffer(4000)
    staged = buf.view(torch.float32)
    d = fake.empty((1000,), torch.float32)
    staged.fill_(1.0)
    fake.max_delay_s = 0.05
    engine.to_device(d, staged)
    staged.fill_(2.0)  # no wait on the event: a bug
    engine.finish()
    assert any("rewritten before the copy ran" in v for v in fake.violations)
    assert torch.equal(d, torch.full((1000,), 2.0))


def test_pageable_copy_is_caught(fake):
    d = fake.empty((10,), torch.float32)
    fake.engine.to_device(d, torch.ones(10))
    fake.engine.finish()
    assert any("not between pinned host memory and the device" in v for v in fake.violations)


def test_cast_and_strided_destination_on_the_device(fake):
    """A cast into a strided destination runs after the transfer, on the copy stream."""
    engine = fake.engine
    buf = engine.host_buffer(6 * 4 * 2)
    src = torch.arange(24, dtype=torch.float32).reshape(6, 4).to(torch.bfloat16)
    staged = buf.view(torch.bfloat16).view(6, 4)
    staged.copy_(src)
    dest = fake.empty((4, 6), torch.float32).t()
    ev = engine.to_device(dest, staged)
    engine.wait_event(ev)
    engine.finish()
    assert torch.equal(dest, src.float())
    assert fake.violations == []
    kernel = [i for i, e in enumerate(fake.log) if e.startswith("ran") and "kernel" in e]
    copy = [i for i, e in enumerate(fake.log) if e.startswith("ran") and "H2D" in e]
    assert kernel and copy and copy[0] < kernel[0]


def test_to_host_waits_for_event(fake):
    engine = fake.engine
    src = fake.to_device(torch.arange(50, dtype=torch.int64))
    buf = engine.host_buffer(400).view(torch.int64)
    engine.begin()
    ev = engine.to_host(buf, src)
    engine.wait_event(ev)
    assert torch.equal(buf, torch.arange(50))
    assert fake.violations == []


def test_host_buffers_are_reused(fake):
    engine = fake.engine
    a = engine.host_buffer(1 << 20)
    ptr = a.data_ptr()
    engine.give_back(a)
    b = engine.host_buffer(1 << 20)
    assert b.data_ptr() == ptr


def test_ring_waits_for_the_oldest_buffers_event(fake):
    """With every buffer out, acquire blocks until one comes back, then waits on its event."""
    engine = fake.engine
    ring = _device.PinnedRing(engine, 2, 64)
    a, b = ring.acquire(), ring.acquire()
    got: list = []
    t = threading.Thread(target=lambda: got.append(ring.acquire()))
    t.start()
    t.join(0.05)
    assert t.is_alive()
    ring.release(a, None)
    t.join(5)
    assert got and got[0].data_ptr() == a.data_ptr()
    ring.release(b, None)

"""The copy engine (``dcp_platform._device``) on the fake accelerator, and its absence on
the host; the fake's own guarantee: a copy completes only once something waits for it
(or ``hold_s`` after it was queued), so a missing wait reads poison."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from dcp_platform import _device
from dcp_platform._torch import TorchPlatform
from dcp_platform.fake_accelerator import POISON_BYTE
from dcp_platform.testing import FakeAccelerator


@pytest.fixture
def fake():
    f = FakeAccelerator(max_delay_s=0.004, seed=1)
    yield f
    f.close()


@pytest.fixture
def held():
    """Copies run only when waited for (or at close): a missing wait is a wrong value."""
    f = FakeAccelerator(max_delay_s=0.002, seed=2, hold_s=None)
    yield f
    f.close()


def _poison(t: torch.Tensor) -> bool:
    return bool((t.contiguous().view(-1).view(torch.uint8) == POISON_BYTE).all())


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


def test_reuse_before_event_is_caught(held):
    """The fake catches a buffer rewritten before its copy ran (the check the load tests
    rely on): rewriting at once corrupts the destination and is recorded."""
    engine = held.engine
    buf = engine.host_buffer(4000)
    staged = buf.view(torch.float32)
    d = held.empty((1000,), torch.float32)
    staged.fill_(1.0)
    engine.to_device(d, staged)
    staged.fill_(2.0)  # no wait on the event: a bug
    engine.finish()
    assert any("rewritten before the copy ran" in v for v in held.violations)
    assert torch.equal(d, torch.full((1000,), 2.0))


def test_memory_starts_poisoned(held):
    assert _poison(held.empty((3, 5), torch.bfloat16)) and _poison(held.engine.host_buffer(77))
    assert torch.isnan(held.empty((4,), torch.float32)).all()


def test_host_to_device_copies_complete_only_when_waited_for(held):
    """Nothing runs before a wait: an event wait runs the stream up to that event (the
    next copy stays poison), the stream synchronize runs the rest."""
    engine = held.engine
    bufs = [engine.host_buffer(400).view(torch.float32) for _ in range(2)]
    dests = [held.empty((100,), torch.float32) for _ in range(2)]
    engine.begin()
    events = []
    for i, (b, d) in enumerate(zip(bufs, dests, strict=True)):
        b.copy_(torch.arange(100, dtype=torch.float32) + i)
        events.append(engine.to_device(d, b))
    time.sleep(0.05)  # well above any delay: still nothing has run
    assert _poison(dests[0]) and _poison(dests[1]) and not events[0].query()
    engine.wait_event(events[0])
    assert torch.equal(dests[0], torch.arange(100, dtype=torch.float32)) and _poison(dests[1])
    engine.finish()
    assert torch.equal(dests[1], torch.arange(100, dtype=torch.float32) + 1)
    assert held.violations == [] and held.event_waits == 1 and held.stream_syncs == 1


def test_device_to_host_copy_without_its_wait_reads_poison_then_the_new_values(held):
    """A D2H copy read before its event is waited for holds poison; once it runs it
    copies what the device tensor holds then (a write after the call is seen)."""
    engine = held.engine
    src = held.to_device(torch.arange(50, dtype=torch.int64))
    buf = engine.host_buffer(400).view(torch.int64)
    engine.begin()
    ev = engine.to_host(buf, src)
    assert _poison(buf)
    src.fill_(9)  # the caller's next write, without waiting for the copy
    engine.wait_event(ev)
    assert torch.equal(buf, torch.full((50,), 9))
    assert any("rewritten before the copy ran" in v for v in held.violations)


def test_a_copy_nobody_waits_for_completes_after_hold_s():
    """``hold_s`` bounds how late a copy nobody waits for completes."""
    f = FakeAccelerator(max_delay_s=0.0, hold_s=0.1)
    try:
        buf = f.engine.host_buffer(40).view(torch.float32)
        buf.fill_(3.0)
        d = f.empty((10,), torch.float32)
        t0 = time.monotonic()
        ev = f.engine.to_device(d, buf)
        while not ev.query() and time.monotonic() - t0 < 10:
            time.sleep(0.005)
        assert ev.query() and time.monotonic() - t0 >= 0.1
        assert torch.equal(d, torch.full((10,), 3.0))
    finally:
        f.close()


def test_close_runs_held_copies_and_drops_the_fakes_buffers(held):
    engine = held.engine
    ring = engine.ring()
    buf = ring.acquire()
    buf[:4].fill_(1)
    d = held.empty((4,), torch.uint8)
    engine.to_device(d, buf[:4])
    held.close()
    assert torch.equal(d, torch.ones(4, dtype=torch.uint8))
    assert engine.ring() is not ring  # the process-wide ring of this fake was dropped


def test_pageable_copy_is_caught(fake):
    d = fake.empty((10,), torch.float32)
    fake.engine.to_device(d, torch.ones(10))
    fake.engine.finish()
    assert any("not between pinned host memory and the device" in v for v in fake.violations)


def test_cast_and_strided_destination_on_the_device(held):
    """A cast into a strided destination runs after the transfer, on the copy stream, and
    before the copy's event: once the event fired the destination holds the values (a
    broadcast ordered after the event sends them)."""
    engine = held.engine
    buf = engine.host_buffer(6 * 4 * 2)
    src = torch.arange(24, dtype=torch.float32).reshape(6, 4).to(torch.bfloat16)
    staged = buf.view(torch.bfloat16).view(6, 4)
    staged.copy_(src)
    dest = held.empty((4, 6), torch.float32).t()
    ev = engine.to_device(dest, staged)
    engine.wait_event(ev)  # no stream synchronize
    assert torch.equal(dest, src.float())
    assert held.violations == []
    ran = [e for e in held.log if e.startswith("ran")]
    kernel = [i for i, e in enumerate(ran) if "kernel" in e]
    copy = [i for i, e in enumerate(ran) if "H2D" in e]
    fire = [i for i, e in enumerate(ran) if "fire" in e]
    assert kernel and copy and fire and copy[0] < kernel[0] < fire[0]


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

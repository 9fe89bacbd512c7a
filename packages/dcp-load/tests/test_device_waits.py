"""Every wait of the device path, removed one at a time, gives wrong values.

The fake accelerator runs with ``hold_s=None``: a host-to-device or device-to-host copy
completes only once something waits for it (an event wait, the stream synchronize, or
``close``), and new device and pinned memory is poison (NaN). With every wait in place
each value is exact; with one wait monkeypatched away, the values read at the point that
wait guarded are wrong by construction, whatever the timing:

* the ring's event wait before a pinned buffer is reused (``DeviceCopies.wait_event`` in
  ``PinnedRing.acquire``): destinations get a later piece's bytes;
* the copy stream's synchronize at the end of a load (``DeviceLoad.finish``): the pieces
  copied last are still poison when ``load`` returns;
* ``async_save``'s wait for its device-to-host copies (``StagingPool._copy_all``): the
  checkpoint holds poison;
* the same wait when staging is stopped between two boxes: a late copy overwrites the
  arena after it was handed to the next save.

(The broadcast's ordering after its piece's copies, ``DeviceLoad.publish``, needs ranks:
``tests-integration/device/test_integ_device.py``.)
"""

from __future__ import annotations

import dcp_load
import pytest
import torch
from dcp_load.run import _device as run_device
from dcp_load.saving import _staging
from dcp_platform._torch import TorchPlatform
from dcp_platform.testing import FakeAccelerator


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    out = {f"w{i}": torch.randn(40 + 3 * i, 32, generator=g) for i in range(10)}
    out["half"] = torch.randn(24, 16, generator=g).to(torch.bfloat16)  # loaded as float32: a cast
    out["col"] = torch.randn(20, 12, generator=g)  # into a transposed view: a strided write
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    src = _state()
    dcp_load.save(src, checkpoint_id=str(path), no_dist=True)
    return str(path), src


@pytest.fixture
def fake():
    f = FakeAccelerator(max_delay_s=0.002, seed=5, hold_s=None)
    yield f
    f.close()


def _targets(fake: FakeAccelerator, src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: fake.empty(v.shape, v.dtype) for k, v in src.items()}
    out["half"] = fake.empty(src["half"].shape, torch.float32)
    out["col"] = fake.empty(tuple(reversed(src["col"].shape)), torch.float32).t()
    for v in out.values():
        v.fill_(float("nan"))
    return out


def _wrong(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in src.items() if not torch.equal(dst[k], v.to(dst[k].dtype))]


def _nan(dst: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in dst.items() if bool(torch.isnan(v).any())]


def _load(fake: FakeAccelerator, path: str, src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    dst = _targets(fake, src)
    dcp_load.load(dst, checkpoint_id=path, no_dist=True, platform=fake.platform())
    return dst  # read as load returned it: nothing here waits


def test_with_every_wait_a_load_is_exact(saved, fake):
    path, src = saved
    dst = _load(fake, path, src)
    assert _wrong(dst, src) == [] and fake.violations == []
    assert fake.copies == len(src) and fake.stream_syncs == 1
    ring = fake.engine.ring()
    assert 1 <= ring._made <= ring.buffers
    assert fake.event_waits == len(src) - ring._made  # the ring: every reuse of one of its buffers


def test_without_the_rings_event_wait_buffers_are_overwritten(saved, fake, monkeypatch):
    """``PinnedRing.acquire`` hands a buffer out without waiting for its last copy: the
    next piece is read into it while that copy is still queued, and the copy then moves
    the next piece's bytes."""
    path, src = saved
    monkeypatch.setattr(fake.engine, "wait_event", lambda event: None)
    dst = _load(fake, path, src)
    wrong = _wrong(dst, src)
    assert len(wrong) >= len(src) - fake.engine.ring().buffers, wrong  # every piece whose buffer was reused
    assert not set(wrong) & set(_nan(dst)), "they hold another piece's values, not poison"
    assert any("a pinned buffer reused before its event fired" in v for v in fake.violations)


def test_without_the_stream_synchronize_a_load_returns_poison(saved, fake, monkeypatch):
    """``DeviceLoad.finish`` skipped: the copies no later acquire waited for (the last
    ones) have not run when ``load`` returns; they are late, not lost."""
    path, src = saved
    monkeypatch.setattr(run_device.DeviceLoad, "finish", lambda self: None)
    dst = _load(fake, path, src)
    wrong = _wrong(dst, src)
    assert wrong and set(wrong) == set(_nan(dst)), wrong  # poison, in the pieces copied last
    assert fake.stream_syncs == 0
    fake.engine.finish()
    assert _wrong(dst, src) == [] and fake.violations == []


def _device_state(fake: FakeAccelerator) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(6)
    host = {f"p{i}": torch.randn(30 + i, 16, generator=g) for i in range(6)}
    host["h"] = torch.randn(8, 8, generator=g).to(torch.bfloat16)
    return host, {k: fake.to_device(v) for k, v in host.items()}


def _async_save(fake: FakeAccelerator, path: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    host, dev = _device_state(fake)
    try:
        fut = dcp_load.async_save(dev, checkpoint_id=path, no_dist=True, platform=fake.platform())
        for v in dev.values():
            v.fill_(3)  # the caller's next step
        fut.result()
    finally:
        dcp_load.release_staging()
    out = {k: torch.zeros_like(v) for k, v in host.items()}
    dcp_load.load(out, checkpoint_id=path, no_dist=True)
    return host, out


def test_with_its_wait_async_save_writes_the_values_at_the_call(tmp_path, fake):
    host, out = _async_save(fake, str(tmp_path / "c"))
    assert _wrong(out, host) == [] and fake.violations == [] and fake.event_waits == 1


def test_without_its_wait_async_save_writes_poison(tmp_path, fake, monkeypatch):
    """``StagingPool`` returns without waiting for the last copy's event: the background
    writer reads the pinned arena before any device-to-host copy ran."""
    monkeypatch.setattr(fake.engine, "wait_event", lambda event: None)
    host, out = _async_save(fake, str(tmp_path / "c"))
    assert _nan({k: v.float() for k, v in out.items()}) == list(host), out


@pytest.mark.parametrize("careless", [False, True])
def test_stopped_staging_waits_before_the_arena_is_reused(fake, monkeypatch, careless):
    """Staging stopped after its first box waits for that box's copy before it frees the
    arena; without the wait, the copy runs late into the next save's staged values."""
    if careless:
        monkeypatch.setattr(fake.engine, "wait_event", lambda event: None)
    pool, platform = _staging.StagingPool(), TorchPlatform()
    first = {"a": fake.to_device(torch.full((256,), 1.0)), "b": fake.to_device(torch.full((256,), 2.0))}
    asked = iter([False, True])
    with pytest.raises(_staging.StagingStopped):
        pool.stage(first, fake.platform(), stop=lambda: next(asked))
    nxt = torch.arange(256, dtype=torch.float32)
    staged, _ = pool.stage({"x": nxt}, platform)  # host values: into the same arena, at offset 0
    fake.engine.finish()  # whatever later waits on the copy stream
    try:
        assert torch.equal(staged["x"], nxt) != careless
        if careless:
            assert torch.equal(staged["x"], torch.full((256,), 1.0))  # the stopped save's late copy
    finally:
        pool.done()
        pool.release()

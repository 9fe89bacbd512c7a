"""``async_save`` in one process: the checkpoint holds the values at the call whatever the
caller does afterwards; refusals raise at the call and touch nothing; a failed write fails
the future and keeps the old checkpoint; saves of one process run in call order; the
staging pool is reused (no growth), bounded and released; no thread stays behind.
Destinations are poisoned before each load."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future

import dcp_load
import pytest
import torch
from dcp_load import LoadError
from dcp_load.saving._staging import POOL
from dcp_platform import HEARTBEAT_THREAD
from dcp_reader import NativeWriter


def _state(gen: int) -> dict:
    g = torch.Generator().manual_seed(gen)
    return {"w": torch.randn(64, 32, generator=g) + 0.5, "h": torch.randn(16, generator=g).to(torch.bfloat16),
            "i": torch.arange(10) + gen, "s": torch.tensor(float(gen)), "step": gen,
            "sched": {"lr": [0.1 * gen], "name": "cosine"}}


def _poisoned() -> dict:
    return {"w": torch.full((64, 32), float("nan")), "h": torch.full((16,), float("nan"), dtype=torch.bfloat16),
            "i": torch.full((10,), -1), "s": torch.tensor(float("nan")), "step": None,
            "sched": {"lr": None, "name": None}}


def _holds(path, gen: int) -> bool:
    got, want = _poisoned(), _state(gen)
    dcp_load.load(got, checkpoint_id=path, no_dist=True)
    return all(torch.equal(got[k], want[k]) for k in ("w", "h", "i", "s")) and got["step"] == gen \
        and got["sched"] == want["sched"]


def _change_everything(sd: dict) -> None:
    for k in ("w", "h", "s"):
        sd[k].neg_()
    sd["i"].add_(1000)
    sd["step"] = -1
    sd["sched"]["lr"].append(7.0)
    sd["sched"]["name"] = "changed"


def _dcp_threads() -> list[str]:
    """Threads of dcp still running (given a moment to exit), less the process's one idle
    heartbeat thread (dcp-platform README, "Failing together")."""
    end = time.monotonic() + 2
    while (left := [t.name for t in threading.enumerate() if t.name.startswith("dcp-")
                    and t.name != HEARTBEAT_THREAD]) and time.monotonic() < end:
        time.sleep(0.01)
    return left


def test_the_checkpoint_holds_the_values_at_the_call(tmp_path, caplog):
    sd = _state(1)
    with caplog.at_level(logging.INFO, logger="dcp_load.saving._async"):
        fut = dcp_load.async_save(sd, checkpoint_id=tmp_path / "ckpt")
        _change_everything(sd)
        report = fut.result(timeout=60)
    assert isinstance(fut, Future) and _holds(tmp_path / "ckpt", 1)
    assert report.staged_bytes == report.bytes_written == report.job_bytes > 0
    assert 0 < report.staging_seconds <= report.blocked_seconds <= report.seconds and report.write_seconds > 0
    said = [r.getMessage() for r in caplog.records]
    assert [m.split(": ")[1].split(" ")[0] for m in said] == ["started", "staged", "committed,"], said
    assert _dcp_threads() == []


def test_a_refusal_raises_at_the_call_and_touches_nothing(tmp_path):
    path = tmp_path / "ckpt"
    dcp_load.save(_state(1), checkpoint_id=path)
    before = sorted(os.listdir(path))
    with pytest.raises(LoadError, match=r"'bad': .*allow_pickle=True"):
        dcp_load.async_save({**_state(2), "bad": object()}, checkpoint_id=path)
    with pytest.raises(ValueError, match="checkpoint_id"):
        dcp_load.async_save(_state(2), checkpoint_id=None)
    assert sorted(os.listdir(path)) == before and _holds(path, 1)
    dcp_load.async_save(_state(3), checkpoint_id=path).result(timeout=60)  # the lock was released
    assert _holds(path, 3)


def test_a_failed_write_fails_the_future_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    dcp_load.save(_state(1), checkpoint_id=path)
    before = sorted(os.listdir(path))

    def fill_disk(self, name, tensors):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(NativeWriter, "write_file", fill_disk)
    fut = dcp_load.async_save(_state(2), checkpoint_id=path)
    with pytest.raises(LoadError, match="No space left on device") as e:
        fut.result(timeout=60)
    assert e.value.phase == "save" and list(e.value.failures) == [0]
    monkeypatch.undo()
    assert sorted(os.listdir(path)) == before and _holds(path, 1)


def test_saves_of_one_process_run_in_call_order(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    real = NativeWriter.write_file

    def slow(self, name, tensors):
        time.sleep(0.3)
        return real(self, name, tensors)

    monkeypatch.setattr(NativeWriter, "write_file", slow)
    first = dcp_load.async_save(_state(1), checkpoint_id=path)
    second = dcp_load.async_save(_state(2), checkpoint_id=path)  # waits for the first
    assert first.done() and first.result().path == str(path)
    dcp_load.save(_state(3), checkpoint_id=tmp_path / "other")  # a save waits too
    assert second.done() and _holds(path, 2) and _holds(tmp_path / "other", 3)


def test_the_staging_pool_is_reused_bounded_and_released(tmp_path):
    dcp_load.release_staging()
    sizes = []
    for gen in range(6):
        report = dcp_load.async_save(_state(gen), checkpoint_id=tmp_path / "ckpt").result(timeout=60)
        sizes.append(POOL.capacity)
    assert len(set(sizes)) == 1 and report.staged_bytes <= sizes[0] <= report.staged_bytes + 2**20
    big = {"w": torch.ones(1024, 1024)}  # 4 MiB: the arena grows to it, once
    dcp_load.async_save(big, checkpoint_id=tmp_path / "big").result(timeout=60)
    assert POOL.capacity == 4 * 2**20
    assert dcp_load.release_staging() == 4 * 2**20 and POOL.capacity == 0
    assert _holds(tmp_path / "ckpt", 5) and _dcp_threads() == []

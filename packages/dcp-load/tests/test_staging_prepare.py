"""``dcp_load.prepare_staging``: the staging arena of the first ``async_save`` taken ahead of
it, on a background thread (``saving/_staging.py``). Sized from the tensors a state dict
holds (or ``nbytes=``); a save that starts while the pages are still being taken waits and
copies into that arena (the same object: nothing allocated on the save's path); the first
``async_save`` after it writes the caller's values (loaded back into poisoned
destinations); a pool already as large is left alone; bad arguments are refused by name."""

from __future__ import annotations

import dcp_load
import numpy as np
import pytest
import torch
from dcp_load.saving._staging import ALIGN, POOL, ROUND_BYTES, held_bytes


@pytest.fixture(autouse=True)
def _empty_pool():
    POOL.release()
    yield
    POOL.release()


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def test_sized_from_the_tensors_held() -> None:
    sd = {"model": {"w": torch.ones(1000, 300), "b": torch.ones(7)}, "opt": [np.ones(5, dtype=np.float64)],
          "step": 3, "name": "x"}
    expect = _round(1000 * 300 * 4, ALIGN) + _round(7 * 4, ALIGN) + _round(5 * 8, ALIGN)
    assert held_bytes(sd) == expect
    assert dcp_load.prepare_staging(sd, wait=True) == _round(expect, ROUND_BYTES) == POOL.capacity


def test_a_save_during_preparation_waits_and_uses_the_prepared_arena() -> None:
    data = {"a": torch.arange(3 << 20, dtype=torch.float32), "b": torch.full((5,), 2.0)}
    size = dcp_load.prepare_staging(nbytes=32 << 20)  # not waited for
    staged, nbytes = POOL.stage(data)
    try:
        arena = POOL._arena
        assert POOL.capacity == size == 32 << 20 and nbytes == (3 << 20) * 4 + 20
        assert all(torch.equal(staged[k], data[k]) for k in data)
        assert np.shares_memory(staged["a"].numpy(), arena)
    finally:
        POOL.done()
    staged, _ = POOL.stage(data)
    POOL.done()
    assert POOL._arena is arena  # the save kept it: nothing new taken


def test_first_async_save_after_prepare_writes_the_values(tmp_path) -> None:
    sd = {"w": torch.randn(512, 256), "i": torch.arange(100), "step": 4}
    dcp_load.prepare_staging(sd, wait=True)
    arena = POOL._arena
    report = dcp_load.async_save(sd, checkpoint_id=tmp_path, no_dist=True).result()
    assert POOL._arena is arena and report.staged_bytes == 512 * 256 * 4 + 100 * 8
    got = {"w": torch.full((512, 256), float("nan")), "i": torch.full((100,), -1), "step": -1}
    dcp_load.load(got, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(got["w"], sd["w"]) and torch.equal(got["i"], sd["i"]) and got["step"] == 4


def test_a_pool_as_large_is_left_alone() -> None:
    dcp_load.prepare_staging(nbytes=8 << 20, wait=True)
    arena = POOL._arena
    assert dcp_load.prepare_staging(nbytes=3 << 20, wait=True) == 8 << 20 and POOL._arena is arena


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match="prepare_staging: pass the state dict"):
        dcp_load.prepare_staging()
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        dcp_load.prepare_staging(nbytes=-1)

"""The staging pool's stoppable copy (``StagingPool.stage(stop=)``, used by ``async_save``'s
early copy): values are exact whatever the slicing; a stop between boxes or inside a large
box raises ``StagingStopped`` and leaves the pool free for the next save; a save whose
boxes are all empty stages nothing (the pool has no arena then)."""

from __future__ import annotations

import threading

import pytest
import torch
from dcp_load.saving import _staging
from dcp_load.saving._staging import StagingPool, StagingStopped
from hypothesis import given, settings
from hypothesis import strategies as st

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(st.lists(shapes, min_size=1, max_size=4), st.integers(8, 400))
def test_a_copy_that_is_never_stopped_is_exact(box_shapes, piece):
    old = _staging.PIECE_BYTES
    _staging.PIECE_BYTES = piece  # slices of a few rows: every box is cut
    try:
        data = {f"k{i}": torch.randn(s) for i, s in enumerate(box_shapes)}
        pool = StagingPool()
        asked = []
        out, nbytes = pool.stage(data, stop=lambda: asked.append(1) is None and False)
        assert nbytes == sum(v.numel() * v.element_size() for v in data.values())
        assert all(torch.equal(out[k], v) for k, v in data.items())
        pool.done()
    finally:
        _staging.PIECE_BYTES = old


@pytest.mark.parametrize("after", [0, 1, 3])
def test_a_stopped_copy_raises_and_frees_the_pool(monkeypatch, after):
    monkeypatch.setattr(_staging, "PIECE_BYTES", 64)
    data = {"a": torch.randn(40, 4), "b": torch.randn(40, 4)}  # 640 bytes each: 10 slices
    pool = StagingPool()
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > after

    with pytest.raises(StagingStopped):
        pool.stage(data, stop=stop)
    done = threading.Event()
    threading.Thread(target=lambda: (pool.stage(data), pool.done(), done.set()), daemon=True).start()
    assert done.wait(10), "the pool stayed busy after a stopped copy"


def test_an_async_save_of_only_empty_tensors_commits(tmp_path):
    import dcp_load

    path = str(tmp_path / "ckpt")
    report = dcp_load.async_save({"e": torch.empty(0, 3), "f": torch.empty(2, 0)}, checkpoint_id=path,
                                 no_dist=True).result(timeout=60)
    assert report.staged_bytes == 0
    got = {"e": torch.full((0, 3), 1.0), "f": torch.full((2, 0), 1.0)}
    dcp_load.load(got, checkpoint_id=path, no_dist=True)
    assert got["e"].shape == (0, 3) and got["f"].shape == (2, 0)

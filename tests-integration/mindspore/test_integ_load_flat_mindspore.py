"""``Flat`` destinations over MindSpore tensors on 2 real MindSpore CPU workers: ZeRO-2
partitions of a flat space (``flat_views`` over one buffer per worker) loaded from a Hugging
Face file, an interval both workers hold (read once, broadcast on the world group through
staging tensors, since MindSpore's CPU tensors have no aliasing views) next to a ``Chunk``,
and a ZeRO-2 save loaded back into whole MindSpore tensors. Buffers are poisoned first."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mindspore

sys.path.insert(0, str(Path(__file__).parent))


def test_flat_views_over_mindspore_buffers(tmp_path):
    pytest.importorskip("mindspore", reason="needs MindSpore (nox -s tests-mindspore)")
    torch = pytest.importorskip("torch", reason="the checkpoint is written with torch")
    import dcp_load
    import integ_flat_ms_cases as cases
    from dcp_platform.testing import run_mindspore_workers
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({n: torch.from_numpy(v) for n, v in cases.values().items()}, str(hf / "model.safetensors"))
    results = run_mindspore_workers(cases.ms_flat_case, 2, str(hf), str(tmp_path / "zero2"), timeout=300)
    errors = [e for r in results for e in r["errors"]]
    assert not errors, "\n".join(errors)
    assert results[0]["names"] == ["a", "b"] and results[1]["names"] == ["b", "c", "s"]
    assert [r["zero2"]["bytes_needed"] for r in results] == [n * 4 for _, n in cases.ZERO2]
    assert sum(r["zero2"]["bytes_read"] for r in results) == cases.TOTAL * 4
    replica = [r["replica"] for r in results]
    assert all(r["broadcasts"] > 0 for r in replica)
    assert sum(r["bytes_read"] for r in replica) == replica[0]["job_unique_bytes"] == (25 + 10) * 4
    boxes = 0
    for offset, numel in cases.ZERO2:  # one chunk per box of each worker's intervals
        views = dcp_load.flat_views(cases.SPACE, torch.zeros(numel), offset)
        boxes += sum(len(v.boxes()) for v in views.values())
    assert sum(r["saved_chunks"] for r in results) == boxes

"""``load(sources=...)`` into MindSpore tensors on 2 real MindSpore CPU workers: a grouped
``Concat`` of a Hugging Face checkpoint's q, k and v into ``Chunk`` targets (a row half per
worker, and a replicated whole read once and broadcast), exact and read once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mindspore

sys.path.insert(0, str(Path(__file__).parent))


def test_concat_into_mindspore_chunks(tmp_path):
    pytest.importorskip("mindspore", reason="needs MindSpore (nox -s tests-mindspore)")
    import integ_sources_ms_cases as cases
    from dcp_platform.testing import run_mindspore_workers
    from safetensors.numpy import save_file

    save_file(cases.saved(), str(tmp_path / "model.safetensors"))
    results = run_mindspore_workers(cases.ms_sources_case, 2, str(tmp_path), timeout=300)
    errors = [e for r in results for e in r["errors"]]
    assert not errors, "\n".join(errors)
    reports = [r["report"] for r in results]
    assert all(r["composed"] == {"wqkv": 3, "wqkv_rep": 3} for r in reports)
    assert sum(r["bytes_read"] for r in reports) == reports[0]["job_unique_bytes"]
    assert all(r["bytes_received"] > 0 for r in reports)

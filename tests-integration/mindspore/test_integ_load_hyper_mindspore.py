"""dcp_load.load on 2 real MindSpore CPU workers from a hyper-parallel checkpoint whose data
files MindSpore wrote (``mindspore.save_checkpoint(format="safetensors")``, MindSpore dtype
names in the metadata, ragged chunk keys on rank 0): the global ``.metadata`` with a
replicated tensor broadcast on the world group and straddling halves, then the per-rank
``{rank}.metadata`` that each worker loads alone. Targets are poisoned first."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.mindspore

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2] / "packages" / "dcp-reader" / "tests"))


def test_mindspore_workers_load_a_mindspore_written_hyper_checkpoint(tmp_path):
    ms = pytest.importorskip("mindspore", reason="needs MindSpore (nox -s tests-mindspore)")
    import hyper_writer as hw
    import integ_load_hyper_ms_cases as cases
    from dcp_platform.testing import run_mindspore_workers

    ranks: dict[int, dict] = {0: {"step": 11}, 1: {}}
    expected = {}
    for i, (name, (shape, dtype)) in enumerate(cases.SPECS.items()):
        values = ((np.arange(int(np.prod(shape)), dtype=np.float32) * (i + 3)) % 89 - 40).reshape(shape)
        t = ms.Tensor(values).astype(getattr(ms, dtype))
        expected[name] = t.astype(ms.float32).asnumpy().astype(np.float64)  # bf16-rounded where bf16
        for rank, first, rows in cases.saved_rows(shape):
            ranks[rank].setdefault(name, []).append(((first, 0), t[first:first + rows]))
    shapes = {n: s for n, (s, _) in cases.SPECS.items()}
    paths = {"global": str(tmp_path / "global"), "rank_local": str(tmp_path / "rank_local")}
    hw.write_checkpoint(paths["global"], ranks, shapes, framework="mindspore")
    hw.write_checkpoint(paths["rank_local"], ranks, shapes, framework="mindspore", per_rank=True)

    results = run_mindspore_workers(cases.ms_hyper_case, 2, paths, expected, timeout=300)
    errors = [e for r in results for e in r["errors"]]
    assert not errors, "\n".join(errors)
    glob = [r["global"] for r in results]
    assert all(g["format"] == "hyper-parallel" and g["world_size"] == 2 and g["values"] == 1 for g in glob)
    assert all(g["broadcasts"] > 0 for g in glob)
    local = [r["rank_local"] for r in results]
    assert all(g["world_size"] == 1 and g["broadcasts"] == 0 and g["bytes_read"] == g["bytes_needed"] > 0
               for g in local)
